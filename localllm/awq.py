"""AWQ (activation-aware weight quantization, Lin et al. 2024): per-input-channel scales s found on calibration
activations, folded into the block so the runtime and the GPU kernels run it unchanged.

A linear layer y = W x becomes y = (W diag(s)) (x / s): the weight is quantized after scaling its input channels
by s, which shrinks the relative rounding error of the channels with large activations. s = mean|x|^alpha or, as
AutoAWQ's "duo" scales, mean|x|^alpha / w_mean^(1 - alpha) (w_mean: how much of its groups' ranges a channel's weights
use; both normalized), alpha from a grid, minimizing the layer's output error ||x W^T - (x / s) Q(W s)^T||^2 on the
calibration inputs, for gate_up the error that reaches the MLP's output through SwiGLU and the unquantized down (alpha
= 0 is plain RTN, so the search never does worse than RTN there). Qwen2.5-Coder-1.5B, whole text, perplexity / KL from
the source, before -> with both: 3 bits 22.38 / 0.263 -> 21.82 / 0.247 (RTN 22.28 / 0.356), 4 bits 18.10 / 0.0582 ->
17.84 / 0.0538 (RTN 17.71 / 0.0598); the demo model lost some (docs/quantization.md). The 1 / s is folded into
whatever produces x:

    qkv, gate_up   the preceding RMSNorm weight (both read the same normed input, so one s each)
    o              the v rows of qkv (attention output = softmax weights x V, linear in V); under GQA one v channel
                   feeds every q head of its group, so s is tied across the group (the group's mean |x|)
    down           the up rows of gate_up (silu(gate) * up is linear in up)

o is searched before qkv and down before gate_up, because their folds change the v / up rows that qkv / gate_up
then quantize. The folded block computes the same function as the source block (tests check it in float64). Then, as
AWQ does, each group's range is shrunk where that lowers the error (clip_search): the weights beyond it take the end
codes, and the residual (QDEC) keeps what the clipping cut.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import ModelConfig
from .quant import TILE_N, _row_blocks, rtn_dequantized

ALPHAS = tuple(i / 20 for i in range(20))  # 0, 0.05, ..., 0.95 (AWQ's grid)
# calibration vectors the error is measured on (evenly spaced over the calibration text). 2048 of the default 4096:
# against 512, demo 3 / 3.5 / 4 bits 59.34 / 41.31 / 33.19 -> 55.92 / 40.45 / 32.38 (QDEC off), Qwen2.5-Coder-1.5B 4
# bits 17.84 / 0.0538 -> 17.80 / 0.0530 (whole text, perplexity / KL); the search then takes ~2x as long
SEARCH_TOKENS = 2048
CLIPS = tuple(1 - i / 20 for i in range(10))  # 1, 0.95, ..., 0.55: a group's range shrunk by up to 45% (AWQ's grid)


def scales_of(mean_abs: Tensor, alpha: float, w_mean: Tensor | None = None) -> Tensor:
    """s = mean|x|^alpha, or with w_mean ("duo" scales, as AutoAWQ) mean|x|^alpha / w_mean^(1 - alpha), normalized so
    that max(s) * min(s) = 1 (AWQ's normalization)."""
    s = mean_abs.double().clamp(min=1e-5) ** alpha
    if w_mean is not None:
        s = s / w_mean.double().clamp(min=1e-5) ** (1 - alpha)
    return s / (s.max() * s.min()).sqrt()


def weight_mean(w: Tensor, group_size: int) -> Tensor:
    """Per input channel of w [N, K]: the mean over rows of |w| relative to the largest |w| of its (row, group), i.e.
    how much of its group's range a channel's weights use (the weight statistic of duo scales)."""
    n, k = w.shape
    g = math.ceil(k / group_size)
    total = torch.zeros(k, dtype=torch.float64, device=w.device)
    for rows in _row_blocks(n, 2 * k, device=w.device):  # bounded float64 temporaries
        a = F.pad(w[rows].double().abs(), (0, g * group_size - k)).view(-1, g, group_size)
        total += (a / a.amax(-1, keepdim=True).clamp(min=1e-30)).view(len(a), -1)[:, :k].sum(0)
    return total / n


def search(w: Tensor, x: Tensor, quantize: Callable[[Tensor], Tensor], mean_abs: Tensor | None = None,
           w_mean: Tensor | None = None, down: Tensor | None = None) -> tuple[Tensor, float, bool, float]:
    """The scales s [K] (float64) minimizing the mean square of x W^T - (x / s) Q(W s)^T over ALPHAS, plain and (given
    w_mean) duo, their alpha, whether they are duo scales, and their error over plain RTN's (alpha 0); with down, of
    what that error becomes at the MLP's output instead: W is gate_up ([gate; up]) and the outputs pass through SwiGLU
    and down [D, N / 2], unquantized.

    w [N, K]; x [T, K] calibration inputs; quantize: W -> W_hat (the base quantizer, dequantized, row by row); mean_abs
    [K]: the per-channel mean |x| the scales come from (default: x's; o passes its GQA-tied one); w_mean [K]:
    weight_mean (o: tied too). The error is summed over row blocks of W, so temporaries stay bounded. The products
    are float32 products of x with W_hat - W (exact in float64, then rounded): float64 ones cost consumer GPUs 64x the
    time, and the error's rounding (~1e-6 of it) only reorders candidates that tie to that precision."""
    x = x.float()
    if x.shape[0] > SEARCH_TOKENS:
        x = x[torch.linspace(0, x.shape[0] - 1, SEARCH_TOKENS).long()]
    mean_abs = x.abs().mean(0) if mean_abs is None else mean_abs
    n, k = w.shape
    if down is None:
        blocks = [(r,) for r in _row_blocks(n, 8 * k, TILE_N, w.device)]
    else:  # gate rows r with their up rows: SwiGLU pairs them
        inter = n // 2
        blocks = [(r, slice(inter + r.start, inter + r.stop)) for r in _row_blocks(inter, 16 * k, TILE_N, w.device)]
        swiglu = lambda y: F.silu(y[:, :y.shape[1] // 2]) * y[:, y.shape[1] // 2:]  # noqa: E731
        ref = [x @ torch.cat([w[r] for r in b]).float().T for b in blocks]  # the source's outputs
    best = (float("inf"), None, 0.0, False)
    for duo in (False, True) if w_mean is not None else (False,):
        for alpha in ALPHAS:
            s = scales_of(mean_abs, alpha, w_mean if duo else None)
            err = 0.0 if down is None else torch.zeros(x.shape[0], down.shape[0], device=w.device)
            for i, b in enumerate(blocks):
                wb = torch.cat([w[r] for r in b]).double()
                # (x / s) Q(W s)^T = x (Q(W s) / s)^T
                dy = x @ (quantize((wb * s).float()).double() / s - wb).float().T
                if down is None:
                    err += dy.double().square().sum().item()
                else:
                    y = ref[i].double()
                    err += (swiglu(y + dy) - swiglu(y)).float() @ down[:, b[0]].float().T
            err = err / (x.shape[0] * n) if down is None else err.double().square().mean().item()
            if err < best[0]:
                best = (err, s, alpha, duo)
            if alpha == 0 and not duo:
                plain = err
    return best[1], best[2], best[3], best[0] / plain if plain > 0 else 1.0


def clip_search(w: Tensor, x: Tensor, bits: int, group_size: int, s: Tensor | None = None) -> Tensor:
    """Per row and group of w [N, K], the shrink of RTN's range in CLIPS that minimizes the group's share of the
    output error on the inputs x [T, K] (x / s, given AWQ's scales s), sum_t (x_t,g . (Q(w)_g - w_g))^2 = d_g^T H_g
    d_g with H_g = X_g^T X_g (each group alone, as AWQ: the cross-group terms are left out) -> clip [N, G] float32
    for quantize_rtn. A shrink wins only if strictly better, so a group whose weights have no outliers keeps its
    whole range."""
    n, k = w.shape
    g = math.ceil(k / group_size)
    gram = torch.zeros(g, group_size, group_size, dtype=torch.float64, device=w.device)
    for rows in _row_blocks(x.shape[0], 2 * k, device=w.device):  # tokens, in float64
        xr = x[rows].double() if s is None else x[rows].double() / s
        xg = F.pad(xr, (0, g * group_size - k)).view(-1, g, group_size).transpose(0, 1)  # [G, T, gs]
        gram += xg.transpose(1, 2) @ xg  # [G, gs, gs]
    best = torch.ones(n, g, device=w.device)
    for rows in _row_blocks(n, k, TILE_N, w.device):  # bounded float64 temporaries
        m = rows.stop - rows.start
        best_err = torch.full((m, g), math.inf, dtype=torch.float64, device=w.device)
        for r in CLIPS:
            clip = torch.full((m, g), r, device=w.device)
            d = (rtn_dequantized(w[rows], bits, group_size, clip) - w[rows].float()).double()
            d = F.pad(d, (0, g * group_size - k)).view(m, g, group_size).transpose(0, 1)  # [G, m, gs]
            err = ((d @ gram) * d).sum(-1).T  # [m, G]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best[rows] = torch.where(better, clip, best[rows])
    return best


def tied(v: Tensor, cfg: ModelConfig) -> Tensor:
    """A statistic [q_size] of o's input channels averaged over the q heads that share a kv head (GQA) and repeated
    back: one scale per v channel."""
    group = cfg.num_heads // cfg.num_kv_heads
    m = v.view(cfg.num_kv_heads, group, cfg.head_dim).mean(1, keepdim=True)
    return m.expand(-1, group, -1).reshape(-1)


def fold(t: dict, cfg: ModelConfig, s: dict[str, Tensor], dtype: torch.dtype = torch.float32) -> dict:
    """Block tensors (Checkpoint.block_tensors' form) with the scales s[kind] [K] folded in: W[:, c] * s[c], and
    1 / s into the producer of the input (see the module doc). Each tensor computed in float64 and rounded once to
    dtype; returns new tensors."""
    d = lambda v: None if v is None else v.to(torch.float64, copy=True)  # noqa: E731 (changed in place below)
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    sv = sd = None
    if "o" in s:
        so = s["o"].double()
        group = cfg.num_heads // cfg.num_kv_heads
        sv = so.view(cfg.num_kv_heads, group, cfg.head_dim)[:, 0].reshape(-1)  # tied: one value per v channel
        if not torch.equal(sv.view(cfg.num_kv_heads, 1, -1).expand(-1, group, -1).reshape(-1), so):
            raise ValueError("o's scales must be tied across the q heads of a kv group (GQA)")
    if "down" in s:
        sd = s["down"].double()

    def weight(kind, producer_rows=None, by=None):  # W * s[kind]; rows producer_rows of W / by (the consumer's s)
        w = d(t[kind]["weight"])
        if by is not None:
            w[producer_rows] /= by[:, None]
        return (w * s[kind].double() if kind in s else w).to(dtype)

    def bias(kind):  # a bias is of the outputs: only the v rows' scale (o's) reaches one
        b = d(t[kind].get("bias"))
        if b is not None and kind == "qkv" and sv is not None:
            b[q + kv:] /= sv
        return None if b is None else b.to(dtype)

    norm = lambda name, kind: d(t[name]) / s[kind].double() if kind in s else d(t[name])  # noqa: E731
    return {"attn_norm": norm("attn_norm", "qkv").to(dtype), "mlp_norm": norm("mlp_norm", "gate_up").to(dtype),
            "qkv": {"weight": weight("qkv", slice(q + kv, None), sv), "bias": bias("qkv")},
            "o": {"weight": weight("o"), "bias": bias("o")},
            "gate_up": {"weight": weight("gate_up", slice(inter, None), sd), "bias": bias("gate_up")},
            "down": {"weight": weight("down"), "bias": bias("down")}}


def awq_block(t: dict, cfg: ModelConfig, inputs: dict[str, Tensor], bits: int, group_size: int
              ) -> tuple[dict, dict[str, dict], dict[str, Tensor]]:
    """Search and fold one block's scales, then search its clipping: t (block tensors), inputs[kind] [T, K] the
    calibration inputs of each projection in the source block (folding leaves the block's function, so these,
    unchanged) -> (folded float32 tensors, {"alpha", "duo", "error_vs_rtn"} per kind, clip [N, G] per kind for
    quantize_rtn)."""
    quantize = lambda w: rtn_dequantized(w, bits, group_size)  # noqa: E731
    s, alphas, cur = {}, {}, t
    for kind in ("o", "qkv", "down", "gate_up"):  # the producer's weights are searched after their fold
        w = cur[kind]["weight"]
        mean, w_mean = None, weight_mean(w, group_size)  # mean None: search takes its inputs' mean |x|
        if kind == "o":  # tied across each GQA group
            mean, w_mean = tied(inputs[kind].float().abs().mean(0), cfg), tied(w_mean, cfg)
        # gate_up: the error that reaches the MLP's output, through SwiGLU and the (unquantized) down
        down = cur["down"]["weight"] if kind == "gate_up" else None
        s[kind], a, duo, gain = search(w, inputs[kind], quantize, mean, w_mean, down)
        alphas[kind] = {"alpha": a, "duo": duo, "error_vs_rtn": round(gain, 4)}
        cur = fold(t, cfg, s)
    # the folded weights multiply x / s
    clips = {kind: clip_search(cur[kind]["weight"], inputs[kind], bits, group_size, s[kind]) for kind in s}
    return cur, alphas, clips
