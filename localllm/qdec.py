"""Reference semantics of QDEC channel selection and error compensation (paper sec. 4.3).

y = W_hat x + R_hat[:, S] x[S], where S is the union over 1024-channel chunks of the input of
the k channels picked in each chunk. This module defines what the fused GPU kernel must compute, and the CPU path
runs it at every decode step: vectorized over tokens and chunks, the selection in numpy (a step's selection is a few
dozen operations on 1024-channel chunks, and torch's per-operation overhead cost several times the work).

Every select_* function returns idx long [T, k_total(k_chunk, K)]: chunk by chunk, and
ascending channel index inside a chunk.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch import Tensor

from localllm.errors import LocalLLMError
from localllm.quant import QuantResidual

CHUNK = 1024
N_BUCKETS = 32  # one per warp lane in the kernel
_HALF = N_BUCKETS // 2
_MIN_WIDTH = 1e-12  # bucket widths never reach 0, so nothing divides by 0
# Elements per block: compensate()'s token blocks [T_block, <= K] and unpacked residual rows [rows, N];
# ActStats.update()'s [T_block, K] copies.
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


@functools.cache  # a layer's (b0, b15) are fixed: every CPU selection would recompute them (~8 us of ~120)
def bucket_widths(b0: float, b15: float) -> tuple[float, float]:
    """1 / bucket width above and below b15, in float32: d_hi = max((b0 - b15) / 15, 1e-12),
    d_lo = max(b15 / 16, 1e-12). The kernel takes these two numbers as arguments (with b0 and b15)."""
    f = np.float32
    d_hi = max(f(f(b0) - f(b15)) / f(_HALF - 1), f(_MIN_WIDTH))
    d_lo = max(f(b15) / f(_HALF), f(_MIN_WIDTH))
    return float(f(1) / f(d_hi)), float(f(1) / f(d_lo))


def bucket_index(a: Tensor, b0: float, b15: float) -> Tensor:
    """Bucket of each magnitude a = |x| (float32): 0 holds the largest values, 31 the smallest.

    As the paper's 31 boundaries b0 > b1 > ... > b30 make them: bucket 0 holds the values above b0 (the calibration's
    largest |x|: an input's outliers beyond what calibration saw, taken first), buckets 1..15 split [b15, b0]
    uniformly, buckets 16..31 split [0, b15). In float32 with round-to-nearest, exactly as the CUDA kernel computes it
    (inv_hi, inv_lo from bucket_widths):
        a >  b0:  0
        a >= b15: 1 + clamp(floor((b0 - a) * inv_hi), 0, 14)
        a <  b15: 16 + clamp(floor((b15 - a) * inv_lo), 0, 15)
    Returns uint8 of a's shape.
    """
    with np.errstate(all="ignore"):  # inf and nan inputs land where the kernel's arithmetic puts them, silently
        return torch.from_numpy(_buckets(_numpy(a), b0, b15).astype(np.uint8)).to(a.device)


def _numpy(x: Tensor) -> np.ndarray:
    return x.detach().float().cpu().numpy()


def _buckets(a: np.ndarray, b0: float, b15: float) -> np.ndarray:
    """bucket_index on float32 a, as float32 (every operation in float32, in place where it can be: a decode step's
    selection is a few dozen operations, an evaluation window's is bound by passes over its inputs)."""
    fb0, fb15, inv_hi, inv_lo = _bucket_args(b0, b15)
    upper = fb0 - a
    upper *= inv_hi
    np.floor(upper, out=upper)
    _clamp(upper, _HALF - 2)
    upper += 1
    upper[a > fb0] = 0
    lower = fb15 - a
    lower *= inv_lo
    np.floor(lower, out=lower)
    _clamp(lower, _HALF - 1)
    lower += _HALF
    return np.where(a >= fb15, upper, lower)


def _clamp(v: np.ndarray, hi: int) -> None:
    """v into [0, hi] in place as the kernel's fminf(fmaxf(v, 0), hi): NaN becomes 0 (np.clip keeps it, and casting
    NaN to an integer is undefined), so a NaN input lands in bucket 16 on both."""
    np.fmax(v, 0, out=v)
    np.fmin(v, hi, out=v)


@functools.cache
def _bucket_args(b0: float, b15: float) -> tuple[np.float32, ...]:
    """b0, b15 and bucket_widths' inv_hi, inv_lo as float32 scalars."""
    return tuple(np.float32(v) for v in (b0, b15, *bucket_widths(b0, b15)))


_M1, _M2 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)


def _fmix32(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finalizer on uint32 h, in place (numpy's uint32 products wrap mod 2^32)."""
    h ^= h >> 16
    h *= _M1
    h ^= h >> 13
    h *= _M2
    h ^= h >> 16
    return h


def boundary_order(x: Tensor) -> tuple[Tensor, Tensor]:
    """The pseudo-random order in which a chunk's boundary-bucket channels are taken, as the kernel computes it.

    x [..., c] (chunks of c <= 1024 channels) -> (A, off) int64 [..., 1]: channel i of a chunk has priority
    p(i) = (i * A + off) mod 1024 (A odd, so p is a permutation) and lower p goes first. A and off come from
    seed = fmix32(sum_i fmix32(i * 65536 + u_i) mod 2^32), u_i the fp16 bits of x_i, so the choice is a fixed
    function of the input (the same on CPU and GPU, in eager and graph replay) that changes with it.
    """
    xs = _numpy(x)
    with np.errstate(over="ignore"):  # beyond fp16's range: inf, as the kernel's fp16 input has
        h = _element_hashes(xs, np.arange(xs.shape[-1], dtype=np.uint32) << 16)
    A, off = _order_of(h.sum(-1, keepdims=True, dtype=np.uint64))
    return torch.from_numpy(A.astype(np.int64)).to(x.device), torch.from_numpy(off.astype(np.int64)).to(x.device)


def _element_hashes(x: np.ndarray, i16: np.ndarray) -> np.ndarray:
    """fmix32(i * 65536 + u) of float32 x, u its fp16 bits, i each channel's place in its chunk (i16 = i << 16,
    uint32). Casting values beyond fp16's range warns: the caller decides."""
    h = x.astype(np.float16).view(np.uint16).astype(np.uint32)
    h |= i16
    return _fmix32(h)


def _order_of(sums: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(A, off) uint32 of each chunk from the sum of its element hashes (any unsigned width)."""
    h = _fmix32(sums.astype(np.uint32))  # the sum mod 2^32
    return 2 * (h & 511) + 1, (h >> 9) & 1023


def _per_chunk(x: np.ndarray, k_chunk: int, pick: Callable[[np.ndarray, int], np.ndarray],
               device: torch.device | str = "cpu") -> Tensor:
    """_chunk_picks(x, k_chunk, pick) as a tensor on `device`."""
    return torch.from_numpy(_chunk_picks(x, k_chunk, pick)).to(device)


def _chunk_picks(x: np.ndarray, k_chunk: int, pick: Callable[[np.ndarray, int], np.ndarray]) -> np.ndarray:
    """Apply pick(xc, k) -> chunk-local idx [T, C, k] of the k >= 1 channels chosen in each chunk of xc [T, C, c] to
    all the full 1024-channel chunks of x [T, K] at once, then to a last partial chunk; the sorted global indices
    [T, k_total]. (Chunk by chunk, a decode step's selection cost a CPU ~0.2 ms per chunk, mostly per-operation
    overhead.)"""
    T, K = x.shape
    parts = []
    for start, n, size in _layout(K)[0]:
        k = k_for_chunk(k_chunk, size)
        xc = x[:, start:start + n * size].reshape(T, n, size)
        idx = np.sort(pick(xc, k), axis=-1).astype(np.int64) if k else np.zeros((T, n, 0), np.int64)
        parts.append((idx + start + np.arange(n)[:, None] * size).reshape(T, n * k))
    return np.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]


def _torch_top(a: np.ndarray, k: int) -> np.ndarray:
    """torch.topk's indices of the k largest along the last axis."""
    return torch.from_numpy(np.ascontiguousarray(a)).topk(k, dim=-1).indices.numpy()


def select_exact(x: Tensor, k_chunk: int) -> Tensor:
    """Exact top-k of |x| per chunk (torch.topk; ties broken arbitrarily): x [T, K] -> idx [T, k_total]."""
    return _per_chunk(np.abs(_numpy(x)), k_chunk, _torch_top, x.device)


def select_approx(x: Tensor, k_chunk: int, b0: float, b15: float) -> Tensor:
    """Approximate top-k per chunk by the 32-bucket rule: x [T, K] -> idx [T, k_total].

    Buckets (bucket_index) are taken whole, from bucket 0 on, while the running count stays
    <= k; from the first bucket that would overflow (the boundary bucket) the remaining
    k - count channels are taken in the pseudo-random order of boundary_order.

    Many rows (a prompt, an evaluation window) go in blocks of _ROWS on the CPU's threads (numpy lets go of the GIL in
    its loops): a 512-token window at K = 4096 took 71 ms at once, 47 ms in blocks and 25 ms in blocks on two threads.
    """
    xs = _numpy(x)
    if len(xs) <= _ROWS:
        return torch.from_numpy(_approx(xs, k_chunk, b0, b15)).to(x.device)
    blocks = [xs[r:r + _ROWS] for r in range(0, xs.shape[0], _ROWS)]
    picks = _pool().map(lambda b: _approx(b, k_chunk, b0, b15), blocks)
    return torch.from_numpy(np.concatenate(list(picks))).to(x.device)


_ROWS = 64  # rows per block of select_approx: its temporaries stay in the CPU's caches


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max(1, torch.get_num_threads()), thread_name_prefix="localllm-select")


def _approx(xs: np.ndarray, k_chunk: int, b0: float, b15: float) -> np.ndarray:
    """select_approx of float32 rows xs [T, K], as numpy int64 [T, k_total]."""
    T, K = xs.shape
    parts, i16, starts = _layout(K)
    # The rule takes the k smallest keys bucket * 1024 + p per chunk, p the boundary order's priority (a
    # permutation of 0..1023, so keys are distinct): every bucket before the boundary one is smaller than any key
    # from there on, and inside the boundary bucket lower p goes first. Keys of the whole input at once (int32:
    # numpy partitions int16 4x slower):
    with np.errstate(all="ignore"):  # fp16's range and inf / nan inputs: as the kernel's arithmetic has them
        A, off = _order_of(np.add.reduceat(_element_hashes(xs, i16), starts, axis=-1, dtype=np.uint64))
        key = _buckets(np.abs(xs), b0, b15).astype(np.int32) << 10
    c = 0
    for s, n, size in parts:  # p of each channel, from its chunk's A and off (views of key: split axes)
        kc = key[:, s:s + n * size].reshape(T, n, size)
        kc |= ((_PLACES[:size] * A[:, c:c + n, None] + off[:, c:c + n, None]) & (CHUNK - 1)).view(np.int32)
        c += n
    return _chunk_picks(key, k_chunk, lambda kc, k: np.argpartition(kc, k - 1, axis=-1)[..., :k])


_PLACES = np.arange(CHUNK, dtype=np.uint32)


@functools.cache
def _layout(K: int) -> tuple[list[tuple[int, int, int]], np.ndarray, np.ndarray]:
    """K channels' chunks as (start, count, size) parts (the full chunks, then a partial one), each channel's place
    in its chunk << 16 (uint32), and the chunks' starts."""
    C, r = divmod(K, CHUNK)
    parts = [(s, n, size) for s, n, size in ((0, C, CHUNK), (C * CHUNK, 1, r)) if n and size]
    return parts, (np.arange(K, dtype=np.uint32) % CHUNK) << 16, np.arange(0, K, CHUNK)


def select_static(importance: Tensor, k_chunk: int, t: int) -> Tensor:
    """Top-k of a calibration importance vector [K] per chunk, the same for all t tokens -> idx [t, k_total]."""
    idx = _per_chunk(_numpy(importance)[None], k_chunk, _torch_top, importance.device)
    return idx.expand(t, -1).contiguous()


def select_random(t: int, in_features: int, k_chunk: int, generator: torch.Generator | None = None) -> Tensor:
    """A uniform random k-subset of each chunk, independently per token -> idx [t, k_total]."""
    return _per_chunk(np.empty((t, in_features), np.float32), k_chunk,
                      lambda xc, k: _torch_top(torch.rand(xc.shape, generator=generator).numpy(), k))


def compensate(x: Tensor, idx: Tensor, residual: QuantResidual) -> Tensor:
    """o_dec[t] = sum_j R_hat[:, idx[t, j]] * x[t, idx[t, j]]: x [T, K], idx [T, k] -> float32 [T, N].

    Per block of tokens, the residual rows of the channels any of them selects are unpacked once and multiplied by
    the inputs laid onto those channels (zero where a token did not select one). A 512-token window selects most
    channels, so each row is unpacked once rather than once per token that selects it (a CPU evaluation of the demo
    model at k_chunk 32: 51 s -> 14 s). A decode step's token multiplies its own rows."""
    t = idx.shape[0]
    if t == 1:  # a decode step
        return x.float().gather(1, idx) @ residual.rows(idx[0])
    n = residual.scales.shape[0]
    out = torch.zeros(t, n, dtype=torch.float32, device=x.device)
    step = max(1, _BLOCK_ELEMS // x.shape[1])  # tokens per block: their inputs on the selected channels, <= K each
    rows_step = max(1, _BLOCK_ELEMS // n)  # unpacked rows at a time
    for t0 in range(0, t, step):
        blk = slice(t0, t0 + step)
        chans, where = idx[blk].unique(return_inverse=True)  # sorted channels; each selection's place among them
        xs = torch.zeros(where.shape[0], chans.numel(), device=x.device)
        xs.scatter_add_(1, where, x[blk].float().gather(1, idx[blk]))
        for c0 in range(0, chans.numel(), rows_step):
            out[blk] += xs[:, c0:c0 + rows_step] @ residual.rows(chans[c0:c0 + rows_step])
    return out


class ActStats:
    """Calibration statistics of a linear layer's inputs for the bucket boundaries and static selection.

    b0 = max |x| over all vectors seen; kth[k_chunk - 1] = b15 for that k_chunk = max over vectors
    and chunks of the k-th largest |x| in a chunk, k = k_for_chunk(k_chunk, chunk size);
    sq_mean = per-channel mean of x^2 (the static importance of paper sec. 3.3).
    """

    def __init__(self, in_features: int, kmax: int = 256, device: torch.device | str = "cpu"):
        if kmax < 1:
            raise ValueError(f"kmax must be >= 1, got {kmax}")
        self.in_features = in_features
        self._b0 = torch.zeros((), dtype=torch.float32, device=device)
        self._kth = torch.zeros(min(kmax, CHUNK), dtype=torch.float32, device=device)  # [kmax]
        self._sq_sum = torch.zeros(in_features, dtype=torch.float64, device=device)  # float64: many vectors are summed
        self._count = 0
        self._ks: list[Tensor] | None = None  # made at the first update (statistics loaded with a model need none)

    def update(self, x: Tensor) -> None:
        """Accumulate vectors x [..., K]."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected last dim {self.in_features}, got {x.shape[-1]}")
        x = x.reshape(-1, self.in_features)
        if self._ks is None:  # per chunk: k_for_chunk of every tracked k_chunk, each in [1, c] (made once: on a GPU
            # the copy waits for the device)
            self._ks = [torch.tensor([k_for_chunk(kc, e - s) for kc in range(1, self._kth.numel() + 1)],
                                     device=self._kth.device) for s, e in chunk_bounds(self.in_features)]
        step = max(1, _BLOCK_ELEMS // self.in_features)  # token blocks bound the float32 copies
        for t0 in range(0, x.shape[0], step):
            xb = x[t0 : t0 + step]
            a = xb.float().abs()  # [Tb, K]
            self._b0 = torch.maximum(self._b0, a.max())
            for (s, e), kc in zip(chunk_bounds(self.in_features), self._ks):
                top = a[:, s:e].topk(int(kc.max()), dim=-1).values  # [Tb, max k] descending
                self._kth = torch.maximum(self._kth, top[:, kc - 1].amax(0))
            self._sq_sum += xb.double().square().sum(0)
        self._count += x.shape[0]

    def _finite(self) -> Tensor:
        """b0, refused if any input was NaN or inf (NaN propagates into the max). Checked where the statistics are
        read, not per update: on a GPU the test waits for the device."""
        if not torch.isfinite(self._b0):
            raise LocalLLMError(f"the calibration inputs of a layer of {self.in_features} input channels hold NaN or "
                                "inf: the checkpoint's weights are damaged, or its activations overflow; check the "
                                "source model (e.g. `localllm eval SOURCE --qdec off`)")
        return self._b0

    @property
    def b0(self) -> float:
        return float(self._finite())

    @property
    def kth(self) -> Tensor:
        return self._kth.clone()

    def b15(self, k_chunk: int) -> float:
        """The approximate selection's b15 for k_chunk: kth[k_chunk - 1] (without kth's copy: read every step)."""
        return float(self._kth[k_chunk - 1])

    @property
    def sq_mean(self) -> Tensor:
        return (self._sq_sum / max(self._count, 1)).float()

    @property
    def count(self) -> int:
        return self._count

    def state(self) -> dict[str, Tensor]:
        """Tensors only (safetensors-friendly); in_features and kmax follow from the shapes."""
        return {
            "b0": self._finite().reshape(1).clone(),
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
