"""Tokenizer wrapper, chat templates, incremental detokenization and stop strings.

`Tokenizer` wraps a transformers fast tokenizer loaded from an HF-style directory or a
GGUF file. `IncrementalDetokenizer` turns a growing list of token ids into text deltas that
never split a character; `StopStringChecker` finds stop strings in that text and tells a
streaming consumer how much of the tail to withhold. The offline engine and the HTTP
ingress use the same two objects, so streamed chunks always add up to the final text.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"
# A pending (incomplete) UTF-8 sequence is at most 3 bytes, so at most 3 tokens (4 for
# tokenizers that spell bytes as single tokens, e.g. SentencePiece byte fallback).
_MAX_PENDING_TOKENS = 4
# Prompt tokens decoded ahead of the output so the first output token decodes in context
# (SentencePiece drops a leading space at the start of a decode).
_MIN_CONTEXT, _MAX_CONTEXT = 4, 24


def cache_root() -> Path:
    return Path(os.environ.get("LLM_CLUSTER_CACHE", "~/.cache/llm-cluster")).expanduser()


class Tokenizer:
    """A thin wrapper over a transformers fast tokenizer with the engine's defaults."""

    def __init__(self, hf: PreTrainedTokenizerBase, source: str = "dir") -> None:
        self.hf = hf
        self.source = source  # "dir", "gguf" (converted now) or "cache" (converted earlier)
        special = {i for i, t in hf.added_tokens_decoder.items() if t.special}
        # What `skip_special_tokens` drops: the named specials plus every added special token.
        self.all_special_ids: list[int] = sorted(special | set(hf.all_special_ids))

    @classmethod
    def load(cls, path: str, cache_dir: str | os.PathLike | None = None,
             use_cache: bool = True) -> "Tokenizer":
        """`path`: an HF-style directory, a .gguf file, or a model preset name.

        Converting a GGUF vocabulary takes ~5 s (the gguf reader parses 49k strings in
        Python), so the converted tokenizer is saved under `cache_dir` (default
        $LLM_CLUSTER_CACHE or ~/.cache/llm-cluster) keyed by path, size and mtime."""
        from cluster.config import MODEL_PRESETS

        if path in MODEL_PRESETS:
            path = MODEL_PRESETS[path]()
        p = Path(path).expanduser()
        if p.is_dir():
            return cls(AutoTokenizer.from_pretrained(p), "dir")
        if not (p.is_file() and p.suffix == ".gguf"):
            raise ValueError(f"tokenizer path must be an HF-style directory or a .gguf file, got {path!r}")
        cached = _gguf_cache_dir(p, Path(cache_dir) if cache_dir else cache_root()) if use_cache else None
        if cached is not None and cached.is_dir():
            try:
                return cls(AutoTokenizer.from_pretrained(cached), "cache")
            except Exception as exc:  # a stale or damaged entry: rebuild it below
                logger.warning("ignoring tokenizer cache %s: %s", cached, exc)
                shutil.rmtree(cached, ignore_errors=True)
        hf = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
        if cached is not None:
            _save_atomically(hf, cached)
        return cls(hf, "gguf")

    @property
    def eos_token_id(self) -> int:
        return self.hf.eos_token_id

    @property
    def vocab_size(self) -> int:
        """The tokenizer's size, added tokens included (the model's may be padded larger)."""
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        # No clean-up: it rewrites spaces around punctuation across token boundaries, which
        # would make the whole-text decode differ from the concatenated streaming deltas.
        # Fast tokenizers ignore spaces_between_special_tokens (as in vLLM's fast path).
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens,
                              clean_up_tokenization_spaces=False,
                              spaces_between_special_tokens=spaces_between_special_tokens)

    def token_ids_for(self, text: str) -> list[int]:
        """Token ids of a stop / reasoning marker string, without BOS or other added tokens."""
        return self.encode(text, add_special_tokens=False)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = False, **kwargs: Any) -> str | list[int]:
        """Render a conversation; with tokenize=True return its ids (the template already
        holds any BOS it wants, so none is added)."""
        if not self.hf.chat_template:
            raise ValueError(f"this tokenizer ({self.hf.name_or_path!r}) has no chat template; "
                             "send a plain prompt instead")
        msgs = [_normalize_message(i, m) for i, m in enumerate(_check_list(messages))]
        try:
            text = self.hf.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt,
                                               tokenize=False, **kwargs)
        except Exception as exc:  # jinja errors, raise_exception() inside templates
            raise ValueError(f"chat template failed on these messages: {exc}") from exc
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _gguf_cache_dir(path: Path, root: Path) -> Path:
    st = path.resolve().stat()
    # The transformers version is in the key too: its GGUF conversion changes between releases.
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return root / "tokenizers" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _save_atomically(hf: PreTrainedTokenizerBase, target: Path) -> None:
    # Several processes (one per worker) may convert at once: write aside, then rename.
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
        hf.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:
        logger.warning("could not cache the converted tokenizer at %s: %s", target, exc)


def _check_list(messages: Any) -> Sequence[Any]:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r:.200}")
    return messages


def _normalize_message(i: int, msg: Any) -> dict[str, Any]:
    if not isinstance(msg, Mapping):
        raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(msg).__name__}")
    role = msg.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError(f"messages[{i}].role must be a non-empty string, got {role!r}")
    # OpenAI allows an assistant turn that only calls tools to have no content.
    tool_call_only = role == "assistant" and msg.get("tool_calls")
    if "content" not in msg and not tool_call_only:
        raise ValueError(f"messages[{i}] ({role}) has no 'content'")
    content = msg.get("content")
    if content is None and not tool_call_only:
        raise ValueError(f"messages[{i}].content must be a string or a list of text parts, got None")
    if isinstance(content, list):
        content = _join_text_parts(i, content)
    elif content is not None and not isinstance(content, str):
        raise ValueError(f"messages[{i}].content must be a string or a list of text parts, "
                         f"got {type(content).__name__}")
    return {**msg, "content": content}


def _join_text_parts(i: int, parts: list[Any]) -> str:
    # Text-only templates concatenate content as a string: flatten OpenAI content parts.
    texts = []
    for j, part in enumerate(parts):
        if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise ValueError(f"messages[{i}].content[{j}] must be {{'type': 'text', 'text': str}}, got {part!r:.200}")
        texts.append(part["text"])
    return "\n".join(texts)


class IncrementalDetokenizer:
    """Token ids in, text deltas out; `.text` is the output text so far.

    Keeps vLLM's two offsets into the id list: [prefix, read) is the window already turned
    into text (decoded again only as context), [read, end) the ids not yet emitted. Each
    step decodes just those two windows, so its cost follows the new tokens, not the
    output length. Text ending in U+FFFD is an incomplete byte sequence (byte-level BPE
    splits emoji and CJK across tokens): it is held until the character completes.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._ids = _clean_context(self._decode, list(prompt_token_ids))
        self._num_context = len(self._ids)
        self._prefix, self._read = 0, len(self._ids)
        self._prefix_text: str | None = None  # decode of [prefix, read), computed when needed
        self.text = ""

    @property
    def token_ids(self) -> list[int]:
        """The output ids stepped so far (prompt context excluded)."""
        return self._ids[self._num_context:]

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Append ids; return the text they complete (may be "" while a character is pending)."""
        self._ids.extend(new_token_ids)
        if self._read == len(self._ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        # Longest clean cut first; cutting a few ids early emits the text before a pending
        # character now instead of holding a whole multi-token chunk back.
        lowest = max(self._read + 1, len(self._ids) - _MAX_PENDING_TOKENS)
        for end in range(len(self._ids), lowest - 1, -1):
            window = self._decode(self._ids[self._prefix:end])
            if not window.endswith(_REPLACEMENT):
                return self._advance(window, end)
        return ""

    def flush(self) -> str:
        """Emit whatever is held (a trailing U+FFFD when the output ends mid-character), so
        that `.text` equals decoding all output ids at once. Call once the request finishes."""
        if self._read == len(self._ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        return self._advance(self._decode(self._ids[self._prefix:]), len(self._ids))

    def _advance(self, window: str, end: int) -> str:
        delta = window[len(self._prefix_text):]
        self._prefix, self._read, self._prefix_text = self._read, end, None
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, self.skip_special_tokens, self.spaces_between_special_tokens)


def _clean_context(decode: Callable[[list[int]], str], prompt: list[int]) -> list[int]:
    """The shortest prompt suffix (>= 4 ids) that decodes without U+FFFD; [] if none does,
    e.g. a prompt given as ids that ends mid-character: then the output decodes standalone."""
    if len(prompt) <= _MIN_CONTEXT:
        return prompt if _REPLACEMENT not in decode(prompt) else []
    for n in range(_MIN_CONTEXT, min(len(prompt), _MAX_CONTEXT) + 1):
        if _REPLACEMENT not in decode(prompt[-n:]):
            return prompt[-n:]
    return []


@dataclass(frozen=True, slots=True)
class StopCheck:
    text: str  # the output text, cut at the stop string when one matched
    stop: str | None  # the stop string that matched; None while generation goes on
    hold_back: int  # trailing chars of `text` a stream must not send yet (0 once stopped)

    @property
    def stopped(self) -> bool:
        return self.stop is not None


class StopStringChecker:
    """Finds stop strings in growing output text.

    Call `check(text, delta)` after each detokenizer step, with `text` the output so far
    (ending with `delta`). Only the last len(delta) + max_len - 1 characters can hold a
    match that was not there before, so only they are searched. The stop string that
    completes first wins (on a tie, the longer one): that is the one a character-by-character
    stream would see, so the result does not depend on how the text was chunked.

    Streaming: keep `sent`; after each check send `r.text[sent:len(r.text) - r.hold_back]`.
    Once `r.stopped`, or when generation ends for another reason, send `r.text[sent:]`.
    """

    def __init__(self, stops: Sequence[str] | None, include_stop_str_in_output: bool = False) -> None:
        self.stops = list(dict.fromkeys(stops or ()))
        if any(not isinstance(s, str) or not s for s in self.stops):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stops!r}")
        self.include_stop_str_in_output = include_stop_str_in_output
        self.max_len = max(map(len, self.stops), default=0)

    def __bool__(self) -> bool:
        return bool(self.stops)

    def check(self, text: str, delta: str) -> StopCheck:
        if not text.endswith(delta):
            raise ValueError(f"delta must be the end of text, got delta {delta[-40:]!r} for text ending "
                             f"{text[-40:]!r}")
        matches = []  # (end, -len, stop): the earliest end wins, then the longest
        for stop in self.stops:
            start = text.find(stop, max(0, len(text) - len(delta) - len(stop) + 1))
            if start >= 0:
                matches.append((start + len(stop), -len(stop), stop))
        if matches:
            end, neg_len, stop = min(matches)
            cut = end if self.include_stop_str_in_output else end + neg_len
            return StopCheck(text[:cut], stop, 0)
        return StopCheck(text, None, self.hold_back(text))

    def hold_back(self, text: str) -> int:
        """How many trailing chars of `text` could begin a stop string. Zero when the stop
        string is kept in the output: whatever matches later, the text so far stays."""
        if self.include_stop_str_in_output:
            return 0
        held = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:k]):
                    held = k
                    break
        return held
