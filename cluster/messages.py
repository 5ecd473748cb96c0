"""Everything that crosses a process boundary: msgspec Structs encoded with msgpack.

Per step the engine sends a `StepPlan` (a delta against the workers' cached request
state), the workers answer with a `StepResult` from rank 0. The ingress and the engine
talk in `EngineRequest` / `EngineOutput`. The offline engine encodes and decodes these
too, so the wire format is exercised on every path.
"""
from __future__ import annotations

from typing import TypeVar

import msgspec

from cluster.lora.adapter import LoRAAdapter, LoRARequest
from cluster.sampling_params import SamplingParams


class NewRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request the workers have not seen: everything needed to build its cached state."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # Outputs already produced (a request preempted and recomputed keeps them).
    output_token_ids: list[int] = []
    # xgrammar CompiledGrammar.serialize_json(), when structured output is asked for.
    grammar: str | None = None
    lora_slot: int = -1  # the adapter slot its rows use (-1: the base model)


class CachedRequests(msgspec.Struct, array_like=True):
    """Requests the workers hold state for, as columns (one entry per request)."""

    req_ids: list[str] = []
    # No sampled tokens: every rank appends a step's emitted tokens itself when the step ends
    # (rank 0 from its sampler, the others from its broadcast), so a step can be planned
    # before the one it follows has run (async scheduling).
    new_block_ids: list[list[int]] = []
    num_computed_tokens: list[int] = []
    # True when the request comes back from preemption: its block ids are replaced, not
    # extended, and it re-enters the persistent batch.
    resumed: list[bool] = []
    # Tail blocks the engine released since the last plan (they held only rejected draft
    # tokens): dropped from the block table before new_block_ids are appended.
    num_freed_blocks: list[int] = []


class LoRALoad(msgspec.Struct, array_like=True):
    slot: int
    adapter: LoRAAdapter


class KVBlock(msgspec.Struct, array_like=True):
    """A full prefix block moving between the KV cache and the node's KV tier (cluster/kv_tier.py)."""

    block_id: int
    chain_hash: bytes  # its 128-bit chain hash, little-endian (msgpack ints stop at 64 bits)
    token_ids: list[int]  # its tokens: written in the file's header, checked when it is read


class KVLoad(msgspec.Struct, array_like=True):
    """Blocks a request starting in this step finds in the tier: read into its fresh blocks
    before the step's forward (or computed there if some rank cannot read them)."""

    load_id: int  # named in this step's StepResult (kv_loaded or kv_load_failed)
    blocks: list[KVBlock]
    req_id: str  # the request whose blocks they are
    start: int  # its token position of the first block


class KVTierCounters(msgspec.Struct, array_like=True):
    """One rank's traffic with the KV tier since it started (rank 0 reports its own)."""

    bytes_read: int = 0
    bytes_written: int = 0
    blocks_written: int = 0
    load_seconds: float = 0.0  # reading, checking and copying blocks in
    evictions: int = 0  # files dropped from the last level over its budget
    spills: int = 0  # files moved from shared memory to disk over its budget
    corrupt_files: int = 0  # unreadable, foreign or failing their checksum: skipped and removed
    writes_dropped: int = 0  # blocks not written because the writer lagged too far behind


class StepPlan(msgspec.Struct, array_like=True):
    step: int
    new_requests: list[NewRequest]
    cached: CachedRequests
    # Tokens to compute this step per request id, in batch order.
    num_scheduled_tokens: dict[str, int]
    # Ids whose prefill completes this step or that are decoding: rank 0 samples for these.
    sample_ids: list[str]
    finished_ids: list[str] = []
    preempted_ids: list[str] = []
    # Speculative decoding: draft tokens per decoding request. Such a request's scheduled
    # tokens are its last token then these; rank 0 verifies all of them in this step.
    draft_token_ids: dict[str, list[int]] = {}
    # Adapters the workers load into their slots before this step's forward (from their host
    # copies, read ahead when announced in `lora_prefetch`).
    lora_loads: list[LoRALoad] = []
    # Adapters a waiting request will need a slot for: the workers read them into host memory
    # in the background, so the load in a later step is a copy, not a disk read on the step.
    lora_prefetch: list[LoRAAdapter] = []
    # The KV tier (cluster/kv_tier.py): blocks whose KV this step completes, for every rank to
    # write to its files after the forward; blocks of requests starting in this step, to read
    # from them before the forward.
    kv_saves: list[KVBlock] = []
    kv_loads: list[KVLoad] = []


class Logprobs(msgspec.Struct, array_like=True):
    """Top-N logprobs per sampled position; column 0 is the sampled token itself."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]  # rank of the sampled token in the processed distribution (1 = best)


class StepResult(msgspec.Struct, array_like=True, omit_defaults=True):
    step: int
    req_ids: list[str]
    # Per request, the tokens it emits this step: one, or with drafts the accepted ones plus
    # the token sampled where the first draft was rejected (or the bonus after the last).
    sampled_token_ids: list[list[int]]
    # One row per emitted token, requests in req_ids order.
    logprobs: Logprobs | None = None
    # Prompt logprobs for requests that asked, keyed by id; filled as their prefill proceeds.
    prompt_logprobs: dict[str, Logprobs] = {}
    # Embedding models: each request whose prompt completed this step, its pooled hidden state.
    embeddings: dict[str, list[float]] = {}
    # The KV tier: this step's loads (`KVLoad.load_id`) read into every rank's cache, and those
    # some rank could not read (computed in the step instead); rank 0's tier counters when they
    # changed.
    kv_loaded: list[int] = []
    kv_load_failed: list[int] = []
    kv_tier: KVTierCounters | None = None


class EngineRequest(msgspec.Struct, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0  # lower first, with scheduling_policy "priority" (vLLM's)
    # The unit of fair scheduling: requests sharing it (the prompts of one HTTP request) get
    # one share of the batch between them. None: the request alone (its n completions).
    group_id: str | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs under (None: the base model)


class EngineOutput(msgspec.Struct, omit_defaults=True):
    """The delta for one request after one step."""

    request_id: str
    new_token_ids: list[int] = []
    index: int = 0  # which of the request's n completions
    new_logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    error: str | None = None
    error_code: str | None = None  # with finish_reason "error": cluster.errors' codes, else a 500
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    embedding: list[float] | None = None  # an embedding model's pooled vector, with the last output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class PrefixCacheSummary(msgspec.Struct, array_like=True, frozen=True):
    """What one engine's prefix cache holds, for a prefix-aware router (cluster/routing.py).

    `keys` are the routing keys (`cluster.prefix_hash.prompt_routing_keys`) of the blocks cached now or
    about to be computed for queued prompts, those the engine keeps longest first, at most the
    engine's report limit. Evicted blocks are gone from the next summary. `tier_keys` are those of
    the blocks in the node's KV tier (cluster/kv_tier.py), which every copy sharing it can read
    back instead of computing, most recently used first (empty with the tier off). `version`
    changes whenever either set may have changed, so a reader can skip an unchanged summary."""

    block_size: int
    version: int
    keys: list[int]
    num_cached_blocks: int  # cached blocks in the engine, reported or not
    tier_keys: list[int] = []


_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder] = {}
T = TypeVar("T")


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, kind: type[T]) -> T:
    dec = _decoders.get(kind)
    if dec is None:
        dec = _decoders[kind] = msgspec.msgpack.Decoder(kind)
    return dec.decode(data)
