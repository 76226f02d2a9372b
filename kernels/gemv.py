"""Launcher of the low-bit GEMV kernels (gemv.cu): y = W_hat x for batch 1, fp16 in and out."""
from __future__ import annotations

import numpy as np
import torch

from . import cuda

ROWS, UNROLL = 4, 4  # rows per warp, 1024-channel strides in flight (gemv.cu template arguments)
THREADS = 128
NAMES = tuple(f"gemv<{b},{ROWS},{UNROLL}>" for b in (2, 3, 4))


def gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
         group_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: fp16 [K] (contiguous, CUDA); qweight int32 [N, K*bits/32]; scales fp16 [N, G]; zeros uint8 [N, G]."""
    N, G = scales.shape
    K = x.shape[-1]
    assert x.dtype == torch.float16 and x.is_contiguous() and qweight.shape == (N, K * bits // 32)
    if out is None:
        out = torch.empty(N, dtype=torch.float16, device=x.device)
    warps = -(-N // ROWS)
    blocks = -(-warps * 32 // THREADS)
    k = cuda.kernel("gemv", f"gemv<{bits},{ROWS},{UNROLL}>", NAMES)
    k((blocks,), (THREADS,), (cuda.ptr(qweight), cuda.ptr(scales), cuda.ptr(zeros), cuda.ptr(x), cuda.ptr(out),
                              np.int32(N), np.int32(K), np.int32(G), np.int32(group_size)), stream=cuda.stream())
    return out
