"""Launcher of the fused decode attention (attention.cu): RoPE + KV-cache append + attention for one new token."""
from __future__ import annotations

import numpy as np
import torch

from . import cuda

CHUNK, GQ_MAX = 128, 8  # as in attention.cu
NAMES = tuple(f"attend_part<{d},{g}>" for d in (64, 128) for g in range(1, GQ_MAX + 1)) + ("attend_combine",)


def supported(heads: int, kv_heads: int, head_dim: int) -> bool:
    return head_dim in (64, 128) and heads % kv_heads == 0 and heads // kv_heads <= GQ_MAX


def attend(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           pos: torch.Tensor, heads: int, kv_heads: int, scale: float) -> torch.Tensor:
    """qkv: fp16 [(heads + 2 kv_heads) * D] of the new token (before RoPE); cos/sin: float32 [D/2] at its position;
    k_cache/v_cache: fp16 [kv_heads, max_len, D] of one layer (the new key and value are written at pos); pos: int64
    [1] on the GPU. Returns the attention output, fp16 [heads * D]."""
    kvh, max_len, D = k_cache.shape
    chunks = -(-max_len // CHUNK)
    ws_o = torch.empty(heads, chunks, D, dtype=torch.float32, device=qkv.device)
    ws_ml = torch.empty(heads, chunks, 2, dtype=torch.float32, device=qkv.device)
    out = torch.empty(heads * D, dtype=torch.float16, device=qkv.device)
    streams = CHUNK // (D // 2)
    smem = 4 * (GQ_MAX * D + GQ_MAX * CHUNK + (streams - 1) * GQ_MAX * D)
    cuda.launch(cuda.kernel("attention", f"attend_part<{D},{heads // kv_heads}>", NAMES), (kvh, chunks), (CHUNK,), (
        cuda.ptr(qkv), cuda.ptr(cos), cuda.ptr(sin), cuda.ptr(k_cache), cuda.ptr(v_cache), cuda.ptr(pos),
        cuda.ptr(ws_o), cuda.ptr(ws_ml), np.int32(heads), np.int32(kv_heads), np.int32(max_len), np.float32(scale)),
        shared_mem=smem, early=True)
    cuda.launch(cuda.kernel("attention", "attend_combine", NAMES), (heads,), (D,), (
        cuda.ptr(ws_o), cuda.ptr(ws_ml), cuda.ptr(pos), cuda.ptr(out), np.int32(chunks), np.int32(D)), early=True)
    return out
