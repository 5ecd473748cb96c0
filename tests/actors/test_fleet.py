"""Several engine replicas behind one endpoint, end to end on a local Ray (loopback): prefix-aware
routing against power-of-two on the same requests, autoscaling up and down without cutting a
request, failover when a replica's worker dies, or freezes, under traffic, lost copies replaced
and reading a conversation's prefix from the KV tier they share, and the lost actors:
the grammar compiler, an ingress replica, the Serve controller; then a graceful
`serve_cli shutdown` of the running cluster (last).

One `serve run` (actors.serve_cli) for the module with three applications of the tiny random
model, each at its own route: `affinity` (2 replicas, prefix-aware router, one KV tier folder),
`p2c` (2 replicas, power of two), `auto` (autoscaled 1..2). `SlowStepProcessor` (tests/fixtures)
stretches requests that ask for it, so scaling and failures happen while they run.
"""
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from fleet_helpers import (close_probes, complete, gcs_address, healthy, metric_sum, probe, scrape, start_serve,
                           stream_events, tiny_app, wait_replicas, write_deploy)
from ray_helpers import ROOT, free_port, loopback_env, stop_process, wait_for

STEP_TIMEOUT_S = 5.0  # p2c: a step that takes longer marks its copy stuck
AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2, "upscale_delay_s": 0.5,
               "downscale_delay_s": 3, "metrics_interval_s": 0.5, "look_back_period_s": 2}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("fleet")
    http_port, metrics_port = free_port(), free_port()
    # Worker actors to kill and freeze (not `uni`); `auto` kills none, and its copies start faster
    # with their rank in the replica.
    ray_workers = {"distributed_executor_backend": "ray"}
    deploy = write_deploy(tmp / "deploy.yaml", http_port, [
        # Both copies share one KV tier folder, as the copies of one node do.
        tiny_app("affinity", tiny_llama_dir, engine_replicas=2, kv_offloading_disk_path=str(tmp / "kv"),
                 kv_offloading_disk_size=0.05, **ray_workers),
        tiny_app("p2c", tiny_llama_dir, engine_replicas=2, request_router="power_of_two",
                 step_timeout_s=STEP_TIMEOUT_S, ingress_replicas=2, **ray_workers),
        tiny_app("auto", tiny_llama_dir, engine_autoscaling_config=AUTOSCALING),
    ])
    log = tmp / "serve.log"
    proc = start_serve(deploy, log, LLM_CLUSTER_METRICS_PORT=str(metrics_port), RAY_metrics_report_interval_ms="1000",
                       LLM_CLUSTER_RAY_DASHBOARD="1")  # fleet_probe.py reads the state API
    base = f"http://127.0.0.1:{http_port}"
    try:
        for app in ("affinity", "p2c", "auto"):
            wait_for(lambda: healthy(f"{base}/{app}/health"), 600, f"{app} to be healthy", proc, log)
        gcs = gcs_address(log)
        for app, n in (("affinity", 2), ("p2c", 2), ("auto", 1)):
            wait_replicas(gcs, app, n, 300, proc, log)
        yield {"base": base, "metrics": f"http://127.0.0.1:{metrics_port}/metrics", "gcs": gcs, "kv": tmp / "kv"}
    finally:
        close_probes()
        stop_process(proc)


def _hit_rate(base: str, app: str, prompts: list[list[int]]) -> float:
    cached = total = 0
    for p in prompts:  # one at a time: what each router knows is all that differs
        r = complete(f"{base}/{app}", app, p, max_tokens=1)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        cached += usage["prompt_tokens_details"]["cached_tokens"]
        total += usage["prompt_tokens"]
    return cached / total


def test_prefix_aware_routing_nearly_matches_one_engine_and_beats_power_of_two(fleet, tiny_llama_dir):
    from cluster import LLM, SamplingParams

    rng = random.Random(13)
    prefixes = [[rng.randrange(100, 40000) for _ in range(160)] for _ in range(8)]  # 10 blocks each
    order = [rng.randrange(len(prefixes)) for _ in range(48)]
    prompts = [prefixes[i] + [rng.randrange(100, 40000) for _ in range(32)] for i in order]
    affinity = _hit_rate(fleet["base"], "affinity", prompts)
    power_of_two = _hit_rate(fleet["base"], "p2c", prompts)
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=512, num_kv_blocks=256, block_size=16)
    outs = [llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=1), use_tqdm=False)[0] for p in prompts]
    single = sum(o.num_cached_tokens for o in outs) / sum(len(p) for p in prompts)
    assert single > 0.6
    assert affinity >= single - 0.03, (affinity, single)
    assert affinity >= power_of_two + 0.05, (affinity, power_of_two)

    # Each routing decision was counted, and every engine series names its replica. Which
    # replicas served is the router's coin flips (eight fresh prefixes, both replicas idle:
    # all eight on one replica has a chance of 1 in 128), so the wait is for the tokens, not
    # for a series from each replica.
    repeats = len(order) - len(set(order))
    replicas = set(probe(fleet["gcs"], "replicas", "affinity"))
    sent = sum(len(p) for p in prompts)

    def counted():
        text = scrape(fleet["metrics"])
        hits = metric_sum(text, "ray_llm_routing_decisions_total", model_name="affinity", decision="prefix_hit")
        fresh = metric_sum(text, "ray_llm_routing_decisions_total", model_name="affinity", decision="no_prefix")
        total = metric_sum(text, "ray_llm_prompt_tokens_total", model_name="affinity")
        tagged = sum(metric_sum(text, "ray_llm_prompt_tokens_total", model_name="affinity", replica=r)
                     for r in replicas)
        return (hits, fresh, total, tagged) if hits + fresh >= len(prompts) and total >= sent else None

    # Ray's metrics agent exports on its own schedule; on a busy 2-core box that took over 60 s once.
    hits, fresh, total, tagged = wait_for(counted, 180, "routing decisions and prompt tokens on the endpoint")
    assert (hits, fresh) == (repeats, len(prompts) - repeats)
    assert tagged == total, (tagged, total, replicas)


def test_a_request_with_several_prompts_routes_each_of_them(fleet):
    # One HTTP request makes one engine call per prompt; Serve gives them one request id.
    for app in ("affinity", "p2c"):
        for stream in (False, True):
            body = {"max_tokens": 3, "ignore_eos": True, "stream": stream}
            r = complete(f"{fleet['base']}/{app}", app, ["one prompt", "another prompt", "a third"], timeout=60, **body)
            assert r.status_code == 200, r.text
            if not stream:
                assert sorted(c["index"] for c in r.json()["choices"]) == [0, 1, 2]
            else:
                assert r.text.rstrip().endswith("data: [DONE]") and '"index":2' in r.text.replace(" ", "")


def test_autoscaling_scales_up_on_a_burst_and_down_without_cutting_a_request(fleet, tmp_path):
    base, gcs = fleet["base"] + "/auto", fleet["gcs"]
    slow = {"vllm_xargs": {"step_delay_s": 0.05}, "ignore_eos": True}
    stop, statuses = threading.Event(), []

    def burst(i: int) -> None:
        n = 0
        while not stop.is_set():
            statuses.append(complete(base, "auto", f"burst {i} {n}", max_tokens=20, **slow).status_code)
            n += 1

    threads = [threading.Thread(target=burst, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    try:  # 8 requests in flight for a target of 2 per replica: the deployment grows to its maximum
        wait_replicas(gcs, "auto", 2, 300)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert statuses and set(statuses) == {200}

    # Idle but for two long streams (one per replica): one replica is enough for them, so
    # the deployment shrinks while both run; the replica that goes drains its stream first.
    # They stay slow until the scale-down has begun, then finish at full speed.
    release = tmp_path / "release"
    long = {"max_tokens": 150, "stream_options": {"include_usage": True},
            "vllm_xargs": {"step_delay_s": 0.1, "slow_until": str(release)}, "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:
        streams = []
        for i in range(2):
            streams.append(pool.submit(stream_events, base, "auto", f"a long story, part {i}", **long))
            time.sleep(1)
        wait_for(lambda: probe(gcs, "status")["auto"]["engine"] != {"RUNNING": 2}, 120, "the scale-down to start")
        assert not all(s.done() for s in streams), "the streams ended before the scale-down began"
        release.touch()
        results = [s.result(timeout=300) for s in streams]
    for events in results:
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1] if isinstance(e, dict))
        assert events[-2]["usage"]["completion_tokens"] == 150
        assert [c["finish_reason"] for e in events[:-1] for c in e.get("choices", [])][-1] == "length"
    wait_replicas(gcs, "auto", 1, 120)


def test_a_dead_worker_under_traffic_fails_over_and_the_fleet_recovers(fleet, tmp_path):
    base, gcs = fleet["base"] + "/affinity", fleet["gcs"]
    victim = probe(gcs, "replicas", "affinity")[0]
    stop, log = threading.Event(), []
    threads = [threading.Thread(target=_steady_traffic, args=(base, "affinity", stop, log, i)) for i in range(2)]
    release = tmp_path / "release"  # the streams are slow until the kill, then finish at full speed
    long = {"max_tokens": 300, "stream_options": {"include_usage": True},
            "vllm_xargs": {"step_delay_s": 0.05, "slow_until": str(release)}, "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:
        # Two long streams, one per replica (the least busy one takes a prompt no one holds),
        # then steady short requests beside them.
        streams = []
        for i in range(2):
            streams.append(pool.submit(stream_events, base, "affinity", f"a long story, chapter {i}", **long))
            time.sleep(1)
        for t in threads:
            t.start()
        time.sleep(1)
        assert probe(gcs, "kill-worker", f"engine-{victim}", "0") == "dead"
        killed = time.monotonic()
        release.touch()
        results = [s.result(timeout=300) for s in streams]
    time.sleep(3)  # traffic goes on after the kill
    stop.set()
    for t in threads:
        t.join(120)

    after = [entry for entry in log if entry[0] > killed]
    assert len(after) >= 3 and all(status == 200 for _, _, status, _ in after), after
    # The stream on the dead replica had produced tokens: it ends with an OpenAI error event.
    outcomes = []
    for events in results:
        assert events[-1] == "[DONE]"
        errors = [e["error"] for e in events[:-1] if "error" in e]
        if errors:
            assert errors[0]["code"] == 503 and "unavailable" in errors[0]["message"], errors
            assert any(e.get("choices") for e in events[:-2])  # tokens came before the failure
            outcomes.append("error")
        else:
            assert events[-2]["usage"]["completion_tokens"] == 300
            outcomes.append("complete")
    assert sorted(outcomes) == ["complete", "error"]
    wait_for(lambda: metric_sum(scrape(fleet["metrics"]), "ray_llm_requests_retried_total", model_name="affinity") >= 1,
             60, "a counted retry")
    # Serve replaces the broken replica: two replicas again, the victim gone.
    wait_for(lambda: victim not in probe(gcs, "replicas", "affinity"), 300, "the broken replica to go")
    wait_replicas(gcs, "affinity", 2, 300)
    assert complete(base, "affinity", "after the recovery", max_tokens=4).status_code == 200


def test_copies_lost_and_replaced_answer_a_conversation_from_the_shared_kv_tier(fleet):
    """`affinity`'s two copies share a disk KV tier. A prompt is computed by one of them, both
    copies' workers are then killed and Serve replaces the copies: a new copy, whose pool never
    held the prompt, answers it again with the same greedy text and its ten full blocks read from
    the folder the lost copy wrote (cached_tokens 160, not computed)."""
    base, gcs = fleet["base"] + "/affinity", fleet["gcs"]
    prompt = [100 + (7 * i) % 9000 for i in range(168)]  # 10 full blocks of 16, and 8 tokens more

    def answer() -> tuple[str, int]:
        r = complete(base, "affinity", prompt, max_tokens=6, temperature=0)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    text, cached = answer()
    assert cached == 0
    # Written in the background right after their step; other tests' prompts add their own files.
    wait_for(lambda: len(list(fleet["kv"].rglob("*.kv"))) >= 10, 60, "the prompt's blocks in the KV tier")
    old = probe(gcs, "replicas", "affinity")
    for rid in old:
        assert probe(gcs, "kill-worker", f"engine-{rid}", "0") == "dead"
    wait_for(lambda: not set(old) & set(probe(gcs, "replicas", "affinity")), 300, "the lost copies to go")
    wait_replicas(gcs, "affinity", 2, 300)
    assert answer() == (text, 160)


def _steady_traffic(base: str, app: str, stop: threading.Event, log: list, i: int, responses: bool = False) -> None:
    """Whole answers one after another (completions, or Responses API answers); each logged as
    (sent at, seconds it took, status, body)."""
    n = 0
    while not stop.is_set():
        start = time.monotonic()
        try:
            if responses:
                r = requests.post(f"{base}/v1/responses", timeout=120, json={
                    "model": app, "input": f"steady traffic {i}, request {n}", "max_output_tokens": 4,
                    "store": False})
            else:
                r = complete(base, app, f"steady traffic {i}, request {n}", max_tokens=4, ignore_eos=True)
            log.append((start, time.monotonic() - start, r.status_code, r.text[:300]))
        except Exception as exc:  # a hang or a dropped connection is a failure too
            log.append((start, time.monotonic() - start, None, repr(exc)))
        n += 1


def _resume(pid: int) -> None:
    """Whatever happened, leave no process stopped (a failed copy's worker may be gone already)."""
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def test_a_frozen_worker_is_detected_and_its_requests_fail_over(fleet, tmp_path):
    """One copy's worker alive but silent (SIGSTOP) under traffic: its step passes step_timeout_s,
    the copy fails, the requests it held with no token yet go to the other copy, its stream in
    flight ends with an error event, and Serve replaces the copy."""
    base, gcs = fleet["base"] + "/p2c", fleet["gcs"]
    victim = probe(gcs, "replicas", "p2c")[0]
    pid = probe(gcs, "actor-pid", f"engine-{victim}", "worker-0")
    stop, log = threading.Event(), []
    # Completions and Responses API answers: both are sent again whole when their copy fails.
    threads = [threading.Thread(target=_steady_traffic, args=(base, "p2c", stop, log, i, i == 1)) for i in range(2)]
    release = tmp_path / "release"  # the streams are slow until the freeze, then the live one finishes
    long = {"max_tokens": 300, "stream_options": {"include_usage": True},
            "vllm_xargs": {"step_delay_s": 0.05, "slow_until": str(release)}, "ignore_eos": True}
    try:
        with ThreadPoolExecutor(2) as pool:
            streams = []
            for i in range(2):  # power of two picks the idle copy: one stream on each
                streams.append(pool.submit(stream_events, base, "p2c", f"a long story, part {i}", **long))
                time.sleep(1)
            for t in threads:
                t.start()
            time.sleep(1)
            os.kill(pid, signal.SIGSTOP)
            frozen = time.monotonic()
            release.touch()
            results = [s.result(timeout=300) for s in streams]
        time.sleep(3)  # traffic goes on after the copy failed
    finally:
        stop.set()
        _resume(pid)
    for t in threads:
        t.join(120)

    # Whole answers in flight on the frozen copy, and those sent after it froze, all succeed:
    # those it held are sent again to the other copy once it fails (their clients saw nothing),
    # and none waits longer than the step timeout and the retry, far from the client's timeout.
    after = [entry for entry in log if entry[0] + entry[1] > frozen]
    assert len(after) >= 3 and all(status == 200 for _, _, status, _ in after), after
    assert max(took for _, took, _, _ in after) < STEP_TIMEOUT_S + 30, after
    outcomes = []
    for events in results:
        assert events[-1] == "[DONE]"
        errors = [e["error"] for e in events[:-1] if "error" in e]
        if errors:
            assert errors[0]["code"] == 503 and "step_timeout_s=5" in errors[0]["message"], errors
            outcomes.append("error")
        else:
            assert events[-2]["usage"]["completion_tokens"] == 300
            outcomes.append("complete")
    assert sorted(outcomes) == ["complete", "error"]
    wait_for(lambda: victim not in probe(gcs, "replicas", "p2c"), 300, "the stuck replica to go")
    wait_replicas(gcs, "p2c", 2, 300)
    assert complete(base, "p2c", "after the recovery", max_tokens=4).status_code == 200


def test_a_frozen_worker_is_found_by_its_liveness_ping_without_a_step_timeout(fleet, tmp_path):
    """`affinity` sets no step_timeout_s. A copy's worker frozen (SIGSTOP) in the middle of long
    requests stops answering its liveness ping (workers answer it during steps too), and the copy
    fails within the liveness timeout instead of waiting on Serve's health checks: its whole
    answers in flight run again on the other copy and succeed, its streams end with an error
    event, and Serve replaces the copy."""
    base, gcs = fleet["base"] + "/affinity", fleet["gcs"]
    victim = probe(gcs, "replicas", "affinity")[0]
    pid = probe(gcs, "actor-pid", f"engine-{victim}", "worker-0")
    retried = metric_sum(scrape(fleet["metrics"]), "ray_llm_requests_retried_total", model_name="affinity")
    release = tmp_path / "release"  # slow until the freeze: then what can run finishes at full speed
    slow = {"max_tokens": 200, "ignore_eos": True, "vllm_xargs": {"step_delay_s": 0.05, "slow_until": str(release)}}
    with ThreadPoolExecutor(8) as pool:  # four of each: by load, both copies hold some
        wholes = [pool.submit(complete, base, "affinity", f"whole {i}", **slow) for i in range(4)]
        streams = [pool.submit(stream_events, base, "affinity", f"stream {i}", **slow) for i in range(4)]
        time.sleep(2)
        try:
            os.kill(pid, signal.SIGSTOP)
            release.touch()
            answers = [w.result(timeout=300) for w in wholes]
            events = [s.result(timeout=300) for s in streams]
        finally:
            _resume(pid)
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 200 for r in answers), \
        [r.text[:300] for r in answers]
    errors = [e["error"] for evs in events for e in evs[:-1] if isinstance(e, dict) and "error" in e]
    assert all(evs[-1] == "[DONE]" for evs in events)
    assert all(e["code"] == 503 and "liveness ping" in e["message"] for e in errors), errors
    for evs in events:  # a stream on the other copy went on to its end
        if not any("error" in e for e in evs[:-1]):
            assert evs[-2]["choices"][0]["finish_reason"] == "length"
    # Eight long requests over two copies by load: the frozen one held some. Its streams were cut
    # (an error event), its whole answers sent again (counted as retries).
    wait_for(lambda: errors or metric_sum(scrape(fleet["metrics"]), "ray_llm_requests_retried_total",
                                          model_name="affinity") > retried, 30, "a request of the frozen copy")
    wait_for(lambda: victim not in probe(gcs, "replicas", "affinity"), 300, "the frozen replica to go")
    wait_replicas(gcs, "affinity", 2, 300)
    assert complete(base, "affinity", "after the recovery", max_tokens=4).status_code == 200


def _copy_stats(base: str, copies: int) -> dict[str, dict]:
    """Each engine copy's /engine/stats by replica id (it answers from one copy at a time, so it
    is asked until every copy has answered)."""
    seen = {}

    def ask():
        stats = requests.get(f"{base}/engine/stats", timeout=30).json()
        seen[stats["replica"]] = stats
        return len(seen) == copies

    wait_for(ask, 60, f"stats from {copies} engine copies")
    return seen


def _engine_idle(base: str, copies: int = 1) -> None:
    """Until every engine copy holds no request and no block."""
    def idle():
        return all(s["num_unfinished"] == 0 and s["num_free_blocks"] == s["num_blocks"]
                   for s in _copy_stats(base, copies).values())

    wait_for(idle, 60, "the engine to hold no request and no block")


def _aborted(base: str, copies: int = 2) -> int:
    """Requests the engine copies ended as aborted (their reader gone)."""
    return sum(s["finished"].get("abort", 0) for s in _copy_stats(base, copies).values())


def _choose(base: str, app: str, i: int) -> requests.Response:
    body = {"model": app, "prompt": f"pick one, {i}", "max_tokens": 8,
            "structured_outputs": {"choice": [f"left-{i}", f"right-{i}"]}}  # a grammar of its own
    return requests.post(f"{base}/v1/completions", json=body, timeout=300)


def test_a_lost_grammar_compiler_is_restarted_and_the_requests_waiting_on_it_compile(fleet):
    """A copy starts its compiler with its first structured request. The compiler stopped
    (SIGSTOP) with two structured requests waiting on it, then killed: Ray restarts it, the two
    compiles run again on the new one, both requests answer with one of their choices, and
    later structured requests compile as before."""
    base, gcs = fleet["base"] + "/auto", fleet["gcs"]
    wait_replicas(gcs, "auto", 1, 300)
    replica = probe(gcs, "replicas", "auto")[0]
    assert probe(gcs, "actor-pid", f"engine-{replica}", "grammar-compiler") is None  # none asked yet
    first = _choose(base, "auto", 9)
    assert first.status_code == 200 and first.json()["choices"][0]["text"] in ("left-9", "right-9")
    pid = probe(gcs, "actor-pid", f"engine-{replica}", "grammar-compiler")
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(2) as pool:
            waiting = [pool.submit(_choose, base, "auto", i) for i in range(2)]
            wait_for(lambda: requests.get(f"{base}/engine/stats", timeout=30).json()["num_unfinished"] == 2, 60,
                     "two requests waiting for their grammar")
            assert not any(f.done() for f in waiting)
            os.kill(pid, signal.SIGKILL)
            answers = [f.result(timeout=300) for f in waiting]
    finally:
        try:
            os.kill(pid, signal.SIGKILL)  # never leave a stopped process behind
        except ProcessLookupError:
            pass
    for i, r in enumerate(answers):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] in (f"left-{i}", f"right-{i}")
    restarted = probe(gcs, "actor-pid", f"engine-{replica}", "grammar-compiler")
    assert restarted not in (None, pid)
    after = _choose(base, "auto", 7)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] in ("left-7", "right-7")
    _engine_idle(base)


def test_a_killed_ingress_replica_loses_only_the_streams_it_carried(fleet, tmp_path):
    """Two ingress replicas, four long streams over them, each answering; the one carrying more
    killed (SIGKILL): the streams it carried (its own count, reported just before) are cut, the
    others finish, new requests are answered by the other replica, Serve starts a replacement, and
    the engine aborts the cut streams and frees their blocks. (A request whose answer has not
    begun when its replica dies is resent by HAProxy to another one: the kill waits for every
    stream's first event, so what it cuts is known.)"""
    base, gcs = fleet["base"] + "/p2c", fleet["gcs"]
    ingresses = probe(gcs, "replicas", "p2c", "ingress")
    assert len(ingresses) == 2
    # Each replica's pid before the streams start: between reading the counts and the kill only
    # the kill itself remains, so the streams counted are still running when it lands (a probe
    # there took seconds, and the streams once finished first: all four completed).
    pids = {i: probe(gcs, "actor-pid", "serve", f"SERVE_REPLICA::p2c#ingress#{i}") for i in ingresses}
    # The streams are slow until the cut ones have been aborted (so none of those finishes
    # first), then the others finish at full speed.
    release = tmp_path / "release"
    long = {"max_tokens": 200, "stream_options": {"include_usage": True},
            "vllm_xargs": {"step_delay_s": 0.1, "slow_until": str(release)}, "ignore_eos": True}
    started = [threading.Event() for _ in range(4)]

    def stream(i: int):
        try:
            return stream_events(base, "p2c", f"a long tale, part {i}", started=started[i], **long)
        except Exception as exc:  # a cut connection
            return exc

    aborted = _aborted(base)
    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(stream, i) for i in range(4)]
        wait_for(lambda: all(e.is_set() for e in started), 60, "every stream's first event")
        counts = wait_for(lambda: (c := probe(gcs, "in-flight")) and sum(c.get(i, 0) for i in ingresses) == 4 and c,
                          60, "the four streams to be in flight")
        victim = max(ingresses, key=lambda i: counts.get(i, 0))  # it carries two streams or more
        carried = counts[victim]
        os.kill(pids[victim], signal.SIGKILL)
        after = [complete(base, "p2c", f"after the kill {i}", max_tokens=4, ignore_eos=True) for i in range(6)]
        # The engine aborted the cut streams (their reader is gone) rather than running them out.
        wait_for(lambda: _aborted(base) == aborted + carried, 60, "the cut streams aborted")
        release.touch()
        results = [s.result(timeout=300) for s in streams]
    assert [r.status_code for r in after] == [200] * 6, [r.text[:200] for r in after]
    finished = [e for e in results if isinstance(e, list) and e[-1] == "[DONE]"
                and e[-2].get("usage", {}).get("completion_tokens") == 200]
    assert len(finished) == 4 - carried, results
    assert all(not isinstance(e, list) or e[-1] != "[DONE]" for e in results if e not in finished)
    wait_for(lambda: victim not in (r := probe(gcs, "replicas", "p2c", "ingress")) and len(r) == 2, 300,
             "a replacement ingress replica")
    assert _aborted(base) == aborted + carried  # and only those
    _engine_idle(base, copies=2)


def test_the_serve_controller_killed_under_traffic_changes_nothing_for_clients(fleet):
    """Serve's controller killed (SIGKILL) under steady traffic: every request is answered while
    Ray restarts it, and the app is RUNNING again afterwards with both engine copies."""
    base, gcs = fleet["base"] + "/affinity", fleet["gcs"]
    stop, log = threading.Event(), []
    threads = [threading.Thread(target=_steady_traffic, args=(base, "affinity", stop, log, i)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(1)
        pid = probe(gcs, "actor-pid", "serve", "SERVE_CONTROLLER_ACTOR")
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: probe(gcs, "actor-pid", "serve", "SERVE_CONTROLLER_ACTOR") not in (None, pid), 120,
                 "the controller to restart")
        time.sleep(2)  # traffic goes on after the restart
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    after = [entry for entry in log if entry[0] > killed]
    assert len(after) >= 3 and all(status == 200 for _, _, status, _ in after), after
    wait_for(lambda: probe(gcs, "apps").get("affinity") == "RUNNING", 120, "the app RUNNING again")
    wait_replicas(gcs, "affinity", 2, 120)
    _engine_idle(base, copies=2)


def test_serve_cli_shutdown_drains_then_stops_serve_and_leaves_the_cluster(fleet, tmp_path):
    """`serve_cli shutdown --address`, the graceful `serve shutdown` of a running cluster: a
    stream in flight finishes, new requests get 503 with Retry-After meanwhile, then Serve
    stops and the cluster stays up. It ends every app, so it runs last."""
    base, gcs = fleet["base"] + "/affinity", fleet["gcs"]
    # Slow (up to 30 s) until released once new requests are refused: it must outlast the start
    # of the shutdown process (Python, Ray) on a busy machine; then it finishes at full speed.
    release = tmp_path / "release"
    long = {"max_tokens": 300, "stream_options": {"include_usage": True},
            "vllm_xargs": {"step_delay_s": 0.1, "slow_until": str(release)}, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(stream_events, base, "affinity", "a long story", **long)
        wait_for(lambda: sum(probe(gcs, "in-flight").values()) == 1 or stream.done(), 60, "the stream in flight")
        shutdown = subprocess.Popen([sys.executable, "-m", "actors.serve_cli", "shutdown", "--address", gcs,
                                     "--drain-timeout-s", "120"], cwd=ROOT, env=loopback_env(),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            # In a list: a Response is falsy when its status is an error.
            (refused,) = wait_for(lambda: [r] if (r := complete(base, "affinity", "a new one", max_tokens=2)).status_code
                                  == 503 else None, 120, "new requests refused")
            assert refused.headers["Retry-After"] and not stream.done()
            release.touch()
            events = stream.result(timeout=300)
            out, _ = shutdown.communicate(timeout=180)
        finally:
            stop_process(shutdown)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 300, events[-3:]
    assert shutdown.returncode == 0 and "Drained." in out and "Serve shut down." in out, out
    assert probe(gcs, "apps") == {}  # Serve is gone; the cluster still answers
