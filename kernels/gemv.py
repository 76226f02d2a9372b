"""Launcher of the low-bit GEMV kernels (gemv.cu): y = W_hat x for batch 1, fp16 in and out."""
from __future__ import annotations

import numpy as np
import torch

from localllm.quant import GROUP_SIZES

from . import cuda

WARPS, UNROLL = 8, 4  # warps per 16-row tile (split K), 64-channel steps in flight per warp (gemv.cu)
NAMES = tuple(f"gemv<{b},{WARPS},{UNROLL},{gs}>" for b in (2, 3, 4) for gs in range(len(GROUP_SIZES)))


def gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
         group_size: int, out: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x: fp16 [K] (contiguous, CUDA); qweight int32 [N/16, K*bits/2] (quant.pack_codes); scales fp16 [N, G];
    zeros uint8 [N, G]; group_size one of GROUP_SIZES. residual: fp16 [N], added to y in the epilogue."""
    N, G = scales.shape
    K = x.shape[-1]
    assert x.dtype == torch.float16 and x.is_contiguous() and qweight.shape == (N // 16, K * bits // 2)
    if out is None:
        out = torch.empty(N, dtype=torch.float16, device=x.device)
    k = cuda.kernel("gemv", f"gemv<{bits},{WARPS},{UNROLL},{GROUP_SIZES.index(group_size)}>", NAMES)
    smem = K * 2 + K // 64 * 4 + 16 * G * 3  # x, its 64-channel sums, the tile's scales and zeros
    if smem > 48 * 1024:
        k.max_dynamic_shared_size_bytes = smem
    k((N // 16,), (32 * WARPS,), (cuda.ptr(qweight), cuda.ptr(scales), cuda.ptr(zeros), cuda.ptr(x),
                              cuda.ptr(residual) if residual is not None else np.uint64(0), cuda.ptr(out),
                              np.int32(N), np.int32(K), np.int32(G)), stream=cuda.stream(),
      shared_mem=smem)
    return out
