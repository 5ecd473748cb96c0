"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, params)`."""
from __future__ import annotations

import itertools
from typing import Any, Sequence

from tqdm.auto import tqdm

from cluster.config import EngineConfig
from cluster.engine.engine_core import EngineCore
from cluster.engine.input_processor import InputProcessor
from cluster.engine.output_processor import OutputProcessor
from cluster.lora.adapter import LoRARequest
from cluster.messages import EngineOutput, EngineRequest
from cluster.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from cluster.pooling import PoolingParams, check_pooling_params, embedding
from cluster.sampling_params import SamplingParams
from cluster.tokenizer import Tokenizer, content_chars
from cluster.worker.worker import InProcessExecutor

PromptType = str | dict[str, Any]


class LLM:
    """An engine in this process. Keyword arguments are EngineConfig options (vLLM's names):
    model, tokenizer, dtype, max_model_len, max_num_seqs, max_num_batched_tokens, block_size,
    kv_cache_dtype, kv_cache_memory, num_kv_blocks, enable_prefix_caching, seed, logits_processors,
    reasoning_config (or vLLM's reasoning_parser="qwen3" / "deepseek_r1"), attention_backend,
    device, scheduling_policy, max_n, max_logprobs, speculative_config (vLLM's dict, e.g.
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}), async_scheduling."""

    def __init__(self, model: str = "smollm2-135m-instruct", **kwargs: Any) -> None:
        from cluster.structured_output import GrammarCompileService

        self.config = EngineConfig.create(model=model, **kwargs).finalize()
        self.tokenizer = self.config.model_config.get_tokenizer()
        self.inputs = InputProcessor(self.config)
        self.engine = EngineCore(self.config, InProcessExecutor(self.config),
                                 GrammarCompileService.for_model(self.config))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """`priority`: one per prompt, lower first; needs scheduling_policy="priority".
        `lora_request`: the adapter every prompt runs under, or one per prompt (None: the base
        model); needs enable_lora."""
        if self.config.model_config.task == "embed":
            raise ValueError("this model serves embeddings (task='embed'): use LLM.embed, not generate")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = _broadcast_params(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts")
        loras = _broadcast_loras(lora_request, len(prompts))
        requests = [(self._prompt_ids(p), p if isinstance(p, str) else p.get("prompt")) for p in prompts]
        return self._run(requests, params, use_tqdm, list(priority or [0] * len(prompts)), loras)

    def embed(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
              ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (a model with task="embed"): its prompt pooled as the model's
        pooler_config says, cut to `pooling_params.dimensions` and normalized (cluster/pooling.py)."""
        mc = self.config.model_config
        if mc.task != "embed":
            raise ValueError(f"LLM.embed needs an embedding model (task='embed'); this one's task is {mc.task!r}")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = pooling_params or PoolingParams()
        check_pooling_params(params, mc.hf_config.hidden_size)
        loras = _broadcast_loras(lora_request, len(prompts))
        ids = [self._prompt_ids(p) for p in prompts]
        checked = [self.inputs.process(EngineRequest(str(next(self._ids)), p, SamplingParams(max_tokens=1, detokenize=False),
                                                     lora_request=lora)) for p, lora in zip(ids, loras)]
        for lora in {lr for lr in loras if lr is not None}:
            self.engine.prepare_lora(lora)
        pooled: dict[str, EngineOutput] = {}
        for req in checked:
            self.engine.add_request(req)
        bar = tqdm(total=len(checked), desc="Embedded prompts", disable=not use_tqdm)
        try:
            while len(pooled) < len(checked):
                for out in self.engine.step():
                    if out.finished:
                        pooled[out.request_id] = out
                        bar.update(1)
            while self.engine.in_flight:
                self.engine.step()
        except BaseException:
            for req in checked:
                if req.request_id not in pooled:
                    self.engine.abort(req.request_id)
            raise
        finally:
            bar.close()
        return [_embedding_output(req, pooled[req.request_id], params, mc.pooler_config) for req in checked]

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """`tools` (OpenAI's list) are rendered into the prompt; the text is returned as written."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = []
        for conv in conversations:
            self.inputs.check_text(content_chars(conv), "messages")
            text = self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                                      tools=tools, **(chat_template_kwargs or {}))
            # The template already holds any BOS: encode without adding special tokens again.
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, False)})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _prompt_ids(self, prompt: PromptType) -> list[int]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if isinstance(text, str):
            self.inputs.check_text(len(text))  # before tokenizing: a huge text costs seconds
            return self.tokenizer.encode(text)
        raise ValueError(f"prompt must be a string or a dict with 'prompt' or 'prompt_token_ids', "
                         f"got {type(prompt).__name__}")

    def _run(self, requests: list[tuple[list[int], str | None]], params: list[SamplingParams],
             use_tqdm: bool, priority: list[int], loras: list[LoRARequest | None]) -> list[RequestOutput]:
        # Validate everything before queueing anything: one bad prompt (or adapter) rejects the call whole.
        checked = [self.inputs.process(EngineRequest(str(next(self._ids)), ids, p, priority=prio, lora_request=lora))
                   for (ids, _), p, prio, lora in zip(requests, params, priority, loras)]
        for lora in {lr for lr in loras if lr is not None}:
            self.engine.prepare_lora(lora)
        processor = OutputProcessor(self.tokenizer)
        order = []
        for (ids, text), req in zip(requests, checked):
            processor.add(req.request_id, text, ids, req.sampling_params)
            self.engine.add_request(req)
            order.append(req.request_id)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm)
        try:
            while len(finished) < len(order):
                outputs, to_abort = processor.process(self.engine.step())
                for rid, index in to_abort:
                    self.engine.abort(rid, "stop", index=index)
                for out in outputs:
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
            while self.engine.in_flight:  # async scheduling: steps planned past a stop
                self.engine.step()
        except BaseException:
            for rid in order:
                if rid not in finished:
                    self.engine.abort(rid)
            raise
        finally:
            bar.close()
        return [finished[rid] for rid in order]


def _embedding_output(req: EngineRequest, out: EngineOutput, params: PoolingParams,
                      pooler: dict) -> EmbeddingRequestOutput:
    if out.embedding is None:  # an error (e.g. a deadline) ended it before its prompt completed
        raise RuntimeError(f"request {req.request_id} ended without an embedding: {out.error or out.finish_reason}")
    return EmbeddingRequestOutput(req.request_id, req.prompt_token_ids,
                                  EmbeddingOutput(embedding(out.embedding, params, pooler)),
                                  num_cached_tokens=out.num_cached_tokens)


def _broadcast_loras(lora: LoRARequest | Sequence[LoRARequest | None] | None, n: int) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    loras = list(lora)
    if len(loras) != n:
        raise ValueError(f"lora_request has {len(loras)} entries for {n} prompts")
    return loras


def _broadcast_params(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"sampling_params has {len(params)} entries for {n} prompts")
    return params
