"""Structured-output specs -> xgrammar sources, and the entry check run before queueing.

`grammar_spec` is the one translation from `StructuredOutputsParams` to what xgrammar
builds; the entry check (`Grammar.from_*`, no tokenizer, milliseconds) and the compile
service (`GrammarCompiler.compile_*`, cached) both use it, so a spec that passes here
compiles the same way there.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import xgrammar as xgr

from cluster.sampling_params import StructuredOutputsParams

# json_object means "some JSON object": any keys, any values. The builtin JSON grammar
# would also admit a top-level array, hence a permissive schema instead.
_ANY_OBJECT = '{"type": "object"}'
# xgrammar prefixes C++ errors with "[hh:mm:ss] /path/file.cc:123: " (and sometimes a
# "Check failed: ... is false:" clause); users need only the reason after it.
_CPP_PREFIX = re.compile(r"^\[\d\d:\d\d:\d\d\] \S+:\d+: (Check failed: .*? is false: )?")

T = TypeVar("T")


@dataclass(frozen=True)
class GrammarSpec:
    """What to build: `kind` picks the xgrammar entry point, `source` is its text."""

    kind: str  # json_schema | ebnf | lark | regex | structural_tag
    source: str
    options: dict[str, Any] = field(default_factory=dict)


def grammar_spec(params: StructuredOutputsParams) -> GrammarSpec:
    """Translate a spec; raises ValueError for inputs that are malformed before xgrammar."""
    kind = params.kind
    any_ws = not params.disable_any_whitespace
    if kind == "json":
        # strict_mode (xgrammar's default and vLLM's) already forbids properties the schema
        # does not name, which is what disable_additional_properties asks for.
        return GrammarSpec("json_schema", _json_text("json", params.json),
                           {"any_whitespace": any_ws, "strict_mode": True})
    if kind == "json_object":
        return GrammarSpec("json_schema", _ANY_OBJECT, {"any_whitespace": any_ws, "strict_mode": False})
    if kind == "regex":
        return GrammarSpec("regex", params.regex)
    if kind == "choice":
        return GrammarSpec("ebnf", choice_ebnf(params.choice))
    if kind == "grammar":
        # vLLM accepts Lark too; EBNF rules are written with "::=", Lark's with ":".
        return GrammarSpec("ebnf" if "::=" in params.grammar else "lark", params.grammar)
    return GrammarSpec("structural_tag", _structural_tag_text(params.structural_tag))


def choice_ebnf(choices: list[str]) -> str:
    """`root ::= "a" | "b"`: JSON string escaping is also valid EBNF literal escaping."""
    bad = [c for c in choices if not isinstance(c, str)]
    if bad:
        raise ValueError(f"structured_outputs.choice must contain only strings, got {bad[:4]!r}")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def build_grammar(spec: GrammarSpec) -> xgr.Grammar:
    """The tokenizer-free grammar: parses and checks the spec without computing token masks."""
    builders: dict[str, Callable[..., xgr.Grammar]] = {
        "json_schema": xgr.Grammar.from_json_schema, "ebnf": xgr.Grammar.from_ebnf,
        "lark": xgr.Grammar.from_lark, "regex": xgr.Grammar.from_regex,
        "structural_tag": xgr.Grammar.from_structural_tag,
    }
    return builders[spec.kind](spec.source, **spec.options)


def validate_structured_outputs(params: StructuredOutputsParams) -> None:
    """Entry check: ValueError carrying xgrammar's reason for a malformed spec."""
    spec = grammar_spec(params)
    call_xgrammar(params.kind, build_grammar, spec)


def call_xgrammar(field_name: str, fn: Callable[..., T], *args: Any) -> T:
    """Run an xgrammar call; its errors become ValueError naming the field and the reason."""
    try:
        return fn(*args)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"structured_outputs.{field_name} is invalid: {clean_error(exc)}") from None


def clean_error(exc: BaseException) -> str:
    lines = [_CPP_PREFIX.sub("", ln).strip() for ln in str(exc).splitlines()]
    return " ".join(ln for ln in lines if ln) or type(exc).__name__


def _json_text(field_name: str, value: str | dict) -> str:
    if isinstance(value, dict):
        try:
            return json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"structured_outputs.{field_name} is not JSON-serializable: {exc}") from None
    try:
        json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"structured_outputs.{field_name} is not valid JSON: {exc}") from None
    return value


def _structural_tag_text(value: str | dict) -> str:
    """vLLM's legacy form {"structures": [{begin, schema, end}], "triggers": [...]} is
    rewritten to xgrammar's current `triggered_tags` format; anything else passes through."""
    tag = json.loads(_json_text("structural_tag", value))
    if not isinstance(tag, dict) or "structures" not in tag:
        return json.dumps(tag)
    try:
        tags = [{"type": "tag", "begin": s["begin"], "end": s["end"],
                 "content": {"type": "json_schema", "json_schema": s["schema"]}}
                for s in tag["structures"]]
        fmt = {"type": "triggered_tags", "triggers": list(tag.get("triggers", [])), "tags": tags}
    except (KeyError, TypeError) as exc:
        raise ValueError("structured_outputs.structural_tag: each of 'structures' needs begin, "
                         f"schema and end; got {tag['structures']!r:.200} ({exc!r})") from None
    return json.dumps({"type": "structural_tag", "format": fmt})
