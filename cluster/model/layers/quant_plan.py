"""Which weights a model serves quantized, and in which format: `quant_plan` from the
`quantization` option (None, "int8", "gguf") and the checkpoint; for a GGUF, tensor by tensor
(`gguf_plan`). The formats and the weights themselves: quantization.py."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from cluster.model.gguf_file import tensor_types
from cluster.model.layers.quantization import GGUF_SERVED, ROW_READ_TYPES

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("int8", "gguf")
_GGUF_LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@dataclass(frozen=True)
class QuantPlan:
    """Which weights a model serves quantized, and in which format (None: floats), learned once
    from the options and the checkpoint (ModelConfig.quant_plan)."""

    layers: str | None  # the decoder's linear layers: their format ("+"-joined when a GGUF mixes several)
    head: str | None  # the LM head
    # A GGUF's tensors served in their own blocks, read straight from the file: (GGUF name, format)
    gguf_tensors: tuple[tuple[str, str], ...] = field(default=(), repr=False)


def quant_plan(quantization: str | None, path: str, device: str) -> QuantPlan | None:
    """The plan for `quantization` (None, "int8", "gguf") and the model at `path`. "gguf" serves
    each linear layer's and the head's tensor whose GGUF type is in GGUF_SERVED in its blocks and
    dequantizes the rest to the model's dtype (their types said once in the log). Without it a
    GGUF loads dequantized, as any checkpoint loads in its dtype: in-register dequantization wins
    at a few rows a step and loses from about a dozen (docs/quantization.md), so it is the
    operator's choice. Quantization runs on CPU only (its kernels are CPU kernels). Raises
    ValueError naming the option."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or null, got {quantization!r}")
    if quantization is None:
        return None
    if quantization == "gguf" and not path.endswith(".gguf"):
        raise ValueError(f"quantization='gguf' needs a .gguf model file, got {path!r}")
    if device != "cpu":
        raise ValueError(f"quantization={quantization!r} runs on CPU only (its kernels are CPU kernels); "
                         f"the device is {device!r}")
    if quantization == "int8":
        return QuantPlan(layers="int8", head="int8")
    return gguf_plan(path)


def gguf_plan(path: str) -> QuantPlan | None:
    """`quantization: gguf`'s plan for the file at `path`, tensor by tensor (None: nothing served
    in blocks): the linear layers and the head of a type in GGUF_SERVED, and an untied embedding
    in k-quants (its rows read from its blocks; a tied one reads the head's)."""
    types = tensor_types(path)
    head = "output.weight" if "output.weight" in types else "token_embd.weight"
    linears = {name: kind for name, kind in types.items() if _is_gguf_linear(name)}
    served = {name: GGUF_SERVED[kind] for name, kind in {**linears, head: types.get(head)}.items() if kind in GGUF_SERVED}
    if head == "output.weight" and types.get("token_embd.weight") in ROW_READ_TYPES:  # rows read from its blocks
        served["token_embd.weight"] = GGUF_SERVED[types["token_embd.weight"]]
    unserved = sorted({kind for name, kind in linears.items() if name not in served})
    if unserved:
        logger.info("%s: layer weights of type %s are served dequantized (GGUF types served in their blocks: %s)",
                    Path(path).name, "/".join(unserved), ", ".join(GGUF_SERVED))
    layers = "+".join(sorted({served[name] for name in linears if name in served})) or None
    plan = QuantPlan(layers=layers, head=served.get(head), gguf_tensors=tuple(sorted(served.items())))
    return plan if plan.gguf_tensors else None


def _is_gguf_linear(name: str) -> bool:
    parts = name.split(".")
    return len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LINEARS and parts[3] == "weight"
