"""Engine token deltas -> text: incremental detokenization, stop strings, logprobs.

Runs where the text is consumed: in the offline `LLM` and in the HTTP ingress, once per
stream. A stop string that hits reports the request for an abort in the engine, which frees
its KV blocks at once.
"""
from __future__ import annotations

from dataclasses import dataclass

import msgspec

from cluster.engine.detokenizer import IncrementalDetokenizer, StopStringChecker
from cluster.messages import EngineOutput, Logprobs
from cluster.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from cluster.sampling_params import SamplingParams
from cluster.tokenizer import Tokenizer


@dataclass
class _Completion:
    out: CompletionOutput
    detok: IncrementalDetokenizer | None
    sent: int = 0  # characters of out.text already handed out as deltas


class _RequestState:
    def __init__(self, tokenizer: Tokenizer, request_id: str, prompt: str | None,
                 prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.params = params
        self.stops = StopStringChecker(params.stop, params.include_stop_str_in_output)
        self.output = RequestOutput(request_id, prompt, prompt_token_ids, [])
        self.completions = []
        for i in range(params.n):
            detok = (IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens,
                                            params.spaces_between_special_tokens)
                     if params.detokenize else None)
            want_lp = params.logprobs is not None
            out = CompletionOutput(i, logprobs=[] if want_lp else None,
                                   cumulative_logprob=0.0 if want_lp else None)
            self.completions.append(_Completion(out, detok))
        self.output.outputs = [c.out for c in self.completions]


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _RequestState] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            params: SamplingParams) -> None:
        self.states[request_id] = _RequestState(self.tokenizer, request_id, prompt, prompt_token_ids, params)

    def process(self, outputs: list[EngineOutput]) -> tuple[list[RequestOutput], list[tuple[str, int]]]:
        """Apply one step's deltas. Returns the updated RequestOutputs (in first-seen order)
        and the (request_id, index) completions a stop string finished: abort those."""
        updated: dict[str, RequestOutput] = {}
        to_abort: list[tuple[str, int]] = []
        touched: set[tuple[str, int]] = set()
        for eo in (piece for out in outputs for piece in _per_token(out)):
            state = self.states.get(eo.request_id)
            if state is None:
                continue
            comp = state.completions[eo.index]
            if (eo.request_id, eo.index) not in touched:
                _clear_deltas(comp.out)
                touched.add((eo.request_id, eo.index))
            if comp.out.finished:
                continue  # a stop string already ended it; the engine's late tokens are dropped
            if self._apply(state, comp, eo):
                to_abort.append((eo.request_id, eo.index))
            state.output.num_cached_tokens = eo.num_cached_tokens
            if eo.prompt_logprobs is not None and state.output.prompt_logprobs is None:
                # vLLM's shape: the first prompt token has no logprob.
                state.output.prompt_logprobs = [None] + _positions(eo.prompt_logprobs, self.tokenizer)
            if eo.error and not state.output.error:
                state.output.error, state.output.error_code = eo.error, eo.error_code
            updated[eo.request_id] = state.output
        for rid, out in updated.items():
            out.finished = all(c.finished for c in out.outputs)
            if out.finished:
                del self.states[rid]
        return list(updated.values()), to_abort

    def _apply(self, state: _RequestState, comp: _Completion, eo: EngineOutput) -> bool:
        out = comp.out
        out.token_ids.extend(eo.new_token_ids)
        out.token_ids_delta.extend(eo.new_token_ids)
        if eo.new_logprobs is not None and out.logprobs is not None:
            positions = _positions(eo.new_logprobs, self.tokenizer)
            out.logprobs.extend(positions)
            out.logprobs_delta.extend(positions)
            out.cumulative_logprob += sum(p[t].logprob for p, t in zip(positions, eo.new_token_ids))
        stop_hit = False
        if comp.detok is not None:
            delta = comp.detok.step(eo.new_token_ids)
            if eo.finished:
                delta += comp.detok.flush()
            text, hold = comp.detok.text, 0
            if state.stops and delta:
                check = state.stops.check(text, delta)
                text, hold = check.text, check.hold_back
                if check.stopped:
                    out.finish_reason, out.stop_reason, stop_hit = "stop", check.stop, True
            out.text = text
            end = len(text) if (eo.finished or stop_hit) else len(text) - hold
            out.text_delta += text[comp.sent:end]
            comp.sent = max(comp.sent, end)
        if eo.finished and not stop_hit:
            out.finish_reason, out.stop_reason = eo.finish_reason, eo.stop_reason
        return stop_hit and not eo.finished


def _per_token(eo: EngineOutput) -> list[EngineOutput]:
    """A delta of several tokens (accepted speculative drafts) as one delta per token, so a
    stop string ends the output at the token that completes it, as without speculation."""
    n = len(eo.new_token_ids)
    if n <= 1:
        return [eo]
    lp = eo.new_logprobs
    pieces = []
    for i, token in enumerate(eo.new_token_ids):
        last = i == n - 1
        pieces.append(msgspec.structs.replace(
            eo, new_token_ids=[token],
            new_logprobs=None if lp is None else Logprobs(lp.token_ids[i:i + 1], lp.logprobs[i:i + 1],
                                                          lp.ranks[i:i + 1]),
            prompt_logprobs=eo.prompt_logprobs if i == 0 else None,
            finish_reason=eo.finish_reason if last else None, stop_reason=eo.stop_reason if last else None,
            error=eo.error if last else None, error_code=eo.error_code if last else None))
    return pieces


def _clear_deltas(out: CompletionOutput) -> None:
    out.text_delta, out.token_ids_delta, out.logprobs_delta = "", [], []


def _positions(lp: Logprobs, tokenizer: Tokenizer) -> list[PositionLogprobs]:
    positions = []
    for ids, vals, rank in zip(lp.token_ids, lp.logprobs, lp.ranks):
        pos: PositionLogprobs = {}
        for j, (t, v) in enumerate(zip(ids, vals)):
            if t not in pos:  # column 0 is the sampled token; it may reappear in the top-N
                pos[t] = Logprob(v, rank if j == 0 else j, tokenizer.decode([t], False))
        positions.append(pos)
    return positions
