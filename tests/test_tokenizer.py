"""Tokenizer wrapper, chat template, incremental detokenizer and stop strings, on the real
SmolLM2 tokenizer read from the GGUF (byte-level BPE: emoji and CJK span several tokens)."""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.engine.detokenizer import IncrementalDetokenizer, StopStringChecker
from cluster.tokenizer import Tokenizer, _gguf_cache_dir

FFFD = "\ufffd"
TEXTS = [
    "Hello, world! A plain sentence.",
    "Robots 🤖 and families 👨‍👩‍👧 and flags 🇫🇷🇯🇵 wave 👋🏽.",
    "中文测试：你好，世界。日本語のテキスト、한국어 텍스트.",
    "Café naïve résumé — Ångström, façade, jalapeño, Ελληνικά, русский.",
    "def f(x):\n    return {'a': [x, x ** 2]}  # comment\n\n\tindent\ttab",
    "spaces     runs \n\n\n   \t\t  trailing   ",
    "<|im_start|>user\nhi 🙂<|im_end|>\n<|im_start|>assistant\n<repo_name>x<file_sep>done<|endoftext|>",
]
CHAT = [{"role": "user", "content": "Write a haiku about tokenizers."}]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tokenizer-cache")


@pytest.fixture(scope="session")
def tok(smollm2_path, cache_dir) -> Tokenizer:
    # An empty cache: this is the real GGUF conversion path, and it fills the cache.
    t = Tokenizer.load(smollm2_path, cache_dir=cache_dir)
    assert t.source == "gguf"
    return t


@pytest.fixture(scope="session")
def prompt_ids(tok) -> list[int]:
    return tok.apply_chat_template(CHAT, tokenize=True)


# --- Tokenizer ---------------------------------------------------------------------------

def test_properties_match_the_model_card(tok):
    assert tok.eos_token_id == 2 and tok.hf.convert_ids_to_tokens(2) == "<|im_end|>"
    assert tok.vocab_size == 49152
    assert {0, 1, 2} <= set(tok.all_special_ids)


def test_all_special_ids_are_exactly_what_skip_special_tokens_drops(tok):
    for i in range(200):
        dropped = tok.decode([i], skip_special_tokens=True) == ""
        assert dropped == (i in tok.all_special_ids), i
        assert tok.decode([i], skip_special_tokens=False) != ""


def test_encode_decode_round_trip(tok):
    for text in TEXTS:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.encode("<|im_end|>") == [2]
    assert tok.decode(tok.encode("a<|im_end|>b"), skip_special_tokens=True) == "ab"


def test_token_ids_for_adds_no_special_tokens(tok):
    for marker in [" stop", "</think>", "<|im_end|>", "###"]:
        ids = tok.token_ids_for(marker)
        assert ids and tok.decode(ids, skip_special_tokens=False) == marker
    assert tok.token_ids_for("hi") == tok.encode("hi", add_special_tokens=False)


def test_cached_tokenizer_behaves_like_the_gguf_one(tok, smollm2_path, cache_dir):
    again = Tokenizer.load(smollm2_path, cache_dir=cache_dir)
    assert again.source == "cache"
    assert (again.eos_token_id, again.vocab_size, again.all_special_ids) == \
        (tok.eos_token_id, tok.vocab_size, tok.all_special_ids)
    for text in TEXTS:
        ids = tok.encode(text)
        assert again.encode(text) == ids
        assert again.decode(ids, skip_special_tokens=True) == tok.decode(ids, skip_special_tokens=True)
    assert again.apply_chat_template(CHAT) == tok.apply_chat_template(CHAT)
    # The cache entry is itself an HF-style directory.
    entry = _gguf_cache_dir(Path(smollm2_path), cache_dir)
    from_dir = Tokenizer.load(str(entry))
    assert from_dir.source == "dir" and from_dir.encode(TEXTS[1]) == tok.encode(TEXTS[1])


def test_cache_key_follows_file_size_and_mtime(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x" * 10)
    first = _gguf_cache_dir(f, tmp_path)
    assert _gguf_cache_dir(f, tmp_path) == first
    st_ = f.stat()
    os.utime(f, ns=(st_.st_atime_ns, st_.st_mtime_ns + 10**9))
    second = _gguf_cache_dir(f, tmp_path)
    f.write_bytes(b"x" * 11)
    os.utime(f, ns=(st_.st_atime_ns, st_.st_mtime_ns + 10**9))
    assert len({first, second, _gguf_cache_dir(f, tmp_path)}) == 3


def test_load_rejects_a_bad_path(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    for bad in [str(tmp_path / "missing"), str(tmp_path / "weights.bin")]:
        with pytest.raises(ValueError, match="directory or a .gguf"):
            Tokenizer.load(bad)


# --- chat template -----------------------------------------------------------------------

def test_chat_template_renders_role_markers(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Bye"}]
    text = tok.apply_chat_template(msgs)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n"
                    "<|im_start|>assistant\nHi!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
                    "<|im_start|>assistant\n")
    bare = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert text.startswith(bare) and not bare.endswith("<|im_start|>assistant\n")


def test_chat_template_default_system_prompt_and_tokenize(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\n") and "<|im_start|>user\nhi<|im_end|>\n" in text
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|> x3, <|im_end|> x2


def test_chat_content_parts_are_joined(tok):
    parts = [{"type": "text", "text": "line one"}, {"type": "text", "text": "line two"}]
    assert tok.apply_chat_template([{"role": "user", "content": parts}]) == \
        tok.apply_chat_template([{"role": "user", "content": "line one\nline two"}])


@pytest.mark.parametrize("messages", [
    [{"content": "no role"}],
    [{"role": "user"}],
    [{"role": "", "content": "x"}],
    [{"role": "user", "content": None}],
    [{"role": "user", "content": 42}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    ["user: hi"],
    [],
    {"role": "user", "content": "a dict, not a list"},
    "hi",
])
def test_malformed_messages_raise(tok, messages):
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template(messages)


def test_template_errors_become_value_errors(tok):
    with pytest.raises(ValueError, match="no tools here"):
        tok.apply_chat_template(CHAT, chat_template="{{ raise_exception('no tools here') }}")


def test_tokenizer_without_chat_template_raises(smollm2_path, cache_dir, tmp_path, tok):
    plain = tmp_path / "plain"
    shutil.copytree(_gguf_cache_dir(Path(smollm2_path), cache_dir), plain)
    (plain / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.load(str(plain)).apply_chat_template(CHAT)


# --- incremental detokenizer -------------------------------------------------------------

def run_detok(tok, ids, chunks, prompt=(), skip=True):
    d = IncrementalDetokenizer(tok, list(prompt), skip_special_tokens=skip)
    deltas, i = [], 0
    for n in chunks:
        deltas.append(d.step(ids[i:i + n]))
        i += n
    assert i >= len(ids)
    deltas.append(d.flush())
    assert "".join(deltas) == d.text
    return d, deltas


def random_chunks(rng, n):
    out = []
    while sum(out) < n:
        out.append(rng.randint(1, 7))
    return out


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tok, prompt_ids, text, skip):
    ids = tok.encode(text)
    full = tok.decode(ids, skip_special_tokens=skip)
    rng = random.Random(text)
    schedules = [[1] * len(ids), [len(ids)]] + [random_chunks(rng, len(ids)) for _ in range(5)]
    for prompt in [(), prompt_ids]:
        for chunks in schedules:
            d, deltas = run_detok(tok, ids, chunks, prompt, skip)
            assert d.text == full
            assert deltas[-1] == ""  # complete text: nothing was left for flush
            assert d.token_ids == ids
            if FFFD not in full:
                assert not any(FFFD in x for x in deltas)


def test_partial_character_is_held_until_complete(tok):
    ids = tok.encode("🤖")
    assert len(ids) > 1  # byte-level BPE splits it
    d = IncrementalDetokenizer(tok, [])
    assert [d.step([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.step(ids[-1:]) == "🤖"


def test_text_before_a_pending_character_is_not_held(tok):
    ids = tok.encode("hello world 世界")
    partial = tok.decode(ids[:-1])
    assert partial.endswith(FFFD)  # the last id completes '界'
    d = IncrementalDetokenizer(tok, [])
    first = d.step(ids[:-1])
    assert first == partial.rstrip(FFFD) == "hello world 世"
    assert first + d.step(ids[-1:]) == "hello world 世界"


def test_flush_emits_an_unfinished_character(tok):
    ids = tok.encode("ok 🤖")[:-1]  # the output stops mid-emoji
    full = tok.decode(ids)
    assert full.endswith(FFFD)
    d, deltas = run_detok(tok, ids, [1] * len(ids))
    assert not any(FFFD in x for x in deltas[:-1])
    assert d.text == full and deltas[-1].endswith(FFFD)
    assert d.flush() == ""


def test_random_token_streams_match_full_decode(tok):
    # What a random-weight model emits: arbitrary byte tokens, invalid UTF-8 included.
    rng = random.Random(0)
    for _ in range(30):
        ids = [rng.randrange(tok.vocab_size) if rng.random() < 0.6 else rng.randrange(100, 400)
               for _ in range(rng.randint(1, 40))]
        for skip in (True, False):
            d, _ = run_detok(tok, ids, random_chunks(rng, len(ids)), skip=skip)
            assert d.text == tok.decode(ids, skip_special_tokens=skip)


def test_prompt_ending_mid_character_decodes_output_standalone(tok):
    for text in ["say 🤖", "Please, just say the word for a robot: 🤖"]:
        robot = tok.encode(text)
        prompt, out = robot[:-1], robot[-1:] + tok.encode(" done")
        assert tok.decode(prompt).endswith(FFFD) and tok.decode(out).startswith(FFFD)
        d, _ = run_detok(tok, out, [1] * len(out), prompt)
        assert d.text == tok.decode(out)


def test_each_step_decodes_only_a_window_around_new_tokens(tok, prompt_ids):
    ids = tok.encode(" ".join(TEXTS) * 8)
    assert len(ids) > 1500
    d = IncrementalDetokenizer(tok, prompt_ids)
    sizes = []
    real = tok.decode
    d.tokenizer = type("Spy", (), {"decode": lambda self, x, *a: sizes.append(len(x)) or real(x, *a)})()
    for i, t in enumerate(ids):
        d.step([t])
        if i == 0:
            sizes.clear()  # the first step also decodes the prompt context
    assert d.text == tok.decode(ids)
    assert max(sizes) <= 12  # independent of the output length
    assert sum(sizes) <= 6 * len(ids)


UNICODE_PIECES = ["a", " b", "é", "ñ", "世", "界", "🤖", "👍🏽", "‍", "🇫🇷", "\n", "\t", "  ", "<|im_end|>",
                  "<|im_start|>", "def", "{", "}", "😀", "ㅎ", "Ω"]


@settings(max_examples=120, deadline=None)
@given(pieces=st.lists(st.sampled_from(UNICODE_PIECES), min_size=1, max_size=30),
       chunks=st.lists(st.integers(1, 6), min_size=1, max_size=60), skip=st.booleans())
def test_incremental_property(tok, pieces, chunks, skip):
    ids = tok.encode("".join(pieces))
    while sum(chunks) < len(ids):
        chunks = chunks + chunks
    d, deltas = run_detok(tok, ids, chunks, skip=skip)
    full = tok.decode(ids, skip_special_tokens=skip)
    assert d.text == full
    if FFFD not in full:
        assert not any(FFFD in x for x in deltas)


# --- stop strings ------------------------------------------------------------------------

def stream(checker, deltas):
    """The ingress's loop: send what is safe, hold back what could start a stop string."""
    text, sent, chunks, r = "", 0, [], None
    for delta in deltas:
        text += delta
        r = checker.check(text, delta)
        if r.stopped:
            assert len(r.text) >= sent
            chunks.append(r.text[sent:])
            return "".join(chunks), r.stop
        upto = len(r.text) - r.hold_back
        assert upto >= sent
        chunks.append(r.text[sent:upto])
        sent = upto
    chunks.append(text[sent:])  # finished for another reason: release the held tail
    return "".join(chunks), None


def whole(checker, text):
    r = checker.check(text, text)
    return r.text, r.stop


def reference(stops, include, text):
    # The specification, independently: scan forward; the first stop to be complete wins.
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            s = max(done, key=len)
            return (text[:end] if include else text[:end - len(s)]), s
    return text, None


@pytest.mark.parametrize("include", [False, True])
def test_stop_inside_one_delta(include):
    c = StopStringChecker(["world"], include)
    r = c.check("Hello world, again", "Hello world, again")
    assert r.stopped and r.stop == "world" and r.hold_back == 0
    assert r.text == ("Hello world" if include else "Hello ")


@pytest.mark.parametrize("include", [False, True])
def test_stop_spanning_deltas(include):
    c = StopStringChecker(["</answer>"], include)
    out, stop = stream(c, ["The answer is 4", "2</ans", "w", "er> and more"])
    assert stop == "</answer>"
    assert out == ("The answer is 42</answer>" if include else "The answer is 42")


@pytest.mark.parametrize("include", [False, True])
def test_stop_at_the_very_start(include):
    c = StopStringChecker(["STOP"], include)
    assert whole(c, "STOP now") == ("STOP" if include else "", "STOP")
    assert stream(c, ["ST", "OP", " now"]) == ("STOP" if include else "", "STOP")


def test_first_completed_stop_wins():
    # "bc" completes before "abcd" does, whatever the list order.
    for stops in (["abcd", "bc"], ["bc", "abcd"]):
        assert whole(StopStringChecker(stops), "xabcdy") == ("xa", "bc")
    # Same end: the longer one (it started earlier) wins.
    for stops in (["bc", "abc"], ["abc", "bc"]):
        assert whole(StopStringChecker(stops), "xabcy") == ("x", "abc")
    # Two occurrences of one stop: the first.
    assert whole(StopStringChecker(["."]), "a.b.c") == ("a", ".")
    assert whole(StopStringChecker(["."], True), "a.b.c") == ("a.", ".")


def test_only_the_new_region_is_searched():
    c = StopStringChecker(["STOP"])
    r = c.check("STOP and then more", " and then more")
    assert not r.stopped and r.text == "STOP and then more"
    assert c.check("xxSTO" + "P", "P").stop == "STOP"


def test_hold_back():
    c = StopStringChecker(["</end>", "##"])
    assert c.check("abc</e", "</e").hold_back == 3
    assert c.check("abc#", "#").hold_back == 1
    assert c.check("abc</x", "</x").hold_back == 0
    assert c.check("", "").hold_back == 0
    assert StopStringChecker(["</end>"], True).check("abc</e", "</e").hold_back == 0


def test_no_stops_and_invalid_input():
    c = StopStringChecker(None)
    assert not c
    assert not c.check("anything", "thing").stopped and c.check("abc", "c").hold_back == 0
    with pytest.raises(ValueError, match="non-empty"):
        StopStringChecker(["ok", ""])
    with pytest.raises(ValueError, match="delta"):
        StopStringChecker(["x"]).check("abc", "zz")


@settings(max_examples=400, deadline=None)
@given(text=st.text(alphabet="ab c", max_size=40),
       stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=12), include=st.booleans())
def test_streamed_equals_whole_equals_reference(text, stops, cuts, include):
    c = StopStringChecker(stops, include)
    bounds = sorted({0, len(text), *(min(x, len(text)) for x in cuts)})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    expected = reference(stops, include, text)
    assert whole(c, text) == expected
    assert stream(c, deltas) == expected
    assert stream(c, list(text)) == expected


@pytest.mark.parametrize("include", [False, True])
def test_detokenizer_and_stop_checker_together(tok, prompt_ids, include):
    text = "Sure 🙂! Here it is: 世界 ###END### trailing words"
    ids = tok.encode(text)
    expected = reference(["###END###"], include, text)
    for chunks in ([1] * len(ids), [len(ids)], random_chunks(random.Random(3), len(ids))):
        d = IncrementalDetokenizer(tok, prompt_ids)
        deltas, i = [], 0
        for n in chunks:
            deltas.append(d.step(ids[i:i + n]))
            i += n
        assert stream(StopStringChecker(["###END###"], include), deltas) == expected


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral", None])
def test_a_folder_loads_the_tokenizer_autotokenizer_would_without_the_model_config_class(
        tok, smollm2_path, cache_dir, tmp_path, model_type):
    """Tokenizer.load of a folder hands AutoTokenizer the fields it reads of the model's config
    instead of letting it load the config class: the same tokenizer, and no model package
    imported (a subprocess shows it). The model type decides some of AutoTokenizer's choices:
    each of these gets what AutoTokenizer.from_pretrained gives."""
    import json
    import subprocess
    import sys

    from transformers import AutoTokenizer

    folder = tmp_path / "model"
    shutil.copytree(_gguf_cache_dir(Path(smollm2_path), cache_dir), folder)
    if model_type is not None:
        (folder / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": ["X"]}))
    ours, theirs = Tokenizer.load(str(folder)).hf, AutoTokenizer.from_pretrained(folder)
    assert type(ours) is type(theirs) and ours.name_or_path == theirs.name_or_path
    assert ours.all_special_ids == theirs.all_special_ids and len(ours) == len(theirs)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text)
    assert ours.apply_chat_template(CHAT, tokenize=False) == theirs.apply_chat_template(CHAT, tokenize=False)
    if model_type == "llama":
        code = ("import sys; from cluster.tokenizer import Tokenizer; Tokenizer.load(sys.argv[1]); "
                "print(any(m.startswith('transformers.models.llama') for m in sys.modules))")
        out = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parents[1])
        assert out.stdout.split()[-1] == "False"
