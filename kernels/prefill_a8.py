"""Launchers of the 8-bit-activation prompt GEMM (prefill_a8.cu): a prompt's tokens quantized to int8 per token,
multiplied by the packed low-bit weights on the int8 tensor cores. The same function as ops.quantize_tokens
followed by the dequantized weights' matmul (up to fp32 rounding of the group scaling)."""
from __future__ import annotations

import numpy as np
import torch

from localllm.quant import GROUP_SIZES

from . import cuda
from .gemv import Packed

TOKENS, ROWS, STAGES = 128, 128, 4  # a block's tile: 128 tokens x 128 outputs (8 warps of 16 rows); x8 ring depth


def linear(x: torch.Tensor, w: Packed) -> torch.Tensor:
    """x: fp16 [T, K] on the GPU -> fp16 [T, N] = quantize_tokens(x) W_hat^T."""
    T, K = x.shape
    N, G = w.out_features, w.meta.shape[1]
    assert x.dtype == torch.float16 and K == w.in_features
    x = x.contiguous()
    x8 = torch.empty(T, K, dtype=torch.int8, device=x.device)
    sx = torch.empty(T, dtype=torch.float32, device=x.device)
    xsum = torch.empty(T, G, dtype=torch.int32, device=x.device)
    s = cuda.stream()
    cuda.kernel("prefill_a8", "quant_a8")(
        (T,), (256,), (cuda.ptr(x), cuda.ptr(x8), cuda.ptr(sx), cuda.ptr(xsum), np.int32(K),
                       np.int32(w.group_size), np.int32(G)), shared_mem=4 * G, stream=s)
    y = torch.empty(T, N, dtype=torch.float16, device=x.device)
    gs = GROUP_SIZES.index(w.group_size)
    cuda.kernel("prefill_a8", f"gemm_a8<{w.bits},{gs}>")(
        (-(-N // ROWS), -(-T // TOKENS)), (256,), (cuda.ptr(w.qweight), cuda.ptr(w.meta), cuda.ptr(x8),
                                                   cuda.ptr(sx), cuda.ptr(xsum), cuda.ptr(y), np.int32(T),
                                                   np.int32(N), np.int32(K), np.int32(G)),
        shared_mem=STAGES * TOKENS * 64, stream=s)
    return y
