"""LoRA adapters made with peft on the tiny llama of tests/conftest.py, and the tokens HF
transformers + peft generate with them: the reference tests/test_lora.py and
tests/actors/tiny_apps/test_lora_serve.py hold served adapters to (fixtures `lora_adapters`, `lora_reference`)."""
from __future__ import annotations

from pathlib import Path

import torch

NUM_TOKENS = 8
PROMPTS = [[1, 400, 2300, 77, 9100, 31, 5], [1, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [1, 30000, 42]]
# name -> peft LoraConfig arguments: ranks 4 / 8 / 16, attention-only, everything, MLP-only,
# plain alpha / r scaling and rsLoRA.
ADAPTERS = {
    "sql": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "chat": dict(r=4, lora_alpha=8, use_rslora=True,
                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "mlp": dict(r=16, lora_alpha=8, target_modules=["gate_proj", "down_proj"]),
}


def make_adapters(base_dir: str, root: Path) -> dict[str, str]:
    """Save every adapter of ADAPTERS for the model at `base_dir` under `root`/<name>."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    for i, (name, spec) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + i)
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        # init_lora_weights=False: B random too, so every adapter changes the output.
        model = get_peft_model(base, LoraConfig(init_lora_weights=False, **spec))
        with torch.no_grad():  # a visible change on a tiny random model
            for pname, p in model.named_parameters():
                if "lora_B" in pname:
                    p.mul_(4.0)
        model.save_pretrained(root / name)
    return {name: str(root / name) for name in ADAPTERS}


def greedy(model, prompt: list[int], num_tokens: int = NUM_TOKENS) -> list[int]:
    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        for _ in range(num_tokens):
            token = int(model(ids).logits[0, -1].argmax())
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def reference_tokens(base_dir: str, adapter_dirs: dict[str, str]) -> dict[str | None, list[list[int]]]:
    """Greedy tokens of every prompt under every adapter (None: the base model), by HF + peft."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def base():
        return AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()

    out: dict[str | None, list[list[int]]] = {None: [greedy(base(), p) for p in PROMPTS]}
    for name, path in adapter_dirs.items():
        model = PeftModel.from_pretrained(base(), path).eval()
        out[name] = [greedy(model, p) for p in PROMPTS]
    return out
