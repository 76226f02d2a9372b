"""Which blocks gain most from compensation, for a budget that cannot pay for every block of a kind.

A layer's estimated gain is the share of its output energy that compensating k_chunk channels per chunk adds back,
from its calibration and residual (diagonal estimate, uncorrelated inputs): with S the k_chunk channels of largest
mean x^2 in each 1024-channel chunk,

    gain = sum_{c in S} E[x_c^2] |R_hat[:, c]|^2 / sum_c E[x_c^2] |W_hat[:, c]|^2.

On the demo model (W3 RTN, k_chunk 8, 2048 tokens, perplexity 116.5 without QDEC) compensating the half of gate_up's
blocks with the largest gain kept 80% of all blocks' improvement (92.8 against 86.8), the other half 26%; down:
87% and 16%, and its best quarter 97%. The same share without the denominator (the added energy itself) ordered them
worse than block order.
"""
from __future__ import annotations

import torch

from localllm.qdec import chunk_bounds, k_for_chunk


def gain(lin, k_chunk: int) -> float:
    """The estimated gain above for one quantized Linear with residual and calibration statistics."""
    sq = lin.stats.sq_mean
    top = torch.cat([sq[s:e].topk(k_for_chunk(k_chunk, e - s)).indices + s for s, e in chunk_bounds(lin.in_features)])
    added = float(lin.residual.rows(top.to(lin.residual.packed.device)).square().sum(-1).cpu() @ sq[top])
    return added / max(lin.weighted_energy(sq), 1e-30)


def order(lins, k_chunk: int) -> tuple[int, ...]:
    """The blocks of `lins` (one kind's Linears), the largest estimated gain first (ties: the earlier block)."""
    g = {lin.block: gain(lin, k_chunk) for lin in lins}
    return tuple(sorted(g, key=lambda b: (-g[b], b)))
