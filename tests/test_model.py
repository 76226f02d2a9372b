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


def test_dynamic_rope_runs_as_default_within_its_native_context_and_yarn_is_refused(tmp_path):
    from localllm.config import ModelConfig
    from localllm.errors import LocalLLMError
    path = make_checkpoint(tmp_path / "dyn", rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    ours, ref = load(path).model, _hf(path)
    assert ours.cfg.max_position_embeddings == 256 and not ours.cfg.rope_scaling
    toks = torch.randint(0, ours.cfg.vocab_size, (1, 200))
    with torch.no_grad():
        assert (ours(toks) - ref(toks).logits).abs().max() < 1e-4
    # an original_max_position_embeddings below it: transformers still runs the default RoPE up to the whole context
    path = make_checkpoint(tmp_path / "dyn2", rope_scaling={"rope_type": "dynamic", "factor": 4.0,
                                                            "original_max_position_embeddings": 64})
    ours, ref = load(path).model, _hf(path)
    assert ours.cfg.max_position_embeddings == 256 and not ours.cfg.rope_scaling
    with torch.no_grad():
        assert (ours(toks) - ref(toks).logits).abs().max() < 1e-4
    yarn = dict(model_type="qwen2", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=4, max_position_embeddings=131072,
                rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    with pytest.raises(LocalLLMError, match="remove rope_scaling from config.json and set max_position_embeddings "
                                            "to 32768 to run the model at its native context"):
        ModelConfig.from_hf(yarn)


def test_llama3_rope_without_its_native_context_takes_transformers_value(tmp_path):
    import json
    path = make_checkpoint(tmp_path / "l3", "llama3")
    c = json.loads((path / "config.json").read_text())
    for key in ("rope_parameters", "rope_scaling"):
        (c.get(key) or {}).pop("original_max_position_embeddings", None)
    (path / "config.json").write_text(json.dumps(c))
    ours, ref = load(path).model, _hf(path)
    toks = torch.arange(10, 250)[None]
    with torch.no_grad():
        assert (ours(toks) - ref(toks).logits).abs().max() < 1e-4


def test_damaged_head_counts_and_rope_factors_are_one_line_errors():
    from localllm.config import ModelConfig
    from localllm.errors import LocalLLMError
    base = dict(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=4)
    with pytest.raises(LocalLLMError, match=r"num_attention_heads \(4\) is not a multiple of num_key_value_heads \(3\)"):
        ModelConfig.from_hf({**base, "num_key_value_heads": 3})
    with pytest.raises(LocalLLMError, match="num_attention_heads is 0"):
        ModelConfig.from_hf({**base, "num_attention_heads": 0})
    # "factors" is what a GGUF's rope_freqs become: from a config.json only with one factor per rotated pair
    with pytest.raises(LocalLLMError, match="unsupported RoPE scaling 'factors"):
        ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "factors"}})
    ok = ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "factors", "factors": [1.0] * 8}})
    assert ok.rope_scaling["rope_type"] == "factors"


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
    assert ModelConfig.from_hf({**base, "model_type": "qwen2", "num_key_value_heads": 2}).qkv_bias
    assert not ModelConfig.from_hf({**base, "model_type": "llama", "attention_bias": False}).qkv_bias


def test_config_keys_left_out_take_transformers_defaults_and_other_activations_are_refused():
    """A config.json without a key means what transformers makes of it for that architecture; an MLP other than
    SwiGLU (hidden_act) and a Qwen2 that slides its window are not run silently as something else."""
    from localllm.config import ModelConfig
    from localllm.errors import LocalLLMError
    base = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=16)
    llama = ModelConfig.from_hf({**base, "model_type": "llama"})
    assert (llama.rms_norm_eps, llama.max_position_embeddings, llama.num_kv_heads) == (1e-6, 2048, 16)
    qwen2 = ModelConfig.from_hf({**base, "model_type": "qwen2", "num_attention_heads": 64, "hidden_size": 256})
    assert qwen2.num_kv_heads == 32  # Qwen2Config's own default, not one kv head per head
    mistral = ModelConfig.from_hf({**base, "model_type": "mistral"})  # slides at 4096 with 8 kv heads
    assert (mistral.max_position_embeddings, mistral.num_kv_heads) == (4096, 8)
    assert mistral.context.startswith("4096 (its sliding-window attention's window") and llama.context == "2048"
    assert ModelConfig.from_hf({**base, "model_type": "mistral", "sliding_window": None}).max_position_embeddings \
        == 131072
    assert ModelConfig.from_hf({**base, "model_type": "llama", "hidden_act": "swish"}).num_layers == 2
    for act in ("gelu", "gelu_pytorch_tanh"):
        with pytest.raises(LocalLLMError, match=f"unsupported activation '{act}' \\(hidden_act\\)"):
            ModelConfig.from_hf({**base, "model_type": "qwen2", "num_key_value_heads": 4, "hidden_act": act})
    qwen = {**base, "model_type": "qwen2", "num_key_value_heads": 4, "max_position_embeddings": 512,
            "sliding_window": 16}
    assert ModelConfig.from_hf(qwen).max_position_embeddings == 512  # use_sliding_window false: full attention
    slide = {**qwen, "use_sliding_window": True, "max_window_layers": 1}  # layer 1 slides
    assert (ModelConfig.from_hf(slide).max_position_embeddings, ModelConfig.from_hf(slide).sliding_window) == (16, 16)
    full = ModelConfig.from_hf({**slide, "max_window_layers": 2})  # none slides
    assert (full.max_position_embeddings, full.sliding_window, full.context) == (512, 0, "512")
    wide = ModelConfig.from_hf({**slide, "sliding_window": 1024})  # a window past the context changes nothing
    assert (wide.max_position_embeddings, wide.sliding_window) == (512, 0)


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


def _rewrite(folder, drop=(), add=None, name="model.safetensors"):
    """Rewrite folder's weights without `drop`, with `add` (name -> tensor)."""
    from safetensors.torch import load_file, save_file
    t = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    save_file({**{k: v for k, v in t.items() if k not in drop}, **(add or {})}, str(folder / name))
    return t


def test_checkpoint_layouts_of_real_repos(tmp_path):
    """What the hub's folders hold: an index that names the shards (and a stray consolidated copy beside them, as in
    Mistral's repos), eos ids in config.json alone, a damaged generation_config.json, a missing untied head."""
    import json

    from localllm.errors import LocalLLMError
    from localllm.loader import open_checkpoint
    path = make_checkpoint(tmp_path / "a", eos_token_id=[5, 7])
    (path / "generation_config.json").unlink(missing_ok=True)
    want = load(path).model(torch.tensor([[1, 2, 3]]))
    t = _rewrite(path, name="model-00001-of-00001.safetensors")
    index = {"weight_map": {k: "model-00001-of-00001.safetensors" for k in t}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    from safetensors.torch import save_file
    save_file({"tok_embeddings.weight": torch.zeros(4, 4)}, str(path / "consolidated.safetensors"))
    ck = open_checkpoint(path)
    assert [f.name for f in ck.files] == ["model-00001-of-00001.safetensors"]  # not the consolidated copy
    assert {5, 7} <= set(ck.eos_ids)  # config.json's, with no generation_config.json
    assert torch.equal(load(path).model(torch.tensor([[1, 2, 3]])), want)
    (path / "model.safetensors").write_bytes((path / "model-00001-of-00001.safetensors").read_bytes())
    assert [f.name for f in open_checkpoint(path).files] == ["model.safetensors"]  # first, as transformers takes it
    (path / "model.safetensors").unlink()
    (path / "model.safetensors.index.json").unlink()
    assert [f.name for f in open_checkpoint(path).files] == ["model-00001-of-00001.safetensors"]
    # with no index, every file: two holding the same tensor are two models' (an old export beside the new)
    (path / "model-old.safetensors").write_bytes((path / "model-00001-of-00001.safetensors").read_bytes())
    with pytest.raises(LocalLLMError, match="model-00001-of-00001.safetensors and model-old.safetensors in .* both "
                                            "hold .*move the one that is not this model's out"):
        open_checkpoint(path)
    (path / "model-old.safetensors").unlink()
    (path / "generation_config.json").write_text('{"eos_token_id": [5,')
    with pytest.raises(LocalLLMError, match="generation_config.json is not valid JSON"):
        open_checkpoint(path).eos_ids
    (path / "generation_config.json").unlink()
    untied = make_checkpoint(tmp_path / "b", tie_word_embeddings=False)
    _rewrite(untied, drop={"lm_head.weight"})
    with pytest.raises(LocalLLMError, match="lacks tensor 'lm_head.weight'"):
        load(untied)


def test_checkpoints_that_do_not_fit_their_config_are_refused_in_one_line(tmp_path):
    """Weights already quantized by another tool (codes the layers would read as plain numbers), a tensor whose shape
    is not the config's, more layers in the files than the config says, a config transformers refuses."""
    import json
    from localllm.errors import LocalLLMError
    path = make_checkpoint(tmp_path / "a")
    cfg = json.loads((path / "config.json").read_text())
    fp8 = {"quant_method": "compressed-tensors"}
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": fp8}))
    with pytest.raises(LocalLLMError, match="is already quantized \\(compressed-tensors"):
        load(path)
    (path / "config.json").write_text(json.dumps(cfg))
    t = _rewrite(path)
    q = t["model.layers.1.self_attn.q_proj.weight"]
    _rewrite(path, add={"model.layers.1.self_attn.q_proj.weight": q[: q.shape[0] // 2]})
    n, k = q.shape
    with pytest.raises(LocalLLMError, match=f"'model.layers.1.self_attn.q_proj.weight' is \\({n // 2}, {k}\\), "
                                            f"but its config makes it \\({n}, {k}\\)"):
        load(path)
    _rewrite(path, add=t)
    (path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": cfg["num_hidden_layers"] - 1}))
    with pytest.raises(LocalLLMError, match=f"hold {cfg['num_hidden_layers']} decoder layers, its config.json "
                                            f"{cfg['num_hidden_layers'] - 1}"):
        load(path)
    (path / "config.json").write_text(json.dumps({**cfg, "rope_scaling": {"rope_type": "linear"}}))  # no factor
    with pytest.raises(LocalLLMError, match="config.json is not a config transformers accepts"):
        load(path)


def test_damaged_or_foreign_checkpoint_files_are_refused_in_one_line(tmp_path, monkeypatch):
    """A NaN weight, an MLX-quantized config ("quantization"), an index whose weight_map is not names to files, a
    tokenizer.model without SentencePiece installed, and a tokenizer whose ids pass the model's vocabulary."""
    import json

    from localllm import loader
    from localllm.errors import LocalLLMError
    from localllm.evaluate import tokenize
    from localllm.generate import generate
    path = make_checkpoint(tmp_path / "a")
    cfg = json.loads((path / "config.json").read_text())
    t = _rewrite(path)
    w = t["model.layers.1.mlp.down_proj.weight"].clone()
    w[5, 7] = float("nan")
    _rewrite(path, add={"model.layers.1.mlp.down_proj.weight": w})
    with pytest.raises(LocalLLMError, match="tensor 'model.layers.1.mlp.down_proj.weight' holds NaN or inf"):
        load(path)
    _rewrite(path, add=t)
    (path / "config.json").write_text(json.dumps({**cfg, "quantization": {"group_size": 64, "bits": 4}}))
    with pytest.raises(LocalLLMError, match="is already quantized \\(mlx, its config.json's quantization\\)"):
        load(path)
    (path / "config.json").write_text(json.dumps(cfg))
    _rewrite(path, name="model-00001-of-00001.safetensors")
    for wmap in ([], {"a": 5}, None):
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))
        with pytest.raises(LocalLLMError, match="has no weight_map of tensor names to file names"):
            load(path)
    (path / "model.safetensors.index.json").unlink()
    lm = load(path)
    tok = lm.tokenizer
    tok.add_special_tokens({"pad_token": "<pad-past-the-vocabulary>"})  # added without resizing the embeddings
    assert len(tok) > lm.model.cfg.vocab_size
    for f in (lambda: generate(lm, "Say <pad-past-the-vocabulary> please", max_new_tokens=2),
              lambda: tokenize(lm, "a <pad-past-the-vocabulary> b")):
        with pytest.raises(LocalLLMError, match=f"token id {len(tok) - 1}, past the model's vocabulary of "
                                                f"{lm.model.cfg.vocab_size}"):
            f()
    (path / "tokenizer.json").rename(path / "tokenizer.model")
    monkeypatch.setattr(loader, "_sentencepiece", lambda: False)
    with pytest.raises(LocalLLMError, match="tokenizer.model \\(SentencePiece\\) alone.*pip install sentencepiece"):
        load(path)


def test_a_tied_config_with_its_own_head_uses_the_head(tmp_path, capfd):
    """As transformers does: a config that says tied, with a lm_head.weight that differs from the embeddings."""
    from transformers import AutoModelForCausalLM
    path = make_checkpoint(tmp_path / "t", tie_word_embeddings=True)
    embed = _rewrite(path)["model.embed_tokens.weight"]
    _rewrite(path, add={"lm_head.weight": torch.randn_like(embed)})
    ids = torch.tensor([[1, 2, 3, 4]])
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        assert (load(path).model(ids) - ref(ids).logits).abs().max() < 1e-4
    assert "differs from them: using lm_head.weight" in capfd.readouterr().err


def test_a_template_that_takes_no_system_message_gets_it_in_the_first_user_message(tiny_quant, capfd):
    from types import SimpleNamespace

    from localllm.errors import LocalLLMError
    from localllm.generate import encode_prompt
    tok = load(tiny_quant).tokenizer
    tok.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('Conversation roles must "
                         "alternate user/assistant/user/assistant/...') }}{% endif %}"
                         "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    lm = SimpleNamespace(tokenizer=tok, path="m", model=SimpleNamespace(cfg=SimpleNamespace(vocab_size=len(tok))))
    plain = [{"role": "user", "content": "hi"}]
    assert encode_prompt(lm, plain)
    folded = encode_prompt(lm, [{"role": "system", "content": "Be brief."}] + plain)  # as chat apps do
    assert folded == encode_prompt(lm, [{"role": "user", "content": "Be brief.\n\nhi"}])
    assert "takes no system message" in capfd.readouterr().err
    encode_prompt(lm, [{"role": "system", "content": "Be brief."}] + plain)
    assert capfd.readouterr().err == ""  # said once
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(LocalLLMError, match=r"the model's chat template refused these messages \(roles must"):
        encode_prompt(lm, plain)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }"  # a template file cut short: the file's fault
    with pytest.raises(LocalLLMError, match=r"^the chat template of m is not a valid template \(.*line 1\); fix it"):
        encode_prompt(lm, plain)
