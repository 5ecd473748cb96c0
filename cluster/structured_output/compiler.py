"""The grammar compile service: one cached xgrammar GrammarCompiler behind a thread pool.

Compiled grammars cannot be pickled, so the service hands out
`CompiledGrammar.serialize_json()` strings; that string travels in
`StepPlan.new_requests[i].grammar` and rank 0 deserializes it against its own
`TokenizerInfo`. Both sides build that info with `make_tokenizer_info`, so the two agree
(xgrammar checks the vocab type, size and stop ids when deserializing).

The service is Ray-free: the Ray layer hosts it in a threaded actor (`grammar-compiler`),
constructed from picklable arguments (a tokenizer path or HF tokenizer, the model's vocab
size, stop ids); a constructed service also pickles as those arguments.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

import xgrammar as xgr

from cluster.sampling_params import StructuredOutputsParams
from cluster.structured_output.validate import call_xgrammar, grammar_spec

_COMPILE = {"json_schema": "compile_json_schema", "ebnf": "compile_grammar", "lark": "compile_lark",
            "regex": "compile_regex", "structural_tag": "compile_structural_tag"}
_SERIALIZED_CACHE_BYTES = 256 << 20
_info_cache: dict[tuple[str, int, tuple[int, ...]], xgr.TokenizerInfo] = {}
_info_lock = threading.Lock()


def load_hf_tokenizer(path: str) -> Any:
    """The HF tokenizer of an HF-style directory or a .gguf file (through the engine's loader,
    which caches the ~5 s GGUF vocabulary conversion)."""
    from cluster.tokenizer import Tokenizer

    return Tokenizer.load(path).hf


def make_tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> xgr.TokenizerInfo:
    """TokenizerInfo sized to the model's vocab (the logits width, not len(tokenizer)).

    Special tokens other than the stop ids get an empty encoding, which xgrammar treats as
    special and never allows: otherwise e.g. `<|im_start|>` is legal text inside a JSON
    string and a detokenizer skipping special tokens would silently drop it.
    """
    tokenizer = load_hf_tokenizer(tokenizer) if isinstance(tokenizer, str) else _unwrap_hf(tokenizer) or tokenizer
    if not stop_token_ids:
        raise ValueError(f"stop_token_ids must name at least one token, got {stop_token_ids!r}")
    stops = [int(t) for t in stop_token_ids]
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
    vocab = [""] * vocab_size
    for text, idx in tokenizer.get_vocab().items():
        if idx < vocab_size:
            vocab[idx] = text
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = set(getattr(tokenizer, "all_special_ids", [])) | {i for i, t in added.items()
                                                                if getattr(t, "special", False)}
    for idx in special - set(stops):
        if 0 <= idx < vocab_size:
            vocab[idx] = ""
    return xgr.TokenizerInfo.from_vocab_and_metadata(vocab, info.dump_metadata())


def tokenizer_info_for(path: str, vocab_size: int, stop_token_ids: Sequence[int],
                       hf_tokenizer: Any = None) -> xgr.TokenizerInfo:
    """Process-wide cache by tokenizer path: the offline engine's compile service and its
    rank 0 share one info (building one from a path means loading the tokenizer, seconds)."""
    key = (str(path), int(vocab_size), tuple(int(t) for t in stop_token_ids))
    with _info_lock:
        if key not in _info_cache:
            _info_cache[key] = make_tokenizer_info(hf_tokenizer if hf_tokenizer is not None else path,
                                                   vocab_size, stop_token_ids)
        return _info_cache[key]


@dataclass
class TokenizerSource:
    """Picklable recipe for a TokenizerInfo: a tokenizer path (or a live HF tokenizer), the
    model's vocab size and the stop ids. A live tokenizer is dropped when pickled if a path
    can rebuild it in the receiving process."""

    path: str | None
    vocab_size: int
    stop_token_ids: list[int]
    hf_tokenizer: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, value: "TokenizerSource | tuple") -> "TokenizerSource":
        if isinstance(value, TokenizerSource):
            return value
        if not isinstance(value, (tuple, list)) or len(value) != 3:
            raise ValueError("tokenizer must be an xgrammar TokenizerInfo, a TokenizerSource or a "
                             f"tuple (hf_tokenizer or path, vocab_size, stop_token_ids), got {value!r:.120}")
        tok, vocab, stops = value
        stops = [int(t) for t in ([stops] if isinstance(stops, int) else stops)]
        return cls(tok, vocab, stops) if isinstance(tok, str) else cls(None, vocab, stops, tok)

    @classmethod
    def for_model(cls, config: Any, tokenizer: Any = None,
                  stop_token_ids: Sequence[int] | None = None) -> "TokenizerSource":
        """From a finalized EngineConfig. `tokenizer` (HF, or a wrapper holding one) saves a
        reload; the stop ids default to its eos, else the model config's."""
        mc, hf = config.model_config, _unwrap_hf(tokenizer)
        stops = stop_token_ids
        if not stops:
            found = (getattr(tokenizer, "eos_token_id", None), getattr(hf, "eos_token_id", None),
                     getattr(mc.hf_config, "eos_token_id", None))
            stops = next((e for e in found if e is not None), None)
        if stops is None:
            raise ValueError("structured output needs the model's eos_token_id; none found in the "
                             "tokenizer or the model config")
        stops = [stops] if isinstance(stops, int) else list(stops)
        return cls(mc.tokenizer or mc.path, mc.vocab_size, [int(t) for t in stops], hf)

    def build(self) -> xgr.TokenizerInfo:
        if self.path is None:
            return make_tokenizer_info(self.hf_tokenizer, self.vocab_size, self.stop_token_ids)
        return tokenizer_info_for(self.path, self.vocab_size, self.stop_token_ids, self.hf_tokenizer)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if self.path is not None:
            state["hf_tokenizer"] = None
        return state


class GrammarCompileService:
    """Compiles structured-output specs off the engine loop; results are serialized grammars."""

    def __init__(self, tokenizer: "xgr.TokenizerInfo | TokenizerSource | tuple", max_threads: int = 4,
                 cache_limit_bytes: int = -1) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be at least 1, got {max_threads}")
        is_info = isinstance(tokenizer, xgr.TokenizerInfo)
        self._source = tokenizer if is_info else TokenizerSource.of(tokenizer)
        self.max_threads, self._cache_limit = max_threads, cache_limit_bytes
        self._compiler: xgr.GrammarCompiler | None = None
        self._info: xgr.TokenizerInfo | None = None
        self._serialized: OrderedDict[tuple, str] = OrderedDict()
        self._serialized_bytes = 0
        self._lock = threading.Lock()  # the serialized cache
        self._build_lock = threading.Lock()  # the compiler, built once (seconds: tokenizer load)
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="grammar-compile")

    @classmethod
    def for_model(cls, config: Any, tokenizer: Any = None, max_threads: int = 4) -> "GrammarCompileService":
        """Lazy: the tokenizer info and compiler are built on the first compile."""
        return cls(TokenizerSource.for_model(config, tokenizer), max_threads)

    lazy_for_model = for_model

    @property
    def tokenizer_info(self) -> xgr.TokenizerInfo:
        self._get_compiler()
        return self._info

    def submit(self, params: StructuredOutputsParams) -> "Future[str]":
        """The future's result is the serialized compiled grammar; a bad spec raises ValueError."""
        return self._pool.submit(self.compile, params)

    def compile(self, params: StructuredOutputsParams) -> str:
        spec = grammar_spec(params)
        key = (spec.kind, spec.source, tuple(sorted(spec.options.items())))
        with self._lock:
            if key in self._serialized:
                self._serialized.move_to_end(key)
                return self._serialized[key]
        compile_fn = getattr(self._get_compiler(), _COMPILE[spec.kind])
        compiled = call_xgrammar(params.kind, lambda: compile_fn(spec.source, **spec.options))
        # Serializing costs far more than a cached compile (300 ms for a 4 MB grammar whose
        # strings have maxLength), so repeated specs reuse the string.
        text = compiled.serialize_json()
        with self._lock:
            self._serialized[key] = text
            self._serialized_bytes += len(text)
            while self._serialized_bytes > _SERIALIZED_CACHE_BYTES and len(self._serialized) > 1:
                self._serialized_bytes -= len(self._serialized.popitem(last=False)[1])
        return text

    def cache_size_bytes(self) -> int:
        return self._get_compiler().get_cache_size_bytes()

    def shutdown(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=True)

    def __reduce__(self) -> tuple:
        if isinstance(self._source, xgr.TokenizerInfo):  # not picklable; its JSON form is
            return (_from_info_json, (self._source.serialize_json(), self.max_threads, self._cache_limit))
        return (type(self), (self._source, self.max_threads, self._cache_limit))

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._build_lock:
            if self._compiler is None:
                info = self._source if isinstance(self._source, xgr.TokenizerInfo) else self._source.build()
                self._info = info
                # xgrammar's threads parallelize one compile; the pool runs several at once.
                threads = min(self.max_threads, os.cpu_count() or 1)
                self._compiler = xgr.GrammarCompiler(info, max_threads=threads,
                                                     cache_enabled=True, cache_limit_bytes=self._cache_limit)
            return self._compiler


def _from_info_json(info_json: str, max_threads: int, cache_limit: int) -> GrammarCompileService:
    return GrammarCompileService(xgr.TokenizerInfo.deserialize_json(info_json), max_threads, cache_limit)


def _unwrap_hf(tokenizer: Any) -> Any:
    """An HF tokenizer, or the one held by a wrapper (cluster.tokenizer.Tokenizer), or None."""
    names = ("hf", "hf_tokenizer", "tokenizer", "_tokenizer")
    candidates = [tokenizer] + [getattr(tokenizer, n, None) for n in names]
    return next((c for c in candidates if hasattr(c, "get_vocab") and hasattr(c, "all_special_ids")), None)
