"""Launchers of the non-uniform (table) GEMV and dequantize kernels (gemv_lut.cu).

The same calls as kernels/gemv.py (gemv, dequantize), for quant.QuantLUT weights on the GPU (QuantLUT.to: the
kernels read its packed codes and tables as they are). QDEC is not fused into this GEMV yet: LocalModel runs
QDEC for these models on the CPU only, and says so (NO_QDEC).
"""
from __future__ import annotations

import numpy as np
import torch

from localllm.errors import LocalLLMError
from localllm.quant import QuantLUT

from . import cuda
from .gemv import _sm_count

WARPS, RUN = 8, 4  # warps per block, consecutive steps a warp loads before decoding them (gemv_lut.cu's U)
BLOCKS_PER_SM = 2
NO_QDEC = ("QDEC is not available on the GPU for non-uniform (SqueezeLLM) weights yet: they run uncompensated "
           "there; use --device cpu for QDEC with them")
NAMES = tuple(f"gemv_lut<{b},{WARPS},{RUN}>" for b in (2, 3, 4)) + tuple(f"dequant_lut<{b}>" for b in (2, 3, 4))


def gemv(x: torch.Tensor, w: QuantLUT, out: torch.Tensor | None = None, residual: torch.Tensor | None = None,
         norm: tuple[torch.Tensor, float] | None = None, glu: bool = False, comp=None,
         blocks_per_sm: int = BLOCKS_PER_SM) -> torch.Tensor:
    """y = W_hat f(x) (+ residual): kernels.gemv.gemv's contract for a table weight (comp: QDEC, not available)."""
    if comp is not None:
        raise LocalLLMError(NO_QDEC)
    N, K = w.out_features, w.in_features
    assert x.dtype == torch.float16 and x.shape == ((2 * K,) if glu else (K,)) and not (glu and norm)
    assert w.qweight.shape == (N // 16, K * w.bits // 2)
    if not x.is_contiguous() or x.data_ptr() % 16:
        x = x.clone()
    if out is None:
        out = torch.empty(N, dtype=torch.float16, device=x.device)
    k = cuda.kernel("gemv_lut", f"gemv_lut<{w.bits},{WARPS},{RUN}>", NAMES)
    smem = K * 2 + 16 * 2**w.bits * 2
    if smem > 48 * 1024:
        k.max_dynamic_shared_size_bytes = smem
    grid = min(N // 16, _sm_count(x.device.index or 0) * blocks_per_sm)
    null = np.uint64(0)
    cuda.launch(k, (grid,), (32 * WARPS,), (
        cuda.ptr(w.qweight), cuda.ptr(w.lut), cuda.ptr(x), null if residual is None else cuda.ptr(residual),
        cuda.ptr(out), np.int32(N), np.int32(K), null if norm is None else cuda.ptr(norm[0]),
        np.float32(norm[1] if norm else 0.0), np.int32(glu)), shared_mem=smem)
    return out


def dequantize(w: QuantLUT) -> torch.Tensor:
    """W_hat as fp16 [N, K] on the GPU: what quant.QuantLUT.dequantize(torch.float16) computes."""
    N, K = w.out_features, w.in_features
    out = torch.empty(N, K, dtype=torch.float16, device=w.qweight.device)
    threads = N // 16 * (K // 64) * 32
    cuda.kernel("gemv_lut", f"dequant_lut<{w.bits}>", NAMES)(
        (-(-threads // 256),), (256,), (cuda.ptr(w.qweight), cuda.ptr(w.lut), cuda.ptr(out), np.int32(N),
                                        np.int32(K)), stream=cuda.stream())
    return out
