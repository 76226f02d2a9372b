"""Shared fixtures: tiny random-weight checkpoints (fast, never evidence of quality) and the demo model."""
from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest
import torch

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")

# Fresh random weights every run; a failing run prints the seed, and LOCALLLM_TEST_SEED=<seed> draws the same models
# again.
SEED = int(os.environ.get("LOCALLLM_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if exitstatus:
        terminalreporter.write_line(f"the tiny models of this run: LOCALLLM_TEST_SEED={SEED}")


# Small but real-shaped: GQA, K % 32 == 0, an intermediate size that is not a power of two.
TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)


def make_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from importlib import resources
    text = resources.files("localllm").joinpath("data", "calibration.txt").read_text()
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text.split("\n\n"), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|end|>",
                                   additional_special_tokens=specials[3:])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_checkpoint(path: Path, arch: str = "llama", **overrides) -> Path:
    """A random-weight Hugging Face checkpoint folder (safetensors + config + tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    kw = {**TINY, **overrides}
    if arch == "llama3":
        arch = "llama"
        kw["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        kw["rope_theta"] = 500000.0
    cfg = AutoConfig.for_model(arch, **kw)
    torch.manual_seed(SEED + zlib.crc32(repr((arch, sorted(kw.items()))).encode()))
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # larger-than-init weights so layers actually matter
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(str(path))
    make_tokenizer(kw["vocab_size"]).save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_quant(tmp_path_factory, tiny_ckpt) -> Path:
    """The tiny checkpoint quantized to 3 bits with residuals and calibration."""
    from localllm.quantize import quantize
    out = tmp_path_factory.mktemp("q") / "tiny-w3"
    return quantize(str(tiny_ckpt), str(out), bits=3, group_size=64, calib_tokens=1024, seq_len=128)


@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    """The real demo model (downloaded once into the localllm cache)."""
    from localllm.demo import demo_gguf as get
    return get()
