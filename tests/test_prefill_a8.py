"""Prompts with 8-bit activations (--prefill-int8): the per-token rounding (ops.quantize_tokens), its place in the
model (prompts of quantized layers only), and on the GPU the int8 GEMM (kernels/prefill_a8.cu) against float64."""
import pytest
import torch

from localllm import ops
from localllm.runtime import load


def test_quantize_tokens_rounds_each_row_to_127_steps():
    x = torch.randn(6, 300) * torch.rand(6, 1) * 10
    x[2] = 0.0
    q = ops.quantize_tokens(x)
    s = x.abs().amax(-1, keepdim=True) / 127
    s[2] = 1.0
    k = q / s
    assert torch.allclose(k, k.round(), atol=1e-3) and k.abs().max() <= 127 + 1e-3  # integer multiples of s
    assert ((q - x).abs() <= s / 2 + 1e-6).all()  # the nearest of them
    assert torch.equal(q[2], x[2])  # an all-zero row stays zero
    assert torch.allclose(q.abs().amax(-1), x.abs().amax(-1))  # the largest value is kept


def test_prompts_of_quantized_layers_change_single_tokens_do_not(tiny_quant):
    plain, a8 = load(tiny_quant, qdec="off"), load(tiny_quant, qdec="off", prefill_int8=True)
    toks = torch.randint(0, plain.model.cfg.vocab_size, (1, 12))
    with torch.no_grad():
        p, q = plain.model(toks), a8.model(toks)
        one_p, one_q = plain.model(toks[:, :1]), a8.model(toks[:, :1])
    rel = ((p - q).norm() / p.norm()).item()
    assert 0 < rel < 0.05, rel  # rounding x to 8 bits moves the logits a little
    assert torch.equal(one_p, one_q)  # decoding (one token) keeps fp activations


def test_eval_refuses_prefill_int8_on_the_gpu(tiny_quant, capsys, monkeypatch):
    """(A GPU faked: the refusal comes before anything would run on it.)"""
    from localllm import devices
    from localllm.cli import main
    monkeypatch.setattr(devices, "resolve_device", lambda *a, **k: torch.device("cuda"))
    assert main(["eval", str(tiny_quant), "--prefill-int8", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "eval measures --prefill-int8 on the CPU only: add --device cpu" in err


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("N,K,gs,T", [(6144, 4096, 128, 200), (4096, 14336, 128, 65), (1536, 576, 128, 7),
                                      (576, 1536, 64, 1), (1024, 1024, 256, 130)])
def test_int8_gemm_matches_float64_reference(bits, N, K, gs, T):
    from localllm.kernels import prefill_a8
    from localllm.kernels.gemv import Packed
    from test_gpu_gemv import random_quant
    q = random_quant(N, K, bits, gs, device="cpu")
    x = torch.randn(T, K) * (torch.rand(T, 1) + 0.1)
    x[:, torch.randint(0, K, (4,))] *= 20  # outlier channels
    x = x.half()
    got = prefill_a8.linear(x.cuda(), Packed.from_quant(q, "cuda")).cpu().double()
    want = ops.quantize_tokens(x.float()).double() @ q.dequantize(torch.float64).T
    assert not got.isnan().any()
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 2e-3, f"{N}x{K} W{bits} g{gs} T={T}: rel err {rel}"


@pytest.mark.gpu
def test_gpu_prompts_take_the_int8_gemm(tiny_quant, monkeypatch):
    """With prefill_int8 every quantized layer of a GPU prompt goes through the int8 GEMM (checked against float64
    above), single tokens do not, and the logits stay near the CPU's (a random model: fp16 rounding alone moves them
    by about as much as the 8-bit activations do, so near is all this can check)."""
    from localllm.kernels import prefill_a8
    cpu = load(tiny_quant, qdec="off", prefill_int8=True)
    gpu = load(tiny_quant, qdec="off", prefill_int8=True, device="cuda")
    calls = []
    real = prefill_a8.linear
    monkeypatch.setattr(prefill_a8, "linear", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    toks = torch.randint(0, cpu.model.cfg.vocab_size, (1, 40))
    with torch.no_grad():
        want, got = cpu.model(toks), gpu.model(toks.cuda()).float().cpu()
        n = len(calls)
        gpu.model(toks[:, :1].cuda())
    assert n == 4 * cpu.model.cfg.num_layers and set(calls) == {40} and len(calls) == n
    assert ((got - want).norm() / want.norm()).item() < 5e-2
