"""The embedding reference the tests hold the engine to: transformers' own base model (its last
hidden states, after the final norm), pooled and normalized here, independently of cluster/."""
import torch


def tiny_qwen3(out, tokenizer_src: str) -> str:
    """A 2-layer random-weight qwen3 (q/k norms) with the tokenizer of `tokenizer_src`, saved in `out`."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_src)
    cfg = Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def reference(folder: str, ids: list[list[int]], pooling: str, normalize: bool = True,
              dimensions: int | None = None) -> list[list[float]]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for prompt in ids:
            hidden = model(torch.tensor([prompt])).last_hidden_state[0]
            vec = hidden[-1] if pooling == "LAST" else hidden.mean(0)
            vec = vec[:dimensions] if dimensions else vec
            out.append((torch.nn.functional.normalize(vec, dim=0) if normalize else vec).tolist())
    return out


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))
