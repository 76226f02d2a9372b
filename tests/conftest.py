"""Shared fixtures: tiny random-weight checkpoints (fast, never evidence of quality) and the demo model."""
from __future__ import annotations

import contextlib
import os
import zlib
from pathlib import Path

import pytest

# Fresh random weights and inputs every run; a failing run prints the seed, and LOCALLLM_TEST_SEED=<seed> draws the
# same models and the same inputs again.
SEED = int(os.environ.get("LOCALLLM_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))


@pytest.fixture(autouse=True)
def _seeded(request):
    """torch's generators (CPU and GPU) seeded per test from the run's seed and the test's id, so that a failure's
    seed repeats its own random draws, not only the tiny models (a test that failed on random inputs once could not be
    repeated)."""
    import torch
    torch.manual_seed(SEED + zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="session", autouse=True)
def _no_config_in_home(tmp_path_factory):
    """matplotlib (the report's figures) keeps its font cache under HOME unless told otherwise."""
    os.environ.setdefault("MPLCONFIGDIR", str(tmp_path_factory.mktemp("matplotlib")))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if exitstatus:
        terminalreporter.write_line(f"the tiny models of this run: LOCALLLM_TEST_SEED={SEED}")


# Small but real-shaped: GQA, K % 32 == 0, an intermediate size that is not a power of two.
TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)


def make_tokenizer(vocab_size: int):
    from localllm.synthetic import tokenizer
    return tokenizer(vocab_size)


def make_checkpoint(path: Path, arch: str = "llama", **overrides) -> Path:
    """A random-weight Hugging Face checkpoint folder (safetensors + config + tokenizer)."""
    from localllm.synthetic import checkpoint
    kw = {**TINY, **overrides}
    if arch == "llama3":
        arch = "llama"
        kw["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        kw["rope_theta"] = 500000.0
    return checkpoint(path, arch, seed=SEED + zlib.crc32(repr((arch, sorted(kw.items()))).encode()), **kw)


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


@contextlib.contextmanager
def same_kv_cache(lm):
    """Put lm's KV cache, and the record of what it holds, back as they were before the block: a reply made with
    generate(reuse_cache=True), as the chat makes them, can then be made again from the same cache (its text depends
    on what the cache held)."""
    dec = lm._decoder
    saved = None if dec is None else ([t.clone() for t in dec.cache.buffers()], dec._prompt, dec._out, dec._at)
    yield
    lm._decoder = dec
    if dec is not None:
        for t, s in zip(dec.cache.buffers(), saved[0]):
            t.copy_(s)
        dec._prompt, dec._out, dec._at = saved[1:]
