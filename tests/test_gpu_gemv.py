"""GPU low-bit GEMV kernels compute the same function as the CPU reference (dequantize, then matmul)."""
import pytest
import torch

from localllm.quant import QuantWeight, pack_codes

pytestmark = pytest.mark.gpu

# Llama-3-8B projections (N, K): fused qkv, o, fused gate+up, down; plus the demo model's and odd sizes.
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1728, 576), (576, 1536), (48, 192)]


def random_quant(N, K, bits, gs, device="cuda"):
    G = -(-K // gs)
    codes = torch.randint(0, 2**bits, (N, K), device=device)
    return QuantWeight(pack_codes(codes, bits), (torch.rand(N, G, device=device) * 0.02 + 1e-3).half(),
                       torch.randint(0, 2**bits, (N, G), device=device, dtype=torch.uint8), bits, gs, K)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("gs", [128, 64])
def test_gemv_matches_float64_reference(bits, N, K, gs):
    from localllm.kernels.gemv import Packed, gemv
    q = random_quant(N, K, bits, gs)
    x = torch.randn(K, device="cuda").half()
    x[torch.randint(0, K, (4,))] *= 30  # activation outliers
    out = torch.full((N,), float("nan"), device="cuda", dtype=torch.float16)  # poison: every row must be written
    gemv(x, Packed.from_quant(q), out=out)
    torch.cuda.synchronize()
    ref = q.dequantize(torch.float64) @ x.double()
    assert not out.isnan().any()
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel < 1e-3, f"bits={bits} {N}x{K} g{gs}: rel err {rel}"


@pytest.mark.parametrize("gs", [256, 512])
@pytest.mark.parametrize("N,K", [(1728, 576), (576, 1536), (4096, 14336)])
def test_gemv_large_groups(N, K, gs):
    """A pair of steps takes one record (group size >= 128); the last group may be partial (K = 576)."""
    test_gemv_matches_float64_reference(3, N, K, gs)


@pytest.mark.parametrize("N,K", [(4096, 4096), (1728, 576), (4096, 14336)])
def test_gemv_sweep_variants(N, K):
    """Every variant that fits the shape (`bench gemv-sweep` times them all) computes the same function, at one
    block per SM and at two."""
    from localllm.kernels.gemv import VARIANTS, Packed, fits, gemv
    q = random_quant(N, K, 3, 128)
    x = torch.randn(K, device="cuda").half()
    ref = q.dequantize(torch.float64) @ x.double()
    for v, b in [(v, b) for v in VARIANTS if fits(v, K, 128) for b in (1, 2)]:
        got = gemv(x, Packed.from_quant(q), variant=v, blocks_per_sm=b)
        assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-3, v


@pytest.mark.parametrize("bits", [3, 4])
def test_gemv_gives_the_same_bits_on_any_grid(bits):
    """Each tile is summed by one block in a fixed order, so the grid (one block per SM, or two: what decode runs
    gate_up's shape at, TWO_BLOCK_TILES) changes no bit of y."""
    from localllm.kernels.gemv import Packed, gemv
    N, K = 28672, 4096
    w = Packed.from_quant(random_quant(N, K, bits, 128))
    x = torch.randn(K, device="cuda").half()
    want = gemv(x, w, blocks_per_sm=1)
    for blocks_per_sm in (None, 2):
        assert torch.equal(gemv(x, w, blocks_per_sm=blocks_per_sm), want), blocks_per_sm


@pytest.mark.parametrize("mode", ["plain", "norm", "glu"])
@pytest.mark.parametrize("K", [4096, 14336, 576])
def test_gemv_gives_the_same_bits_whether_x_or_the_weights_load_first(mode, K):
    """A GEMV whose launch the one before it held stages x before it requests its first weights, else the weights
    go first: the order of the loads changes no bit of y, and y is right."""
    from localllm import ops
    from localllm.kernels.gemv import Packed, gemv
    N = 1024
    q = random_quant(N, K, 3, 128)
    w = Packed.from_quant(q)
    x, nw = torch.randn(2 * K if mode == "glu" else K, device="cuda").half() * 3, torch.rand(K, device="cuda") + 0.5
    kw = {"norm": (nw, 1e-5)} if mode == "norm" else {"glu": True} if mode == "glu" else {}
    got = {held: gemv(x, w, held=held, **kw) for held in (False, True)}
    assert torch.equal(got[True], got[False])
    xin = ops.rmsnorm(x.float(), nw, 1e-5) if mode == "norm" else ops.silu_mul(x.float()) if mode == "glu" else x
    ref = q.dequantize(torch.float64) @ xin.half().double()
    assert ((got[True].double() - ref).norm() / ref.norm()).item() < 1e-3


@pytest.mark.parametrize("mode", ["plain", "norm", "glu"])
@pytest.mark.parametrize("N,K", [(28672, 4096), (4096, 14336), (1728, 576), (48, 192)])
@pytest.mark.parametrize("bits", [4, 3])
def test_gemv_on_the_int8_path_matches_float64_reference(N, K, mode, bits, monkeypatch):
    """4- and 3-bit weights on the int8 tensor cores (uses_int8: decode takes it for the 8B qkv, o and gate_up)
    compute the same function as the fp16 path: forced on every shape (two pairs a slot, one, a last single step),
    with the input transforms, x with outliers and tiny values, and the residual. Where its planes do not fit the
    GPU's shared memory (K = 14336 at 4 bits in 99 KB) the fp16 kernel runs instead."""
    from localllm import ops
    from localllm.kernels import cuda
    import localllm.kernels.gemv as kg
    monkeypatch.setattr(kg, "uses_int8", lambda w, qdec, dev: w.group_size == 128 and not qdec)
    q = random_quant(N, K, bits, 128)
    x, nw = torch.randn(2 * K if mode == "glu" else K, device="cuda").half() * 3, torch.rand(K, device="cuda") + 0.5
    x[torch.randint(0, K, (4,))] *= 30
    x[torch.randint(0, K, (64,))] *= 1e-4
    res = torch.randn(N, device="cuda").half()
    kw = {"norm": (nw, 1e-5)} if mode == "norm" else {"glu": True} if mode == "glu" else {}
    w = kg.Packed.from_quant(q)
    from test_gpu_qdec import kernels_asked
    asked = kernels_asked(monkeypatch)
    got = kg.gemv(x, w, residual=res, **kw)
    limit = cuda.shared_limit(torch.cuda.current_device())
    fits = kg.int8_fits(w, kg.decode_variant(w, limit), limit)
    assert (K, bits) != (4096, 4) or fits  # the 8B's gate_up runs it on every GPU
    # the int8 kernel ran where it fits
    assert asked and all(e.endswith(f",{str(fits).lower()}>") for e in asked if e.startswith("gemv<")), asked
    xin = ops.rmsnorm(x.float(), nw, 1e-5) if mode == "norm" else ops.silu_mul(x.float()) if mode == "glu" else x
    ref = q.dequantize(torch.float64) @ xin.half().double() + res.double()
    err = ((got.double() - ref).norm() / ref.norm()).item()
    monkeypatch.setattr(kg, "uses_int8", lambda w, qdec, dev: False)
    fp16 = kg.gemv(x, w, residual=res, **kw)
    assert err < 1e-3 and err <= 1.2 * ((fp16.double() - ref).norm() / ref.norm()).item(), err  # as close as fp16's


def test_decode_takes_the_int8_path_where_it_pays():
    """The 8B shapes at 4 and 3 bits, group 128: qkv, o and gate_up (K = 4096, ~2 tiles per SM or more) on the int8
    path, with QDEC gate_up only; down (K = 14336), group 64 and the demo model's small layers on the fp16 one (on a
    GPU of the H100's 132 SMs)."""
    from localllm.kernels import cuda
    from localllm.kernels.gemv import Packed, uses_int8
    if not 100 <= cuda.sm_count(0) <= 200:
        pytest.skip("the pick depends on the SM count; this checks it on an H100/H200-sized GPU")
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (960, 576), (3072, 576)]
    pick = {(N, K, b, gs): uses_int8(Packed.from_quant(random_quant(N, K, b, gs)), False, 0)
            for N, K in shapes for b in (3, 4) for gs in (64, 128)}
    assert [k for k, v in pick.items() if v] == [(N, K, b, 128) for N, K in shapes[:3] for b in (3, 4)]
    pick = {(N, K, b): uses_int8(Packed.from_quant(random_quant(N, K, b, 128)), True, 0)
            for N, K in shapes for b in (3, 4)}
    assert [k for k, v in pick.items() if v] == [(28672, 4096, 3), (28672, 4096, 4)]


def test_gemv_adds_residual_in_epilogue():
    from localllm.kernels.gemv import Packed, gemv
    q = random_quant(4096, 4096, 4, 128)
    x, res = torch.randn(4096, device="cuda").half(), torch.randn(4096, device="cuda").half()
    ref = q.dequantize(torch.float64) @ x.double() + res.double()
    got = gemv(x, Packed.from_quant(q), residual=res)
    assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-3


@pytest.mark.parametrize("N,K", [(128256, 4096), (151936, 1536), (49152, 576), (48, 192)])
def test_head_gemv_8bit(N, K):
    """The 8-bit output head (quant.HEAD_BITS; Llama-3-8B's, Qwen2.5-1.5B's, the demo model's vocabulary), with the
    final RMSNorm fused into its staging as decode runs it."""
    from localllm import ops
    from localllm.kernels.gemv import Packed, gemv
    q = random_quant(N, K, 8, 128)
    x, w = torch.randn(K, device="cuda").half() * 3, torch.rand(K, device="cuda") + 0.5
    out = torch.full((N,), float("nan"), device="cuda", dtype=torch.float16)
    gemv(x, Packed.from_quant(q), out=out, norm=(w, 1e-5))
    ref = q.dequantize(torch.float64) @ ops.rmsnorm(x.float(), w, 1e-5).half().double()
    assert not out.isnan().any()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-3


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("N,K,gs", [(6144, 4096, 128), (1728, 576, 128), (48, 192, 64)])
def test_dequant_kernel_equals_reference(bits, N, K, gs):
    from localllm.kernels.gemv import Packed, dequantize
    q = random_quant(N, K, bits, gs)
    assert torch.equal(dequantize(Packed.from_quant(q)), q.dequantize(torch.float16))


@pytest.mark.parametrize("mode", ["norm", "glu"])
@pytest.mark.parametrize("K", [4096, 14336, 576])  # one round of the staging's loads, 3.5 rounds, a partial one
def test_gemv_applies_the_input_transform_while_staging(mode, K):
    from localllm import ops
    from localllm.kernels.gemv import Packed, gemv
    N = 1024
    q = random_quant(N, K, 4, 128)
    if mode == "norm":
        x, w = torch.randn(K, device="cuda").half() * 3, torch.rand(K, device="cuda") + 0.5
        xin = ops.rmsnorm(x.cpu().float(), w.cpu(), 1e-5).half()  # the torch reference, on the CPU
        got = gemv(x, Packed.from_quant(q), norm=(w, 1e-5))
    else:
        x = torch.randn(2 * K, device="cuda").half() * 3
        xin = ops.silu_mul(x.cpu().float()).half()
        got = gemv(x, Packed.from_quant(q), glu=True)
    ref = q.dequantize(torch.float64).cpu() @ xin.double()
    assert ((got.cpu().double() - ref).norm() / ref.norm()).item() < 1e-3


def fit_only(monkeypatch, w, variant):
    """Make this GPU report just enough shared memory per block for `variant` on w's shape (an RTX 30/40's 99 KB
    falls short of decode's first choice on a 32B model's down), so decode_variant picks it; returns the limit."""
    from localllm.kernels import cuda
    from localllm.kernels.gemv import decode_variant, shared_bytes, static_shared_bytes
    limit = shared_bytes(w, *variant) + static_shared_bytes(variant[0], 99 * 1024)  # (a limit that small)
    monkeypatch.setattr(cuda, "shared_limit", lambda device: limit)
    assert decode_variant(w, limit) == variant
    return limit


@pytest.mark.parametrize("variant", [(16, 2, 1), (8, 3, 1), (8, 2, 1)])
@pytest.mark.parametrize("bits", [3, 4])
def test_gemv_in_the_variant_that_fits_a_smaller_shared_memory(bits, variant, monkeypatch):
    """gemv's default on a GPU short of shared memory: the smaller variant, the same function, norm fused."""
    from localllm import ops
    from localllm.kernels.gemv import Packed, gemv
    N, K = 1024, 14336
    q = random_quant(N, K, bits, 128)
    w = Packed.from_quant(q)
    fit_only(monkeypatch, w, variant)
    x, nw = torch.randn(K, device="cuda").half() * 3, torch.rand(K, device="cuda") + 0.5
    ref = q.dequantize(torch.float64)
    for norm in (None, (nw, 1e-5)):
        xin = x.double() if norm is None else ops.rmsnorm(x.float(), nw, 1e-5).half().double()
        got = gemv(x, w, norm=norm).double()
        want = ref @ xin
        assert ((got - want).norm() / want.norm()).item() < 1e-3, (variant, norm)


@pytest.mark.parametrize("mode", ["plain", "glu"])
def test_gemv_built_for_a_gpu_with_99_kb_equals_the_one_built_for_this_one(mode, monkeypatch):
    """LOCALLLM_SHARED_LIMIT=101376 makes the kernels choose and compile as an RTX 40's 99 KB allows (the second
    pass of scripts/gpu_check.sh runs every GPU test so): the partial sums of one tile a barrier instead of four (a
    quarter of the static shared memory), on shapes whose blocks take several tiles; the same bits as the kernel
    built for this GPU where both run the same variant."""
    from localllm.kernels import cuda
    from localllm.kernels.gemv import Packed, gemv, tiles_per_barrier
    dev = torch.cuda.current_device()
    if cuda.shared_limit(dev) < 200 * 1024:
        pytest.skip("this GPU already has less than 200 KB of shared memory a block")
    cases = []
    for N, K, bits in [(28672, 4096, 3), (4096, 14336, 4), (6144, 4096, 4), (1728, 576, 3)]:
        w = Packed.from_quant(random_quant(N, K, bits, 128))
        x = torch.randn(2 * K if mode == "glu" else K, device="cuda").half()
        cases.append((w, x, gemv(x, w, glu=mode == "glu", variant=(8, 3, 1))))
    k4 = cuda.kernel("gemv", "gemv<3,8,3,1,0,false,1,false>")
    try:
        monkeypatch.setenv("LOCALLLM_SHARED_LIMIT", "101376")
        cuda.forget()
        assert cuda.shared_limit(dev) == 101376 and "-DSHARED_LIMIT=101376" in cuda.options(dev)
        assert tiles_per_barrier(cuda.shared_limit(dev)) == 1
        k1 = cuda.kernel("gemv", "gemv<3,8,3,1,0,false,1,false>")
        # red[2][NB][8 warps][16] floats: 1 KB a tile a barrier
        assert k4.shared_size_bytes - k1.shared_size_bytes == 3 * 1024
        for w, x, want in cases:
            got = gemv(x, w, glu=mode == "glu", variant=(8, 3, 1))
            assert torch.equal(got, want), (w.out_features, w.in_features, w.bits)
    finally:
        monkeypatch.delenv("LOCALLLM_SHARED_LIMIT")
        cuda.forget()
