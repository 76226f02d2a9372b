import numpy as np
import pytest
import torch

from localllm.qdec import (
    CHUNK,
    ActStats,
    boundary_order,
    bucket_index,
    chunk_bounds,
    compensate,
    k_for_chunk,
    k_total,
    select_approx,
    select_exact,
    select_random,
    select_static,
)
from localllm.quant import quantize_residual


@pytest.fixture
def seed() -> int:
    """Fresh random inputs every run; the seed goes into assertion messages to reproduce a failure."""
    return torch.seed()


def gen(s: int) -> torch.Generator:
    return torch.Generator().manual_seed(s)


def activations(t: int, k: int) -> torch.Tensor:
    """Gaussian activations with a few persistent outlier channels, like LLM layer inputs."""
    x = torch.randn(t, k)
    x[:, torch.randperm(k)[: k // 64]] *= 8
    return x


def test_chunks_and_k():
    assert chunk_bounds(4096) == [(0, 1024), (1024, 2048), (2048, 3072), (3072, 4096)]
    assert chunk_bounds(576) == [(0, 576)]
    assert chunk_bounds(1536) == [(0, 1024), (1024, 1536)]
    assert k_for_chunk(32, CHUNK) == 32
    assert k_for_chunk(32, 512) == 16
    assert k_for_chunk(33, 512) == 17  # rounded up
    assert k_for_chunk(1, 96) == 1
    assert k_for_chunk(2000, 512) == 512  # capped by the chunk
    assert k_for_chunk(0, 512) == 0
    assert k_total(32, 4096) == 128
    assert k_total(32, 1536) == 48
    assert k_total(100, 14336) == 1400
    with pytest.raises(ValueError):
        k_for_chunk(-1, 1024)


def naive_bucket(a: float, b0: float, b15: float) -> int:
    """Scalar float32 (numpy) evaluation of the documented formula."""
    f = np.float32
    a, b0, b15 = f(a), f(b0), f(b15)
    inv_hi = f(1) / max(f((b0 - b15) / f(15)), f(1e-12))
    inv_lo = f(1) / max(f(b15 / f(16)), f(1e-12))
    if a > b0:
        return 0
    if a >= b15:
        return 1 + int(min(max(np.floor(f((b0 - a) * inv_hi)), 0), 14))
    return 16 + int(min(max(np.floor(f((b15 - a) * inv_lo)), 0), 15))


def boundary_bucket(a: float, b0: float, b15: float) -> int:
    """Bucket from the paper's boundary list b0 > b1 > ... > b30 (b15 the k-th largest value): the number of
    boundaries a lies below (at or below b0 .. b14, below b15, at or below b16 .. b30)."""
    d_hi, d_lo = (b0 - b15) / 15, b15 / 16
    upper = [b0 - i * d_hi for i in range(15)]
    lower = [b15 - i * d_lo for i in range(1, 16)]
    return sum(a <= b for b in upper) + (a < b15) + sum(a <= b for b in lower)


def test_bucket_index_matches_naive(seed):
    b0, b15 = 7.3, 2.1
    d_hi, d_lo = (b0 - b15) / 15, b15 / 16
    edges = [b0 - i * d_hi for i in range(16)] + [b15 - i * d_lo for i in range(17)]
    a = torch.cat([torch.rand(2000) * 9, torch.tensor(edges, dtype=torch.float32), torch.tensor([0.0, 1e-30, 100.0])])
    got = bucket_index(a, b0, b15)
    assert got.dtype == torch.uint8 and got.shape == a.shape
    want = [naive_bucket(v, b0, b15) for v in a.tolist()]
    assert got.tolist() == want, f"seed={seed}"
    # Away from the (float-rounding-sensitive) edges, the formula is the boundary-list rule.
    tol = 1e-4
    for v, b in zip(a.tolist(), got.tolist()):
        if min(abs(v - e) for e in edges) > tol:
            assert b == boundary_bucket(v, b0, b15), f"seed={seed} a={v}"
    # Fixed points of the rule.
    below_b15 = float(np.nextafter(np.float32(b15), np.float32(0)))
    fixed = torch.tensor([100.0, b0, b15, below_b15, 0.0], dtype=torch.float32)
    assert bucket_index(fixed, b0, b15).tolist() == [0, 1, 15, 16, 31]  # bucket 0: beyond b0 only


def test_bucket_index_monotone_and_degenerate(seed):
    a = (torch.rand(5000) * 3).sort().values
    for b0, b15 in [(2.5, 0.4), (1.0, 1.0), (3.0, 1e-9)]:
        b = bucket_index(a, b0, b15).long()
        assert (b.diff() <= 0).all(), f"seed={seed} b0={b0} b15={b15}"
        assert b.min() >= 0 and b.max() <= 31


def test_inf_and_nan_land_where_the_kernel_puts_them():
    """The kernel's clamp is fminf(fmaxf(v, 0), 15), which turns NaN into 0: a NaN magnitude fails a > b0 and a >= b15
    and lands in bucket 16, an inf one in bucket 0 (casting NaN to an integer, as a plain clip would leave it, is
    undefined)."""
    a = torch.tensor([float("nan"), float("inf"), 20.0, 10.0, 0.0])
    assert bucket_index(a, 10.0, 1.0).tolist() == [16, 0, 0, 1, 31]
    x = torch.full((1, 1024), 2.0)
    x[0, 100], x[0, 200] = float("nan"), 9.0
    assert select_approx(x, 1, 10.0, 1.0).tolist() == [[200]]  # 9 is in a higher bucket than NaN's 16


def test_an_input_beyond_the_calibrations_largest_goes_first():
    """Bucket 0 holds only what lies above b0 (the paper's boundary b0): at k_chunk 1 such an outlier is chosen over
    a value just under b0, whatever the boundary bucket's pseudo-random order would pick."""
    for _ in range(50):
        x = torch.rand(1, 1024) * 2 - 1
        x[0, 10], x[0, 20] = 50.0, 7.7
        assert select_approx(x, 1, 8.0, 2.0).tolist() == [[10]]


def test_act_stats_refuse_nan_and_inf_inputs():
    from localllm.errors import LocalLLMError
    for bad in (float("nan"), float("inf")):
        st = ActStats(1024, 8)
        x = torch.randn(4, 1024)
        x[1, 7] = bad
        st.update(x)
        st.update(torch.randn(4, 1024))  # a later finite batch does not hide it
        with pytest.raises(LocalLLMError, match="hold NaN or inf"):
            st.state()  # what quantize saves
        with pytest.raises(LocalLLMError, match="hold NaN or inf"):
            st.b0


def naive_exact(x: torch.Tensor, k_chunk: int) -> torch.Tensor:
    rows = []
    for t in range(x.shape[0]):
        row = []
        for s, e in chunk_bounds(x.shape[1]):
            order = sorted(range(s, e), key=lambda j: -abs(float(x[t, j])))
            row += sorted(order[: k_for_chunk(k_chunk, e - s)])
        rows.append(row)
    return torch.tensor(rows, dtype=torch.long)


@pytest.mark.parametrize("k,k_chunk", [(2048, 32), (576, 40), (1536, 100), (96, 300)])
def test_select_exact_matches_naive(k, k_chunk, seed):
    x = activations(6, k)
    idx = select_exact(x, k_chunk)
    assert idx.dtype == torch.long and idx.shape == (6, k_total(k_chunk, k))
    assert torch.equal(idx, naive_exact(x, k_chunk)), f"seed={seed}"
    # Any float dtype; fp16 has ties at the k-th value, so compare the selected magnitudes.
    xh = x.half()
    got = xh.abs().gather(1, select_exact(xh, k_chunk)).sort().values
    want = xh.abs().gather(1, naive_exact(xh.float(), k_chunk)).sort().values
    assert torch.equal(got, want), f"seed={seed}"


def check_bucket_rule(x: torch.Tensor, idx: torch.Tensor, k_chunk: int, b0: float, b15: float, seed: int) -> None:
    """Per token and chunk: exactly k distinct channels, whole buckets above the boundary, none below it."""
    a = x.float().abs()
    col = 0
    for s, e in chunk_bounds(x.shape[1]):
        k = k_for_chunk(k_chunk, e - s)
        for t in range(x.shape[0]):
            sel = idx[t, col : col + k]
            msg = f"seed={seed} token={t} chunk={s}"
            assert sel.numel() == k and sel.unique().numel() == k, msg
            assert sel.min() >= s and sel.max() < e, msg
            assert (sel.diff() > 0).all(), msg  # documented order: ascending within a chunk
            bucket = bucket_index(a[t, s:e], b0, b15).long()
            cum = torch.bincount(bucket, minlength=32).cumsum(0)
            boundary = int((cum <= k).sum())
            chosen = torch.zeros(e - s, dtype=torch.bool)
            chosen[sel - s] = True
            assert chosen[bucket < boundary].all(), msg
            assert not chosen[bucket > boundary].any(), msg
            before = int(cum[boundary - 1]) if boundary > 0 else 0
            assert int(chosen[bucket == boundary].sum()) == k - before, msg
        col += k
    assert col == idx.shape[1]


@pytest.mark.parametrize("k,k_chunk", [(4096, 32), (576, 40), (1536, 100), (96, 300), (2048, 1)])
def test_select_approx_bucket_rule(k, k_chunk, seed):
    x = activations(24, k)
    st = ActStats(k, kmax=max(k_chunk, 1))
    st.update(x[:12])  # calibrate on half: the other half may fall outside [0, b0]
    b0, b15 = st.b0, float(st.kth[k_chunk - 1])
    idx = select_approx(x, k_chunk, b0, b15)
    assert idx.dtype == torch.long and idx.shape == (24, k_total(k_chunk, k))
    check_bucket_rule(x, idx, k_chunk, b0, b15, seed)
    # Boundaries far off: everything in one bucket, or spread over the lower range.
    for b0_, b15_ in [(1e-3, 1e-4), (100.0, 50.0)]:
        check_bucket_rule(x, select_approx(x, k_chunk, b0_, b15_), k_chunk, b0_, b15_, seed)


def test_select_approx_in_row_blocks_is_row_by_row(seed, monkeypatch):
    """Rows go in blocks on a thread pool (a prompt, an evaluation window): each row's channels are what it selects
    alone, in order, including a last short block."""
    import localllm.qdec as q
    monkeypatch.setattr(q, "_ROWS", 5)
    x = activations(23, 1536)
    alone = torch.cat([select_approx(x[t:t + 1], 8, 3.0, 0.5) for t in range(23)])
    assert torch.equal(select_approx(x, 8, 3.0, 0.5), alone), f"seed={seed}"
    assert select_approx(x[:0], 8, 3.0, 0.5).shape == (0, k_total(8, 1536))


def naive_boundary_order(x: torch.Tensor) -> tuple[int, int]:
    """boundary_order for one chunk [c], with Python integers."""
    def fmix(h):
        for shift, mul in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
            h = ((h ^ (h >> shift)) * mul) % 2**32
        return h ^ (h >> 16)

    u = [int(v) & 0xFFFF for v in x.half().view(torch.int16).tolist()]
    h = fmix(sum(fmix(i * 65536 + ui) for i, ui in enumerate(u)) % 2**32)
    return 2 * (h & 511) + 1, (h >> 9) & 1023


def test_boundary_order_matches_naive(seed):
    x = activations(8, 1536)
    for s, e in chunk_bounds(1536):
        A, off = boundary_order(x[:, s:e])
        assert [(int(a), int(o)) for a, o in zip(A[:, 0], off[:, 0])] == \
            [naive_boundary_order(x[t, s:e]) for t in range(8)], f"seed={seed}"


def test_select_approx_random_boundary(seed):
    # Equal magnitudes put every channel in one bucket, so the whole choice is the pseudo-random order, a
    # function of the input: the same input picks the same channels, another input (signs) others.
    signs = torch.where(torch.rand(2000, 1024) < 0.5, -1.0, 1.0)
    a = select_approx(signs, 32, 2.0, 0.5)
    assert torch.equal(a, select_approx(signs.clone(), 32, 2.0, 0.5)), "same input -> same selection"
    assert (a != select_approx(-signs[:, torch.randperm(1024)], 32, 2.0, 0.5)).any(1).float().mean() > 0.99
    # Near uniform over tokens: each channel is picked ~ 2000 * 32 / 1024 = 62.5 times (sd ~ 7.8).
    freq = torch.bincount(a.flatten(), minlength=1024)
    assert freq.min() > 20 and freq.max() < 110, f"seed={seed} min={freq.min()} max={freq.max()}"


def test_select_approx_recall(seed):
    x = activations(128, 4096)
    for k_chunk in (16, 32, 64):
        st = ActStats(4096, kmax=64)
        st.update(x)
        approx = select_approx(x, k_chunk, st.b0, float(st.kth[k_chunk - 1]))
        exact = select_exact(x, k_chunk)
        recall = torch.tensor([np.intersect1d(p, q).size for p, q in zip(approx.numpy(), exact.numpy())])
        recall = recall.float().mean() / exact.shape[1]
        assert recall > 0.8, f"seed={seed} k_chunk={k_chunk} recall={recall:.3f}"


@pytest.mark.parametrize("k,k_chunk", [(4096, 32), (576, 40), (1536, 2000)])
def test_select_static_and_random(k, k_chunk, seed):
    imp = torch.rand(k)
    idx = select_static(imp, k_chunk, 5)
    want = naive_exact(imp[None], k_chunk)
    assert idx.shape == (5, k_total(k_chunk, k)) and idx.dtype == torch.long
    assert torch.equal(idx, want.expand(5, -1)), f"seed={seed}"
    rnd = select_random(50, k, k_chunk, generator=gen(3))
    assert torch.equal(rnd, select_random(50, k, k_chunk, generator=gen(3)))
    assert rnd.shape == (50, k_total(k_chunk, k)) and rnd.dtype == torch.long
    col = 0
    for s, e in chunk_bounds(k):
        kc = k_for_chunk(k_chunk, e - s)
        part = rnd[:, col : col + kc]
        assert (part >= s).all() and (part < e).all()
        assert all(row.unique().numel() == kc for row in part)
        col += kc
    if k_total(k_chunk, k) < k:
        assert rnd.unique(dim=0).shape[0] > 1, "tokens draw independently"


@pytest.mark.parametrize("k", [576, 2048])
@pytest.mark.parametrize("blocks", ["whole", "small"])
def test_compensate_matches_naive(k, blocks, seed, monkeypatch):
    if blocks == "small":  # tokens two at a time, residual rows 24 or 85 at a time
        import localllm.qdec as q
        monkeypatch.setattr(q, "_BLOCK_ELEMS", 2 * k)
    n, t = 48, 5
    res = quantize_residual(torch.randn(n, k) * 0.01)
    x = activations(t, k).to(torch.bfloat16)
    idx = select_exact(x, 24)
    got = compensate(x, idx, res)
    assert got.shape == (t, n) and got.dtype == torch.float32
    r_hat = res.dequantize().double()
    want = torch.zeros(t, n, dtype=torch.float64)
    for i in range(t):
        for j in idx[i].tolist():
            want[i] += r_hat[:, j] * float(x[i, j])
    assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item()), f"seed={seed}"
    one = compensate(x[2:3], idx[2:3], res)  # a decode step's token alone
    assert torch.allclose(one.double(), want[2:3], rtol=1e-4, atol=1e-4 * want.abs().max().item())
    # Compensating every channel is the full residual product.
    full = torch.arange(k).expand(t, -1)
    assert torch.allclose(compensate(x, full, res).double(), x.double() @ r_hat.T, rtol=1e-4, atol=1e-4)


def test_act_stats_matches_naive(seed):
    k = 1536  # one full and one partial (512) chunk
    batches = [activations(7, k), activations(2 * 3, k).view(2, 3, k), activations(1, k) * 3]
    st = ActStats(k, kmax=300)
    for b in batches:
        st.update(b)
    x = torch.cat([b.reshape(-1, k) for b in batches])
    assert st.count == 14
    assert st.b0 == x.abs().max().item()
    assert st.kth.shape == (300,) and st.kth.dtype == torch.float32
    for kc in (1, 2, 31, 64, 300):
        want = 0.0
        for row in x.abs():
            for s, e in chunk_bounds(k):
                want = max(want, sorted(row[s:e].tolist(), reverse=True)[k_for_chunk(kc, e - s) - 1])
        assert st.kth[kc - 1].item() == want, f"seed={seed} k_chunk={kc}"
    assert (st.kth.diff() <= 0).all()
    assert torch.allclose(st.sq_mean, x.double().square().mean(0).float(), rtol=1e-6), f"seed={seed}"
    assert ActStats(k, kmax=5000).kth.shape == (1024,)
    with pytest.raises(ValueError):
        st.update(torch.randn(3, 1024))


def test_act_stats_small_input_large_k(seed):
    x = activations(9, 96)
    st = ActStats(96, kmax=1024)
    st.update(x)
    # k_for_chunk(k_chunk, 96) reaches 96 at k_chunk = 1024: the smallest value of a vector.
    assert st.kth[-1].item() == x.abs().min(dim=1).values.max().item()
    assert st.kth[0].item() == st.b0


def test_act_stats_state_roundtrip(tmp_path, seed):
    from safetensors.torch import load_file, save_file

    st = ActStats(2048, kmax=64)
    st.update(activations(10, 2048))
    path = tmp_path / "stats.safetensors"
    save_file(st.state(), str(path))
    back = ActStats.from_state(load_file(str(path)))
    assert (back.in_features, back.count, back.b0) == (2048, st.count, st.b0)
    assert torch.equal(back.kth, st.kth) and torch.equal(back.sq_mean, st.sq_mean)
    more = activations(4, 2048)
    st.update(more)
    back.update(more)
    assert back.count == 14 and torch.equal(back.kth, st.kth) and torch.equal(back.sq_mean, st.sq_mean)


@pytest.mark.parametrize("mode", ["approx", "static"])
def test_a_models_layers_select_as_their_mode_says(tiny_quant, mode):
    """What the CPU reference compensates in a whole model: approx's bucket rule at the layer's calibration
    boundaries, static's top mean x^2 of the calibration per chunk (computed here in float64), for every kind."""
    from localllm.model import KINDS
    from localllm.runtime import load
    k_chunk = 128  # 8 of the tiny model's 64 channels: enough for approx and exact top-k to part
    lm = load(tiny_quant, qdec={"mode": mode, "k_chunk": k_chunk})
    seen = []
    lm.settings.observer = lambda lin, x, idx: seen.append((lin, x.clone(), idx.clone()))
    with torch.no_grad():
        lm.model(torch.randint(0, lm.model.cfg.vocab_size, (1, 24)))
    assert {lin.kind for lin, _, _ in seen} == set(KINDS)
    differs = False
    for lin, x, idx in seen:
        if mode == "approx":
            want = select_approx(x, k_chunk, lin.stats.b0, lin.stats.b15(k_chunk))
            differs |= not torch.equal(idx.sort(1).values, select_exact(x, k_chunk).sort(1).values)
        else:
            imp = lin.stats.sq_mean.double()
            want = torch.cat([imp[s:e].topk(k_for_chunk(k_chunk, e - s)).indices + s
                              for s, e in chunk_bounds(x.shape[1])]).expand(x.shape[0], -1)
        assert torch.equal(idx.sort(1).values, want.sort(1).values), lin.kind
    assert mode == "static" or differs  # (else this would not tell approx from exact top-k)


def test_b15_is_the_kth_largest_of_its_k_chunk(seed):
    """The bucket boundary of approximate top-k at k_chunk kc: the calibration's kc-th value (the kernel and the CPU
    both take it from here, so a test that computes its expectation through b15 cannot see it shift)."""
    st = ActStats(1536, kmax=300)
    st.update(torch.randn(9, 1536, generator=gen(seed)))
    for kc in (1, 2, 31, 64, 300):
        assert st.b15(kc) == float(st.kth[kc - 1]), (kc, seed)


def test_approx_takes_the_boundary_bucket_in_boundary_order(seed):
    """Which channels of the boundary bucket approximate top-k takes, not only how many: the k smallest of
    bucket * 1024 + (i * A + off) mod 1024 per chunk, from a plain reference."""
    x = torch.randn(16, 1536, generator=gen(seed))
    b0, b15, kc = 3.0, 1.0, 24
    got = select_approx(x, kc, b0, b15)
    col = 0
    for s, e in chunk_bounds(1536):
        k = k_for_chunk(kc, e - s)
        A, off = boundary_order(x[:, s:e])
        for t in range(16):
            b = bucket_index(x[t, s:e].abs(), b0, b15).long()
            p = (torch.arange(e - s) * A[t, 0] + off[t, 0]) % 1024
            want = sorted((b * 1024 + p).argsort()[:k].add(s).tolist())
            assert got[t, col:col + k].tolist() == want, (t, s, seed)
        col += k
