"""The grammar compile service: one cached xgrammar GrammarCompiler behind a thread pool.

Compiled grammars cannot be pickled, so the service hands out
`CompiledGrammar.serialize_json()` strings; that string travels in
`StepPlan.new_requests[i].grammar` and rank 0 deserializes it against its own
`TokenizerInfo`. Both sides build that info with `tokenizer_info_for_config`, so the two
agree (xgrammar checks the vocab type, size and stop ids when deserializing).

The service is Ray-free: the Ray layer hosts it in a threaded actor (`grammar-compiler`).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

import xgrammar as xgr

from cluster.sampling_params import StructuredOutputsParams
from cluster.structured_output.validate import call_xgrammar, grammar_spec

_COMPILE = {"json_schema": "compile_json_schema", "ebnf": "compile_grammar", "lark": "compile_lark",
            "regex": "compile_regex", "structural_tag": "compile_structural_tag"}
_SERIALIZED_CACHE_BYTES = 128 << 20  # repeats are answered from here, as strings
# xgrammar's own cache. Unbounded (its -1), it grows with every distinct schema a long-running
# server is sent (benchmarks/soak.py measured ~20 GB/h on fresh schemas). Its compiled grammars
# duplicate our string cache; what it adds is a cross-grammar rule cache that speeds fresh
# compiles of similar schemas (2x on the soak's), so it is kept, small.
XGRAMMAR_CACHE_BYTES = 64 << 20
# xgrammar 0.2.8 counts only its compiled grammars against that limit. With fresh schemas
# (~12 MB grammars each) the process grew ~1 MB per compile while `get_cache_size_bytes()` sat
# at the limit, `clear_cache()` gave nothing back, and dropping the GrammarCompiler gave it all
# back. So when no compile is running the service compares its resident memory, less its string
# cache, with where it stood when its compiler was built, and past this much builds a new one.
MEMORY_SLACK_BYTES = 2 * XGRAMMAR_CACHE_BYTES
_info_cache: dict[tuple[str, int, tuple[int, ...]], xgr.TokenizerInfo] = {}
_info_lock = threading.Lock()


def make_tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> xgr.TokenizerInfo:
    """TokenizerInfo of an HF tokenizer, sized to the model's vocab (the logits width, not
    len(tokenizer)).

    Special tokens other than the stop ids get an empty encoding, which xgrammar treats as
    special and never allows: otherwise e.g. `<|im_start|>` is legal text inside a JSON
    string and a detokenizer skipping special tokens would silently drop it.
    """
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
    rank 0 share one info (building one means converting the whole vocabulary, seconds)."""
    from cluster.tokenizer import load_tokenizer

    key = (str(path), int(vocab_size), tuple(int(t) for t in stop_token_ids))
    with _info_lock:
        if key not in _info_cache:
            hf = hf_tokenizer if hf_tokenizer is not None else load_tokenizer(path).hf
            _info_cache[key] = make_tokenizer_info(hf, vocab_size, stop_token_ids)
        return _info_cache[key]


def tokenizer_info_for_config(config: Any) -> xgr.TokenizerInfo:
    """The TokenizerInfo of a finalized EngineConfig's model (its eos ends every grammar)."""
    mc = config.model_config
    if mc.eos_token_id is None:
        raise ValueError("structured output needs the model's eos_token_id; its tokenizer has none")
    return tokenizer_info_for(mc.tokenizer_path, mc.vocab_size, [mc.eos_token_id])


class GrammarCompileService:
    """Compiles structured-output specs off the engine loop; results are serialized grammars.

    `tokenizer_info` may be a zero-argument callable: the info and the compiler are then
    built on the first compile (loading a tokenizer takes seconds)."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo | Callable[[], xgr.TokenizerInfo],
                 max_threads: int = 4, cache_limit_bytes: int = XGRAMMAR_CACHE_BYTES) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be at least 1, got {max_threads}")
        self._source = tokenizer_info
        self.max_threads, self._cache_limit = max_threads, cache_limit_bytes
        self._compiler: xgr.GrammarCompiler | None = None
        self._info: xgr.TokenizerInfo | None = None
        self._serialized: OrderedDict[tuple, str] = OrderedDict()
        self._serialized_bytes = 0
        self._lock = threading.Lock()  # the serialized cache
        self._build_lock = threading.Lock()  # the compiler, built once
        self._rss_floor = 0  # resident bytes less the string cache, when the compiler was built
        self._compiling = 0
        self.compiler_rebuilds = 0
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="grammar-compile")

    @classmethod
    def for_model(cls, config: Any, max_threads: int = 4) -> "GrammarCompileService":
        """For a finalized EngineConfig; lazy."""
        return cls(lambda: tokenizer_info_for_config(config), max_threads)

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
            self._compiling += 1
        try:
            text = self._compile(params, spec)
        finally:
            with self._lock:
                self._compiling -= 1
        with self._lock:
            self._serialized[key] = text
            self._serialized_bytes += len(text)
            while self._serialized_bytes > _SERIALIZED_CACHE_BYTES and len(self._serialized) > 1:
                self._serialized_bytes -= len(self._serialized.popitem(last=False)[1])
        self._bound_memory()
        return text

    def _compile(self, params: StructuredOutputsParams, spec) -> str:
        compile_fn = getattr(self._get_compiler(), _COMPILE[spec.kind])
        compiled = call_xgrammar(params.kind, lambda: compile_fn(spec.source, **spec.options))
        # Serializing costs far more than a cached compile (300 ms for a 4 MB grammar whose
        # strings have maxLength), so repeated specs reuse the string.
        return compiled.serialize_json()

    def _bound_memory(self) -> None:
        """After a fresh compile: hand the freed heap back and, when no compile is running (a
        running one holds ~10x its grammar's size) and the process has grown MEMORY_SLACK_BYTES
        past its floor, replace the compiler. Only with a bounded cache: an unbounded one was
        asked for."""
        release_free_heap()
        if self._cache_limit < 0:
            return
        with self._build_lock:
            with self._lock:
                idle = self._compiling == 0
            if not idle or self._grown() <= MEMORY_SLACK_BYTES:
                return
            self._compiler = None
            release_free_heap()
            self._compiler = self._new_compiler()
            self.compiler_rebuilds += 1

    def _grown(self) -> int:
        return resident_bytes() - self._serialized_bytes - self._rss_floor

    def shutdown(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=True)

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._build_lock:
            if self._compiler is None:
                src = self._source
                self._info = src if isinstance(src, xgr.TokenizerInfo) else src()
                self._compiler = self._new_compiler()
            return self._compiler

    def _new_compiler(self) -> xgr.GrammarCompiler:
        # xgrammar's threads parallelize one compile; the pool runs several at once.
        threads = min(self.max_threads, os.cpu_count() or 1)
        compiler = xgr.GrammarCompiler(self._info, max_threads=threads, cache_enabled=True,
                                       cache_limit_bytes=self._cache_limit)
        self._rss_floor = resident_bytes() - self._serialized_bytes
        return compiler


def resident_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 where there is none, which disables the
    memory bound)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


_libc = ctypes.CDLL(ctypes.util.find_library("c") or None)


def pin_mmap_threshold(nbytes: int = 1 << 20) -> None:
    """Serve every malloc of `nbytes` or more from its own mapping, returned to the OS on free.
    glibc otherwise raises the threshold after each large free, and the ~12 MB strings of
    serialized grammars then fragment the heap for good. For a process that only compiles
    (the grammar-compiler actor): an engine process would pay a page fault per large tensor.
    A no-op on other C libraries."""
    mallopt = getattr(_libc, "mallopt", None)
    if mallopt is not None:
        mallopt(-3, nbytes)  # M_MMAP_THRESHOLD


def release_free_heap() -> None:
    """Give freed heap pages back to the OS (glibc's malloc_trim): a compile allocates and frees
    hundreds of MB, which glibc otherwise keeps mapped. A no-op on other C libraries."""
    trim = getattr(_libc, "malloc_trim", None)
    if trim is not None:
        trim(0)
