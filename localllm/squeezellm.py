"""SqueezeLLM-style non-uniform weights (Kim et al. 2024): per output channel a table of 2^bits values fitted by
sensitivity-weighted k-means, each weight the code of its nearest value; the format they run in (QuantLUT: packed
codes, the tables snapped to an 8-bit grid per row) is quant's, as AWQ's output is RTN's.

With groups (what `localllm quantize --method squeezellm` writes), each group of input channels keeps RTN's range
(fp16 scale and offset from its min and max, table_groups) and the row's table is fitted in that unit; with
calibration inputs the fitted values are then refit to the layer's output error on them, the codes kept
(refit_table)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .errors import LocalLLMError
from .quant import (_FP16_MIN_SUBNORMAL, TABLE_GROUP, TILE_K, TILE_N, QuantLUT, _check_weight, _row_blocks, pack_codes,
                    per_channel)


def _nearest(w: Tensor, centroids: Tensor) -> Tensor:
    """Index of the nearest of each row's ascending centroids [n, C] for every value of w [n, K] (ties: lower)."""
    mids = ((centroids[:, 1:] + centroids[:, :-1]) / 2).contiguous()  # [n, C-1]
    return torch.searchsorted(mids, w.contiguous())


def lut_centroids(w: Tensor, bits: int, importance: Tensor | None = None, iters: int = 100, bins: int = 128) -> Tensor:
    """Weighted k-means of each row of w [n, K] into 2^bits centroids -> fp16 [n, 2^bits], ascending.

    Minimizes sum_c importance[c] * (w[n, c] - centroid)^2 per row (importance: [K] per input channel, or [n, K];
    default 1). In 1-D an optimal cluster is a run of the sorted row, so the start is the exact optimum of the row
    coarsened to `bins` runs of consecutive sorted values (_runs_kmeans; exact where K <= bins), and Lloyd iterations
    over every weight refine it until no weight changes cluster (an empty cluster keeps its centroid). Each Lloyd
    iteration only places the 2^bits - 1 midpoints in the sorted row and takes the clusters' weighted sums from prefix
    sums (float64), instead of touching every weight. Lloyd from weighted quantiles alone stopped far from the
    optimum: on the demo model's weights (whose source is Q4_1) at 4 bits its error was 1.1-1.4x that of RTN g128,
    this start's 0.7-0.8x (on Gaussian rows 0.94x and 0.92x)."""
    n, k = w.shape
    c = 2**bits
    imp = torch.ones(n, k, device=w.device) if importance is None else importance.float().expand(n, k)
    imp = imp.clamp(min=1e-12)  # every weight pulls a little: zero-importance channels still get a nearby value
    srt, order = w.float().sort(dim=1)
    imp = imp.gather(1, order).double()
    x = srt.double()
    pw, pwx, pwxx = (F.pad(t.cumsum(1), (1, 0)) for t in (imp, imp * x, imp * x * x))  # prefix sums [n, K+1]
    blocks = _row_blocks(n, 16 * bins * bins, device=w.device)  # the DP's [rows, bins, bins] temporaries
    cent = torch.cat([_runs_kmeans(pw[r], pwx[r], pwxx[r], c, bins) for r in blocks])
    edges = None
    for _ in range(iters):
        mids = ((cent[:, 1:] + cent[:, :-1]) / 2).float().contiguous()
        # cluster m holds the sorted positions [e_m, e_m+1); a value equal to a midpoint goes to the lower cluster
        e = F.pad(F.pad(torch.searchsorted(srt, mids, right=True), (1, 0), value=0), (0, 1), value=k)  # [n, C+1]
        if edges is not None and torch.equal(e, edges):
            break
        edges = e
        den = pw.gather(1, e).diff(dim=1)
        num = pwx.gather(1, e).diff(dim=1)
        cent = torch.where(den > 0, num / den.clamp(min=1e-300), cent).sort(dim=1).values
    return cent.half().sort(dim=1).values


def _runs_kmeans(pw: Tensor, pwx: Tensor, pwxx: Tensor, c: int, bins: int) -> Tensor:
    """The weighted 1-D k-means optimum of sorted rows, given as prefix sums [n, K+1] of the weights w, w x and
    w x^2, with their values grouped into runs of s = ceil(K / bins) consecutive values that stay together: clusters
    are unions of consecutive runs, found by dynamic programming (cost[i, j]: the weighted squared error of runs
    i..j around their mean; best[m][j]: the least error of runs 0..j in m + 1 clusters). -> float64 [n, c]
    centroids, ascending."""
    n, k = pw.shape[0], pw.shape[1] - 1
    s = -(-k // bins)
    b = -(-k // s)  # runs, the last one possibly shorter
    dev = pw.device
    bounds = (torch.arange(b + 1, device=dev) * s).clamp(max=k)
    runs = [t[:, bounds] for t in (pw, pwx, pwxx)]  # prefix sums at the runs' bounds [n, b+1]
    sw, sx, sxx = (r[:, None, 1:] - r[:, :-1, None] for r in runs)  # [n, i, j]: runs i..j (broadcast, not gathered)
    below = torch.ones(b, b, dtype=torch.bool, device=dev).tril(-1)  # i > j: no such range
    cost = (sxx - sx * sx / sw).clamp_(min=0).masked_fill_(below, torch.inf)
    best, choice = cost[:, 0], []  # one cluster: runs 0..j
    for m in range(1, min(c, b)):
        prev = F.pad(best[:, :-1], (1, 0), value=torch.inf)[:, :, None]
        if m < min(c, b) - 1:
            best, first = (prev + cost).min(1)  # first run of the last cluster
        else:  # the walk back starts at the last run: only its column
            best, first = (prev + cost[:, :, -1:]).min(1)
            first = F.pad(first, (b - 1, 0))
        choice.append(first)
    # walk back from the last run: each cluster's first run, its centroid the runs' weighted mean
    cent = torch.empty(n, c, dtype=torch.float64, device=dev)
    rows, last = torch.arange(n, device=dev), torch.full((n,), b - 1, device=dev)
    for m in range(len(choice), -1, -1):
        first = choice[m - 1][rows, last] if m else torch.zeros(n, dtype=torch.long, device=dev)
        cent[:, m] = (runs[1][rows, last + 1] - runs[1][rows, first]) / (runs[0][rows, last + 1] - runs[0][rows, first])
        last = first - 1
    cent[:, len(choice) + 1:] = cent[:, len(choice):len(choice) + 1]  # fewer runs than clusters: repeat the last
    return cent.sort(dim=1).values


def table_groups(w: Tensor, bits: int, group_size: int = TABLE_GROUP) -> tuple[Tensor, Tensor]:
    """Per group of `group_size` input channels of each row of w [n, K]: the fp16 (scales, offsets) [n, G] that map
    the group's [min, max] into [0, 2^bits - 1] (QuantLUT's grouped unit): the offset is the min rounded down to
    fp16 and the scale rounded up, so no weight falls outside the range the tables are fitted on. A constant group
    whose min fp16 holds exactly gets the least fp16 scale, 2^-24 (its weights sit at 0 in the unit)."""
    n, k = w.shape
    g = math.ceil(k / group_size)  # a partial last group: padded with copies of its last weight
    wg = F.pad(w.float()[None], (0, g * group_size - k), mode="replicate")[0].view(n, g, group_size)
    lo, hi = wg.amin(-1), wg.amax(-1)
    down, up = (torch.full((n, g), v, dtype=torch.float16, device=w.device) for v in (-math.inf, math.inf))
    offset = lo.half()
    offset = torch.where(offset.float() > lo, torch.nextafter(offset, down), offset)
    scale = ((hi - offset.float()) / (2**bits - 1)).half()
    scale = torch.where(scale.float() * (2**bits - 1) < hi - offset.float(), torch.nextafter(scale, up), scale)
    if not (torch.isfinite(scale).all() and torch.isfinite(offset).all()):
        raise LocalLLMError(f"weights up to {w.abs().max().item():.3g} in magnitude: too large for fp16 scales "
                            "(65504); the checkpoint is damaged or its tensors are not float weights: re-download it")
    return scale.clamp(min=_FP16_MIN_SUBNORMAL), offset


def quantize_lut(w: Tensor, bits: int, importance: Tensor | None = None, x: Tensor | None = None,
                 group_size: int | None = None) -> QuantLUT:
    """Per-output-channel non-uniform quantization: lut_centroids, then every weight takes the code of its
    nearest fp16 centroid (dequantize() gives that centroid on the row's 8-bit grid). With calibration inputs x [T, K],
    the table values are then refit to the layer's output error on them, the codes kept (refit_table).

    group_size (a multiple of 64; the last group may be partial): grouped tables (QuantLUT), fitted to the weights in
    their groups' unit u = (w - offset) / s; an error e in u is s e in w, so the k-means weighs each weight by
    importance * s^2, and the refit fits s * table[code] to w - offset."""
    _check_weight(w, bits)
    n, k = w.shape
    if group_size is not None and (group_size < TILE_K or group_size % TILE_K):
        raise ValueError(f"table groups must be a multiple of {TILE_K}, got {group_size}")
    qweight = torch.empty(n // TILE_N, k * bits // 2, dtype=torch.int32, device=w.device)
    lut = torch.empty(n, 2**bits, dtype=torch.float16, device=w.device)
    scales = offsets = None
    if group_size is not None:
        scales, offsets = table_groups(w, bits, group_size)
    for rows in _row_blocks(n, k * 4, TILE_N, w.device):  # k-means keeps a few [n, K] temporaries
        imp = None if importance is None else importance[rows] if importance.ndim == 2 else importance
        target, s = w[rows].float(), None  # what s * table[code] fits, s the weights' group scales
        u = target  # the weights in the tables' unit
        if group_size is not None:
            s = per_channel(scales[rows].float(), group_size, k)
            target = target - per_channel(offsets[rows].float(), group_size, k)
            u = target / s
            imp = (torch.ones(k, device=w.device) if imp is None else imp.float()) * s.square()
        cent = lut_centroids(u, bits, imp)
        codes = _nearest(u, cent.float())
        if x is not None:
            cent = refit_table(target, codes, cent, x, scale=s).half()
            cent, order = cent.sort(dim=1)  # tables ascend: renumber the codes with them
            codes = order.argsort(dim=1).gather(1, codes)
        qweight[rows.start // TILE_N: rows.stop // TILE_N] = pack_codes(codes.to(torch.uint8), bits)
        lut[rows] = cent
    return QuantLUT(qweight, lut, bits, k, scales, offsets, group_size)


def refit_table(w: Tensor, codes: Tensor, cent: Tensor, x: Tensor, damp: float = 1e-2,
                scale: Tensor | None = None) -> Tensor:
    """Table values l [n, C] (float64) minimizing each row's output error on the inputs x [T, K] with the codes
    [n, K] kept: ||X (A l - w)||^2 + lam ||l - cent||^2, A the codes as one-hot [K, C], lam = damp * mean diag(M):
    (M + lam I) l = A^T X^T X w + lam cent with M = (X A)^T (X A), a C x C solve per row. The k-means weighs every
    weight alone; this counts the products of different weights' errors through X too, as AWQ's clipping does. A
    value no weight takes keeps its k-means value, and (before rounding to fp16) the error never exceeds cent's.
    scale [n, K] (grouped tables): weight c of a row is scale[c] * l[code] (w then excludes the groups' offsets), so
    A's ones become the scales."""
    n, k = w.shape
    c = cent.shape[1]
    dev = w.device
    out = torch.empty(n, c, dtype=torch.float64, device=dev)
    x = x.float()
    for rows in _row_blocks(n, k * c, device=dev):  # the one-hot codes [K, rows * C]
        m = rows.stop - rows.start
        hot = torch.zeros(k, m * c, device=dev)
        hot[torch.arange(k, device=dev)[:, None], torch.arange(m, device=dev) * c + codes[rows].T.long()] = \
            1.0 if scale is None else scale[rows].T.float()
        xa = (x @ hot).view(-1, m, c).double()  # [T, m, C]: X A per row
        y = (x @ w[rows].float().T).double()  # [T, m]
        mm = torch.einsum("tmc,tmd->mcd", xa, xa)
        lam = damp * mm.diagonal(dim1=1, dim2=2).mean(1).clamp(min=1e-30)
        rhs = torch.einsum("tmc,tm->mc", xa, y) + lam[:, None] * cent[rows].double()
        out[rows] = torch.linalg.solve(mm + lam[:, None, None] * torch.eye(c, dtype=torch.float64, device=dev), rhs)
    return out
