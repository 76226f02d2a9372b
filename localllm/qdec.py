"""Reference semantics of QDEC channel selection and error compensation (paper sec. 4.3).

y = W_hat x + R_hat[:, S] x[S], where S is the union over 1024-channel chunks of the input of
the k channels picked in each chunk. This CPU module defines what the fused GPU kernel must
compute; it favours clarity over speed but is vectorized over tokens.

Every select_* function returns idx long [T, k_total(k_chunk, K)]: chunk by chunk, and
ascending channel index inside a chunk.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from localllm.quant import QuantResidual

CHUNK = 1024
N_BUCKETS = 32  # one per warp lane in the kernel
_HALF = N_BUCKETS // 2
_MIN_WIDTH = 1e-12  # bucket widths never reach 0, so nothing divides by 0
# Elements per token block: [T_block, k, N] gathered residual rows in compensate(),
# [T_block, K] copies in ActStats.update().
_BLOCK_ELEMS = 1 << 24


def chunk_bounds(in_features: int) -> list[tuple[int, int]]:
    """[start, end) of consecutive 1024-channel chunks; a last partial chunk (or K < 1024) is its own chunk."""
    return [(s, min(s + CHUNK, in_features)) for s in range(0, in_features, CHUNK)]


def k_for_chunk(k_chunk: int, size: int) -> int:
    """Channels selected in a chunk of `size` channels: k_chunk for a full chunk.

    A partial chunk selects a proportional share, rounded up: min(size, ceil(k_chunk * size / 1024)).
    """
    if k_chunk < 0:
        raise ValueError(f"k_chunk must be >= 0, got {k_chunk}")
    return min(size, -(-k_chunk * size // CHUNK))


def k_total(k_chunk: int, in_features: int) -> int:
    """Channels selected over an input of K channels."""
    return sum(k_for_chunk(k_chunk, e - s) for s, e in chunk_bounds(in_features))


def bucket_index(a: Tensor, b0: float, b15: float) -> Tensor:
    """Bucket of each magnitude a = |x| (float32): 0 holds the largest values, 31 the smallest.

    Buckets 0..15 split [b15, b0] uniformly (bucket 0 is open above, so values > b0 land
    there); buckets 16..31 split [0, b15) uniformly. In float32, exactly as the CUDA kernel
    (which must use IEEE division, i.e. no fast-math):
        d_hi = max((b0 - b15) / 16, 1e-12),  d_lo = max(b15 / 16, 1e-12)
        a >= b15: clamp(floor((b0 - a) / d_hi), 0, 15)
        a <  b15: 16 + clamp(floor((b15 - a) / d_lo), 0, 15)
    Returns uint8 of a's shape.
    """
    a = a.float()
    b0_t = torch.tensor(b0, dtype=torch.float32)
    b15_t = torch.tensor(b15, dtype=torch.float32)
    d_hi = torch.clamp((b0_t - b15_t) / _HALF, min=_MIN_WIDTH)
    d_lo = torch.clamp(b15_t / _HALF, min=_MIN_WIDTH)
    upper = torch.floor((b0_t - a) / d_hi).clamp(0, _HALF - 1)
    lower = _HALF + torch.floor((b15_t - a) / d_lo).clamp(0, _HALF - 1)
    return torch.where(a >= b15_t, upper, lower).to(torch.uint8)


def _per_chunk(in_features: int, k_chunk: int, pick: Callable[[int, int, int], Tensor]) -> Tensor:
    """Concatenate pick(start, end, k) -> chunk-local idx [T, k] over chunks, as sorted global indices."""
    parts = [pick(s, e, k_for_chunk(k_chunk, e - s)).sort(dim=-1).values + s for s, e in chunk_bounds(in_features)]
    return torch.cat(parts, dim=-1)


def select_exact(x: Tensor, k_chunk: int) -> Tensor:
    """Exact top-k of |x| per chunk (torch.topk; ties broken arbitrarily): x [T, K] -> idx [T, k_total]."""
    a = x.float().abs()
    return _per_chunk(x.shape[-1], k_chunk, lambda s, e, k: a[:, s:e].topk(k, dim=-1).indices)


def select_approx(
    x: Tensor, k_chunk: int, b0: float, b15: float, generator: torch.Generator | None = None
) -> Tensor:
    """Approximate top-k per chunk by the 32-bucket rule: x [T, K] -> idx [T, k_total].

    Buckets (bucket_index) are taken whole, from bucket 0 on, while the running count stays
    <= k; from the first bucket that would overflow (the boundary bucket) the remaining
    k - count channels are drawn uniformly at random with `generator`.
    """
    a = x.float().abs()
    t = a.shape[0]

    def pick(s: int, e: int, k: int) -> Tensor:
        bucket = bucket_index(a[:, s:e], b0, b15).long()  # [T, c]
        counts = torch.zeros(t, N_BUCKETS, dtype=torch.long, device=a.device)
        counts.scatter_add_(1, bucket, torch.ones_like(bucket))
        # Boundary bucket: the first whose cumulative count exceeds k (N_BUCKETS if k == c).
        boundary = (counts.cumsum(1) <= k).sum(1, keepdim=True)  # [T, 1]
        # Whole buckets score 2, the boundary bucket a random priority in [0, 1), the rest -1:
        # top-k then takes every whole bucket plus a uniform random subset of the boundary.
        rand = torch.rand(bucket.shape, generator=generator, device=a.device)
        score = torch.where(bucket < boundary, 2.0, torch.where(bucket == boundary, rand, -1.0))
        return score.topk(k, dim=-1).indices

    return _per_chunk(x.shape[-1], k_chunk, pick)


def select_static(importance: Tensor, k_chunk: int, t: int) -> Tensor:
    """Top-k of a calibration importance vector [K] per chunk, the same for all t tokens -> idx [t, k_total]."""
    imp = importance.float()
    idx = _per_chunk(imp.shape[0], k_chunk, lambda s, e, k: imp[s:e].topk(k).indices)
    return idx.expand(t, -1).contiguous()


def select_random(t: int, in_features: int, k_chunk: int, generator: torch.Generator | None = None) -> Tensor:
    """A uniform random k-subset of each chunk, independently per token -> idx [t, k_total]."""

    def pick(s: int, e: int, k: int) -> Tensor:
        return torch.rand(t, e - s, generator=generator).topk(k, dim=-1).indices

    return _per_chunk(in_features, k_chunk, pick)


def compensate(x: Tensor, idx: Tensor, residual: QuantResidual) -> Tensor:
    """o_dec[t] = sum_j R_hat[:, idx[t, j]] * x[t, idx[t, j]]: x [T, K], idx [T, k] -> float32 [T, N]."""
    t, k = idx.shape
    n = residual.scales.shape[0]
    out = torch.empty(t, n, dtype=torch.float32, device=x.device)
    step = max(1, _BLOCK_ELEMS // max(1, k * n))
    for t0 in range(0, t, step):
        blk = slice(t0, t0 + step)
        rows = residual.rows(idx[blk])  # [tb, k, N]
        xs = x[blk].float().gather(1, idx[blk])  # [tb, k]
        out[blk] = torch.bmm(xs.unsqueeze(1), rows).squeeze(1)
    return out


class ActStats:
    """Calibration statistics of a linear layer's inputs for the bucket boundaries and static selection.

    b0 = max |x| over all vectors seen; kth[k_chunk - 1] = b15 for that k_chunk = max over vectors
    and chunks of the k-th largest |x| in a chunk, k = k_for_chunk(k_chunk, chunk size);
    sq_mean = per-channel mean of x^2 (the static importance of paper sec. 3.3).
    """

    def __init__(self, in_features: int, kmax: int = 256):
        if kmax < 1:
            raise ValueError(f"kmax must be >= 1, got {kmax}")
        self.in_features = in_features
        self._b0 = torch.zeros((), dtype=torch.float32)
        self._kth = torch.zeros(min(kmax, CHUNK), dtype=torch.float32)  # [kmax]
        self._sq_sum = torch.zeros(in_features, dtype=torch.float64)  # float64: many vectors are summed
        self._count = 0

    def update(self, x: Tensor) -> None:
        """Accumulate vectors x [..., K]."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected last dim {self.in_features}, got {x.shape[-1]}")
        x = x.reshape(-1, self.in_features)
        k_chunks = range(1, self._kth.numel() + 1)
        # Per chunk: k_for_chunk of every tracked k_chunk, each in [1, c].
        ks = [torch.tensor([k_for_chunk(kc, e - s) for kc in k_chunks]) for s, e in chunk_bounds(self.in_features)]
        step = max(1, _BLOCK_ELEMS // self.in_features)  # token blocks bound the float32 copies
        for t0 in range(0, x.shape[0], step):
            xb = x[t0 : t0 + step]
            a = xb.float().abs()  # [Tb, K]
            self._b0 = torch.maximum(self._b0, a.max())
            for (s, e), kc in zip(chunk_bounds(self.in_features), ks):
                top = a[:, s:e].topk(int(kc.max()), dim=-1).values  # [Tb, max k] descending
                self._kth = torch.maximum(self._kth, top[:, kc - 1].amax(0))
            self._sq_sum += xb.double().square().sum(0)
        self._count += x.shape[0]

    @property
    def b0(self) -> float:
        return float(self._b0)

    @property
    def kth(self) -> Tensor:
        return self._kth.clone()

    @property
    def sq_mean(self) -> Tensor:
        return (self._sq_sum / max(self._count, 1)).float()

    @property
    def count(self) -> int:
        return self._count

    def state(self) -> dict[str, Tensor]:
        """Tensors only (safetensors-friendly); in_features and kmax follow from the shapes."""
        return {
            "b0": self._b0.reshape(1).clone(),
            "kth": self._kth.clone(),
            "sq_sum": self._sq_sum.clone(),
            "count": torch.tensor([self._count], dtype=torch.int64),
        }

    @classmethod
    def from_state(cls, d: dict[str, Tensor]) -> ActStats:
        st = cls(d["sq_sum"].numel(), d["kth"].numel())
        st._b0 = d["b0"].reshape(()).float().clone()
        st._kth = d["kth"].float().clone()
        st._sq_sum = d["sq_sum"].double().clone()
        st._count = int(d["count"].item())
        return st
