"""GPU check, the KV tier on CUDA (benchmarks/gpu_check.py runs it with `--checks parity`): a pool
too small for four 5-turn conversations, greedy tokens equal with the tier (shared memory spilling
to disk) on and off, plain and async scheduling; tier hits, reads and writes counted."""
from __future__ import annotations

import gc
import random
import shutil
import time
from pathlib import Path

import torch


def tier_chat(llm, convs: int = 4, turns: int = 5) -> list[list[int]]:
    """Conversations in lockstep (random token ids), each answer and a new user turn appended to
    its history; the tier's asynchronous writes are flushed between turns. Every answer's tokens."""
    from cluster import SamplingParams

    rng = random.Random(3)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    histories = [[rng.randint(100, 10000) for _ in range(40)] for _ in range(convs)]
    answers = []
    for _ in range(turns):
        outs = llm.generate([{"prompt_token_ids": h} for h in histories], params, use_tqdm=False)
        for c, o in enumerate(outs):
            answers.append(list(o.outputs[0].token_ids))
            histories[c] = histories[c] + answers[-1] + [rng.randint(100, 10000) for _ in range(30)]
        offload = llm.engine.executor.worker.runner.kv_offload
        if offload is not None:
            offload.flush()
    return answers


def check_kv_tier(preset: dict, tier_dir: Path) -> dict:
    """`preset`: the engine's options (configs/gpu.yaml's, SmolLM2's path), run in fp32 (TF32 off)
    with 24 blocks of 16 tokens, about two of the four conversations: the tier off, then on (10
    MiB of shared memory under `tier_dir` spilling to disk there) with plain and async
    scheduling, CUDA graphs on. Equal tokens expected; a differing answer is listed."""
    from cluster import LLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    base = dict(preset, dtype="float32", block_size=16, num_kv_blocks=24, max_model_len=512, max_num_seqs=16)
    result: dict = {}
    want = None
    for label, extra in (("off", {}), ("on", {"tier": True}), ("on_async", {"tier": True, "async_scheduling": True})):
        shutil.rmtree(tier_dir, ignore_errors=True)
        kw = dict(base, **{k: v for k, v in extra.items() if k != "tier"})
        if extra.get("tier"):
            kw.update(kv_offloading_size=0.01, kv_offloading_shm_path=str(tier_dir / "shm"),
                      kv_offloading_disk_path=str(tier_dir / "disk"), kv_offloading_disk_size=0.2)
        llm = LLM(**kw)
        t0 = time.perf_counter()
        got = tier_chat(llm)
        st = llm.engine.stats()
        fig = {"seconds": time.perf_counter() - t0, "preemptions": st.preemptions,
               "free_blocks_at_end": st.num_free_blocks, "blocks": st.num_blocks}
        if extra.get("tier"):
            fig.update({k: getattr(st, f"kv_tier_{k}") for k in (
                "hit_tokens", "blocks_written", "bytes_read", "load_failures", "corrupt_files", "spills",
                "promotions")})
            fig["equal_to_off"] = got == want
            fig["differing_answers"] = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
        else:
            want = got
        result[label] = fig
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    shutil.rmtree(tier_dir, ignore_errors=True)
    on = [result[k] for k in ("on", "on_async")]
    result["ok"] = all(f["equal_to_off"] and f["hit_tokens"] > 0 and f["load_failures"] == 0
                       and f["corrupt_files"] == 0 and f["free_blocks_at_end"] == f["blocks"] for f in on)
    return {"kv_tier": result, "kv_tier_ok": result["ok"]}
