"""Prometheus metrics through `ray.util.metrics` (exported as `ray_<name>` by each node).

Every series is tagged `model` with the served model's id (and `model_name`, vLLM's name for
the same label, with the same value), so the series of the models one app serves stay apart.
The engine deployment owns the scheduler-side numbers (gauges + counters from
`EngineCore.stats()`), each series tagged with the engine replica's id; the ingress owns the
latencies a client sees (TTFT, inter-token, end-to-end), measured from the HTTP request's
arrival, and the retries of requests a failed replica refused; the engine router (running in
the ingress) counts its decisions. docs/metrics.md lists them; dashboards/grafana.json charts them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ray.util.metrics import Counter, Gauge, Histogram

if TYPE_CHECKING:
    from cluster.engine.engine_core import EngineStats

TAGS = ("model", "model_name")
ENGINE_TAGS = TAGS + ("replica",)
TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0]
ITL_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5]
E2E_BUCKETS = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0]

# EngineStats field -> counter name; counters advance by the change since the last record.
_COUNTERS = {
    "prompt_tokens": ("llm_prompt_tokens", "Prompt tokens prefilled."),
    "generation_tokens": ("llm_generation_tokens", "Tokens generated."),
    "preemptions": ("llm_preemptions", "Requests preempted (KV cache full, recomputed later)."),
    "prefix_cache_queries": ("llm_prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("llm_prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "spec_decode_num_drafts": ("llm_spec_decode_num_drafts",
                               "Speculative drafts verified (one per request and step)."),
    "spec_decode_num_draft_tokens": ("llm_spec_decode_num_draft_tokens", "Draft tokens verified."),
    "spec_decode_num_accepted_tokens": ("llm_spec_decode_num_accepted_tokens", "Draft tokens accepted."),
    # The KV tier (docs/kv_tier.md); the traffic is rank 0's (each rank moves its own heads' share).
    "kv_tier_hit_tokens": ("llm_kv_tier_hit_tokens", "Prompt tokens read from the KV tier instead of computed."),
    "kv_tier_load_failures": ("llm_kv_tier_load_failures",
                              "Requests whose KV tier read failed on a rank (their blocks were computed)."),
    "kv_tier_bytes_read": ("llm_kv_tier_bytes_read", "Bytes read from the KV tier (rank 0)."),
    "kv_tier_bytes_written": ("llm_kv_tier_bytes_written", "Bytes written to the KV tier (rank 0)."),
    "kv_tier_load_seconds": ("llm_kv_tier_load_seconds", "Seconds spent reading, checking and copying in "
                             "KV tier blocks (rank 0; in the steps that start their requests)."),
    "kv_tier_evictions": ("llm_kv_tier_evictions", "KV tier files deleted from its last level over budget."),
    "kv_tier_spills": ("llm_kv_tier_spills", "KV tier files moved from shared memory to disk over budget."),
    "kv_tier_corrupt_files": ("llm_kv_tier_corrupt_files",
                              "KV tier files skipped and removed: torn, foreign or failing their checksum."),
    "kv_tier_writes_dropped": ("llm_kv_tier_writes_dropped",
                               "KV blocks not written to the tier because its writer lagged."),
    "kv_tier_promotions": ("llm_kv_tier_promotions",
                           "KV tier blocks copied up from disk to shared memory before a request read them."),
    "kv_tier_writes_held": ("llm_kv_tier_writes_held",
                            "KV blocks not written to the tier while it held its contents (not read back)."),
}


def model_tags(model: str) -> dict[str, str]:
    return {"model": model, "model_name": model}


class EngineMetrics:
    def __init__(self, model_name: str, replica: str = "") -> None:
        self.tags = {**model_tags(model_name), "replica": replica}
        self.running = Gauge("llm_requests_running", "Requests in the running batch.", ENGINE_TAGS)
        self.waiting = Gauge("llm_requests_waiting", "Requests waiting to be scheduled.", ENGINE_TAGS)
        self.kv_usage = Gauge("llm_kv_cache_usage", "Fraction of KV cache blocks in use (0-1).", ENGINE_TAGS)
        self.hit_rate = Gauge("llm_prefix_cache_hit_rate",
                              "Prefix-cache hits / queries (tokens) since the engine started.", ENGINE_TAGS)
        self.acceptance_length = Gauge("llm_spec_decode_mean_acceptance_length",
                                       "Tokens emitted per speculative draft (1 + accepted / drafts) "
                                       "since the engine started.", ENGINE_TAGS)
        self.counters = {key: Counter(name, doc, ENGINE_TAGS) for key, (name, doc) in _COUNTERS.items()}
        self.last = {key: 0 for key in _COUNTERS}
        # LoRA (docs/lora.md): per adapter, its requests, whether it sits in a slot, its read time.
        self.lora_requests = Counter("llm_lora_requests", "Requests admitted per LoRA adapter.",
                                     ENGINE_TAGS + ("adapter",))
        self.lora_resident = Gauge("llm_lora_adapter_resident", "1 while the LoRA adapter sits in one of the "
                                   "copy's max_loras slots, else 0.", ENGINE_TAGS + ("adapter",))
        self.lora_load_seconds = Gauge("llm_lora_adapter_load_seconds", "Time the adapter's last read and "
                                       "check from its folder took.", ENGINE_TAGS + ("adapter",))
        self.lora_slot_loads = Counter("llm_lora_slot_loads", "Adapters loaded into a slot (an idle one "
                                       "evicted when all were taken).", ENGINE_TAGS)
        self.lora_last: dict[str, int] = {}
        self.lora_seen: set[str] = set()
        self.last_slot_loads = 0

    def record(self, stats: EngineStats) -> None:
        self.running.set(stats.running, self.tags)
        self.waiting.set(stats.waiting, self.tags)
        self.kv_usage.set(stats.kv_usage, self.tags)
        queries = stats.prefix_cache_queries
        self.hit_rate.set(stats.prefix_cache_hits / queries if queries else 0.0, self.tags)
        if stats.spec_decode_num_drafts:
            self.acceptance_length.set(stats.spec_decode_mean_acceptance_length, self.tags)
        for key, counter in self.counters.items():
            value = getattr(stats, key)
            if value > self.last[key]:
                counter.inc(value - self.last[key], self.tags)
            self.last[key] = value
        if stats.lora_requests or stats.lora_resident:
            self._record_lora(stats)

    def _record_lora(self, stats: EngineStats) -> None:
        for adapter, count in stats.lora_requests.items():
            if count > self.lora_last.get(adapter, 0):
                self.lora_requests.inc(count - self.lora_last.get(adapter, 0), {**self.tags, "adapter": adapter})
            self.lora_last[adapter] = count
        resident = set(stats.lora_resident)
        self.lora_seen |= resident | set(stats.lora_load_seconds)
        for adapter in self.lora_seen:
            tags = {**self.tags, "adapter": adapter}
            self.lora_resident.set(1.0 if adapter in resident else 0.0, tags)
            if adapter in stats.lora_load_seconds:
                self.lora_load_seconds.set(stats.lora_load_seconds[adapter], tags)
        if stats.lora_slot_loads > self.last_slot_loads:
            self.lora_slot_loads.inc(stats.lora_slot_loads - self.last_slot_loads, self.tags)
        self.last_slot_loads = stats.lora_slot_loads


class RequestMetrics:
    def __init__(self, model_name: str) -> None:
        self.tags = model_tags(model_name)
        self.ttft = Histogram("llm_time_to_first_token_seconds",
                              "HTTP arrival to the first generated token.", TTFT_BUCKETS, TAGS)
        self.itl = Histogram("llm_inter_token_latency_seconds",
                             "Time between consecutive tokens of a request.", ITL_BUCKETS, TAGS)
        self.e2e = Histogram("llm_e2e_request_latency_seconds",
                             "HTTP arrival to the last token.", E2E_BUCKETS, TAGS)
        self.finished = Counter("llm_requests_finished", "Requests finished, by finish reason.",
                                TAGS + ("finish_reason",))
        self.requests = Counter("llm_api_requests", "Requests by API endpoint (completions, chat_completions, "
                                "responses, messages, embeddings), counted once the model is found.",
                                TAGS + ("endpoint",))
        self.retried = Counter("llm_requests_retried",
                               "Requests sent again to another engine replica after one refused them "
                               "before producing a token.", TAGS)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds, self.tags)

    def inter_token(self, seconds: float, num_tokens: int) -> None:
        # Tokens that arrive together share the gap (a reader that fell behind a step).
        for _ in range(num_tokens):
            self.itl.observe(seconds / num_tokens, self.tags)

    def finish(self, seconds: float, reason: str) -> None:
        self.e2e.observe(seconds, self.tags)
        self.finished.inc(1, {**self.tags, "finish_reason": reason})

    def retry(self) -> None:
        self.retried.inc(1, self.tags)

    def request(self, endpoint: str) -> None:
        self.requests.inc(1, {**self.tags, "endpoint": endpoint})


class RoutingMetrics:
    """Decisions of the prefix-aware engine router (actors/fleet/router.py), in each caller."""

    def __init__(self, model_name: str) -> None:
        self.tags = model_tags(model_name)
        self.decisions = Counter("llm_routing_decisions",
                                 "Requests routed to an engine replica, by decision: prefix_hit (it "
                                 "holds the longest cached prefix), tier_hit (its node's KV tier holds "
                                 "it), load_fallback (that replica was too busy), no_prefix (no "
                                 "replica holds one).", TAGS + ("decision", "replica"))

    def decision(self, reason: str, replica: str) -> None:
        self.decisions.inc(1, {**self.tags, "decision": reason, "replica": replica})
