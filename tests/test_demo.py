"""The real demo model (SmolLM2-135M-Instruct GGUF from PyPI): parity with transformers and real answers."""
import pytest
import torch

from localllm.generate import generate
from localllm.runtime import dense_model, load

pytestmark = pytest.mark.slow  # `pytest -m "not gpu and not slow"` skips the download


@pytest.fixture(scope="module")
def ckpt(demo_gguf):
    from localllm.loader import open_checkpoint
    return open_checkpoint(demo_gguf)


def test_demo_logits_match_transformers(ckpt, demo_gguf):
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(str(demo_gguf.parent), gguf_file=demo_gguf.name,
                                               dtype=torch.float32).eval()
    ours = dense_model(ckpt)
    tok = ckpt.tokenizer
    for text in ["The capital of France is", "def fibonacci(n):\n    ", "Water boils at a temperature of"]:
        ids = torch.tensor([tok(text)["input_ids"]])
        with torch.no_grad():
            want, got = ref(ids).logits, ours(ids)
        assert (got - want).abs().max().item() < 1e-3, text
        assert torch.equal(got[0, -1].argmax(), want[0, -1].argmax())


def test_gguf_conversion_reports_to_the_observer(demo_gguf, capfd):
    """transformers' GGUF conversion bar follows our rule: under observe() (the chat app) it reports its progress
    and writes nothing to the terminal."""
    from localllm.loader import open_checkpoint
    from localllm.progress import observe
    seen = []
    with observe(lambda desc, n, total, unit: seen.append((desc, n, total))):
        open_checkpoint(demo_gguf)
    conv = [(n, total) for desc, n, total in seen if "GGUF" in desc]
    assert conv and conv[-1][0] == conv[-1][1] > 100  # every tensor, once done
    assert "GGUF" not in capfd.readouterr().err


def test_quantized_demo_answers(tmp_path_factory, ckpt):
    from localllm.quantize import quantize
    out = quantize("demo", str(tmp_path_factory.mktemp("demo") / "w4"), bits=4, ckpt=ckpt, calib_tokens=1024)
    lm = load(out)
    assert lm.settings.mode == "approx"
    # a tied head gets its own 8-bit weights; the parameter count is still the source's (the head is its embeddings)
    from localllm.runtime import describe
    assert lm.manifest["quant"]["head"]["bits"] == 8 and lm.model.head.quant is not None
    src = dense_model(ckpt)
    assert describe(lm)["parameters"] == sum(p.numel() for p in src.parameters())
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    reply = generate(lm, msgs, max_new_tokens=24, temperature=0, seed=0)
    assert "Paris" in reply, reply
    for kv_bits in (8, 4):  # a quantized KV cache (with the SmoothAttention factors quantize folded in)
        reply = generate(lm, msgs, max_new_tokens=24, temperature=0, seed=0, kv_bits=kv_bits)
        assert "Paris" in reply, (kv_bits, reply)
