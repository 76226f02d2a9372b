"""Launcher of the low-bit GEMV kernels (gemv.cu): y = W_hat x for batch 1, fp16 in and out."""
from __future__ import annotations

import numpy as np
import torch

from localllm.quant import GROUP_SIZES

from . import cuda

# (warps per 16-row tile splitting K, 64-channel steps in flight per warp): the compiled variants of gemv.cu.
# Measured on the H100 (localllm bench gemv-sweep): long K wants more warps per tile, large N more steps in flight.
VARIANTS = ((4, 2), (4, 4), (16, 2))
NAMES = tuple(f"gemv<{b},{w},{u},{gs}>" for b in (2, 3, 4) for w, u in VARIANTS for gs in range(len(GROUP_SIZES))) \
    + tuple(f"dequant<{b}>" for b in (2, 3, 4))


def pick_variant(N: int, K: int) -> tuple[int, int]:
    if K >= 8192:
        return 16, 2
    return (4, 4) if N >= 16384 else (4, 2)


def gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
         group_size: int, out: torch.Tensor | None = None, residual: torch.Tensor | None = None,
         variant: tuple[int, int] | None = None) -> torch.Tensor:
    """x: fp16 [K] (contiguous, CUDA); qweight int32 [N/16, K*bits/2] (quant.pack_codes); scales fp16 [N, G];
    zeros uint8 [N, G]; group_size one of GROUP_SIZES. residual: fp16 [N], added to y in the epilogue.
    variant: one of VARIANTS (default: pick_variant for the shape)."""
    N, G = scales.shape
    K = x.shape[-1]
    assert x.dtype == torch.float16 and x.is_contiguous() and qweight.shape == (N // 16, K * bits // 2)
    if out is None:
        out = torch.empty(N, dtype=torch.float16, device=x.device)
    warps, unroll = variant or pick_variant(N, K)
    k = cuda.kernel("gemv", f"gemv<{bits},{warps},{unroll},{GROUP_SIZES.index(group_size)}>", NAMES)
    smem = K * 2 + K // 64 * 4 + 16 * G * 3  # x, its 64-channel sums, the tile's scales and zeros
    if smem > 48 * 1024:
        k.max_dynamic_shared_size_bytes = smem
    k((N // 16,), (32 * warps,), (cuda.ptr(qweight), cuda.ptr(scales), cuda.ptr(zeros), cuda.ptr(x),
                              cuda.ptr(residual) if residual is not None else np.uint64(0), cuda.ptr(out),
                              np.int32(N), np.int32(K), np.int32(G)), stream=cuda.stream(),
      shared_mem=smem)
    return out


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
               group_size: int) -> torch.Tensor:
    """W_hat as fp16 [N, K] on the GPU: what quant.QuantWeight.dequantize(torch.float16) computes."""
    N, G = scales.shape
    K = qweight.shape[1] * 2 // bits
    out = torch.empty(N, K, dtype=torch.float16, device=qweight.device)
    threads = N // 16 * (K // 64) * 32
    cuda.kernel("gemv", f"dequant<{bits}>", NAMES)(
        (-(-threads // 256),), (256,), (cuda.ptr(qweight), cuda.ptr(scales), cuda.ptr(zeros), cuda.ptr(out),
                                        np.int32(N), np.int32(K), np.int32(G), np.int32(group_size)),
        stream=cuda.stream())
    return out
