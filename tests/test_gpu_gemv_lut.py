"""The GEMV and dequantize kernels on table (non-uniform) weights compute what the CPU reference (QuantLUT) computes,
with and without QDEC."""
import pytest
import torch

from localllm.quant import QuantLUT, pack_codes

pytestmark = pytest.mark.gpu

# Llama-3-8B projections (N, K), the demo model's, and a small odd one
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1728, 576), (576, 1536), (48, 192)]


def random_lut(N, K, bits, device="cuda", grouped=False):
    """Random codes and tables; grouped: tables in the unit [0, 2^bits - 1], random fp16 group scales and offsets."""
    codes = torch.randint(0, 2**bits, (N, K), device=device)
    if not grouped:
        lut = (torch.randn(N, 2**bits, device=device) * 0.02).sort(dim=1).values.half()
        return QuantLUT(pack_codes(codes, bits), lut, bits, K)
    lut = (torch.rand(N, 2**bits, device=device) * (2**bits - 1)).sort(dim=1).values.half()
    G = -(-K // 128)
    scales = (torch.rand(N, G, device=device) * 0.01 / 2**bits).half()
    offsets = (-torch.rand(N, G, device=device) * 0.01).half()
    return QuantLUT(pack_codes(codes, bits), lut, bits, K, scales, offsets, 128)


def on_gpu(q: QuantLUT):
    """The kernels' form (2 / 3 bits: codes and tables rearranged at load time)."""
    from localllm.kernels.gemv import PackedLUT
    return PackedLUT.from_quant(q, "cuda")


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("N,K", SHAPES)
def test_lut_gemv_matches_float64_reference(bits, N, K, grouped):
    from localllm.kernels.gemv import gemv
    q = random_lut(N, K, bits, grouped=grouped)
    x = torch.randn(K, device="cuda").half()
    x[torch.randint(0, K, (4,))] *= 30  # activation outliers
    out = torch.full((N,), float("nan"), device="cuda", dtype=torch.float16)  # poison: every row must be written
    gemv(x, on_gpu(q), out=out)
    torch.cuda.synchronize()
    ref = q.dequantize(torch.float64) @ x.double()
    assert not out.isnan().any()
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel < 1e-3, f"bits={bits} {N}x{K}: rel err {rel}"


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("N,K", [(6144, 4096), (1728, 576), (48, 192)])
def test_lut_dequant_kernel_equals_reference(bits, N, K, grouped):
    from localllm.kernels.gemv import dequantize
    q = random_lut(N, K, bits, grouped=grouped)
    assert torch.equal(dequantize(on_gpu(q)), q.dequantize(torch.float16))


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("mode", ["norm", "glu", "residual"])
def test_lut_gemv_input_transforms_and_residual(mode, bits, grouped):
    from localllm import ops
    from localllm.kernels.gemv import gemv
    N, K = 1024, 4096
    q = random_lut(N, K, bits, grouped=grouped)
    w = on_gpu(q)
    if mode == "norm":
        x, nw = torch.randn(K, device="cuda").half(), torch.rand(K, device="cuda") + 0.5
        xin, got = ops.rmsnorm(x.float().cpu(), nw.cpu(), 1e-5).half(), gemv(x, w, norm=(nw, 1e-5))
        ref = q.dequantize(torch.float64).cpu() @ xin.double()
    elif mode == "glu":
        x = torch.randn(2 * K, device="cuda").half()
        xin, got = ops.silu_mul(x.float().cpu()).half(), gemv(x, w, glu=True)
        ref = q.dequantize(torch.float64).cpu() @ xin.double()
    else:
        x, res = torch.randn(K, device="cuda").half(), torch.randn(N, device="cuda").half()
        got = gemv(x, w, residual=res)
        ref = (q.dequantize(torch.float64) @ x.double() + res.double()).cpu()
    assert ((got.double().cpu() - ref).norm() / ref.norm()).item() < 2e-3


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("bits,k_chunk", [(3, 8), (4, 32), (2, 2)])
def test_lut_gemv_with_qdec_adds_the_selected_residual_rows(bits, k_chunk, grouped):
    from test_gpu_qdec import check_selection, setup
    from localllm.kernels.gemv import gemv
    N, K = 6144, 4096
    q = random_lut(N, K, bits, device="cpu", grouped=grouped)
    _, r, _, x, comp = setup(N, K, 3, k_chunk)  # a residual, x and a QDEC launch for this shape
    w = on_gpu(q)
    out = torch.full((N,), float("nan"), device="cuda", dtype=torch.float16)
    gemv(x.cuda(), w, out=out, comp=comp)
    torch.cuda.synchronize()
    S = check_selection(x, comp, K, k_chunk)
    corr = r.rows(S).double().T @ x.double()[S]
    want = q.dequantize(torch.float64) @ x.double() + corr
    assert not out.isnan().any()
    assert ((out.cpu().double() - want).norm() / want.norm()).item() < 1e-3
    # the correction is there: the output moved from the uncompensated GEMV's by about R_hat[:, S] x[S]
    moved = out.cpu().double() - gemv(x.cuda(), w).cpu().double()
    assert ((moved - corr).norm() / corr.norm()).item() < 0.05


@pytest.fixture(scope="module")
def tiny_sq(tiny_ckpt, tmp_path_factory):
    from localllm.quantize import quantize
    return quantize(str(tiny_ckpt), str(tmp_path_factory.mktemp("sq") / "sq3"), bits=3, method="squeezellm",
                    calib_tokens=512, seq_len=128)


def test_squeezellm_model_on_the_gpu_matches_the_cpu(tiny_sq):
    """A SqueezeLLM model on the GPU: prompts (dequantize kernel + cuBLAS) and graph-replayed decode steps follow the
    CPU's logits; with QDEC on both, the GPU's steps follow the CPU's compensated ones (closer than uncompensated)."""
    from localllm.decode import Decoder
    from localllm.runtime import load
    cpu, gpu = load(tiny_sq, qdec="off"), load(tiny_sq, device="cuda", qdec="off")
    toks = torch.randint(0, cpu.model.cfg.vocab_size, (1, 20))

    def steps(lm):  # one token at a time, teacher-forced (with a graph, step() returns a view: keep copies)
        dec = Decoder(lm.model, 32, use_graph=lm.model.device.type == "cuda")
        with torch.no_grad():
            out = [dec.prefill(toks[0, :1].tolist()).clone()] + [
                dec.step(toks[0, p].to(lm.model.device), p).clone() for p in range(1, 8)]
        return torch.stack(out).float().cpu()

    with torch.no_grad():
        want = cpu.model(toks)
        prompt = gpu.model(toks.cuda()).cpu()
    off = steps(gpu)
    err = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert err(prompt, want) < 2e-2
    assert err(off[None], want[:, :8]) < 2e-2
    k = min(64, cpu.manifest["calibration"]["kmax"])
    for lm in (cpu, gpu):
        lm.set_qdec({"mode": "approx", "k_chunk": k})
    comp_cpu, comp_gpu = steps(cpu), steps(gpu)
    assert err(comp_gpu, comp_cpu) < 0.5 * err(off, comp_cpu), (err(comp_gpu, comp_cpu), err(off, comp_cpu))


@pytest.mark.parametrize("variant", [(8, 3, 1), (8, 2, 1)])
@pytest.mark.parametrize("grouped", [False, True])
def test_lut_gemv_in_the_variant_that_fits_a_smaller_shared_memory(grouped, variant, monkeypatch):
    """Table weights on a GPU short of shared memory (Qwen2.5-7B's down, 4-bit, on an RTX 40): half the warps, the
    same function, with and without QDEC."""
    from test_gpu_gemv import fit_only
    N, K = 4096, 4096
    fit_only(monkeypatch, on_gpu(random_lut(16, K, 4, device="cpu", grouped=grouped)), variant)
    test_lut_gemv_matches_float64_reference(4, N, K, grouped)
    test_lut_gemv_with_qdec_adds_the_selected_residual_rows(4, 32, grouped)
