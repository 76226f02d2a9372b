"""Which blocks gain most from compensation, for a budget that cannot pay for every block of a kind, and what each
is worth against the other kinds'.

A layer's estimated gain is the share of its output energy that compensating k_chunk channels per chunk adds back,
from its calibration and residual (diagonal estimate, uncorrelated inputs): with S the k_chunk channels of largest
mean x^2 in each 1024-channel chunk,

    gain = sum_{c in S} E[x_c^2] |R_hat[:, c]|^2 / sum_c E[x_c^2] |W_hat[:, c]|^2.

On the demo model (W3 RTN, k_chunk 8, 2048 tokens, perplexity 116.5 without QDEC) compensating the half of gate_up's
blocks with the largest gain kept 80% of all blocks' improvement (92.8 against 86.8), the other half 26%; down:
87% and 16%, and its best quarter 97%. The same share without the denominator (the added energy itself) ordered them
worse than block order.

The share does not compare kinds: per unit of it, compensating o took 0.1 of the KL divergence away that down did
(demo model, W3, k_chunk 8 in every block; KL from the source on the evaluation text: off 1.58, gate_up -0.29,
down -0.21, qkv -0.22, o -0.02). So quantize measures each kind's KL taken away with the kind compensated in every
block (the manifest's calibration.qdec_value), and values() splits it over the blocks in proportion to their gain
(kind_weight). For models whose quantize also recorded each block's value to first order (first_order(); one
backward pass of that KL on the calibration text) the tuner splits it by those instead; the share remains for older
models. Demo W3, the blocks of most value by each, measured alone on the evaluation text, KL taken away by the best
4 / 8 / 12 blocks: gate_up 0.158 / 0.203 / 0.240 by first order, 0.095 / 0.135 / 0.176 by the share (best possible
0.163 / 0.227 / 0.270); qkv 0.120 / 0.182 / 0.215 against 0.092 / 0.147 / 0.129 (v rows); down 0.073 / 0.123 / 0.130
against 0.125 / 0.130 / 0.124, the one kind where the share picks better at 3-6 blocks.

For qkv the sums run over its v rows only (counted_rows). q and k reach the block's output only through the softmax,
and SmoothAttention scales their rows by a per-channel factor that q · k does not see (q times lambda, k over it),
which made q's rows most of the share. Demo model W3, each block's qkv compensated alone at k_chunk 8 (KL from the
source taken away, 1024 tokens, CPU; 32 gives the same per-block pattern, correlation 0.99): the four best blocks by
the share over all rows took 0.018 away, by the v rows' share 0.092, the four best measured 0.144; rank correlation
0.21 against 0.43. Some blocks' compensation adds KL (block 9: -0.038), which no estimate here sees.
"""
from __future__ import annotations

import weakref

from localllm.qdec import chunk_bounds, k_for_chunk

# per Linear: what gain() needs at every k_chunk, computed once (the tuner asks for each kind at up to seven k_chunks,
# and each ask dequantized the whole layer for the denominator: 3.7 s of an 8B tune)
_parts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def counted_rows(cfg, kind: str) -> slice | None:
    """The output rows the gain counts: qkv's v rows (above), every row (None) of the other kinds."""
    return slice(cfg.q_size + cfg.kv_size, cfg.q_size + 2 * cfg.kv_size) if kind == "qkv" else None


def _ranked(lin, k_chunk: int, rows: slice | None) -> dict:
    """The layer's denominator, and per 1024-channel chunk its channels by descending mean x^2 (at least k_chunk's
    share) with the squared norm of R_hat's row at each (its `rows` outputs); grown when a larger k_chunk asks."""
    p, of = _parts.get(lin), (lin.stats, lin.residual, lin.packed)
    # computed from these very objects, with the statistics as they were then (ActStats.update adds to them), else again
    if p is None or any(a is not b for a, b in zip(p["of"], of)) or p["count"] != lin.stats.count or p["rows"] != rows:
        p = {"of": of, "count": lin.stats.count, "rows": rows, "k": 0, "chunks": [],
             "den": max(lin.weighted_energy(lin.stats.sq_mean, rows), 1e-30)}
        _parts[lin] = p
    if k_chunk > p["k"]:
        sq, chunks = lin.stats.sq_mean, []
        for s, e in chunk_bounds(lin.in_features):
            idx = sq[s:e].topk(k_for_chunk(k_chunk, e - s)).indices + s  # sorted: a smaller k takes a prefix
            r = lin.residual.rows(idx.to(lin.residual.packed.device))[:, rows or slice(None)]
            chunks.append((sq[idx].double(), r.square().sum(-1).cpu().double()))
        p["k"], p["chunks"] = k_chunk, chunks
    return p


def gain(lin, k_chunk: int, rows: slice | None = None) -> float:
    """The estimated gain above for one quantized Linear with residual and calibration statistics, over its output
    rows `rows` (None: all; counted_rows)."""
    p = _ranked(lin, k_chunk, rows)
    added = sum(float(sq[:n] @ r2[:n]) for (sq, r2), (s, e) in zip(p["chunks"], chunk_bounds(lin.in_features))
                for n in (k_for_chunk(k_chunk, e - s),))
    return added / p["den"]


def order(lins, k_chunk: int, rows: slice | None = None) -> tuple[int, ...]:
    """The blocks of `lins` (one kind's Linears), the largest estimated gain first (ties: the earlier block)."""
    g = {lin.block: gain(lin, k_chunk, rows) for lin in lins}
    return tuple(sorted(g, key=lambda b: (-g[b], b)))


def taken_away(measured: dict, kind: str) -> float:
    """The KL divergence that compensating `kind` in every block took away (measured: calibration.qdec_value)."""
    return max(measured["off"] - measured["kl"][kind], 0.0)


def kind_weight(lins, measured: dict, rows: slice | None = None) -> float:
    """KL divergence taken away per unit of gain for `lins` (one kind's Linears): the kind's measured KL taken away
    (measured: the manifest's calibration.qdec_value) over the sum of its blocks' gain at the measured k_chunk."""
    ref = sum(gain(lin, measured["k_chunk"], rows) for lin in lins)
    return taken_away(measured, lins[0].kind) / ref if ref > 0 else 0.0


def values(lins, k_chunk: int, weight: float, rows: slice | None = None) -> dict[int, float]:
    """Per block of `lins` (one kind's Linears): the KL divergence from the source that compensating its layer at
    k_chunk is predicted to take away, weight * gain(lin, k_chunk, rows) (weight: kind_weight with the same rows)."""
    return {lin.block: weight * gain(lin, k_chunk, rows) for lin in lins}


def first_order(lins, measured: dict, k_chunk: int) -> dict[int, float] | None:
    """Per block of `lins` (one kind's Linears): quantize's first-order value of compensating its layer at k_chunk
    (measured["blocks"], localllm.quantize.first_order_values), scaled so that the kind's blocks of positive value
    add up to its measured KL taken away at the measured k_chunk (negative ones, which first order gives a few, are
    left out of the sum: blocks that nearly cancel would make the scale, and one block's value, unbounded). None
    where quantize did not record them (models quantized before), at a k_chunk it did not record, or where no block
    has a positive value to scale."""
    fo = measured.get("blocks")
    if not fo or k_chunk not in fo["k_chunks"] or measured["k_chunk"] not in fo["k_chunks"]:
        return None
    per = fo["kl"][lins[0].kind]
    j, j0 = fo["k_chunks"].index(k_chunk), fo["k_chunks"].index(measured["k_chunk"])
    ref = sum(max(per[lin.block][j0], 0.0) for lin in lins)
    if ref <= 0:
        return None
    weight = taken_away(measured, lins[0].kind) / ref
    return {lin.block: weight * per[lin.block][j] for lin in lins}
