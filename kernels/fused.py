"""Launchers of the fused decode kernels (fused.cu); fp16 CUDA tensors in, fp16 out."""
from __future__ import annotations

import numpy as np
import torch

from . import cuda


def _k(name: str):
    return cuda.kernel("fused", name, ("rmsnorm", "rope", "silu_mul", "embed_rows"))


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x: fp16 [..., D] contiguous; w: float32 [D]."""
    D = x.shape[-1]
    y = torch.empty_like(x)
    _k("rmsnorm")((x.numel() // D,), (256,), (cuda.ptr(x), cuda.ptr(w), cuda.ptr(y), np.int32(D), np.float32(eps)),
                  stream=cuda.stream())
    return y


def rope_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    """In place on the first `heads` heads of qkv [rows, ld] (contiguous); cos/sin float32 [T, head_dim/2]."""
    rows, ld = qkv.shape
    half = head_dim // 2
    _k("rope")((rows * heads,), (max(32, half),), (cuda.ptr(qkv), cuda.ptr(cos), cuda.ptr(sin), np.int32(ld),
                                                   np.int32(cos.shape[0]), np.int32(heads), np.int32(half)),
               stream=cuda.stream())


def embed_rows(tokens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """tokens: int64 on the GPU; table: fp16 [V, D] pinned in host memory, D % 8 == 0 -> fp16 [*tokens.shape, D] on
    the GPU."""
    V, D = table.shape
    out = torch.empty(*tokens.shape, D, dtype=table.dtype, device=tokens.device)
    tok = tokens.contiguous()
    _k("embed_rows")((max(1, tok.numel()),), (min(256, D // 8),),
                     (cuda.ptr(tok), np.uint64(table.data_ptr()), cuda.ptr(out), np.int32(D // 8)), stream=cuda.stream())
    return out


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu: fp16 [..., 2I] contiguous -> silu(gate) * up [..., I]."""
    I = gu.shape[-1] // 2
    out = torch.empty(*gu.shape[:-1], I, dtype=gu.dtype, device=gu.device)
    n = out.numel()
    _k("silu_mul")((-(-n // 256),), (256,), (cuda.ptr(gu), cuda.ptr(out), np.int32(I), np.int64(n)),
                   stream=cuda.stream())
    return out
