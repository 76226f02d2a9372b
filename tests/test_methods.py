"""Base quantizers beyond RTN: AWQ (scale search + folding), SqueezeLLM-style tables, mixed 3.5-bit by KL."""
import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from localllm import awq, quant, squeezellm
from localllm.config import ModelConfig, rope_inv_freq
from localllm.errors import LocalLLMError
from localllm.model import KINDS, QdecSettings, attention_mask, build_block, rope_tables
from localllm.quant import TABLE_LEVELS, QuantLUT, pack_codes, quantize_rtn, rtn_dequantized, unpack_codes
from localllm.quantize import (REFIT_K_CHUNK, REFIT_TOKENS, GpuMemoryFit, block_inputs, kl_sensitivity, mixed_bits,
                               quantize, quantize_block, refit_inputs)
from localllm.runtime import describe, load
from localllm.squeezellm import lut_centroids, quantize_lut, refit_table, table_groups


@pytest.fixture
def seed() -> int:
    return torch.seed()


CFG = ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=192, num_layers=1, num_heads=4,
                  num_kv_heads=2, head_dim=32, qkv_bias=True)


def random_block(cfg: ModelConfig, dtype=torch.float64) -> dict:
    D, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    r = lambda *s: torch.randn(*s, dtype=dtype) * 0.1  # noqa: E731
    return {"attn_norm": 1 + r(D), "mlp_norm": 1 + r(D), "qkv": {"weight": r(q + 2 * kv, D), "bias": r(q + 2 * kv)},
            "o": {"weight": r(D, q)}, "gate_up": {"weight": r(2 * inter, D)}, "down": {"weight": r(D, inter)}}


def ref_block(t: dict, cfg: ModelConfig, h: torch.Tensor) -> torch.Tensor:
    """A Llama block written out in float64 (RMSNorm, RoPE, causal GQA attention, SwiGLU): h [T, D] -> [T, D]."""
    T = h.shape[0]
    norm = lambda x, w: x * torch.rsqrt(x.square().mean(-1, keepdim=True) + cfg.rms_norm_eps) * w  # noqa: E731
    qkv = norm(h, t["attn_norm"]) @ t["qkv"]["weight"].T + t["qkv"]["bias"]
    q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * rope_inv_freq(cfg).double()[None]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]

    def rope(x, heads):
        x = x.view(T, heads, cfg.head_dim)
        a, b = x.chunk(2, dim=-1)
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

    q, k, v = rope(q, cfg.num_heads), rope(k, cfg.num_kv_heads), v.view(T, cfg.num_kv_heads, cfg.head_dim)
    g = cfg.num_heads // cfg.num_kv_heads
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    att = torch.einsum("thd,shd->hts", q, k) / math.sqrt(cfg.head_dim)
    att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    a = torch.einsum("hts,shd->thd", att, v).reshape(T, cfg.q_size)
    h = h + a @ t["o"]["weight"].T
    gate, up = (norm(h, t["mlp_norm"]) @ t["gate_up"]["weight"].T).chunk(2, dim=-1)
    return h + (F.silu(gate) * up) @ t["down"]["weight"].T


def test_reference_block_is_the_model_block():
    """The float64 reference below computes what model.Block computes (so it can judge the fold)."""
    t = random_block(CFG)
    h = torch.randn(12, CFG.hidden_size, dtype=torch.float64)
    pos = torch.arange(12)
    blk = build_block(CFG, 0, {k: ({kk: vv.float() for kk, vv in v.items()} if isinstance(v, dict) else v.float())
                               for k, v in t.items()}, QdecSettings())
    with torch.no_grad():
        got = blk(h.float()[None], *rope_tables(rope_inv_freq(CFG), pos), pos, None, attention_mask(pos, None))[0]
    assert (got.double() - ref_block(t, CFG, h)).abs().max() < 1e-4


def test_awq_fold_computes_the_same_function(seed):
    t = random_block(CFG)
    h = torch.randn(16, CFG.hidden_size, dtype=torch.float64)
    x_o = torch.rand(8, CFG.q_size) * 3  # any positive statistics: the scales below come from them
    s = {"qkv": awq.scales_of(torch.rand(CFG.hidden_size) + 0.1, 0.7),
         "o": awq.scales_of(awq.tied(x_o.abs().mean(0), CFG), 0.5),
         "gate_up": awq.scales_of(torch.rand(CFG.hidden_size) * 5, 0.4),
         "down": awq.scales_of(torch.rand(CFG.intermediate_size) + 0.01, 0.9)}
    folded = awq.fold(t, CFG, s, torch.float64)
    assert not torch.equal(folded["qkv"]["weight"], t["qkv"]["weight"])
    want, got = ref_block(t, CFG, h), ref_block(folded, CFG, h)
    assert (got - want).abs().max() < 1e-10 * want.abs().max(), f"seed={seed}"
    # GQA: the v channel of a kv head feeds every q head of its group, so o's scales must be tied across the group
    with pytest.raises(ValueError, match="tied"):
        awq.fold(t, CFG, {"o": torch.rand(CFG.q_size) + 0.5})


def test_awq_ties_o_statistics_across_each_gqa_group(seed):
    """o's input channels that share a v channel (GQA) get one statistic: their group's mean, repeated."""
    torch.manual_seed(seed % 2**31)
    v = torch.rand(CFG.q_size)
    group = CFG.num_heads // CFG.num_kv_heads
    assert group > 1
    want = v.view(CFG.num_kv_heads, group, CFG.head_dim).mean(1, keepdim=True).expand(-1, group, -1).reshape(-1)
    assert torch.allclose(awq.tied(v, CFG), want), f"seed={seed}"


def test_awq_search_beats_rtn_on_outlier_channels(seed, monkeypatch):
    torch.manual_seed(seed % 2**31)
    w = torch.randn(64, 256) * 0.02
    x = torch.randn(2048, 256)
    x[:, :4] *= 30  # a few salient input channels
    q = lambda v: rtn_dequantized(v, 3, 64)  # noqa: E731
    s, alpha, duo, gain = awq.search(w, x, q)
    err = lambda w_hat: ((x @ (w_hat - w).T) ** 2).mean().item()  # noqa: E731
    assert alpha > 0 and not duo, f"seed={seed}"
    assert err((q((w * s).float()).double() / s).float()) < 0.7 * err(q(w)), f"seed={seed}"
    # the error it reports over RTN's is that ratio
    assert gain == pytest.approx(err((q((w * s).float()).double() / s).float()) / err(q(w)), rel=1e-4), f"seed={seed}"
    # alpha = 0 is RTN: s = 1
    assert torch.equal(awq.scales_of(torch.rand(7), 0.0), torch.ones(7, dtype=torch.float64))
    # with duo scales on offer the search picks whichever measures less, and it measures no more than without them
    s2, _, _, _ = awq.search(w, x, q, w_mean=awq.weight_mean(w, 64))
    assert err((q((w * s2).float()).double() / s2).float()) <= err((q((w * s).float()).double() / s).float())
    monkeypatch.setattr(quant, "_BLOCK_ELEMS", 16 * 8 * 256)  # the error summed over blocks of 16 rows: the same pick
    s3, _, _, _ = awq.search(w, x, q)  # (up to ties at the products' float32 precision)
    e, e3 = (err((q((w * v).float()).double() / v).float()) for v in (s, s3))
    assert abs(e3 - e) <= 1e-5 * e, f"seed={seed}"


def test_awq_search_with_duo_scales_and_the_mlp_output_takes_the_grids_least_error(seed, monkeypatch):
    torch.manual_seed(seed % 2**31)
    w = torch.randn(64, 128) * 0.02  # gate_up: 32 gate rows, then their 32 up rows
    w[:, 5] *= 6  # a channel whose weights set its groups' ranges
    x = torch.randn(300, 128) * (torch.rand(128) * 4 + 0.1)
    down = torch.randn(40, 32) * 0.05
    q = lambda v: rtn_dequantized(v, 3, 64)  # noqa: E731
    wm = awq.weight_mean(w, 64)
    assert wm.shape == (128,) and (wm > 0).all() and (wm <= 1).all() and wm[5] > 0.5 > wm.median()
    s, alpha, duo, gain = awq.search(w, x, q, w_mean=wm, down=down)
    x64, w64 = x.double(), w.double()
    mlp = lambda y: (F.silu(y[:, :32]) * y[:, 32:]) @ down.double().T  # noqa: E731
    errs = {}
    for d in (False, True):
        for a in awq.ALPHAS:
            sc = awq.scales_of(x.abs().mean(0), a, wm if d else None)
            w_hat = q((w64 * sc).float()).double() / sc
            errs[d, a] = (mlp(x64 @ w_hat.T) - mlp(x64 @ w64.T)).square().mean().item()
    # the grid's least error, up to the search's float32 products (~1e-6 of the error)
    assert errs[duo, alpha] <= min(errs.values()) * (1 + 1e-5), f"seed={seed}"
    assert gain == pytest.approx(errs[duo, alpha] / errs[False, 0.0], rel=1e-4), f"seed={seed}"  # over RTN's
    assert torch.equal(s, awq.scales_of(x.abs().mean(0), alpha, wm if duo else None))
    # row blocks (16 gate rows with their up rows, a GPU's size on the CPU's scale) sum to the same errors
    monkeypatch.setattr(quant, "_BLOCK_ELEMS", 16 * 16 * 128)
    _, a2, d2, _ = awq.search(w, x, q, w_mean=wm, down=down)
    assert errs[d2, a2] <= min(errs.values()) * (1 + 1e-5), f"seed={seed}"
    monkeypatch.setattr(quant, "_BLOCK_ELEMS", 16 * 2 * 128)  # weight_mean in blocks of 16 rows
    assert torch.allclose(awq.weight_mean(w, 64), wm, rtol=1e-12)


def test_awq_block_quantizes_the_folded_weights(seed):
    cfg, t = CFG, random_block(CFG, torch.float32)
    inputs = {k: torch.randn(300, n) * torch.rand(n) * 4 for k, n in
              (("qkv", 128), ("o", 128), ("gate_up", 128), ("down", 192))}
    qt, alphas = quantize_block(t, 3, 64, True, "awq", inputs, cfg)
    assert set(alphas) == set(KINDS)
    folded, _, clips = awq.awq_block(t, cfg, inputs, 3, 64)
    for kind in KINDS:  # the stored weights are the clipped RTN of the folded weights, the residual of what was stored
        assert torch.equal(qt[kind]["quant"].dequantize(),
                           quantize_rtn(folded[kind]["weight"], 3, 64, clips[kind]).dequantize())
        r = folded[kind]["weight"] - qt[kind]["quant"].dequantize()
        assert ((r - qt[kind]["residual"].dequantize()) ** 2).mean() < 0.05 * (r ** 2).mean(), f"seed={seed}"
    assert torch.equal(qt["attn_norm"], folded["attn_norm"])
    assert any((c < 1).any() for c in clips.values()), "random weights: some group gains from clipping"


def test_awq_clip_search_picks_each_groups_least_output_error(seed, monkeypatch):
    torch.manual_seed(seed % 2**31)
    w = torch.randn(32, 192) * 0.02
    w[torch.rand(32, 192) < 0.01] *= 8  # outliers that stretch their group's range
    x = torch.randn(400, 192) * (torch.rand(192) * 3 + 0.2)
    clip = awq.clip_search(w, x, 3, 64)
    grid = torch.tensor(awq.CLIPS, dtype=torch.float32)
    assert clip.shape == (32, 3) and torch.isin(clip, grid).all()
    # brute force over the grid, each group's error summed over the tokens
    errs = torch.stack([((x.double().view(400, 1, 3, 64) * (rtn_dequantized(w, 3, 64, torch.full((32, 3), r))
                                                             - w).double().view(1, 32, 3, 64)).sum(-1) ** 2).sum(0)
                        for r in awq.CLIPS])  # [clips, N, G]
    picked = errs.gather(0, (clip[None] == grid[:, None, None]).float().argmax(0)[None])[0]
    assert (picked <= errs.min(0).values * (1 + 1e-9)).all(), f"seed={seed}"
    assert (clip < 1).float().mean() > 0.5, f"seed={seed}: most groups gain from clipping (~92%)"
    # the layer's output error falls (the cross-group terms were left out of the search, so not by construction)
    out_err = lambda w_hat: ((x @ (w_hat - w).T) ** 2).mean().item()  # noqa: E731
    plain, clipped = (out_err(quantize_rtn(w, 3, 64, c).dequantize()) for c in (None, clip))
    assert clipped < 0.95 * plain, f"seed={seed}: {clipped} vs {plain}"  # ~0.77x
    with pytest.raises(ValueError, match="clip"):
        quantize_rtn(w, 3, 64, torch.full((32, 3), 1.5))
    monkeypatch.setattr(quant, "_BLOCK_ELEMS", 20 * 192)  # blocks of 16 rows (the packing's tile): the same choice
    assert torch.equal(awq.clip_search(w, x, 3, 64), clip)


# ------------------------------------------------------------------------------------------- SqueezeLLM tables

def naive_lloyd(row: torch.Tensor, imp: torch.Tensor, c: int, iters: int = 300) -> torch.Tensor:
    """Weighted Lloyd on one row with Python loops, from the same weighted-quantile start."""
    order = row.argsort()
    srt, wts = row[order].double(), imp[order].double()
    cw = wts.cumsum(0) / wts.sum()
    cent = [srt[min(int((cw < (i + 0.5) / c).sum()), len(srt) - 1)].item() for i in range(c)]
    for _ in range(iters):
        mids = [(a + b) / 2 for a, b in zip(cent, cent[1:])]
        num, den = [0.0] * c, [0.0] * c
        for x, wt in zip(srt.tolist(), wts.tolist()):
            j = sum(x > m for m in mids)
            num[j] += wt * x
            den[j] += wt
        new = sorted(num[j] / den[j] if den[j] > 0 else cent[j] for j in range(c))
        if new == cent:
            break
        cent = new
    return torch.tensor(cent, dtype=torch.float64)


def kmeans_optimum(row: torch.Tensor, imp: torch.Tensor, c: int) -> float:
    """The least weighted squared error of c clusters of one row: dynamic programming over runs of the sorted
    values, in plain Python (O(c K^2))."""
    order = row.argsort()
    xs, ws = row[order].double().tolist(), imp[order].double().tolist()
    pw, px, pq = [0.0], [0.0], [0.0]
    for x, w in zip(xs, ws):
        pw.append(pw[-1] + w), px.append(px[-1] + w * x), pq.append(pq[-1] + w * x * x)
    n = len(xs)
    err = lambda i, j: pq[j + 1] - pq[i] - (px[j + 1] - px[i]) ** 2 / (pw[j + 1] - pw[i])  # noqa: E731
    best = [err(0, j) for j in range(n)]
    for m in range(1, c):
        best = [min((best[i - 1] + err(i, j) for i in range(m, j + 1)), default=math.inf) for j in range(n)]
    return best[-1]


def weighted_error(row: torch.Tensor, imp: torch.Tensor, cent: torch.Tensor) -> float:
    """sum_c imp[c] (row[c] - nearest centroid)^2."""
    d = (row.double()[:, None] - cent.double()[None, :]) ** 2
    return float((d.min(1).values * imp.double()).sum())


def test_lut_centroids_reach_the_weighted_kmeans_optimum(seed):
    torch.manual_seed(seed % 2**31)
    w = torch.randn(3, 128) * 0.02  # K <= bins: the start is the exact optimum
    w[0, :64] = w[0, 64:]  # repeated values, as in weights converted from a GGUF file
    imp = torch.rand(128) ** 3
    got = lut_centroids(w, 3, imp)
    assert got.dtype == torch.float16 and got.shape == (3, 8) and (got.diff(dim=1) >= 0).all()
    for r in range(3):
        opt = kmeans_optimum(w[r], imp.clamp(min=1e-12), 8)
        e = weighted_error(w[r], imp, got[r])
        assert opt * (1 - 1e-9) <= e <= opt * (1 + 2e-3), f"seed={seed} row={r}: {e} vs the optimum {opt}"


def test_lut_centroids_beat_lloyd_from_quantiles(seed):
    torch.manual_seed(seed % 2**31)
    w = torch.randn(16, 384) * 0.02  # K > bins: the start is the optimum over runs of 3 sorted values
    w[1::4] = torch.round(w[1::4] * 800) / 800  # few distinct values
    imp = torch.rand(384) ** 3
    got = lut_centroids(w, 3, imp)
    ratios = []
    for r in range(16):
        e, lloyd = weighted_error(w[r], imp, got[r]), weighted_error(w[r], imp, naive_lloyd(w[r], imp, 8).half())
        # the start is exact only up to runs of 3 values: a row may end a little above Lloyd's (<= 1.6% in 6400 rows)
        assert e <= lloyd * 1.05, f"seed={seed} row={r}: {e} vs {lloyd}"
        ratios.append(e / lloyd)
        assert_lloyd_fixed_point(w[r], imp, got[r], f"seed={seed} row={r}")
    assert sum(ratios) / 16 < 0.95, f"seed={seed}: error {sum(ratios) / 16:.3f}x Lloyd's on average"  # ~0.85x


def assert_lloyd_fixed_point(row: torch.Tensor, imp: torch.Tensor, cent: torch.Tensor, where: str) -> None:
    """Each fp16 centroid is the weighted mean of the weights nearest to it. Rounding the centroids to fp16 moves
    the midpoints by up to an ulp, so a weight that close to a midpoint may belong to either side: some choice of
    sides for those must give every mean."""
    x, c = row.double(), cent.double()
    d = (x[:, None] - c[None, :]).abs()
    near = d.argmin(1)
    two = d.topk(2, dim=1, largest=False)
    ulp = float(torch.finfo(torch.float16).eps) * c.abs().max().item()
    unsure = x[two.values[:, 1] - two.values[:, 0] <= ulp].unique()  # equal weights move together
    for m in near.unique().tolist():
        sides = [v for v in unsure.tolist() if m in two.indices[x == v][0].tolist()]
        assert len(sides) <= 8, f"{where} cluster={m}: {len(sides)} values at its midpoints"
        means = []
        for pick in range(2 ** len(sides)):
            sel = (near == m).clone()
            for b, v in enumerate(sides):
                sel[x == v] = bool(pick >> b & 1)
            if sel.any():
                means.append(float((x[sel] * imp[sel]).sum() / imp[sel].double().sum()))
        assert min(abs(c[m].item() - u) for u in means) <= 2e-3 * abs(c[m].item()) + 1e-6, f"{where} cluster={m}"


@pytest.mark.parametrize("bits", (2, 3, 4))
def test_quantize_lut(bits, seed):
    w = torch.randn(32, 256) * 0.05
    imp = torch.rand(256)
    q = quantize_lut(w, bits, imp)
    assert isinstance(q, QuantLUT) and q.lut.shape == (32, 2**bits) and q.lut.dtype == torch.float16
    assert q.qweight.shape == (2, 256 * bits // 2) and q.nbytes == q.qweight.numel() * 4 + 32 * 2**bits * 2
    assert (q.lut.diff(dim=1) >= 0).all(), "tables ascend"
    w_hat = q.dequantize()
    # every weight took its nearest fitted value (codes in the packed layout of the uniform weights), and runs as
    # that value on the row's 8-bit grid
    codes = unpack_codes(q.qweight, bits).long()
    dist = (w[:, :, None] - q.lut.float()[:, None, :]).abs()
    assert torch.allclose((w - q.lut.float().gather(1, codes)).abs(), dist.min(-1).values), f"seed={seed}"
    assert torch.equal(w_hat, q.values().gather(1, codes))
    assert torch.equal(q.dequantize(torch.float16), w_hat.half())
    u = q.unpacked(slice(16, 32))  # the CPU's low-memory form of the second tile: codes as bytes, the same rows
    assert u.codes.dtype == torch.uint8 and torch.equal(u.rows(), w_hat[16:]) and q.unpacked_nbytes == 2 * u.nbytes


@pytest.mark.parametrize("bits", (2, 3, 4))
def test_quantize_lut_grouped(bits, seed):
    k = 576  # four groups of 128 and a partial one of 64
    w = torch.randn(32, k) * 0.05 * (torch.rand(k) * 4 + 0.1)
    w[3, 128:256] = 0.01  # a constant group
    q = quantize_lut(w, bits, torch.rand(k), group_size=128)
    assert q.group_size == 128 and q.scales.shape == q.offsets.shape == (32, 5) and q.scales.dtype == torch.float16
    assert q.nbytes == q.qweight.numel() * 4 + 32 * 2**bits * 2 + 32 * 5 * 4
    s, o = table_groups(w, bits, 128)
    assert torch.equal(q.scales, s) and torch.equal(q.offsets, o)
    assert o[3, 1] <= 0.01 and 0 < s[3, 1] < 1e-5  # the constant group: its offset at (or just below) its value
    # every weight took the table value nearest it in its group's unit u = (w - offset) / scale
    sf, of = (t.float().repeat_interleave(128, dim=1)[:, :k] for t in (s, o))
    u = (w - of) / sf
    assert u.min() >= 0 and u.max() <= 2**bits - 1, "every group's [min, max] maps into [0, 2^bits - 1]"
    codes = unpack_codes(q.qweight, bits).long()
    dist = (u[:, :, None] - q.lut.float()[:, None, :]).abs()
    assert torch.allclose((u - q.lut.float().gather(1, codes)).abs(), dist.min(-1).values, atol=1e-5), f"seed={seed}"
    # and runs as offset + scale * (the entry on the row's 8-bit grid), in float64 then rounded once
    want = (of.double() + sf.double() * q._values64().gather(1, codes)).float()
    assert torch.equal(q.dequantize(), want) and torch.equal(q.dequantize(torch.float16), want.half())
    u = q.unpacked()  # the CPU's low-memory form, partial last group included
    assert torch.equal(u.rows(), want) and q.unpacked_nbytes == u.nbytes
    with pytest.raises(ValueError, match="not whole 16-row tiles"):
        q.unpacked(slice(8, 32))
    assert (q.dequantize()[3, 128:256] - 0.01).abs().max() < 1e-5  # the constant group, through its offset
    with pytest.raises(ValueError, match="multiple of 64"):
        quantize_lut(w, bits, group_size=96)
    # the partial last group's range is its own 64 weights' (one-signed ones here: padding would reach 0)
    w1 = torch.randn(32, k) * 0.05 + 0.3
    s, o = table_groups(w1, bits, 128)
    s_last, o_last = table_groups(w1[:, 512:], bits, 64)  # the same weights as a whole group
    assert torch.equal(s[:, 4], s_last[:, 0]) and torch.equal(o[:, 4], o_last[:, 0]), f"seed={seed}"
    lo = w1[:, 512:].amin(1)
    assert (o[:, 4].float() <= lo).all() and (o[:, 4].float() > lo - 1e-3).all()


def test_a_refit_table_keeps_each_weights_value_whatever_order_it_comes_in(seed, monkeypatch):
    """refit_table may return a row's values in another order than the codes were drawn against: the codes are
    renumbered with it. (A real refit mostly swaps neighbours, for which a wrong renumbering agrees; a cyclic shift
    does not.)"""
    torch.manual_seed(seed % 2**31)
    w, x = torch.randn(32, 128) * 0.02, torch.randn(200, 128)
    cent = lut_centroids(w, 3)
    codes = (w[:, :, None] - cent.float()[:, None, :]).abs().argmin(-1)
    table = cent.double().roll(1, dims=1)
    monkeypatch.setattr(squeezellm, "refit_table", lambda *a, **k: table)
    q = quantize_lut(w, 3, None, x)
    want = QuantLUT(q.qweight, table.half(), 3, 128)  # (the shifted table, the codes as first drawn)
    assert torch.equal(q.dequantize(), want.values().gather(1, codes)), f"seed={seed}"


@pytest.mark.parametrize("bits", (2, 3, 4))
def test_tables_run_on_an_8_bit_grid_per_row(bits, seed):
    lut = (torch.randn(64, 2**bits) * torch.rand(64, 1) * 0.1).half()
    lut[0] = 0.25  # a constant row
    if bits == 4:  # ties that leave no even split but all on one side (_even_split's fallback)
        lut[1] = torch.tensor([-0.03] * 7 + [0.05] * 9)
    q = QuantLUT(pack_codes(torch.randint(0, 2**bits, (64, 128), dtype=torch.uint8), bits), lut, bits, 128)
    v, scale, offset = q.grid()
    assert v.dtype == torch.uint8 and int(v.max()) <= TABLE_LEVELS
    t = lut.double()
    lo, hi = t.min(1).values, t.max(1).values
    assert scale[0] == 0 and (scale[1:] > 0).all()
    if bits < 4:  # the row's range on 0..255
        assert torch.equal(offset, lo.float())
        assert (v[1:].min(1).values == 0).all() and (v[1:].max(1).values == TABLE_LEVELS).all(), f"seed={seed}"
    else:  # an even number of entries below 128 (the GPU's pairs), on the grid that moves them least
        assert ((v < 128).sum(1) % 2 == 0).all(), f"seed={seed}"
        moved = lambda v, s, o: (o.double()[:, None] + s.double()[:, None] * v.double() - t).square().sum(1)  # noqa
        mine = moved(v, scale, offset)
        scale0 = ((hi - lo) / TABLE_LEVELS).float()
        v0 = quant._snap(t, scale0, lo.float()).clamp(0, TABLE_LEVELS)
        even0 = (v0 < 128).sum(1) % 2 == 0
        assert even0.any() and not even0.all(), f"seed={seed}: both kinds of rows occur"
        # (candidates are scored in float32: near-ties within its rounding, ~1e-5 of a row's sum, may go either way)
        assert (mine <= moved(v0, scale0, lo.float()) * (1 + 1e-3) + 1e-30)[even0].all(), f"seed={seed}"
        ve, se, oe = quant._even_split(t)
        assert (mine <= moved(ve.clamp(0, TABLE_LEVELS), se, oe) * (1 + 1e-3) + 1e-30).all(), f"seed={seed}"
        assert (scale.double() <= (hi - lo) / 127.5 * (1 + 2**-20)).all()
        assert ((v[1] < 128).all() or (v[1] >= 128).all()) and scale[1] > (hi[1] - lo[1]) / 128
    # each entry moves by at most half a step (plus float32 rounding: of the scale, times v <= 255, and of the entry;
    # without it 1.4% of seeds failed by ~1e-9), and the grid keeps the table's order
    tol = scale.double()[:, None] * (0.5 + TABLE_LEVELS * 2**-24) + t.abs() * 2**-23 + 1e-12
    assert ((q.values().double() - t).abs() <= tol).all(), f"seed={seed}"
    order = t.argsort(1)
    assert (v.gather(1, order).diff(dim=1) >= 0).all()
    assert torch.equal(q.values()[0], torch.full((2**bits,), 0.25))


def test_lut_importance_protects_the_important_channels(seed):
    w = torch.randn(64, 512) * 0.02
    imp = torch.ones(512)
    imp[:32] = 1000.0
    plain, weighted = quantize_lut(w, 3).dequantize(), quantize_lut(w, 3, imp).dequantize()
    e = lambda w_hat, sl: ((w - w_hat)[:, sl] ** 2).mean().item()  # noqa: E731
    assert e(weighted, slice(0, 32)) < 0.8 * e(plain, slice(0, 32)), f"seed={seed}"
    # and a non-uniform table fits a Gaussian row better than a uniform grid of as many levels
    assert ((w - plain) ** 2).mean() < ((w - rtn_dequantized(w, 3, 512)) ** 2).mean(), f"seed={seed}"


def test_grouped_tables_fit_rows_whose_channels_differ_in_scale(seed):
    torch.manual_seed(seed % 2**31)
    w = torch.randn(64, 512) * 0.02
    w[:, :256] *= 0.2  # half the input channels (say, heads) 5x smaller in every row
    imp = torch.ones(512)
    plain, grouped = quantize_lut(w, 3, imp).dequantize(), quantize_lut(w, 3, imp, group_size=128).dequantize()
    err = lambda w_hat, sl=slice(None): ((w - w_hat)[:, sl] ** 2).sum().item()  # noqa: E731
    # the small channels keep their precision instead of sharing the large ones' levels, and the total is lower
    assert err(grouped, slice(0, 256)) < 0.3 * err(plain, slice(0, 256)), f"seed={seed}"
    assert err(grouped) < err(plain), f"seed={seed}"


def test_refit_table_is_the_least_squares_fit_of_the_output(seed):
    torch.manual_seed(seed % 2**31)
    w = torch.randn(32, 128) * 0.02
    x = torch.randn(600, 128) * (torch.rand(128) * 3 + 0.2)
    cent = lut_centroids(w, 3)
    codes = (w[:, :, None] - cent.float()[:, None, :]).abs().argmin(-1)
    codes[0][codes[0] == 7] = 6  # row 0 leaves its last value unused
    got = refit_table(w[16:], codes[16:], cent[16:], x, damp=0.0)
    err = lambda r, table: ((x.double() @ (table[codes[r]] - w[r].double())) ** 2).sum().item()  # noqa: E731
    for r in range(16, 32):  # undamped: the plain least-squares solution over X A
        a = F.one_hot(codes[r], 8).double()
        want = torch.linalg.lstsq(x.double() @ a, x.double() @ w[r].double()).solution
        assert torch.allclose(got[r - 16], want, rtol=1e-4, atol=1e-7), f"seed={seed} row={r}"
        assert err(r, got[r - 16]) <= err(r, cent[r].double()), f"seed={seed} row={r}"
    damped = refit_table(w, codes, cent, x)
    assert torch.isclose(damped[0, 7], cent[0, 7].double(), rtol=1e-9)  # an unused value keeps its k-means value
    assert all(err(r, damped[r]) <= err(r, cent[r].double()) for r in range(32)), f"seed={seed}"
    # quantize_lut with inputs: ascending tables, each weight's value the refit one of its k-means code
    q = quantize_lut(w, 3, None, x)
    assert (q.lut.diff(dim=1) >= 0).all()
    codes = (w[:, :, None] - cent.float()[:, None, :]).abs().argmin(-1)
    refit = QuantLUT(q.qweight, refit_table(w, codes, cent, x).half(), 3, 128)  # the same tables, unsorted
    assert torch.equal(q.dequantize(), refit.values().gather(1, codes))
    # with per-weight scales (grouped tables): weight c is scale[c] * table[code], the least-squares fit of w
    sc = torch.rand(32, 128) + 0.5
    got = refit_table(w, codes, cent, x, damp=0.0, scale=sc)
    for r in range(4):
        a = F.one_hot(codes[r], 8).double() * sc[r].double()[:, None]
        want = torch.linalg.lstsq(x.double() @ a, x.double() @ w[r].double()).solution
        assert torch.allclose(got[r], want, rtol=1e-4, atol=1e-7), f"seed={seed} row={r}"


def test_squeezellm_block_quantizes_grouped_tables(seed):
    cfg, t = CFG, random_block(CFG, torch.float32)
    inputs = {k: torch.randn(300, n) * torch.rand(n) * 4 for k, n in
              (("qkv", 128), ("o", 128), ("gate_up", 128), ("down", 192))}
    qt, _ = quantize_block(t, 3, 128, True, "squeezellm", inputs, cfg)
    for kind in KINDS:  # k-means weighted by the inputs' mean x^2, refit on refit_inputs, groups of 128
        want = quantize_lut(t[kind]["weight"], 3, inputs[kind].square().mean(0), refit_inputs(inputs[kind]), 128)
        got = qt[kind]["quant"]
        assert torch.equal(got.lut, want.lut) and torch.equal(got.qweight, want.qweight)
        assert got.group_size == 128 and torch.equal(got.scales, want.scales)
        assert torch.equal(got.offsets, want.offsets)


def test_refit_inputs_mask_the_channels_qdec_compensates():
    x = torch.randn(5000, 2048)
    x[x == 0] = 1.0  # 10M normal draws hold an exact zero now and then
    got = refit_inputs(x)
    n = REFIT_TOKENS
    assert got.shape == (2 * n, 2048) and torch.equal(got[:n], x[torch.linspace(0, 4999, n).long()])
    masked = got[n:]
    for chunk in (slice(0, 1024), slice(1024, 2048)):  # per 1024 channels, the REFIT_K_CHUNK largest |x| are zeroed
        plain, m = got[:n, chunk], masked[:, chunk]
        assert ((m == 0).sum(1) == REFIT_K_CHUNK).all()
        kept_max = m.abs().max(1).values
        dropped_min = torch.where(m == 0, plain.abs(), torch.inf).min(1).values
        assert (dropped_min >= kept_max).all() and torch.equal(m[m != 0], plain[m != 0])


# ----------------------------------------------------------------------------------------------- mixed bits

def test_mixed_bits_takes_the_least_sensitive_half():
    assert mixed_bits([0.5, 0.1, 0.9, 0.2], 3.5) == [4, 3, 4, 3]
    assert mixed_bits([0.3, 0.1, 0.2], 3.5) == [4, 3, 4]
    assert mixed_bits([0.3, 0.1], 2.5) == [3, 2]


def test_kl_sensitivity_measures_each_blocks_damage(tiny_ckpt):
    from localllm.loader import open_checkpoint
    ckpt = open_checkpoint(tiny_ckpt)
    toks = torch.randint(0, ckpt.config.vocab_size, (2, 32))

    def noisy(scale):
        def quantize_one(i, t, h):
            for k in KINDS:
                t[k] = {"weight": t[k]["weight"] + scale[i] * torch.randn_like(t[k]["weight"]),
                        "bias": t[k].get("bias")}
            return t
        return quantize_one

    assert kl_sensitivity(ckpt, toks, noisy([0.0, 0.0])) == pytest.approx([0.0, 0.0], abs=1e-6)
    kls = kl_sensitivity(ckpt, toks, noisy([0.0, 0.2]))
    assert kls[0] == pytest.approx(0.0, abs=1e-6) and kls[1] > 1e-3
    kls = kl_sensitivity(ckpt, toks, noisy([0.3, 0.01]))
    assert kls[0] > kls[1] > 0


def test_block_inputs_are_what_the_projections_multiply(tiny_ckpt):
    from localllm.loader import open_checkpoint
    ckpt = open_checkpoint(tiny_ckpt)
    cfg, t = ckpt.config, ckpt.block_tensors(0)
    h = torch.randn(2, 16, cfg.hidden_size)
    pos = torch.arange(16)
    x = block_inputs(cfg, 0, t, h, rope_tables(rope_inv_freq(cfg), pos), pos, attention_mask(pos, None))
    assert {k: v.shape for k, v in x.items()} == {"qkv": (32, 64), "o": (32, 64), "gate_up": (32, 64),
                                                   "down": (32, 192)}
    n = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + cfg.rms_norm_eps) * t["attn_norm"]
    assert torch.allclose(x["qkv"], n.reshape(32, -1), atol=1e-5)


# ------------------------------------------------------------------------------- end to end on the tiny model

@pytest.fixture(scope="module", params=["awq", "squeezellm"])
def method_quant(request, tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "m"
    return request.param, quantize(str(tiny_ckpt), str(out), bits=3.5, method=request.param,
                                   group_size=128 if request.param == "squeezellm" else 64, calib_tokens=512,
                                   seq_len=128)


def test_methods_end_to_end(method_quant, tiny_ckpt, capsys):
    method, path = method_quant
    m = json.loads((path / "localllm.json").read_text())
    q = m["quant"]
    assert q["method"] == method and q["bits"] == 3.5 and sorted(q["block_bits"]) == [3, 4]
    from localllm.modelfile import quant_label
    assert "3.5-bit" in quant_label(q) and "(1 block 3-bit, 1 block 4-bit)" in quant_label(q)
    assert quant_label({**q, "block_bits": [4]}).startswith("3.5-bit") and "(1 block 4-bit)" in quant_label(
        {**q, "block_bits": [4]})  # (one block: all of it at the higher width)
    assert len(q["sensitivity"]["kl"]) == 2 and q["sensitivity"]["tokens"] > 0
    assert q["layout"] == ("lut-group-mma-v3" if method == "squeezellm" else "rtn-mma-v3")
    assert ("awq_alpha" in q and "awq_clip" in q) == (method == "awq")
    lm, src = load(path, qdec="off"), load(tiny_ckpt).model
    d = describe(lm)["awq"]
    if method == "awq":  # alpha 0 is RTN, so no pick measures worse than RTN
        assert all(0 < p["error_vs_rtn"] <= 1 for blk in q["awq_alpha"] for p in blk.values())
        # `localllm info` sums the picks up per projection kind
        from localllm.cli import main
        assert set(d) == {"qkv", "o", "gate_up", "down"}
        for kind, v in d.items():
            picks = [blk[kind] for blk in q["awq_alpha"]]
            assert v["blocks"] == len(picks) == 2
            assert v["rtn_blocks"] == sum(p["alpha"] == 0 and not p["duo"] for p in picks)
            assert v["mean_error_vs_rtn"] == pytest.approx(sum(p["error_vs_rtn"] for p in picks) / 2)
        assert main(["info", str(path)]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("awq "))
        assert f"qkv {d['qkv']['mean_error_vs_rtn']:.3f}" in line and "of 8 projections kept RTN" in line
    else:
        assert d is None
    assert ("table_refit" in q) == (method == "squeezellm")
    for blk, bits in zip(lm.model.blocks, q["block_bits"]):
        assert {lin.quant.bits for lin in (blk.qkv, blk.o, blk.gate_up, blk.down)} == {bits}
        assert all(isinstance(lin.quant, QuantLUT) == (method == "squeezellm") for lin in (blk.qkv, blk.down))
        assert all(lin.quant.group_size == (128 if method == "squeezellm" else 64) for lin in (blk.qkv, blk.down))
    toks = torch.randint(0, src.cfg.vocab_size, (1, 48))
    with torch.no_grad():
        ref = src(toks)
        off = (lm.model(toks) - ref).norm() / ref.norm()
        lm.set_qdec({"mode": "exact", "k_chunk": 1024})  # every channel: the residuals are of the stored weights
        full = (lm.model(toks) - ref).norm() / ref.norm()
        lm.set_qdec({"mode": "approx", "k_chunk": 16})  # the calibration statistics are there for approx
        some = (lm.model(toks) - ref).norm() / ref.norm()
    assert full < 0.3 * off and some < off, (off, some, full)


def test_files_of_other_formats(method_quant, tmp_path):
    method, path = method_quant
    dst = tmp_path / "copy"
    shutil.copytree(path, dst)
    m = json.loads((dst / "localllm.json").read_text())
    m["quant"]["layout"] = "lut-mma-v9"
    (dst / "localllm.json").write_text(json.dumps(m))
    with pytest.raises(LocalLLMError, match="layout 'lut-mma-v9', which this localllm cannot read"):
        load(dst)
    m["quant"]["layout"], m["format_version"] = "lut-group-mma-v3", 3  # version 3 had no grouped tables
    (dst / "localllm.json").write_text(json.dumps(m))
    with pytest.raises(LocalLLMError, match="layout 'lut-group-mma-v3', which this localllm cannot read"):
        load(dst)
    m["quant"]["layout"], m["format_version"] = "lut-mma-v3", 1  # version 1 had no tables
    (dst / "localllm.json").write_text(json.dumps(m))
    with pytest.raises(LocalLLMError, match="older format"):
        load(dst)
    if method == "squeezellm":  # per-row tables (format 2 and 3 files) still load: the same files read so
        m["quant"]["layout"], m["format_version"] = "lut-mma-v3", 3
        (dst / "localllm.json").write_text(json.dumps(m))
        lin = load(dst, qdec="off").model.blocks[0].qkv
        assert isinstance(lin.quant, QuantLUT) and lin.quant.scales is None and lin.quant.group_size is None


def test_version_1_files_still_load(tiny_quant, tmp_path):
    dst = tmp_path / "v1"
    shutil.copytree(tiny_quant, dst)
    m = json.loads((dst / "localllm.json").read_text())
    m["format_version"] = 1
    del m["quant"]["block_bits"]
    (dst / "localllm.json").write_text(json.dumps(m))
    lm = load(dst, qdec="off")
    assert {lin.quant.bits for lin in lm.model.linears()} == {3}
    m["quant"]["block_bits"] = [3, 5]
    m["format_version"] = 2
    (dst / "localllm.json").write_text(json.dumps(m))
    with pytest.raises(LocalLLMError, match="quant.block_bits \\(not of quant.bits\\)"):
        load(dst)


def test_quantize_command_methods_and_bits(tiny_ckpt, tmp_path, capsys):
    from localllm.cli import main
    out = tmp_path / "sq"
    assert main(["quantize", str(tiny_ckpt), "-o", str(out), "--bits", "3", "--method", "squeezellm",
                 "--calib-tokens", "512"]) == 0
    assert main(["info", str(out)]) == 0
    assert "3-bit SqueezeLLM" in capsys.readouterr().out
    with pytest.raises(LocalLLMError, match="--method bogus"):
        quantize(str(tiny_ckpt), str(tmp_path / "x"), method="bogus")
    with pytest.raises(LocalLLMError, match="--bits 3.25 is not supported"):
        quantize(str(tiny_ckpt), str(tmp_path / "x"), bits=3.25)
    with pytest.raises(LocalLLMError, match="squeezellm groups its tables by 128"):
        quantize(str(tiny_ckpt), str(tmp_path / "x"), method="squeezellm", group_size=64)


def test_tuner_bounds_k_chunk_by_the_widest_layer_of_a_kind(tiny_ckpt, tmp_path):
    """With mixed bits the 4-bit layers need the most shared memory for a k_chunk: they set the bound."""
    from localllm.kernels import qdec
    from localllm.tuner.timing import problem_of
    path = quantize(str(tiny_ckpt), str(tmp_path / "m"), bits=3.5, group_size=64, calib_tokens=512, seq_len=128)
    lm = load(path, qdec="off")
    grid_of = lambda N: min(N // 16, 132)  # noqa: E731 - kernels.gemv.grid_of on an H100
    downs = [lin for lin in lm.model.linears() if lin.kind == "down"]
    assert sorted(lin.quant.bits for lin in downs) == [3, 4]
    # on a GPU short of shared memory (a limit under 200 KB: gemv.tiles_per_barrier's smaller static part)
    need = {lin.quant.bits: qdec.shared_bytes_total(lin.quant, 10, grid_of(lin.out_features), 99 * 1024)
            for lin in downs}
    assert need[4] > need[3]
    for blocks in (list(lm.model.blocks), list(lm.model.blocks)[::-1]):  # whichever comes first
        lm.model.blocks = torch.nn.ModuleList(blocks)
        p = problem_of(lm, sm_count=132, smem=need[4], grid_of=grid_of)
        assert {lay.kind: lay.k_max for lay in p.layers}["down"] == 10


def test_a_gpu_out_of_memory_halves_the_row_blocks_then_names_the_fix(monkeypatch, capsys):
    """On a GPU a step that runs out of memory runs again with row blocks half as large, down to the CPU's size, and
    later steps keep the smaller size; then the error is one line that names --device cpu (the GPU tests force it
    inside quantize). On the CPU the error passes through as it is."""
    from types import SimpleNamespace
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Some GPU")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=6 * 2**30))
    fit, seen = GpuMemoryFit(torch.device("cuda")), []

    def step(fits_at):
        # the row blocks a step sees, in units of the CPU's (4096 rows of 1024 channels)
        seen.append(next(quant._row_blocks(1 << 20, 1024, device=torch.device("cuda"))).stop // 4096)
        if seen[-1] > fits_at:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return "done"
    assert fit("quantizing block 3", lambda: step(4)) == "done"
    assert seen == [16, 8, 4] and fit.factor == 4
    assert "ran out of memory quantizing block 3; trying again with smaller row blocks (4x" in capsys.readouterr().err
    seen.clear()
    assert fit("quantizing block 4", lambda: step(4)) == "done" and seen == [4]
    with pytest.raises(LocalLLMError, match=r"^the GPU \(Some GPU, 6 GiB\) ran out of memory quantizing block 5; "
                                            r"quantize on the CPU with --device cpu"):
        fit("quantizing block 5", lambda: step(0))
    assert seen[1:] == [4, 2, 1]
    assert next(quant._row_blocks(1 << 20, 1024, device=torch.device("cuda"))).stop == 16 * 4096  # restored after
    with pytest.raises(torch.OutOfMemoryError):
        GpuMemoryFit(torch.device("cpu"))("quantizing block 3", lambda: step(0))

# ----------------------------------------------------------------------------------------- QDEC's value per kind

def test_qdec_value_is_the_kl_that_eval_measures(tiny_quant, tiny_ckpt):
    """quantize records, per kind, the KL divergence from the source with that kind compensated (approx, every
    block) beside QDEC off; the same numbers as `localllm eval --reference` on the same tokens."""
    from localllm.evaluate import Reference, losses
    from localllm.quantize import calibration_text, calibration_tokens
    m = json.loads((tiny_quant / "localllm.json").read_text())
    v, c = m["calibration"]["qdec_value"], m["calibration"]
    assert v["metric"] == "kl" and v["mode"] == "approx" and set(v["kl"]) == set(KINDS)
    lm = load(tiny_quant, qdec="off")
    text, name = calibration_text(None)
    toks, _ = calibration_tokens(lm.tokenizer, text, name, v["tokens"] + c["seq_len"], c["seq_len"])
    ids = toks.flatten()[: v["tokens"] + 1].tolist()  # the measured sequences; the next one's first token
    assert len(ids) == v["tokens"] + 1
    ref = Reference(load(tiny_ckpt, qdec="off"), lm)
    kl = lambda: losses(lm, ids, c["seq_len"], reference=ref)[1]  # noqa: E731
    assert kl() == pytest.approx(v["off"], rel=1e-3)
    for kind in KINDS:
        lm.set_qdec({"mode": "approx", "k_chunk": {kind: v["k_chunk"]}})
        # (the file's head and final norm are not the source's, and the selection is discrete: a few channels flip;
        # within 2% on 12 seeds, 2.8% on LOCALLLM_TEST_SEED=303232586)
        assert kl() == pytest.approx(v["kl"][kind], rel=4e-2), kind
    # what the residuals buy: compensation takes divergence away (on the mean over kinds: in ~7% of these tiny random
    # models one kind's compensation at k_chunk 8 adds a little, through attention's softmax)
    assert sum(v["kl"].values()) / len(KINDS) < v["off"]


def test_block_values_are_the_first_order_kl_change(tiny_quant, tiny_ckpt):
    """quantize's per-block values (qdec_value["blocks"], blocks run again in reverse one at a time) equal the same
    first-order prediction made in one backward pass of the whole loaded model: minus the gradient of KL(source ||
    model) at each layer's output dotted with the compensation that layer would add."""
    import torch.nn.functional as F
    from localllm.evaluate import Reference
    from localllm.model import select_channels
    from localllm.qdec import compensate
    from localllm.quantize import calibration_text, calibration_tokens
    m = json.loads((tiny_quant / "localllm.json").read_text())
    v, c = m["calibration"]["qdec_value"], m["calibration"]
    fo = v["blocks"]
    lm = load(tiny_quant, qdec="off")
    L = lm.model.cfg.num_layers
    assert fo["k_chunks"] == [1, 2, 4, 8, 16, 32, 64] and all(len(fo["kl"][k]) == L for k in KINDS)
    text, name = calibration_text(None)
    toks, _ = calibration_tokens(lm.tokenizer, text, name, v["tokens"] + c["seq_len"], c["seq_len"])
    toks = toks[: v["tokens"] // c["seq_len"]]
    ref = Reference(load(tiny_ckpt, qdec="off"), lm)
    lins = [lin for lin in lm.model.linears() if lin.kind != "head"]
    X, D = {}, {}
    hooks = [lin.hook_input(lambda lin, x: X.setdefault(lin, []).append(x.detach().reshape(-1, x.shape[-1])))
             for lin in lins]

    def add_delta(mod, args, kwargs, y):  # a zero added to the output, whose gradient is the output's
        D.setdefault(mod, []).append(torch.zeros_like(y, requires_grad=True))
        return y + D[mod][-1]
    hooks += [lin.register_forward_hook(add_delta, with_kwargs=True) for lin in lins]
    with torch.enable_grad():
        kl = 0.0
        for s, seq in enumerate(toks):
            w = torch.cat([seq, seq[:1]])  # the last token's successor is not scored: the KL needs no target
            lp = F.log_softmax(lm.model(seq[None], 0, None)[0].float(), -1)
            r = ref.log_probs(s * c["seq_len"], w)
            kl = kl + (r.exp() * (r - lp)).sum()
        (kl / toks.numel()).backward()
    for h in hooks:
        h.remove()
    lm.settings.mode = "approx"
    want = {}
    for lin in lins:
        x = torch.cat(X[lin])
        g = torch.cat([d.grad.reshape(-1, d.shape[-1]) for d in D[lin]])
        for j, k in enumerate(fo["k_chunks"]):
            # (g is of the mean KL per token: its product with the compensation is the change in that mean)
            want[lin.kind, lin.block, j] = -float((g * compensate(x, select_channels(lin, x, k), lin.residual)).sum())
    # (the loaded model's head and final norm are the file's, not the source's: the gradient moves a little; and the
    # selection is discrete)
    scale = max(abs(w) for w in want.values())
    assert scale > 0 and sum(abs(fo["kl"][kind][b][j] - w) for (kind, b, j), w in want.items()) < \
        0.05 * sum(abs(w) for w in want.values())
    for (kind, b, j), w in want.items():
        assert fo["kl"][kind][b][j] == pytest.approx(w, rel=0.2, abs=0.05 * scale), (kind, b, fo["k_chunks"][j])


def test_quantize_keeps_the_model_when_the_block_values_run_out_of_memory(tiny_ckpt, tmp_path, monkeypatch, capsys):
    """The per-block values are an improvement for the tuner: out of memory measuring them, quantize says so in one
    line and saves the model without them (the tuner then falls back to its estimate)."""
    import localllm.quantize as q

    def oom(*a, **k):
        raise torch.OutOfMemoryError("test")
    monkeypatch.setattr(q, "first_order_values", oom)
    out = q.quantize(str(tiny_ckpt), str(tmp_path / "m"), bits=4, group_size=64, calib_tokens=256, seq_len=128)
    v = json.loads((out / "localllm.json").read_text())["calibration"]["qdec_value"]
    assert "blocks" not in v and set(v["kl"]) == set(KINDS)
    assert "ran out of memory measuring QDEC's value per block; the model is saved without it" in capsys.readouterr().err
    load(out, qdec="off")


def test_a_calibration_text_too_short_is_refused_in_one_line():
    from localllm.errors import LocalLLMError
    from localllm.quantize import calibration_tokens
    from localllm.synthetic import tokenizer
    tok = tokenizer(384)
    for text in ("", "a few words"):  # an empty file once divided by zero
        with pytest.raises(LocalLLMError, match="too short"):
            calibration_tokens(tok, text, "notes.txt", 4096, 512)


def test_a_calibration_text_shorter_than_asked_is_named_in_a_warning(capsys):
    """A text that gives fewer tokens than --calib-tokens asks for is used (statistics are still made), with a
    warning; one that gives what was asked (to whole sequences) says nothing."""
    from importlib import resources

    from localllm.quantize import calibration_tokens
    from localllm.synthetic import tokenizer
    tok = tokenizer(384)
    text = resources.files("localllm").joinpath("data", "calibration.txt").read_text()[:4000]
    have = len(tok(text, add_special_tokens=False)["input_ids"])
    assert have > 3 * 64
    toks, info = calibration_tokens(tok, text, "short.txt", 4 * have, 64)
    assert info["tokens"] == toks.numel() == have // 64 * 64
    err = capsys.readouterr().err
    assert err.startswith(f"localllm: warning: calibration text short.txt gives {have // 64 * 64} tokens in sequences "
                          f"of 64, fewer than the {4 * have} asked") and err.count("\n") == 1
    calibration_tokens(tok, text, "short.txt", 2 * 64, 64)
    assert capsys.readouterr().err == ""
