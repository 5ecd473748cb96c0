"""OpenAI response bodies and stream chunks built from `RequestOutput`s (completions, chat)."""
from __future__ import annotations

import time
from typing import Any

from actors.http.chat_parsers import ChatParsing, ChoiceParser
from actors.http.openai_protocol import CompletionRequest, echo_only, output_error
from actors.http.prompt import PromptState
from cluster.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from cluster.tokenizer import Tokenizer


def finish_reason(c: CompletionOutput) -> str | None:
    return None if c.finish_reason in (None, "abort", "error") else c.finish_reason


# A token the grammar or a processor ruled out has logprob -inf, which JSON cannot carry (it
# would go out as null, which the API's schema does not allow); vLLM sends this instead.
NEG_INF_LOGPROB = -9999.0


def logprob_json(value: float) -> float:
    return NEG_INF_LOGPROB if value == float("-inf") else value


def prompt_logprobs(p: PromptState) -> list[dict | None] | None:
    """vLLM's shape: per prompt position, None (the first) or token id -> logprob entry."""
    if p.final is None or p.final.prompt_logprobs is None:
        return None
    return [None if pos is None else {str(t): {"logprob": logprob_json(lp.logprob), "rank": lp.rank,
                                               "decoded_token": lp.decoded_token} for t, lp in pos.items()}
            for pos in p.final.prompt_logprobs]


class OpenAIFormat:
    """Shared response building; subclasses give the completions / chat shapes."""

    object_name = chunk_name = ""

    def __init__(self, tokenizer: Tokenizer, model_name: str, rid: str) -> None:
        self.tokenizer, self.model_name, self.rid, self.created = tokenizer, model_name, rid, int(time.time())
        self.sent: set[tuple[int, int]] = set()  # (prompt, index) choices that have started

    def _base(self, name: str) -> dict[str, Any]:
        return {"id": self.rid, "object": name, "created": self.created, "model": self.model_name}

    def _decoded(self, token_id: int, lp) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def usage(self, prompts: list[PromptState]) -> dict[str, int | dict]:
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        completion = sum(len(c.token_ids) for p in prompts if p.final for c in p.final.outputs)
        cached = sum(p.final.num_cached_tokens for p in prompts if p.final)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}

    def usage_chunk(self, prompts: list[PromptState]) -> dict[str, Any]:
        return {**self._base(self.chunk_name), "choices": [], "usage": self.usage(prompts)}

    def response(self, prompts: list[PromptState]) -> dict[str, Any]:
        choices = [self.choice(i, p, c) for i, p in enumerate(prompts) for c in p.final.outputs]
        return {**self._base(self.object_name), "choices": choices, "usage": self.usage(prompts)}

    def chunks(self, i: int, p: PromptState, out: RequestOutput) -> list[dict[str, Any]]:
        result = []
        for c in out.outputs:
            if out.error and c.finish_reason == "error":
                raise output_error(out.error, out.error_code)
            if c.text_delta or c.logprobs_delta or c.finish_reason or (i, c.index) not in self.sent:
                result.append({**self._base(self.chunk_name), "choices": [self.delta(i, p, c)]})
                self.sent.add((i, c.index))
        return result

    def choice(self, i: int, p: PromptState, c: CompletionOutput) -> dict[str, Any]:
        raise NotImplementedError

    def delta(self, i: int, p: PromptState, c: CompletionOutput) -> dict[str, Any]:
        raise NotImplementedError


class CompletionFormat(OpenAIFormat):
    """The legacy completions shape. With `echo` the prompt's text leads each choice's text and,
    with `logprobs`, the prompt's tokens lead its `logprobs` (vLLM's shape: the first prompt
    token has no logprob, so its `token_logprobs` and `top_logprobs` entries are null; the
    prompt's positions carry `logprobs` alternatives, from the engine's prompt_logprobs).
    `echo_only` (`max_tokens: 0`): the prompt alone, the token the engine ran left out."""

    object_name = chunk_name = "text_completion"

    def __init__(self, tokenizer: Tokenizer, model_name: str, rid: str, echo: bool, echo_only: bool = False) -> None:
        super().__init__(tokenizer, model_name, rid)
        self.echo, self.echo_only = echo, echo_only
        self.streamed_prompt_logprobs: dict[int, list[PositionLogprobs | None] | None] = {}

    @classmethod
    def for_request(cls, tokenizer: Tokenizer, model_name: str, rid: str, req: CompletionRequest) -> CompletionFormat:
        return cls(tokenizer, model_name, rid, req.echo, echo_only(req))

    def _index(self, i: int, p: PromptState, c: CompletionOutput) -> int:
        return i * p.params.n + c.index

    def _prompt_text(self, p: PromptState) -> str:
        return p.text if p.text is not None else self.tokenizer.decode(p.token_ids)

    def usage(self, prompts: list[PromptState]) -> dict[str, int | dict]:
        usage = super().usage(prompts)
        if self.echo_only:  # the one token run is not part of the answer
            usage["total_tokens"] -= usage["completion_tokens"]
            usage["completion_tokens"] = 0
        return usage

    def _logprobs(self, token_ids: list[int], positions: list[PositionLogprobs | None],
                  offset: int) -> dict[str, Any] | None:
        """`text_offset` counts from `offset` by each token's text, as vLLM does."""
        if not positions:
            return None
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, pos in zip(token_ids, positions):
            tok = self._decoded(tid, None if pos is None else pos.get(tid))
            tokens.append(tok)
            token_lps.append(logprob_json(pos[tid].logprob) if pos and tid in pos else None)
            tops.append(None if pos is None else
                        {self._decoded(t, lp): logprob_json(lp.logprob) for t, lp in pos.items()})
            offsets.append(offset)
            offset += len(tok)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _scored(self, p: PromptState, prompt_lps: list[PositionLogprobs | None] | None, echoed: bool,
                token_ids: list[int], positions: list[PositionLogprobs]) -> tuple[list[int], list]:
        """The (token ids, positions) the answer scores: the echoed prompt's, then the output's."""
        if self.echo_only:
            token_ids, positions = [], []
        if not echoed:
            return token_ids, positions
        return [*p.token_ids, *token_ids], [*(prompt_lps or [None] * len(p.token_ids)), *positions]

    def choice(self, i: int, p: PromptState, c: CompletionOutput) -> dict[str, Any]:
        prefix = self._prompt_text(p) if self.echo else ""
        lps = None
        if p.params.logprobs is not None:
            ids, positions = self._scored(p, p.final.prompt_logprobs, self.echo, c.token_ids, c.logprobs or [])
            lps = self._logprobs(ids, positions, 0)
        return {"index": self._index(i, p, c), "text": prefix + ("" if self.echo_only else c.text),
                "logprobs": lps, "finish_reason": finish_reason(c), "stop_reason": c.stop_reason,
                "prompt_logprobs": prompt_logprobs(p)}

    def chunks(self, i: int, p: PromptState, out: RequestOutput) -> list[dict[str, Any]]:
        self.streamed_prompt_logprobs[i] = out.prompt_logprobs  # read by the first delta's echo
        return super().chunks(i, p, out)

    def delta(self, i: int, p: PromptState, c: CompletionOutput) -> dict[str, Any]:
        echoed = self.echo and (i, c.index) not in self.sent
        prefix = self._prompt_text(p) if echoed else ""
        text = prefix + ("" if self.echo_only else c.text_delta)
        lps = None
        if p.params.logprobs is not None:
            ids, positions = self._scored(p, self.streamed_prompt_logprobs.get(i), echoed, c.token_ids_delta,
                                          c.logprobs_delta)
            before = len(c.text) - len(c.text_delta) + (len(self._prompt_text(p)) if self.echo else 0)
            lps = self._logprobs(ids, positions, 0 if echoed else before)
        return {"index": self._index(i, p, c), "text": text, "logprobs": lps,
                "finish_reason": finish_reason(c), "stop_reason": c.stop_reason}


class ChatFormat(OpenAIFormat):
    object_name, chunk_name = "chat.completion", "chat.completion.chunk"

    def __init__(self, tokenizer: Tokenizer, model_name: str, rid: str, parsing: ChatParsing | None = None) -> None:
        super().__init__(tokenizer, model_name, rid)
        self.parsing = parsing  # reasoning split and tool calls (actors/http/chat_parsers.py)
        self.parsers: dict[tuple[int, int], ChoiceParser] = {}

    def _parser(self, i: int, p: PromptState, c: CompletionOutput) -> ChoiceParser | None:
        if self.parsing is None:
            return None
        if (i, c.index) not in self.parsers:
            self.parsers[i, c.index] = self.parsing.choice(p.token_ids)
        return self.parsers[i, c.index]

    def response(self, prompts: list[PromptState]) -> dict[str, Any]:
        """vLLM's: with `prompt_logprobs` asked, they sit beside the choices (one prompt)."""
        body = super().response(prompts)
        if prompts[0].params.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs(prompts[0])
        return body

    def usage(self, prompts: list[PromptState]) -> dict[str, int | dict]:
        usage = super().usage(prompts)
        if self.parsing is not None and self.parsing.markers is not None:
            n = sum(self.parsing.reasoning_tokens(p.token_ids, c.token_ids)
                    for p in prompts if p.final for c in p.final.outputs)
            usage["completion_tokens_details"] = {"reasoning_tokens": n}
        return usage

    def _logprobs(self, p: PromptState, token_ids: list[int], positions) -> dict[str, Any] | None:
        if p.params.logprobs is None or not positions:
            return None
        content = []
        for tid, pos in zip(token_ids, positions):
            tok = self._decoded(tid, pos.get(tid))
            top = sorted(pos.items(), key=lambda kv: -kv[1].logprob)[:p.params.logprobs]
            content.append({"token": tok, "logprob": logprob_json(pos[tid].logprob) if tid in pos else None,
                            "bytes": list(tok.encode()),
                            "top_logprobs": [{"token": self._decoded(t, lp), "logprob": logprob_json(lp.logprob),
                                              "bytes": list(self._decoded(t, lp).encode())} for t, lp in top]})
        return {"content": content}

    def choice(self, i: int, p: PromptState, c: CompletionOutput) -> dict[str, Any]:
        parser, reason = self._parser(i, p, c), finish_reason(c)
        message = {"role": "assistant", "content": c.text}
        if parser is not None:
            message |= parser.message(c.text)
            reason = parser.finish_reason(reason)
        return {"index": c.index, "message": message, "logprobs": self._logprobs(p, c.token_ids, c.logprobs),
                "finish_reason": reason, "stop_reason": c.stop_reason}

    def delta(self, i: int, p: PromptState, c: CompletionOutput) -> dict[str, Any]:
        parser, reason = self._parser(i, p, c), finish_reason(c)
        delta: dict[str, Any] = {"content": c.text_delta}
        if parser is not None:
            delta = parser.delta(c.text_delta, final=c.finish_reason is not None)
            reason = parser.finish_reason(reason)
        if (i, c.index) not in self.sent:
            delta = {"role": "assistant", "content": "", **delta}
        return {"index": c.index, "delta": delta, "logprobs": self._logprobs(p, c.token_ids_delta, c.logprobs_delta),
                "finish_reason": reason, "stop_reason": c.stop_reason}
