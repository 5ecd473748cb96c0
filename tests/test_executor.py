"""The in-process executor as a served copy runs it at one CPU rank (`distributed_executor_backend:
uni`): the worker built, and every step run, on one thread of its own, the caller free meanwhile."""
import threading

import torch

from cluster import LLM, SamplingParams
from cluster.config import EngineConfig
from cluster.engine.engine_core import EngineCore
from cluster.messages import EngineRequest
from cluster.worker.worker import InProcessExecutor

PROMPTS = [[5, 9, 200, 31, 7] * 4, [100 + i for i in range(37)]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_own_thread_builds_the_worker_and_runs_every_step_there(tiny_llama_dir):
    config = EngineConfig.create(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64).finalize()
    main_threads = torch.get_num_threads()
    executor = InProcessExecutor(config, own_thread=True, torch_threads=1)
    # OpenMP's thread count is the calling thread's: set where the model runs, not here.
    assert executor.thread.submit(torch.get_num_threads).result() == 1
    assert torch.get_num_threads() == main_threads
    threads, execute = [], executor.worker.execute

    def recorded(plan_bytes):
        threads.append(threading.current_thread().name)
        return execute(plan_bytes)

    executor.worker.execute = recorded
    try:
        core = EngineCore(config, executor)
        for i, prompt in enumerate(PROMPTS):
            core.add_request(EngineRequest(str(i), prompt, PARAMS))
        got = {str(i): [] for i in range(len(PROMPTS))}
        while core.has_unfinished():
            for out in core.step():
                got[out.request_id] += out.new_token_ids
    finally:
        executor.shutdown()
    want = LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=64).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    assert [got[str(i)] for i in range(len(PROMPTS))] == [o.outputs[0].token_ids for o in want]
    assert threads and set(threads) == {"worker-0_0"} and threading.current_thread().name not in threads
