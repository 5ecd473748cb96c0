"""The model's tokenizer: a transformers fast tokenizer with the engine's defaults, chat
templates, and a per-process cache (`load_tokenizer`), since every part of the engine that
needs it (entry checks, grammar compiler, rank 0, ingress) asks for the same one.

A GGUF vocabulary is converted once and kept in the on-disk cache (`cluster.cache`).
"""
from __future__ import annotations

import functools
import json
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import transformers
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from cluster.cache import cache_key, cache_root, record_source, write_atomically
from cluster.tool_prompt import check_tools, for_tool_template, inline_tools, template_supports_tools

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str) -> "Tokenizer":
    """The tokenizer at `path`, loaded once per process (`ModelConfig.get_tokenizer`)."""
    return Tokenizer.load(path)


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
        """`path`: an HF-style directory or a .gguf file.

        Converting a GGUF vocabulary takes ~5 s (the gguf reader parses 49k strings in
        Python), so the converted tokenizer is saved under `cache_dir` (default
        $LLM_CLUSTER_CACHE or ~/.cache/llm-cluster) keyed by path, size and mtime."""
        p = Path(path).expanduser()
        if p.is_dir():
            return cls(_from_folder(p), "dir")
        if not (p.is_file() and p.suffix == ".gguf"):
            raise ValueError(f"tokenizer path must be an HF-style directory or a .gguf file, got {path!r}")
        cached = _gguf_cache_dir(p, Path(cache_dir) if cache_dir else cache_root()) if use_cache else None
        if cached is not None and cached.is_dir():
            try:
                return cls(_from_folder(cached), "cache")
            except Exception as exc:  # a stale or damaged entry: rebuild it below
                logger.warning("ignoring tokenizer cache %s: %s", cached, exc)
                shutil.rmtree(cached, ignore_errors=True)
        hf = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
        if cached is not None:
            write_atomically(cached, hf.save_pretrained, directory=True)
            record_source(cached, p)
        return cls(hf, "gguf")

    @property
    def eos_token_id(self) -> int:
        return self.hf.eos_token_id

    @property
    def vocab_size(self) -> int:
        """The tokenizer's size, added tokens included (the model's may be padded larger)."""
        return len(self.hf)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters in the vocabulary's longest token, as its byte-level / sentencepiece
        string (never fewer than its text has): a text of C characters needs at least
        C / max_token_chars tokens, which bounds a prompt's length before tokenizing it."""
        return max(len(t or "") for t in self.hf.convert_ids_to_tokens(list(range(len(self.hf)))))

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
                            tokenize: bool = False, tools: Sequence[Mapping[str, Any]] | None = None,
                            **kwargs: Any) -> str | list[int]:
        """Render a conversation; with tokenize=True return its ids (the template already
        holds any BOS it wants, so none is added). `tools` (OpenAI's list) and tool turns go
        to a tools-aware template as is, else through the default rendering (`cluster.tool_prompt`)."""
        if not self.hf.chat_template:
            raise ValueError(f"this tokenizer ({self.hf.name_or_path!r}) has no chat template; "
                             "send a plain prompt instead")
        msgs, tools = _check_list(messages), check_tools(tools)
        if tools or any(isinstance(m, Mapping) and (m.get("role") == "tool" or m.get("tool_calls")) for m in msgs):
            if template_supports_tools(self.hf.chat_template):
                msgs = for_tool_template(msgs)
                if tools:
                    kwargs["tools"] = list(tools)
            else:
                msgs = inline_tools(msgs, tools)
        msgs = [_normalize_message(i, m) for i, m in enumerate(msgs)]
        try:
            text = self.hf.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt,
                                               tokenize=False, **kwargs)
        except Exception as exc:  # jinja errors, raise_exception() inside templates
            raise ValueError(f"chat template failed on these messages: {exc}") from exc
        return self.encode(text, add_special_tokens=False) if tokenize else text


def content_chars(messages: Any) -> int:
    """Characters of a conversation's text (string contents and text parts), counted
    before rendering it, to bound its length cheaply (`InputProcessor.check_text`)."""
    total = 0
    for msg in messages if isinstance(messages, Sequence) and not isinstance(messages, str) else ():
        content = msg.get("content") if isinstance(msg, Mapping) else None
        for part in content if isinstance(content, list) else [content]:
            text = part.get("text") if isinstance(part, Mapping) else part
            total += len(text) if isinstance(text, str) else 0
    return total


def _from_folder(folder: Path) -> PreTrainedTokenizerBase:
    """AutoTokenizer's tokenizer of an HF-style folder. AutoTokenizer loads the model's config
    for its type and name; through the model's config class that imports its model package
    in every process that loads a tokenizer. Where
    tokenizer_config.json names the tokenizer class (and no remote code), the same fields are
    handed over in a plain config read from config.json instead."""
    def read(name: str) -> dict[str, Any]:
        f = folder / name
        return json.loads(f.read_text(encoding="utf-8")) if f.is_file() else {}

    tokenizer_config = read("tokenizer_config.json")
    if not tokenizer_config.get("tokenizer_class") or "auto_map" in tokenizer_config:
        return AutoTokenizer.from_pretrained(folder)
    model = read("config.json")
    config = PretrainedConfig(tokenizer_class=model.get("tokenizer_class"), name_or_path=str(folder))
    config.model_type = model.get("model_type", "")
    return AutoTokenizer.from_pretrained(folder, config=config)


def _gguf_cache_dir(path: Path, root: Path) -> Path:
    # The transformers version is in the key too: its GGUF conversion changes between releases.
    return root / "tokenizers" / f"{path.stem}-{cache_key(path, transformers.__version__)}"


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
