"""Who may load LoRA adapters at runtime, and from where (actors/http/lora_updates.py), without a
Ray cluster: the options resolved when an app is built (both deploy-file forms), the folder check
of /v1/load_lora_adapter, and the 404 of both endpoints where runtime loading is off.
tests/actors/test_lora_serve.py loads adapters through a served app with it on."""
from types import SimpleNamespace

import pytest
from pydantic import ValidationError
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

from actors.app import build_app, build_openai_app
from actors.http.lora_updates import RUNTIME_LORA_ENV, RuntimeLoRAUpdates, env_allows_runtime_lora_updating
from actors.http.openai_protocol import OpenAIError
from actors.http.adapters import AdapterCatalogue
from actors.http.served import ModelTable

OFF = RuntimeLoRAUpdates(False, ())


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(RUNTIME_LORA_ENV, raising=False)


@pytest.fixture
def tree(tmp_path):
    """root/ (an allowed folder, holding an adapter folder and two symlinks) and outside/."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "sql").mkdir(parents=True)
    (outside / "secret").mkdir(parents=True)
    (root / "escape").symlink_to(outside / "secret")
    (root / "alias").symlink_to(root / "sql")
    (tmp_path / "root-sibling").mkdir()  # shares root's name as a prefix
    return tmp_path


def _specs(app) -> dict:
    return {m.config.model_config.name: m for m in app._bound_deployment.init_args[0]}


def _llm(model_dir: str, model_id: str = "m", lora: bool = True, **engine_kwargs) -> dict:
    llm = {"model_loading_config": {"model_id": model_id, "model_source": model_dir},
           "engine_kwargs": {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 32, **engine_kwargs}}
    return {**llm, "lora_config": {}} if lora else llm


def _build(*llms: dict) -> dict:
    return _specs(call_user_app_builder_with_args_if_necessary(build_openai_app, {"llm_configs": list(llms)}))


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("True", True), (" TRUE ", True),
                                       ("0", False), ("false", False), ("yes", False), ("on", False), ("", False)])
def test_the_environment_variable_reads_as_vllm_reads_it(value, on):
    assert env_allows_runtime_lora_updating({RUNTIME_LORA_ENV: value}) is on
    assert env_allows_runtime_lora_updating({}) is False


def test_off_by_default_on_with_the_option_or_the_environment(tiny_llama_dir, tree, monkeypatch):
    root = str(tree / "root")
    specs = _build(_llm(tiny_llama_dir, "default"), _llm(tiny_llama_dir, "roots-only", allowed_local_lora_paths=[root]),
                   _llm(tiny_llama_dir, "on", allow_runtime_lora_updating=True, allowed_local_lora_paths=root),
                   _llm(tiny_llama_dir, "no-lora", lora=False))
    assert specs["default"].lora_updates == OFF and specs["no-lora"].lora_updates == OFF
    assert specs["roots-only"].lora_updates == RuntimeLoRAUpdates(False, (str((tree / "root").resolve()),))
    assert specs["on"].lora_updates == RuntimeLoRAUpdates(True, (str((tree / "root").resolve()),))

    monkeypatch.setenv(RUNTIME_LORA_ENV, "True")
    specs = _build(_llm(tiny_llama_dir, "env", allowed_local_lora_paths=[root]),
                   _llm(tiny_llama_dir, "option-wins", allow_runtime_lora_updating=False),
                   _llm(tiny_llama_dir, "no-lora", lora=False))  # no LoRA: the variable means nothing to it
    assert specs["env"].lora_updates.enabled and specs["env"].lora_updates.roots == (str((tree / "root").resolve()),)
    assert specs["option-wins"].lora_updates == OFF and specs["no-lora"].lora_updates == OFF

    # The short form: the same options at the top of `args`.
    app = call_user_app_builder_with_args_if_necessary(build_app, {
        "preset": "smollm2-cpu-small", "enable_lora": True,
        "allow_runtime_lora_updating": True, "allowed_local_lora_paths": [root, str(tree / "root" / ".." / "root")]})
    (spec,) = _specs(app).values()
    assert spec.lora_updates == RuntimeLoRAUpdates(True, (str((tree / "root").resolve()),))


def test_options_that_cannot_be_honoured_fail_the_build_naming_them(tiny_llama_dir, tree, monkeypatch):
    prefix = r"llm_configs\[0\] \(model_id 'm'\): "
    empty = prefix + r"allowed_local_lora_paths is empty "
    with pytest.raises(ValueError, match=empty + r".*allow_runtime_lora_updating=true"):
        _build(_llm(tiny_llama_dir, allow_runtime_lora_updating=True))
    with pytest.raises(ValueError, match=prefix + r"allow_runtime_lora_updating=true needs enable_lora"):
        _build(_llm(tiny_llama_dir, lora=False, allow_runtime_lora_updating=True))
    with pytest.raises(ValueError, match=prefix + r"allowed_local_lora_paths \[.*\] needs enable_lora"):
        _build(_llm(tiny_llama_dir, lora=False, allowed_local_lora_paths=[str(tree)]))
    missing = str(tree / "missing")
    with pytest.raises(ValueError, match=prefix + f"allowed_local_lora_paths: '{missing}' is not a directory"):
        _build(_llm(tiny_llama_dir, allow_runtime_lora_updating=True, allowed_local_lora_paths=[missing]))
    for bad, message in (("s3://bucket/loras", "no remote URIs"), ("", "empty path"), (3, "valid string")):
        with pytest.raises(ValidationError, match=rf"(?s)engine_kwargs\.allowed_local_lora_paths.*{message}"):
            _build(_llm(tiny_llama_dir, allowed_local_lora_paths=[bad]))
    with pytest.raises(ValidationError, match=r"engine_kwargs\.allow_runtime_lora_updating"):
        _build(_llm(tiny_llama_dir, allow_runtime_lora_updating="sometimes"))
    monkeypatch.setenv(RUNTIME_LORA_ENV, "1")  # on through vLLM's variable, still no folder: the message says so
    with pytest.raises(ValueError, match=prefix + rf"allowed_local_lora_paths is empty .*{RUNTIME_LORA_ENV}='1'"):
        _build(_llm(tiny_llama_dir))
    with pytest.raises(ValueError, match=r"allowed_local_lora_paths is empty"):
        call_user_app_builder_with_args_if_necessary(build_app, {"preset": "smollm2-cpu-small", "enable_lora": True})


def _refused(updates: RuntimeLoRAUpdates, path: str) -> OpenAIError:
    with pytest.raises(OpenAIError) as err:
        updates.folder(path, "m")
    return err.value


def test_only_folders_under_the_roots_resolved_are_loaded(tree):
    root = tree / "root"
    updates = RuntimeLoRAUpdates.create(True, [str(root)], enable_lora=True, env={})
    assert updates.folder(str(root / "sql"), "m") == str((root / "sql").resolve())
    assert updates.folder(str(root / "alias"), "m") == str((root / "sql").resolve())  # a symlink within: its target
    assert updates.folder(str(root / "new" / ".." / "sql"), "m") == str((root / "sql").resolve())
    outside = [str(tree / "outside" / "secret"),  # outside, and there
               str(root / ".." / "outside" / "secret"),  # `..` out of the root
               str(root / "escape"),  # a symlink in the root to a folder outside it
               str(root / "escape" / "sub"),
               str(tree / "root-sibling"),  # a name that only starts like the root
               str(tree / "outside" / "nothing-here"),  # outside, and not there
               "/", "relative/sql", "~no-such-user-x/sql", "bad\0path"]
    first = _refused(updates, outside[0])
    assert first.status == 400 and first.param == "lora_path"
    allowed = [str(root.resolve())]
    assert first.message == f"lora_path must be a folder under one of allowed_local_lora_paths of model `m`: {allowed}"
    for path in outside:
        err = _refused(updates, path)
        # The same answer whatever the path: nothing tells whether it exists or what it holds.
        assert (err.status, err.message, err.param) == (first.status, first.message, first.param)
        assert "outside" not in err.message and "secret" not in err.message


def test_where_runtime_loading_is_off_both_endpoints_are_404(tree):
    error = _refused(OFF, str(tree / "root" / "sql"))
    body = error.body()["error"]
    assert error.status == 404 and body["type"] == "NotFoundError"
    assert "disabled for model `m`" in body["message"]
    for how in ("allow_runtime_lora_updating: true", f"{RUNTIME_LORA_ENV}=True", "allowed_local_lora_paths"):
        assert how in body["message"]
    on = RuntimeLoRAUpdates.create(True, [str(tree / "root")], enable_lora=True, env={})

    # The ingress's lookup (ModelTable.lora_model) of the model an adapter endpoint acts on.
    def model(name: str, updates: RuntimeLoRAUpdates) -> SimpleNamespace:
        return SimpleNamespace(name=name, lora_updates=updates)

    def adapters(name: str, updates: RuntimeLoRAUpdates) -> AdapterCatalogue:
        lora = SimpleNamespace(enable_lora=True, lora_modules={}, dynamic_lora_loading_path=None, max_lora_rank=16)
        return AdapterCatalogue(SimpleNamespace(model_config=SimpleNamespace(name=name), lora_config=lora), updates)

    off_only = ModelTable([model("a", OFF), model("b", OFF)])
    for name in (None, "a", "unknown"):
        with pytest.raises(OpenAIError) as err:
            off_only.lora_model(name)
        assert err.value.status == 404 and "disabled on this server" in err.value.message
    mixed = ModelTable([model("a", OFF), model("b", on)])
    assert mixed.lora_model(None).name == "b" and mixed.lora_model("b").name == "b"
    with pytest.raises(OpenAIError, match="disabled for model `a`") as err:
        mixed.lora_model("a")
    assert err.value.status == 404

    # The served model's own checks come first: nothing of the path (or the adapters) is looked at.
    with pytest.raises(OpenAIError, match="disabled for model `a`"):
        adapters("a", OFF).unload("sql")
    with pytest.raises(OpenAIError, match="disabled for model `a`"):
        adapters("a", OFF).load("sql", str(tree / "root" / "sql"))
    with pytest.raises(OpenAIError, match="must be a folder under one of allowed_local_lora_paths"):
        adapters("b", on).load("x", str(tree / "root" / "escape"))
