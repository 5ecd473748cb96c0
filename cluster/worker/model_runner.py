"""One rank's model runner: applies the StepPlan delta to its cached request state, runs its
shard of the model, and on rank 0 hands the logits to the sampling step (`SamplingStep`).

Every rank builds the same flat token layout from the plan (decodes first, then prefill
chunks, each group in plan order), so the row-parallel all-reduces line up across ranks.
When a step ends every rank appends the tokens it emitted to its request state (rank 0's
sample, broadcast to the others): the next plan may have been made before the engine saw them.

On CUDA: the KV cache takes what `gpu_memory_utilization` leaves after a profiling pass
(kv_budget.py), step inputs go through pinned memory with non-blocking copies, and
pure-decode steps replay CUDA graphs (cuda_graphs.py) unless `enforce_eager` is set. On CPU
the same switch keeps decode steps of a few rows off the one-call decoder layers
(model/layers/fused_layer.py).
"""
from __future__ import annotations

import logging

import torch

from cluster.config import EngineConfig
from cluster.lora.model_slots import ModelLoRASlots
from cluster.messages import CachedRequests, KVLoad, Logprobs, NewRequest, StepPlan, StepResult
from cluster.model.context import build_attention_metadata, set_forward_context
from cluster.model.kv_cache import bind_kv_cache, kv_cache_bytes_per_block
from cluster.model.layers.attention import select_backend
from cluster.model.layers.lora import LoRAMapping, set_lora_mapping
from cluster.model.loader import load_model
from cluster.model.parallel import ParallelContext
from cluster.worker.cuda_graphs import GRAPH_BACKENDS, CudaGraphSeam, DecodeGraphs
from cluster.worker.cpu_malloc import keep_freed_memory, release_freed_memory
from cluster.worker.input_batch import CachedRequestState
from cluster.worker.kv_offload import KVOffload
from cluster.worker.kv_budget import needs_profile, num_kv_blocks, profile_peak_activation
from cluster.worker.pooling import PromptPooler
from cluster.worker.sampling_step import SamplingStep

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, parallel: ParallelContext) -> None:
        mc, sc = config.model_config, config.scheduler_config
        self.config, self.parallel = config, parallel
        self.device = torch.device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory()
        torch.manual_seed(mc.seed)
        self.model = load_model(mc, parallel, self.device, config.attention_backend,
                                fuse_layers=not config.enforce_eager)
        if self.device.type == "cpu":
            release_freed_memory()  # the weights' copies left behind on the heap while packing
        lc = config.lora_config
        self.lora = ModelLoRASlots(self.model, lc.max_loras, lc.max_lora_rank) if lc.enable_lora else None
        self.block_size = config.cache_config.block_size
        kv_dtype = config.cache_config.kv_torch_dtype
        self.attention_backend = select_backend(config.attention_backend, self.device, self.block_size, kv_dtype)
        use_graphs = self.device.type == "cuda" and not config.enforce_eager and self.attention_backend in GRAPH_BACKENDS
        per_block = kv_cache_bytes_per_block(mc.hf_config, parallel, self.block_size, kv_dtype)
        peak = profile_peak_activation(self.model, config, self.attention_backend) if needs_profile(config) else 0
        self.num_blocks = num_kv_blocks(config, per_block, self.device, peak)
        # With graphs, one more block than the engine knows of: the padded rows' scratch.
        self.kv_caches = bind_kv_cache(self.model, self.num_blocks + int(use_graphs), self.block_size,
                                       kv_dtype, self.device, self.attention_backend)
        self.graphs: DecodeGraphs | None = None
        if use_graphs:
            self.graphs = DecodeGraphs(sc.max_num_seqs, mc.max_model_len, self.block_size, self.num_blocks,
                                       mc.hf_config.hidden_size, mc.torch_dtype, self.device, CudaGraphSeam())
            with torch.inference_mode():
                self.graphs.capture(self.model)
        if self.device.type == "cuda":
            logger.info("rank %d: attention %s, CUDA graphs %s, %d KV blocks of %d tokens (peak activation "
                        "%.2f GiB)", parallel.rank, self.attention_backend,
                        self.graphs.sizes if self.graphs else "off", self.num_blocks, self.block_size, peak / 2**30)
        self.kv_offload = KVOffload.create(config, parallel, self.kv_caches)  # None: no KV tier
        self.requests: dict[str, CachedRequestState] = {}
        self.sampling = SamplingStep(config, self.device) if parallel.rank == 0 else None
        # Embedding models pool their prompts' hidden states on rank 0 instead of sampling.
        embed = mc.task == "embed" and parallel.rank == 0
        self.pooler = PromptPooler(mc.pooler_config["pooling_type"]) if embed else None

    # ---- state updates ----------------------------------------------------------------
    def _update_states(self, plan: StepPlan) -> None:
        for adapter in plan.lora_prefetch:  # read in the background, loaded in a later step
            self.lora.prefetch(adapter)
        for load in plan.lora_loads:  # its slot's last holder finished in an earlier step
            self.lora.load(load.slot, load.adapter)
        for req_id in plan.finished_ids:
            self.requests.pop(req_id, None)
            if self.pooler is not None:
                self.pooler.forget(req_id)
        for new in plan.new_requests:
            self.requests[new.req_id] = self._new_state(new)
        self._update_cached(plan.cached)

    def _new_state(self, new: NewRequest) -> CachedRequestState:
        sp = new.sampling_params
        gen = None
        if sp.seed is not None and not sp.greedy:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(sp.seed)
        return CachedRequestState(req_id=new.req_id, prompt_token_ids=new.prompt_token_ids,
                                  sampling_params=sp, output_token_ids=list(new.output_token_ids),
                                  block_ids=list(new.block_ids),
                                  num_computed_tokens=new.num_computed_tokens, generator=gen,
                                  lora_slot=new.lora_slot)

    def _update_cached(self, cached: CachedRequests) -> None:
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            if cached.resumed[i]:
                state.block_ids = list(cached.new_block_ids[i])
            else:
                freed = cached.num_freed_blocks[i] if cached.num_freed_blocks else 0
                if freed:  # slots of rejected drafts, released by the engine
                    del state.block_ids[-freed:]
                state.block_ids.extend(cached.new_block_ids[i])

    # ---- the step -----------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult | None:
        if self.kv_offload is None:
            return self._execute(plan)
        self.kv_offload.start_loads(plan.kv_loads)  # read while the step's states are updated
        return self.kv_offload.finish_step(plan, self._execute(plan))

    def _execute(self, plan: StepPlan) -> StepResult | None:
        self._update_states(plan)
        if plan.kv_loads:
            self._compute_unread(self.kv_offload.finish_loads())
        if self.sampling is not None:
            self.sampling.update(plan, self.requests)
        if not plan.num_scheduled_tokens:
            return None if self.sampling is None else StepResult(plan.step, [], [])
        order = self._token_order(plan)
        tokens, positions, seqs, last_index = self._prepare_inputs(plan, order)
        lora = self._lora_mapping(plan, order)
        if self.config.model_config.task == "embed":
            return self._pool(plan, order, tokens, positions, seqs, last_index, lora)
        # Every rank gathers logits for the same hidden rows (the LM head gather is collective):
        # each scheduled request's last token (with drafts: its last 1 + k tokens, every
        # position rank 0 verifies), then prompt positions whose logprobs were asked.
        drafts = plan.draft_token_ids
        picks = [i for r in order for i in range(last_index[r] - len(drafts.get(r, ())), last_index[r] + 1)]
        num_sampled = len(picks)
        prompt_lp = self._prompt_logprob_rows(plan, order, last_index)
        for _, rows, _ in prompt_lp:
            picks.extend(rows)
        with torch.inference_mode():
            with set_lora_mapping(lora):
                hidden = self._forward(tokens, positions, seqs, graphs_ok=lora is None)
            pure_decode = not prompt_lp and len(order) == len(tokens)  # picks == 0..n-1
            picked = hidden[: len(picks)] if pure_decode else hidden[self._to_device(picks)]
            logits = self.model.compute_logits(picked)
            if self.sampling is None:
                self._append_emitted(plan, None)
                return None
            result = self.sampling.sample(plan, logits[:num_sampled], order)
            self._append_emitted(plan, result)
            offset = num_sampled
            for req_id, lp_rows, targets in prompt_lp:
                chunk = logits[offset: offset + len(lp_rows)]
                offset += len(lp_rows)
                k = self.requests[req_id].sampling_params.prompt_logprobs
                result.prompt_logprobs[req_id] = prompt_logprobs(chunk, targets, k)
            return result

    def _compute_unread(self, loads: list[KVLoad]) -> None:
        """Compute the blocks of tier loads some rank could not read (every rank the same ones),
        in chunks of at most max_num_batched_tokens: the plan counts them as computed."""
        chunk = self.config.scheduler_config.max_num_batched_tokens
        for load in loads:
            state = self.requests[load.req_id]
            end = load.start + len(load.blocks) * self.block_size
            for start in range(load.start, end, chunk):
                stop = min(start + chunk, end)
                lora = None if self.lora is None else LoRAMapping.from_runs([(state.lora_slot, stop - start)])
                with torch.inference_mode(), set_lora_mapping(lora):
                    self._forward(_token_slice(state, start, stop), list(range(start, stop)),
                                  [(stop - start, stop, state.block_ids)], graphs_ok=False)

    def _pool(self, plan: StepPlan, order: list[str], tokens: list[int], positions: list[int],
              seqs: list, last_index: dict[str, int], lora: LoRAMapping | None) -> StepResult | None:
        """An embedding model's step: the forward, then (rank 0) each prompt chunk's hidden rows
        into its request's pooled vector; a request whose prompt completes gets it, and emits
        one placeholder token so the engine finishes it as it finishes a generation."""
        with torch.inference_mode():
            with set_lora_mapping(lora):
                hidden = self._forward(tokens, positions, seqs, graphs_ok=False)
            result = None
            if self.pooler is not None:
                for req_id in order:
                    n, last = plan.num_scheduled_tokens[req_id], last_index[req_id]
                    self.pooler.add(req_id, self.requests[req_id].num_computed_tokens, hidden[last - n + 1: last + 1])
                result = StepResult(plan.step, list(plan.sample_ids), [[0] for _ in plan.sample_ids],
                                    embeddings={r: self.pooler.pooled(r, hidden[last_index[r]]) for r in plan.sample_ids})
        self._append_emitted(plan, result)
        return result

    def _append_emitted(self, plan: StepPlan, result: StepResult | None) -> None:
        """Each sampled request's emitted tokens onto its state (the live output list the
        logits processors hold). Rank 0 has them in `result`; with TP it broadcasts them, one
        row per `plan.sample_ids` entry, as wide as the longest emission can be (1 + drafts)."""
        if not plan.sample_ids:
            return
        if self.parallel.world_size == 1:
            emitted = zip(result.req_ids, result.sampled_token_ids)
        else:
            width = 1 + max(len(plan.draft_token_ids.get(r, ())) for r in plan.sample_ids)
            padded = [[-1] * width for _ in plan.sample_ids]
            if result is not None:
                by_id = dict(zip(result.req_ids, result.sampled_token_ids))
                padded = [by_id[r] + [-1] * (width - len(by_id[r])) for r in plan.sample_ids]
            rows = torch.tensor(padded, dtype=torch.long, device=self.device)
            rows = self.parallel.broadcast_from_rank0(rows).tolist()
            emitted = ((r, [t for t in row if t >= 0]) for r, row in zip(plan.sample_ids, rows))
        for req_id, tokens in emitted:
            self.requests[req_id].output_token_ids.extend(tokens)

    def _forward(self, tokens: list[int], positions: list[int], seqs: list[tuple[int, int, list[int]]],
                 graphs_ok: bool = True) -> torch.Tensor:
        # Graphs are captured without adapters: a step with adapter rows runs eagerly.
        if self.graphs is not None and graphs_ok and len(tokens) == len(seqs) and self.graphs.fits(len(seqs)):
            return self.graphs.run(tokens, positions, seqs)
        meta = build_attention_metadata(seqs, self.block_size, self.device, self.attention_backend)
        with set_forward_context(meta):
            return self.model(self._to_device(tokens), self._to_device(positions))

    def _to_device(self, values: list[int]) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.long)
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _prompt_logprob_rows(self, plan: StepPlan, order: list[str], last_index: dict[str, int]):
        """(req id, hidden rows, next prompt tokens) for prefill chunks that want prompt logprobs."""
        out = []
        for req_id in order:
            state, n = self.requests[req_id], plan.num_scheduled_tokens[req_id]
            start, plen = state.num_computed_tokens, len(state.prompt_token_ids)
            if state.sampling_params.prompt_logprobs is None or start >= plen - 1:
                continue
            stop = min(start + n, plen - 1)  # position p predicts prompt token p + 1
            first = last_index[req_id] - n + 1
            out.append((req_id, list(range(first, first + stop - start)),
                        state.prompt_token_ids[start + 1: stop + 1]))
        return out

    def _token_order(self, plan: StepPlan) -> list[str]:
        """Decodes first, then prefill chunks; with adapters, each group by slot, so the rows of
        one adapter are one run (a LoRA segment) in each."""
        ids = list(plan.num_scheduled_tokens)
        decodes = [r for r in ids if plan.num_scheduled_tokens[r] == 1]
        prefills = [r for r in ids if plan.num_scheduled_tokens[r] != 1]
        if self.lora is not None:
            decodes.sort(key=lambda r: self.requests[r].lora_slot)
            prefills.sort(key=lambda r: self.requests[r].lora_slot)
        return decodes + prefills

    def _lora_mapping(self, plan: StepPlan, order: list[str]) -> LoRAMapping | None:
        if self.lora is None:
            return None
        return LoRAMapping.from_runs([(self.requests[r].lora_slot, plan.num_scheduled_tokens[r]) for r in order])

    def _prepare_inputs(self, plan: StepPlan, order: list[str]):
        tokens: list[int] = []
        positions: list[int] = []
        seqs: list[tuple[int, int, list[int]]] = []
        last_index: dict[str, int] = {}
        for req_id in order:
            state, n = self.requests[req_id], plan.num_scheduled_tokens[req_id]
            start = state.num_computed_tokens
            draft = plan.draft_token_ids.get(req_id, ())
            tokens.extend(_token_slice(state, start, start + n - len(draft)))
            tokens.extend(draft)  # verified in this forward, like a short prefill chunk
            positions.extend(range(start, start + n))
            seqs.append((n, start + n, state.block_ids))
            last_index[req_id] = len(tokens) - 1
        return tokens, positions, seqs, last_index


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> Logprobs:
    """Raw (unprocessed) logprobs of each next prompt token plus the top-k, and its rank."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    tgt = torch.tensor(targets, device=lp.device)
    chosen = lp.gather(1, tgt[:, None])
    ranks = (lp > chosen).sum(dim=1) + 1
    ids, vals = tgt[:, None], chosen
    if k > 0:
        top = lp.topk(k, dim=-1)
        ids, vals = torch.cat([ids, top.indices], 1), torch.cat([vals, top.values], 1)
    return Logprobs(ids.tolist(), vals.tolist(), ranks.tolist())


def _token_slice(state: CachedRequestState, start: int, end: int) -> list[int]:
    prompt = state.prompt_token_ids
    if end <= len(prompt):
        return prompt[start:end]
    out = state.output_token_ids
    if start >= len(prompt):
        return out[start - len(prompt): end - len(prompt)]
    return prompt[start:] + out[: end - len(prompt)]
