"""GPU non-uniform (table) GEMV and dequantize kernels compute what the CPU reference (QuantLUT) computes."""
import pytest
import torch

from localllm.quant import QuantLUT, pack_codes

pytestmark = pytest.mark.gpu

# Llama-3-8B projections (N, K), the demo model's, and a small odd one
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1728, 576), (576, 1536), (48, 192)]


def random_lut(N, K, bits, device="cuda"):
    codes = torch.randint(0, 2**bits, (N, K), device=device)
    lut = (torch.randn(N, 2**bits, device=device) * 0.02).sort(dim=1).values.half()
    return QuantLUT(pack_codes(codes, bits), lut, bits, K)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("N,K", SHAPES)
def test_lut_gemv_matches_float64_reference(bits, N, K):
    from localllm.kernels.gemv_lut import gemv
    q = random_lut(N, K, bits)
    x = torch.randn(K, device="cuda").half()
    x[torch.randint(0, K, (4,))] *= 30  # activation outliers
    out = torch.full((N,), float("nan"), device="cuda", dtype=torch.float16)  # poison: every row must be written
    gemv(x, q, out=out)
    torch.cuda.synchronize()
    ref = q.dequantize(torch.float64) @ x.double()
    assert not out.isnan().any()
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel < 1e-3, f"bits={bits} {N}x{K}: rel err {rel}"


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("N,K", [(6144, 4096), (1728, 576), (48, 192)])
def test_lut_dequant_kernel_equals_reference(bits, N, K):
    from localllm.kernels.gemv_lut import dequantize
    q = random_lut(N, K, bits)
    assert torch.equal(dequantize(q), q.dequantize(torch.float16))


@pytest.mark.parametrize("mode", ["norm", "glu", "residual"])
def test_lut_gemv_input_transforms_and_residual(mode):
    from localllm import ops
    from localllm.kernels.gemv_lut import gemv
    N, K = 1024, 4096
    q = random_lut(N, K, 4)
    if mode == "norm":
        x, nw = torch.randn(K, device="cuda").half(), torch.rand(K, device="cuda") + 0.5
        xin, got = ops.rmsnorm(x.float().cpu(), nw.cpu(), 1e-5).half(), gemv(x, q, norm=(nw, 1e-5))
        ref = q.dequantize(torch.float64).cpu() @ xin.double()
    elif mode == "glu":
        x = torch.randn(2 * K, device="cuda").half()
        xin, got = ops.silu_mul(x.float().cpu()).half(), gemv(x, q, glu=True)
        ref = q.dequantize(torch.float64).cpu() @ xin.double()
    else:
        x, res = torch.randn(K, device="cuda").half(), torch.randn(N, device="cuda").half()
        got = gemv(x, q, residual=res)
        ref = (q.dequantize(torch.float64) @ x.double() + res.double()).cpu()
    assert ((got.double().cpu() - ref).norm() / ref.norm()).item() < 2e-3


@pytest.fixture(scope="module")
def tiny_sq(tiny_ckpt, tmp_path_factory):
    from localllm.quantize import quantize
    return quantize(str(tiny_ckpt), str(tmp_path_factory.mktemp("sq") / "sq3"), bits=3, method="squeezellm",
                    calib_tokens=512, seq_len=128)


def test_squeezellm_model_on_the_gpu_matches_the_cpu(tiny_sq, capsys):
    from localllm.decode import Decoder
    from localllm.errors import LocalLLMError
    from localllm.runtime import load
    cpu = load(tiny_sq, qdec="off")
    gpu = load(tiny_sq, device="cuda")  # qdec "on": not available for tables on the GPU, said once
    assert gpu.settings.mode == "off" and "not available" in gpu.qdec_source
    assert "not available on the GPU" in capsys.readouterr().err
    with pytest.raises(LocalLLMError, match="not available on the GPU"):
        gpu.set_qdec(8)
    toks = torch.randint(0, cpu.model.cfg.vocab_size, (1, 20))
    with torch.no_grad():
        want = cpu.model(toks)
        prompt = gpu.model(toks.cuda()).cpu()  # dequantize kernel + cuBLAS
        dec = Decoder(gpu.model, 32, use_graph=True)  # the LUT GEMV, replayed in a CUDA graph
        # (with a graph, step() returns a view of its output buffer: keep copies)
        steps = [dec.prefill(toks[0, :1].tolist()).clone()] + [dec.step(toks[0, p].cuda(), p).clone()
                                                                for p in range(1, 8)]
        one = torch.stack(steps).float().cpu()
    for got, ref in ((prompt, want), (one[None], want[:, :8])):
        rel = ((got - ref).norm() / ref.norm()).item()
        assert rel < 2e-2, rel
