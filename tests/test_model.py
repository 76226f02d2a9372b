"""The reference decoder computes what transformers computes, for every supported architecture."""
import pytest
import torch

from conftest import make_checkpoint
from localllm.runtime import load


def _hf(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ["llama", "llama3", "mistral", "qwen2"])
def test_logits_match_transformers(tmp_path, arch):
    path = make_checkpoint(tmp_path / arch, arch)
    ours, ref = load(path).model, _hf(path)
    V = ours.cfg.vocab_size
    for T in (1, 7, 100):
        toks = torch.randint(0, V, (2, T))
        with torch.no_grad():
            want = ref(toks).logits
            got = ours(toks)
        err = (got - want).abs().max().item()
        assert err < 1e-4 * max(1.0, want.abs().max().item()), f"{arch} T={T}: max |dlogit| {err}"


def test_rope_scaling_is_applied(tmp_path):
    """Llama-3 scaling changes the low frequencies: a config without it must give other logits."""
    from localllm.config import ModelConfig, rope_inv_freq
    cfg = load(make_checkpoint(tmp_path / "l3", "llama3")).model.cfg
    plain = ModelConfig(**{**cfg.to_dict(), "rope_scaling": {}})
    a, b = rope_inv_freq(cfg), rope_inv_freq(plain)
    assert torch.equal(a[0], b[0]) and (a[-1] < b[-1] / 4)


def test_kv_cache_decode_matches_full_forward(tiny_ckpt):
    from localllm.model import KVCache
    m = load(tiny_ckpt).model
    toks = torch.randint(0, m.cfg.vocab_size, (1, 24))
    with torch.no_grad():
        full = m(toks)
        cache = KVCache(m.cfg, 32)
        parts = [m(toks[:, :10], 0, cache)]
        parts += [m(toks[:, t:t + 1], t, cache) for t in range(10, 24)]
    inc = torch.cat(parts, dim=1)
    assert (inc - full).abs().max().item() < 1e-4


def test_llama_biases_it_cannot_run_are_refused():
    """Llama's attention_bias (q, k, v and o biases) and mlp_bias are refused in one line, not silently dropped;
    Qwen2's q, k, v biases run."""
    from localllm.config import ModelConfig
    from localllm.errors import LocalLLMError
    base = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)
    for flag in ("attention_bias", "mlp_bias"):
        with pytest.raises(LocalLLMError, match=f"unsupported Llama variant \\({flag} true"):
            ModelConfig.from_hf({**base, "model_type": "llama", flag: True})
    assert ModelConfig.from_hf({**base, "model_type": "qwen2"}).qkv_bias
    assert not ModelConfig.from_hf({**base, "model_type": "llama", "attention_bias": False}).qkv_bias


def test_unsupported_architecture_is_refused(tmp_path):
    import json
    from localllm.errors import LocalLLMError
    path = make_checkpoint(tmp_path / "x")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "gpt2", ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LocalLLMError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load(path)


def test_quantizing_a_quantized_model_names_it(tiny_quant):
    import re
    from localllm.errors import LocalLLMError
    from localllm.loader import open_checkpoint
    with pytest.raises(LocalLLMError, match=f"quantized localllm model; .*`localllm generate {re.escape(str(tiny_quant))} "):
        open_checkpoint(tiny_quant)
