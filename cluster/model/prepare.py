"""`python -m cluster.model.prepare [MODEL ...]`: convert a model's GGUF into the on-disk cache
(cluster/cache.py) now rather than at its first start: its config, its tokenizer and its
dequantized weights, what a served copy and its worker would each convert on first use. MODEL is
a preset name or a path (`resolve_model_path`); the default is the default preset's model.
`make install` runs it, so the first `make serve` starts as fast as the next ones. With
`--quantization gguf` (the engine option of the same name) the weights are left alone: they are
then read from the file's own blocks, never dequantized.

An HF-style folder needs no conversion: it is only checked. A file that cannot be converted
fails with its reason, and nothing half-written is left in the cache (`write_atomically`).
"""
from __future__ import annotations

import argparse
import logging
import time

from cluster.config.model import MODEL_PRESETS, resolve_model_path
from cluster.model.loader import iter_weights, resolved_hf_config
from cluster.tokenizer import load_tokenizer

DEFAULT_MODEL = next(iter(MODEL_PRESETS))


def prepare(model: str, quantization: str | None = None) -> str:
    """Converts `model`'s config, tokenizer and (for a GGUF served without `quantization: gguf`)
    weights into the cache; returns its local path. Each step reads the cache first, so a
    prepared model costs a few reads."""
    path = resolve_model_path(model)
    config = resolved_hf_config(path)
    load_tokenizer(path)
    if path.endswith(".gguf") and quantization != "gguf":
        for _ in iter_weights(path, config):  # the dequantized tensors, written once as safetensors
            pass
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cluster.model.prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", default=[DEFAULT_MODEL], help=f"presets or paths (default {DEFAULT_MODEL})")
    parser.add_argument("--quantization", choices=["gguf"], help="the models are served with quantization: gguf "
                                                                  "(their weights are not converted)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for model in args.models:
        start = time.monotonic()
        try:
            path = prepare(model, args.quantization)
        except ValueError as exc:
            raise SystemExit(f"cluster.model.prepare: {exc}") from None
        print(f"{model}: ready in the cache ({path}, {time.monotonic() - start:.1f} s)")


if __name__ == "__main__":
    main()
