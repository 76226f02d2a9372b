import math

import pytest
import torch

from localllm.quant import (
    BASE_BITS,
    PACK_BITS,
    QuantResidual,
    pack_codes,
    quantize_residual,
    quantize_rtn,
    residual_scale_search,
    unpack_codes,
)


@pytest.fixture
def seed() -> int:
    """Fresh random inputs every run; the seed goes into assertion messages to reproduce a failure."""
    return torch.seed()


# The documented mma-v3 fields (quant.py), restated: (word, bit position) of register j of mma tile m; None is the
# 3-bit register spread over bit 15 of words 0, 1, 2.
FIELDS = {
    4: [[(m, 4 * j) for j in range(4)] for m in range(4)],
    3: [[(0, 0), (1, 0), (0, 9), (1, 9)], [(2, 0), (0, 3), (2, 9), (0, 12)],
        [(1, 3), (2, 3), (1, 12), (2, 12)], [(0, 6), (2, 6), (1, 6), None]],
    2: [[(0, 0), (1, 0), (0, 10), (1, 10)], [(0, 2), (1, 2), (0, 12), (1, 12)],
        [(0, 4), (1, 4), (0, 14), (1, 14)], [(0, 6), (0, 8), (1, 6), (1, 8)]],
    8: [[(2 * m + j // 2, 8 * (j % 2)) for j in range(4)] for m in range(4)],  # the output head
}


def naive_pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Scalar loops over the documented layout: words built as Python ints, then wrapped."""
    n, k = codes.shape
    out = []
    for tr in range(n // 16):
        row_words = []
        for tk in range(k // 64):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                words = [0] * bits
                for m in range(4):  # mma tile: columns 16m..16m+15 of the 64-channel tile
                    for j in range(4):
                        for h in range(2):
                            r = 16 * tr + g + 8 * (j % 2)
                            c = 64 * tk + 16 * m + 2 * t + h + 8 * (j // 2)
                            code = int(codes[r, c])
                            if FIELDS[bits][m][j] is None:
                                for b in range(bits):
                                    words[b] |= ((code >> b) & 1) << (15 + 16 * h)
                            else:
                                w, p = FIELDS[bits][m][j]
                                words[w] |= code << (p + 16 * h)
                row_words += words
        out.append([w - (1 << 32) if w >= 1 << 31 else w for w in row_words])
    return torch.tensor(out, dtype=torch.int32)


@pytest.mark.parametrize("bits", PACK_BITS)
@pytest.mark.parametrize("shape", [(16, 64), (64, 4096), (48, 576)])
def test_pack_roundtrip(bits, shape, seed):
    n, k = shape
    codes = torch.randint(0, 2**bits, shape, dtype=torch.uint8)
    codes[:16] = 2**bits - 1  # an all-max tile: sets bit 31 of every word
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.int32
    assert packed.shape == (n // 16, k * bits // 2), "exactly `bits` bits per weight"
    assert (packed[0] == -1).all(), "all-max codes fill every bit"
    assert torch.equal(unpack_codes(packed, bits), codes), f"seed={seed}"
    assert unpack_codes(packed, bits).dtype == torch.uint8


@pytest.mark.parametrize("bits", PACK_BITS)
def test_pack_layout_matches_naive(bits, seed):
    codes = torch.randint(0, 2**bits, (32, 128), dtype=torch.uint8)
    assert torch.equal(pack_codes(codes, bits), naive_pack(codes, bits)), f"seed={seed}"


def test_pack_layout_known_words():
    # 4-bit: row 9 = g 1 + 8 (register j odd), column 3 = 2t + h with t 1, h 1, in mma tile 0 ->
    # lane 4g + t = 5, word 0 (mma tile 0), bits 4j + 16h with j = 1: 20.
    codes = torch.zeros(16, 64, dtype=torch.uint8)
    codes[9, 3] = 5
    words = pack_codes(codes, 4).view(32, 4)
    assert words[5].tolist() == [5 << 20, 0, 0, 0] and words.count_nonzero() == 1
    # 3-bit: code 6 = 0b110 at row 0, column 16 + 8 (mma tile 1, register j = 2, t = 0, h = 0, lane 0):
    # field (word 2, bit 9). Code 5 = 0b101 at row 8, column 48 + 9 (tile 3, j = 3, t = 0, h = 1): spread over
    # bit 31 of words 0, 1, 2 -> bits 1, 0, 1.
    codes[9, 3] = 0
    codes[0, 24] = 6
    codes[8, 57] = 5
    words = pack_codes(codes, 3).view(32, 3)
    assert words[0].tolist() == [-(1 << 31), 0, (6 << 9) - (1 << 31)] and words.count_nonzero() == 2


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 64"):
        pack_codes(torch.zeros(16, 96, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="multiple of 16"):
        pack_codes(torch.zeros(8, 64, dtype=torch.uint8), 4)
    with pytest.raises(ValueError):
        pack_codes(torch.full((16, 64), 4, dtype=torch.uint8), 2)
    with pytest.raises(ValueError):
        pack_codes(torch.zeros(16, 64, dtype=torch.uint8), 5)


def naive_rtn(w: torch.Tensor, bits: int, gs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row, per-group loop with the documented formula: (codes, scales, zeros, w_hat)."""
    maxq = 2**bits - 1
    n, k = w.shape
    g = math.ceil(k / gs)
    codes = torch.zeros(n, k, dtype=torch.uint8)
    scales = torch.zeros(n, g, dtype=torch.float16)
    zeros = torch.zeros(n, g, dtype=torch.uint8)
    w_hat = torch.zeros(n, k)
    for r in range(n):
        for j in range(g):
            grp = w[r, j * gs : (j + 1) * gs].float()
            lo = torch.clamp(grp.min(), max=0.0)
            hi = torch.clamp(grp.max(), min=0.0)
            s16 = torch.clamp((hi - lo) / maxq, min=2.0**-14).half()
            s = s16.float()
            z = torch.clamp(torch.round(-lo / s), 0, maxq)
            c = torch.clamp(torch.round(grp / s) + z, 0, maxq)
            codes[r, j * gs : (j + 1) * gs] = c.to(torch.uint8)
            scales[r, j], zeros[r, j] = s16, z.to(torch.uint8)
            w_hat[r, j * gs : (j + 1) * gs] = (c - z) * s
    return codes, scales, zeros, w_hat


@pytest.mark.parametrize("bits", PACK_BITS)
@pytest.mark.parametrize("k,gs", [(576, 128), (256, 64), (192, 128), (64, 64)])
def test_rtn_matches_naive(bits, k, gs, seed):
    w = torch.randn(16, k) * 0.05
    w[0, :gs] = w[0, :gs].abs() + 0.5  # a one-signed group
    w[1, :gs] = 0.0  # a zero-range group
    q = quantize_rtn(w, bits, gs)
    g = math.ceil(k / gs)
    assert q.qweight.shape == (1, k * bits // 2) and q.qweight.dtype == torch.int32
    assert q.scales.shape == (16, g) and q.scales.dtype == torch.float16
    assert q.zeros.shape == (16, g) and q.zeros.dtype == torch.uint8
    assert (q.bits, q.group_size, q.in_features) == (bits, gs, k)
    codes, scales, zeros, w_hat = naive_rtn(w, bits, gs)
    got = unpack_codes(q.qweight, bits)
    assert int(got.max()) <= 2**bits - 1
    assert torch.equal(got, codes), f"seed={seed}"
    assert torch.equal(q.scales, scales), f"seed={seed}"
    assert torch.equal(q.zeros, zeros), f"seed={seed}"
    assert torch.equal(q.dequantize(), w_hat), f"seed={seed}"
    assert q.dequantize(torch.float16).dtype == torch.float16
    u = q.unpacked()  # the CPU's low-memory form: one byte a code (8 bits: the zeros apart), the same rows
    assert u.codes.dtype == (torch.uint8 if bits == 8 else torch.int8)
    assert u.nbytes == 16 * g * gs + 16 * g * (8 if bits == 8 else 4)
    assert torch.equal(u.rows(), w_hat) and torch.equal(u.rows(slice(3, 9)), w_hat[3:9]) and q.unpacked_nbytes == u.nbytes
    # Each weight lies within half a step of the grid; the fp16 scale rounding (relative
    # 2^-11, times maxq steps) may stretch that slightly at the group ends.
    s = q.scales.float().repeat_interleave(gs, dim=1)[:, :k]
    bound = s * (0.5 + (2**bits - 1) * 2.0**-10) + 1e-7
    assert ((w - q.dequantize()).abs() <= bound).all(), f"seed={seed}"
    assert (q.dequantize()[1, :gs] == 0).all()


def test_rtn_error_decreases_with_bits(seed):
    w = torch.randn(64, 1024)
    err = {b: ((w - quantize_rtn(w, b).dequantize()) ** 2).mean().item() for b in BASE_BITS}
    assert err[4] < err[3] < err[2], f"seed={seed} err={err}"
    assert err[4] < 0.02 * w.var().item(), f"seed={seed} err={err}"


def test_rtn_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 64"):
        quantize_rtn(torch.randn(16, 100), 4)
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_rtn(torch.randn(4, 128), 4)
    with pytest.raises(ValueError, match="group_size"):
        quantize_rtn(torch.randn(16, 128), 4, 32)
    with pytest.raises(ValueError, match="bits must be one of"):
        quantize_rtn(torch.randn(16, 128), 5)


ALPHAS = torch.linspace(0.2, 1.0, 100, dtype=torch.float32)


def brute_force_scale(row: torch.Tensor) -> torch.Tensor:
    """Scalar loop over the candidate grid, float64 error, first minimum wins."""
    amax = row.abs().max()
    best, best_err = None, math.inf
    for a in ALPHAS:
        s16 = torch.clamp(a * amax / 7, min=2.0**-24).half()
        s = s16.double()
        q = torch.clamp(torch.round(row.double() / s), -7, 7)
        err = ((q * s - row.double()) ** 2).sum().item()
        if err < best_err:
            best, best_err = s16, err
    return best


def test_scale_search_matches_brute_force(seed):
    r = torch.randn(24, 256) * 0.01
    r[3] *= 50  # a large-scale row
    r[5, 7] = 1.0  # an outlier row
    r[6] = 0.0  # an all-zero row
    got = residual_scale_search(r)
    assert got.dtype == torch.float16 and got.shape == (24,)
    want = torch.stack([brute_force_scale(r[i]) for i in range(24)])
    assert torch.equal(got, want), f"seed={seed} rows={torch.nonzero(got != want).flatten().tolist()}"
    assert torch.isfinite(got).all() and (got > 0).all()


def test_residual_quantization(seed):
    n, k = 64, 512
    r = torch.randn(n, k) * 0.01
    r[:, 3] *= 20  # an outlier input channel
    res = quantize_residual(r)
    assert isinstance(res, QuantResidual)
    assert res.packed.shape == (k, n // 8) and res.packed.dtype == torch.int32
    assert res.scales.shape == (n,) and res.scales.dtype == torch.float16
    assert torch.equal(res.scales, residual_scale_search(r))
    r_hat = res.dequantize()
    assert r_hat.shape == (n, k)
    q = r_hat / res.scales.float()[:, None]
    assert torch.equal(q, q.round()) and q.abs().max() <= 7, f"seed={seed}"
    # The codes are the documented quantizer with the stored scale.
    want = torch.clamp(torch.round(r / res.scales.float()[:, None]), -7, 7) * res.scales.float()[:, None]
    assert torch.equal(r_hat, want), f"seed={seed}"
    # Input-channel-major nibbles q + 8: output channel 8j+i at bits 4i of word j of row c.
    c, o = 5, 8 * 3 + 6
    nib = (int(res.packed[c, 3]) >> (4 * 6)) & 0xF
    assert 1 <= nib <= 15
    assert (nib - 8) * res.scales[o].float() == r_hat[o, c], f"seed={seed}"
    idx = torch.tensor([[0, 3, 511], [7, 7, 2]])
    rows = res.rows(idx)
    assert rows.shape == (2, 3, n) and rows.dtype == torch.float32
    assert torch.equal(rows, r_hat[:, idx].permute(1, 2, 0)), f"seed={seed}"


def test_residual_zero_rows_and_bad_shape():
    r = torch.zeros(8, 64)
    r[1, 2] = 0.5
    res = quantize_residual(r)
    assert torch.isfinite(res.scales).all()
    r_hat = res.dequantize()
    assert (r_hat[0] == 0).all() and abs(r_hat[1, 2] - 0.5) < 1e-3
    with pytest.raises(ValueError, match="multiple of 8"):
        quantize_residual(torch.randn(12, 64))


def test_residual_compensation_shrinks_error(seed):
    w = torch.randn(128, 1024) * 0.02
    for bits in BASE_BITS:
        w_hat = quantize_rtn(w, bits).dequantize()
        r_hat = quantize_residual(w - w_hat).dequantize()
        base = ((w - w_hat) ** 2).mean()
        comp = ((w - w_hat - r_hat) ** 2).mean()
        assert comp < 0.02 * base, f"seed={seed} bits={bits} base={base} comp={comp}"


def test_residual_widths_for_the_table1_comparison(seed):
    """Other residual widths (the report emulates them on the CPU path): the same quantizer at b bits, codes in
    [-(2^(b-1) - 1), 2^(b-1) - 1] with the MSE-searched scale; 16 bits keeps R in fp16."""
    n, k = 32, 256
    r = torch.randn(n, k) * 0.01
    r[:, 9] *= 30  # an outlier input channel
    errs = {}
    for bits in (2, 4, 8):
        qmax = 2 ** (bits - 1) - 1
        res = quantize_residual(r, bits)
        assert res.bits == bits and res.packed.shape == (k, n * bits // 32)
        assert torch.equal(res.scales, residual_scale_search(r, qmax=qmax)), f"seed={seed} bits={bits}"
        want = torch.clamp(torch.round(r / res.scales.float()[:, None]), -qmax, qmax) * res.scales.float()[:, None]
        r_hat = res.dequantize()
        assert torch.equal(r_hat, want), f"seed={seed} bits={bits}"
        idx = torch.tensor([[0, 9, 255], [4, 4, 1]])
        assert torch.equal(res.rows(idx), r_hat[:, idx].permute(1, 2, 0))
        errs[bits] = ((r - r_hat) ** 2).mean().item()
    assert errs[2] > errs[4] > errs[8], f"seed={seed} {errs}"
    assert torch.equal(quantize_residual(r, 4).packed, quantize_residual(r).packed), "4 bits is the default format"
    res16 = quantize_residual(r, 16)
    assert torch.equal(res16.dequantize(), r.half().float()) and res16.packed.shape == (k, n // 2)
    for bad in (3, 32):
        with pytest.raises(ValueError, match="residual bits must be one of"):
            quantize_residual(r, bad)
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_residual(torch.randn(24, 64), 2)


def test_scale_search_at_other_widths_matches_brute_force(seed):
    r = torch.randn(6, 128) * 0.01
    r[2, 5] = 0.5
    for qmax in (1, 127):
        got = residual_scale_search(r, qmax=qmax)
        for i in range(6):
            amax, best, best_err = r[i].abs().max(), None, math.inf
            for a in ALPHAS:
                s16 = torch.clamp(a * amax / qmax, min=2.0**-24).half()
                q = torch.clamp(torch.round(r[i].double() / s16.double()), -qmax, qmax)
                err = ((q * s16.double() - r[i].double()) ** 2).sum().item()
                if err < best_err:
                    best, best_err = s16, err
            assert got[i] == best, f"seed={seed} qmax={qmax} row={i}"
