"""Structured output: entry validation, the compile service, and rank 0's matchers driven by a
fake model (random logits masked by the grammar bitmask), with SmolLM2's real tokenizer."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr

from cluster.errors import EngineInternalError
from cluster.sampling_params import SamplingParams, StructuredOutputsParams as SO
from cluster.structured_output import (GrammarCompileService, StructuredOutputManager, make_tokenizer_info,
                                       tokenizer_info_for, validate_structured_outputs)

VOCAB, EOS = 49152, 2

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 10},
                                   "zip": {"type": "integer", "minimum": 1000, "maximum": 99999}},
                    "required": ["city", "zip"]},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
                   "minItems": 1, "maxItems": 4},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "scores"],
}

ARITH = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= num | "(" expr ")"
num ::= [0-9]+
"""


@pytest.fixture(scope="session")
def tok(smollm2_path):
    from cluster.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_path).hf


@pytest.fixture(scope="session")
def info(smollm2_path, tok):
    # Seeds the process-wide cache under the GGUF path, as the offline engine does.
    return tokenizer_info_for(smollm2_path, VOCAB, [EOS], hf_tokenizer=tok)


@pytest.fixture(scope="session")
def service(info):
    svc = GrammarCompileService(info, max_threads=2)
    yield svc
    svc.shutdown()


@pytest.fixture(scope="session")
def fake_model(tok):
    return FakeModel(tok)


class FakeModel:
    """Random logits that drift, step by step, toward tokens that close a structure (and away
    from bare whitespace), so constrained generations end in a bounded number of steps. The
    grammar bitmask alone decides what is legal."""

    def __init__(self, tok) -> None:
        vocab = tok.get_vocab()
        # '"' first: inside a string "}" and "]" are just characters.
        weights = {'"': 3.5, "}": 3.0, "]": 3.0, ")": 2.0, ":": 2.0, ",": 1.0}
        self.bias = torch.zeros(VOCAB)
        for text, w in weights.items():
            self.bias[vocab[text]] = w
        self.bias[EOS] = 4.0
        ws = [i for t, i in vocab.items() if i < VOCAB and tok.convert_tokens_to_string([t]).isspace()]
        self.bias[ws] = -3.0
        self.tok = tok

    def generate(self, mgr: StructuredOutputManager, req_ids: list[str | None], seed: int,
                 max_steps: int = 300, warmup: int = 12) -> dict[str, list[int]]:
        """One batch; rows with None are unconstrained and must come out bit-identical."""
        gen = torch.Generator().manual_seed(seed)
        outs: dict[str, list[int]] = {r: [] for r in req_ids if r is not None}
        for step in range(max_steps):
            live = [(i, r) for i, r in enumerate(req_ids) if r is not None and not mgr.matchers[r].is_terminated()]
            if not live:
                return outs
            logits = torch.randn(len(req_ids), VOCAB, generator=gen)
            logits += self.bias * max(0.0, (step - warmup) / 4)
            before = logits.clone()
            mask = mgr.fill_bitmask(live, len(req_ids))
            mgr.apply(logits, mask)
            constrained = {i for i, _ in live}
            for i in range(len(req_ids)):
                if i not in constrained:
                    assert torch.equal(logits[i], before[i])
            for i, r in live:
                t = int(logits[i].argmax())
                assert mgr.accept(r, t), f"{r}: the grammar rejected its own allowed token {t}"
                outs[r].append(t)
        raise AssertionError(f"not terminated after {max_steps} steps: "
                             f"{ {r: self.text(o) for r, o in outs.items()} }")

    def text(self, ids: list[int]) -> str:
        assert ids[-1] == EOS, "a terminated grammar ends with its stop token"
        # Special tokens are masked by the grammar, so keeping them must change nothing.
        return self.tok.decode(ids[:-1], skip_special_tokens=False)


def run(service, fake_model, info, params: SO, n: int = 4, seed: int = 0,
        unconstrained: int = 0) -> list[str]:
    mgr = StructuredOutputManager(info, max_num_seqs=n + unconstrained)
    grammar = service.compile(params)
    ids = [f"r{i}" for i in range(n)]
    for r in ids:
        mgr.add(r, grammar)
    rows = ids + [None] * unconstrained
    outs = fake_model.generate(mgr, rows[::2] + rows[1::2], seed)
    assert all(mgr.matchers[r].is_terminated() for r in ids)
    return [fake_model.text(outs[r]) for r in ids]


def allowed(mgr: StructuredOutputManager, rid: str) -> set[int]:
    logits = torch.zeros(1, VOCAB)
    mgr.apply(logits, mgr.fill_bitmask([(0, rid)], 1))
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


# ---- entry validation ---------------------------------------------------------------------------
@pytest.mark.parametrize("params, reason", [
    (SO(json={"type": "objec"}), "Unsupported type"),
    (SO(json={"type": "object", "properties": 5}), "properties must be an object"),
    (SO(json='{"type": "object",'), "not valid JSON"),
    (SO(regex="a(b"), "parenthesis is not closed"),
    (SO(regex="[z-a]"), "lower bound is larger than upper bound"),
    (SO(grammar='root ::= "a" | '), "EBNF parser error"),
    (SO(grammar='root ::= item\n'), 'Rule "item" is not defined'),
    (SO(structural_tag={"type": "structural_tag", "format": {"type": "nope"}}), "not recognized"),
    (SO(choice=["a", 3]), "only strings"),
])
def test_invalid_specs_raise_value_error_with_reason(params, reason):
    with pytest.raises(ValueError, match=re.escape(reason)) as exc:
        validate_structured_outputs(params)
    assert f"structured_outputs.{params.kind}" in str(exc.value)
    assert not re.search(r"\[\d\d:\d\d:\d\d\]|\.cc:\d+", str(exc.value))  # C++ location stripped


def test_two_constraints_or_none_rejected():
    with pytest.raises(ValueError, match="exactly one .* got 2 \\(json, regex\\)"):
        SO(json={"type": "string"}, regex="a+")
    with pytest.raises(ValueError, match="got 0"):
        SO()
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs=SO(choice=["a"], grammar='root ::= "a"'))


@pytest.mark.parametrize("params", [
    SO(json=PERSON), SO(json=json.dumps(PERSON), disable_any_whitespace=True), SO(json_object=True),
    SO(regex=r"\d{3}-\d{4}"), SO(choice=["yes", 'say "no"']), SO(grammar=ARITH),
    SO(grammar='start: "yes" | "no"'),  # Lark
    SO(structural_tag={"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}],
                       "triggers": ["<f"]}),
])
def test_valid_specs_pass(params):
    validate_structured_outputs(params)


# ---- compile service ----------------------------------------------------------------------------
def test_concurrent_submits_complete_and_round_trip(service, info):
    specs = [SO(json={"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]})
             for i in range(6)] + [SO(regex=r"[ab]{2,4}"), SO(choice=["x", "y"]), SO(grammar=ARITH)]
    futures = [service.submit(p) for p in specs]
    grammars = [f.result(timeout=120) for f in futures]
    assert all(isinstance(g, str) for g in grammars) and len(set(grammars)) == len(specs)
    mgr = StructuredOutputManager(info, max_num_seqs=4)
    for i in range(6):
        mgr.add(f"j{i}", grammars[i])
        text = f'{{"k{i}": {i * 7}}}'
        assert mgr.matchers[f"j{i}"].accept_string(text), text
        assert mgr.accept(f"j{i}", EOS) and mgr.matchers[f"j{i}"].is_terminated()
    mgr.add("other", grammars[0])
    assert not mgr.matchers["other"].accept_string('{"k1": 1}')  # each future kept its own schema


def test_repeated_spec_reuses_serialized_grammar(service):
    params = SO(json={"type": "object", "properties": {"v": {"type": "string", "maxLength": 3}}})
    first = service.compile(params)
    assert service.submit(SO(json=dict(params.json))).result(timeout=60) is first
    other = service.compile(SO(json=params.json, disable_any_whitespace=True))
    assert other != first  # the options are part of the key


def test_grown_service_rebuilds_its_compiler_and_keeps_serving_repeats(info, monkeypatch):
    """Past its memory slack the service drops its xgrammar compiler (whose cache limit misses
    part of what it holds) for a fresh one; the serialized-string cache still answers repeats,
    and compiles go on."""
    import cluster.structured_output.compiler as compiler

    svc = GrammarCompileService(info, 1)
    spec = SO(json={"type": "object", "properties": {"w": {"type": "string", "maxLength": 5}}})
    first = svc.compile(spec)
    old = svc._compiler
    assert svc.compiler_rebuilds == 0 and old.get_cache_size_bytes() > 0
    monkeypatch.setattr(compiler, "MEMORY_SLACK_BYTES", -(1 << 62))  # any size is past it
    svc.compile(SO(regex="[0-9]{3}"))
    assert svc.compiler_rebuilds == 1 and svc._compiler is not old
    assert svc._compiler.get_cache_size_bytes() == 0
    assert svc.compile(spec) is first  # a repeat: no compile, so no rebuild
    assert svc.compiler_rebuilds == 1
    monkeypatch.setattr(compiler, "MEMORY_SLACK_BYTES", 1 << 40)  # and none is
    mgr = StructuredOutputManager(info, 1)
    mgr.add("r", svc.compile(SO(regex="[a-c]{2}")))  # a fresh compile after the clear
    assert mgr.matchers["r"].accept_string("ab") and mgr.accept("r", EOS)
    assert svc._compiler.get_cache_size_bytes() > 0
    assert svc.compiler_rebuilds == 1
    svc.shutdown()


def test_rank0_grammar_cache_is_bounded_by_bytes(service, info, monkeypatch):
    """Deserialized grammars are kept for repeats up to a byte budget, oldest out first; an
    evicted grammar still serves the matcher that holds it, and a repeat deserializes again."""
    import cluster.structured_output.matcher as matcher

    small = service.compile(SO(regex="[ab]{2}"))
    big = service.compile(SO(json={"type": "object", "properties": {"s": {"type": "string", "maxLength": 40}}}))
    mgr = StructuredOutputManager(info, 4)
    mgr.add("s1", small)
    mgr.add("s2", small)  # a repeat: one deserialized grammar
    assert len(mgr._compiled) == 1
    (kept, size), = mgr._compiled.values()
    monkeypatch.setattr(matcher, "_GRAMMAR_CACHE_BYTES", size)  # room for the small one only
    mgr.add("b", big)
    assert len(mgr._compiled) == 1 and next(iter(mgr._compiled.values()))[0] is not kept
    assert mgr._compiled_bytes == next(iter(mgr._compiled.values()))[1]
    assert mgr.matchers["s1"].accept_string("ab") and mgr.accept("s1", EOS)  # evicted, still matching
    mgr.add("s3", small)
    assert mgr.matchers["s3"].accept_string("ba") and mgr.accept("s3", EOS)


def test_bad_grammar_future_raises(service):
    fut = service.submit(SO(grammar="root ::= nothing_here"))
    reason = 'structured_outputs.grammar is invalid: .*"nothing_here" is not defined'
    with pytest.raises(ValueError, match=reason):
        fut.result(timeout=60)
    assert service.submit(SO(regex="ok")).result(timeout=60)  # the pool keeps serving


def test_service_from_a_tokenizer_info_factory_is_lazy(smollm2_path, info, tok):
    built = []
    svc = GrammarCompileService(lambda: built.append(1) or tokenizer_info_for(smollm2_path, VOCAB, [EOS]),
                                max_threads=1)
    assert svc._compiler is None and not built  # nothing built at construction
    g = svc.compile(SO(choice=["alpha", "beta"]))
    assert built == [1] and svc.tokenizer_info is info
    mgr = StructuredOutputManager(info, max_num_seqs=1)
    mgr.add("c", g)
    assert mgr.matchers["c"].accept_string("beta") and mgr.accept("c", EOS)
    mgr.add("d", svc.compile(SO(regex="a+b")))
    assert mgr.matchers["d"].accept_string("aaab") and built == [1]
    svc.shutdown()


def test_for_model_shares_tokenizer_info(smollm2_path, info, tok):
    """The offline engine builds both sides from its EngineConfig: one TokenizerInfo in-process."""
    from types import SimpleNamespace

    from cluster.config import EngineConfig

    cfg = EngineConfig.create(max_num_seqs=3).with_facts(path=smollm2_path, hf_config=SimpleNamespace(vocab_size=VOCAB),
                                                          eos_token_id=EOS)
    svc = GrammarCompileService.for_model(cfg, max_threads=1)
    mgr = StructuredOutputManager.for_model(cfg)
    assert svc.tokenizer_info is mgr.tokenizer_info is info
    assert mgr.fill_bitmask([], 3) is None
    mgr.add("x", svc.submit(SO(regex="(ab)+")).result(timeout=60))
    ok = allowed(mgr, "x")
    assert {tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("ab")} <= ok
    assert all(re.fullmatch("(ab)*a?", tok.decode([t])) for t in ok)
    svc.shutdown()


# ---- matcher: generations follow the grammar ------------------------------------------------------
def test_json_schema_outputs_validate(service, fake_model, info):
    texts = run(service, fake_model, info, SO(json=PERSON), n=10, seed=1, unconstrained=3)
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 1


def test_json_without_whitespace_freedom(service, fake_model, info):
    loose, tight = (StructuredOutputManager(info, 1) for _ in range(2))
    loose.add("a", service.compile(SO(json=PERSON)))
    tight.add("a", service.compile(SO(json=PERSON, disable_any_whitespace=True)))
    for m in (loose, tight):
        assert m.matchers["a"].accept_string("{")
    assert allowed(tight, "a") < allowed(loose, "a")  # the loose one also admits whitespace here
    for text in run(service, fake_model, info, SO(json=PERSON, disable_any_whitespace=True), n=3, seed=2):
        outside = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
        assert not re.search(r"[\n\t\r]|  | [,:}\]]", outside), text
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_outputs_are_objects(service, fake_model, info):
    for text in run(service, fake_model, info, SO(json_object=True), n=6, seed=3, unconstrained=2):
        assert isinstance(json.loads(text), dict), text


def test_regex_outputs_fullmatch(service, fake_model, info):
    pattern = r"[a-z]{2,6}@(example|test)\.(com|org)"
    texts = run(service, fake_model, info, SO(regex=pattern), n=6, seed=4)
    assert all(re.fullmatch(pattern, t) for t in texts), texts


def test_choice_outputs_are_choices(service, fake_model, info):
    choices = ["red", "green", 'say "hi"', "back\\slash", "new\nline", "ünï"]
    seen = set()
    for seed in range(3):
        texts = run(service, fake_model, info, SO(choice=choices), n=6, seed=seed, unconstrained=1)
        assert all(t in choices for t in texts), texts
        seen.update(texts)
    assert len(seen) >= 3


def test_lark_grammar_outputs(service, fake_model, info):
    texts = run(service, fake_model, info, SO(grammar='start: "yes" | "no" | "maybe"'), n=4, seed=5)
    assert set(texts) <= {"yes", "no", "maybe"}


def parses_arith(s: str) -> bool:
    """Recursive-descent check of ARITH: expr := term (('+'|'-') term)*, term := factor
    (('*'|'/') factor)*, factor := digits | '(' expr ')'."""
    pos = 0

    def factor() -> bool:
        nonlocal pos
        if pos < len(s) and s[pos] == "(":
            pos += 1
            if not expr() or pos >= len(s) or s[pos] != ")":
                return False
            pos += 1
            return True
        start = pos
        while pos < len(s) and s[pos].isdigit():
            pos += 1
        return pos > start

    def chain(item, ops) -> bool:
        nonlocal pos
        if not item():
            return False
        while pos < len(s) and s[pos] in ops:
            pos += 1
            if not item():
                return False
        return True

    def expr() -> bool:
        return chain(lambda: chain(factor, "*/"), "+-")

    return expr() and pos == len(s)


def test_arith_checker_itself():
    assert all(parses_arith(s) for s in ["1", "12+3*(4-5)", "((7))/2"])
    assert not any(parses_arith(s) for s in ["", "1+", "(1", "1)", "1 + 2", "a", "()"])


def test_ebnf_outputs_parse(service, fake_model, info):
    texts = run(service, fake_model, info, SO(grammar=ARITH), n=8, seed=6, unconstrained=1)
    assert all(parses_arith(t) for t in texts), texts
    assert any(set(t) & set("+-*/()") for t in texts), texts  # not only bare numbers


def test_structural_tag_legacy_form(service, info):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    tag = {"structures": [{"begin": "<f=add>", "schema": schema, "end": "</f>"}], "triggers": ["<f="]}
    mgr = StructuredOutputManager(info, 1)
    g = service.compile(SO(structural_tag=tag))
    mgr.add("ok", g)
    assert mgr.matchers["ok"].accept_string('thinking... <f=add>{"a": 3}</f> done')
    mgr.add("bad", g)
    assert not mgr.matchers["bad"].accept_string('<f=add>{"b": 3}')


# ---- matcher: bitmask semantics ---------------------------------------------------------------
def test_stop_token_masked_until_grammar_can_end(service, info, tok):
    mgr = StructuredOutputManager(info, 1)
    mgr.add("r", service.compile(SO(choice=["a", "ab"])))
    a, b = tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("b")
    assert EOS not in allowed(mgr, "r")
    assert mgr.accept("r", a)
    assert {EOS, b} <= allowed(mgr, "r")  # may end or continue
    assert mgr.accept("r", b)
    assert allowed(mgr, "r") == {EOS}  # must end
    assert not mgr.accept("r", a) and not mgr.matchers["r"].is_terminated()  # rejected token: state kept
    assert mgr.accept("r", EOS) and mgr.matchers["r"].is_terminated()
    # ignore_eos: the grammar still ends the request; a terminated row offers only the stop token.
    assert allowed(mgr, "r") == {EOS}
    assert not mgr.accept("r", a)


def test_special_tokens_never_allowed(service, info, tok):
    mgr = StructuredOutputManager(info, 1)
    mgr.add("s", service.compile(SO(json_object=True)))
    assert mgr.matchers["s"].accept_string('{"k": "v')
    ok = allowed(mgr, "s")
    specials = set(tok.all_special_ids) - {EOS}
    assert specials and not ok & specials
    assert len(ok) > VOCAB // 2  # inside a string almost everything else is legal


def test_unconstrained_rows_bit_identical_and_dtypes(service, info):
    mgr = StructuredOutputManager(info, max_num_seqs=2)  # grows past its preallocated rows
    g = service.compile(SO(regex=r"[0-9]+"))
    for r in ("x", "y"):
        mgr.add(r, g)
    decoded = mgr.tokenizer_info.decoded_vocab
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits = torch.randn(5, VOCAB).to(dtype)
        logits[3, :10] = float("nan")
        before = logits.clone()
        mask = mgr.fill_bitmask([(1, "x"), (4, "y")], 5)
        assert mask.shape == (5, VOCAB // 32) and mask.dtype == torch.int32
        assert (mask[[0, 2, 3]] == -1).all()
        mgr.apply(logits, mask)
        for i in (0, 2, 3):
            assert torch.equal(logits[i].view(torch.int16 if dtype != torch.float32 else torch.int32),
                               before[i].view(torch.int16 if dtype != torch.float32 else torch.int32))
        for i in (1, 4):
            finite = torch.isfinite(logits[i]).nonzero().flatten()
            assert 0 < len(finite) < 1000
            texts = [decoded[t] for t in finite.tolist()]
            assert all(re.fullmatch(rb"[0-9]+", t) for t in texts)
            assert torch.equal(logits[i, finite], before[i, finite])
    assert mgr.fill_bitmask([], 5) is None


def test_logits_wider_than_tokenizer(tok):
    """Model vocab padded past the tokenizer (and not a multiple of 32): padded ids masked."""
    padded = VOCAB + 17
    info = make_tokenizer_info(tok, padded, [EOS])
    svc = GrammarCompileService(info, 1)
    mgr = StructuredOutputManager(info, 2)
    mgr.add("p", svc.compile(SO(json_object=True)))
    mgr.matchers["p"].accept_string('{"k": "')
    logits = torch.zeros(2, padded)
    mask = mgr.fill_bitmask([(0, "p")], 2)
    assert mask.shape == (2, (padded + 31) // 32)
    mgr.apply(logits, mask)
    assert torch.isinf(logits[0, VOCAB:]).all() and (logits[0, :VOCAB] == 0).sum() > VOCAB // 2
    assert (logits[1] == 0).all()
    # Logits even wider than the grammar's vocab: the excess is masked on constrained rows only.
    wide = torch.zeros(2, padded + 40)
    mgr.apply(wide, mgr.fill_bitmask([(1, "p")], 2))
    assert torch.isinf(wide[1, padded:]).all() and (wide[0] == 0).all()
    svc.shutdown()


def test_replay_restores_state(service, fake_model, info, tok):
    g = service.compile(SO(json=PERSON))
    mgr = StructuredOutputManager(info, 4)
    mgr.add("orig", g)
    out = fake_model.generate(mgr, ["orig"], seed=11)["orig"]
    for k in (0, 3, len(out) // 2, len(out) - 1, len(out)):
        mgr.add(f"a{k}", g)
        for t in out[:k]:
            assert mgr.accept(f"a{k}", t)
        mgr.add(f"b{k}", g, out[:k])  # replayed on add
        for r in (f"a{k}", f"b{k}"):
            assert mgr.matchers[r].is_terminated() == (k == len(out))
        if k < len(out):
            m1 = mgr.fill_bitmask([(0, f"a{k}")], 2).clone()
            m2 = mgr.fill_bitmask([(1, f"b{k}")], 2)
            assert torch.equal(m1[0], m2[1])
            for t in out[k:]:  # both continue identically to the end
                assert mgr.accept(f"b{k}", t)
            assert mgr.matchers[f"b{k}"].is_terminated()
    mgr.add("orig", g, out)  # re-adding an id restarts it from its outputs
    assert mgr.matchers["orig"].is_terminated()
    with pytest.raises(EngineInternalError, match="does not follow its grammar"):
        mgr.add("bad", g, [tok.convert_tokens_to_ids("}")])
    mgr.remove("orig")
    assert not mgr.has("orig")


@pytest.mark.parametrize("density", [0.0, 0.001, 0.005, 0.3, 0.97, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_matches_xgrammar_reference(info, density, dtype):
    """Both CPU paths (sparse rebuild for rows allowing few tokens, xgrammar's kernel otherwise) give
    exactly xgrammar's result on the listed rows and leave the others alone."""
    gen = torch.Generator().manual_seed(int(density * 1000))
    allowed_tok = torch.rand(6, VOCAB, generator=gen) < density
    bits = allowed_tok.view(6, -1, 32).to(torch.int64) << torch.arange(32)
    words = bits.sum(-1)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    mgr = StructuredOutputManager(info, 1)
    for rows in ([0, 1, 2, 3, 4, 5], [1, 4], [2]):
        logits = torch.randn(6, VOCAB, generator=gen).to(dtype)
        ref = logits.clone()
        xgr.apply_token_bitmask_inplace(ref, bitmask, indices=rows)
        mgr.apply(logits, bitmask, rows=rows)
        assert torch.equal(logits, ref)
        for i in rows:
            assert torch.equal(torch.isfinite(logits[i]), allowed_tok[i])


# ---- through the engine, with the real model ------------------------------------------------------
def test_engine_with_real_model():
    """Greedy SmolLM2 through the offline engine: the grammar shapes the output and, with
    ignore_eos, still ends the request."""
    from cluster import LLM

    llm = LLM("smollm2-135m-instruct", max_model_len=384, num_kv_blocks=96, max_num_seqs=4)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"]}
    greedy = dict(temperature=0, max_tokens=48)
    params = [SamplingParams(**greedy, structured_outputs=SO(json=schema, disable_any_whitespace=True)),
              SamplingParams(**greedy, ignore_eos=True, structured_outputs=SO(choice=["yes", "no"])),
              SamplingParams(**greedy, structured_outputs=SO(regex=r"[A-Z][a-z]+ [0-9]{4}"))]
    prompts = [[{"role": "user", "content": "Name a big city and its population, as JSON."}],
               [{"role": "user", "content": "Is water wet? Answer yes or no."}],
               [{"role": "user", "content": "Name a month and a year."}]]
    outs = [o.outputs[0] for o in llm.chat(prompts, params, use_tqdm=False)]
    assert [o.finish_reason for o in outs] == ["stop"] * 3, [(o.text, o.finish_reason) for o in outs]
    jsonschema.validate(json.loads(outs[0].text), schema)
    assert outs[1].text in ("yes", "no") and outs[1].token_ids[-1] == EOS
    assert re.fullmatch(r"[A-Z][a-z]+ [0-9]{4}", outs[2].text), outs[2].text
    assert not llm.engine.has_unfinished()
