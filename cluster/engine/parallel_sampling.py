"""n > 1: one request's completions run as n sequences of the scheduler (vLLM's parallel sampling).

A request asking for n completions fans out into n `Request`s that share its prompt and its
arrival time: completion i is `<id>#i`, seeded `seed + i` when the request is seeded, so its
completions differ yet repeat from run to run (n = 1 keeps the request's own id and seed).
The n form one fair-scheduling group (cluster/engine/waiting_queue.py) and, with prefix
caching, share the prompt's blocks (the scheduler holds siblings back while one computes
them). Outputs go out under the request's id with the completion's index.

`ParallelSampling` keeps that mapping from admission until every completion has finished;
it does not schedule.
"""
from __future__ import annotations

import time

from cluster.engine.request import Request
from cluster.lora.adapter import LoRAAdapter
from cluster.messages import EngineRequest


class ParallelSampling:
    def __init__(self) -> None:
        self.sequences: dict[str, list[Request]] = {}  # request id -> its n sequences
        self.origin: dict[str, tuple[str, int]] = {}  # sequence id -> (request id, index)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.sequences

    def __len__(self) -> int:
        """Requests (not sequences) with a completion not finished."""
        return len(self.sequences)

    def fan_out(self, request: EngineRequest, max_tokens: int, lora: LoRAAdapter | None = None) -> list[Request]:
        """The request's n sequences, registered under its id (`max_tokens` resolved, `lora` the
        checked adapter it names)."""
        params, rid = request.sampling_params, request.request_id
        common = dict(arrival_time=time.monotonic(), priority=request.priority,
                      group_id=request.group_id or rid, lora=lora)
        if params.n == 1:
            seqs = [Request(rid, list(request.prompt_token_ids), params, max_tokens, **common)]
        else:
            seqs = [Request(f"{rid}#{i}", list(request.prompt_token_ids),
                            params.clone(n=1, seed=None if params.seed is None else params.seed + i),
                            max_tokens, parent_id=rid, **common) for i in range(params.n)]
        self.sequences[rid] = seqs
        for i, seq in enumerate(seqs):
            self.origin[seq.request_id] = (rid, i)
        return seqs

    def unfinished(self, request_id: str, index: int | None = None) -> list[Request]:
        """The request's sequences not finished (only completion `index`, if given)."""
        seqs = self.sequences.get(request_id, [])
        if index is not None:
            seqs = seqs[index:index + 1]
        return [s for s in seqs if not s.is_finished]

    def output_of(self, seq: Request) -> tuple[str, int]:
        """(request id, completion index) that `seq`'s outputs are reported under."""
        return self.origin.get(seq.request_id, (seq.request_id, 0))

    def retire(self, seq: Request) -> str | None:
        """Forget a finished sequence; the request's id once all of its sequences finished."""
        rid, _ = self.origin.pop(seq.request_id, (seq.request_id, 0))
        if all(s.is_finished for s in self.sequences.get(rid, ())):
            self.sequences.pop(rid, None)
            return rid
        return None
