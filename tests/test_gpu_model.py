"""The GPU decode path computes what the CPU reference computes, eagerly and as a replayed CUDA graph."""
import pytest
import torch

from localllm.decode import Decoder
from localllm.runtime import load

pytestmark = pytest.mark.gpu


def test_gpu_logits_match_cpu(tiny_quant):
    cpu, gpu = load(tiny_quant, qdec="off"), load(tiny_quant, device="cuda")
    toks = torch.randint(0, cpu.model.cfg.vocab_size, (1, 24))
    with torch.no_grad():
        want = cpu.model(toks)
        prompt = gpu.model(toks.cuda()).cpu()  # several tokens: dequantize + cuBLAS
        one = torch.cat([gpu.model(toks[:, :t + 1].cuda())[:, -1:] for t in range(4)], 1).cpu()  # GEMV kernel
    for got, ref in ((prompt, want), (one, want[:, :4])):
        rel = ((got - ref).norm() / ref.norm()).item()
        assert rel < 2e-2, rel


def test_graph_replay_equals_eager(tiny_quant):
    lm = load(tiny_quant, device="cuda")
    ids = torch.randint(0, lm.model.cfg.vocab_size, (12,)).tolist()
    eager, graph = Decoder(lm.model, 40, use_graph=False), Decoder(lm.model, 40, use_graph=True)
    with torch.no_grad():
        a, b = eager.prefill(ids), graph.prefill(ids)
        for pos in range(12, 30):
            tok = a.argmax()
            a, b = eager.step(tok, pos), graph.step(tok, pos)
            assert torch.allclose(a, b, atol=2e-2, rtol=1e-2), pos


@pytest.mark.parametrize("rows,D", [(1, 4096), (7, 576), (3, 5120)])
def test_fused_kernels_match_torch_reference(rows, D):
    from localllm import ops
    from localllm.kernels import fused
    x = torch.randn(rows, D, device="cuda").half()
    w = torch.rand(D, device="cuda") + 0.5
    ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5) * w).half()
    assert torch.allclose(fused.rmsnorm(x, w, 1e-5).float(), ref.float(), rtol=2e-3, atol=2e-3)
    gu = torch.randn(rows, 2 * D, device="cuda").half()
    ref = (torch.nn.functional.silu(gu[:, :D].float()) * gu[:, D:].float()).half()
    assert torch.allclose(fused.silu_mul(gu).float(), ref.float(), rtol=2e-3, atol=2e-3)
    heads, hd = 6, 128
    qkv = torch.randn(rows, heads * hd + 256, device="cuda").half()
    ang = torch.rand(rows, hd // 2, device="cuda") * 6
    want = qkv.clone().cpu().float()
    ops.rope_(want, ang.cos().cpu(), ang.sin().cpu(), heads, hd)  # the torch reference, on the CPU
    fused.rope_(qkv, ang.cos(), ang.sin(), heads, hd)
    assert torch.allclose(qkv.float().cpu(), want, rtol=2e-3, atol=2e-3)


def test_too_big_for_the_gpu_is_refused_with_sizes(tiny_quant, monkeypatch):
    from localllm.errors import LocalLLMError
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (1 << 20, 80 << 30))
    with pytest.raises(LocalLLMError, match=r"needs .* GiB of GPU memory .* but 0.0 GiB is free"):
        load(tiny_quant, device="cuda")
