"""Elementwise pieces of the decoder, one function each: the fused CUDA kernel for fp16 tensors on a GPU
(kernels/fused.cu), else the torch reference below, which defines what the kernel computes."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def cuda_kernels() -> bool:
    """Whether the kernels of kernels/ run here (a GPU, CuPy, not switched off)."""
    from .kernels import cuda
    return cuda.available()


def _fused(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype == torch.float16 and x.is_contiguous() and cuda_kernels()


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] * rsqrt(mean(x^2) + eps) * w (w float32), computed in float32, returned in x's dtype."""
    if _fused(x):
        from .kernels import fused
        return fused.rmsnorm(x, w, eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w).to(x.dtype)


def embedding(tokens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rows of table [V, D] for tokens. A GPU model keeps an embedding table that the head does not share in pinned host
    memory (model.Transformer.place, host_embedding): the kernel reads the rows through its host pointer."""
    if table.device != tokens.device:
        from .kernels import fused
        return fused.embed_rows(tokens, table)
    return F.embedding(tokens, table)


def host_rows(table: torch.Tensor) -> bool:
    """Whether the embedding kernel can read table's rows from host memory: whole 16-byte words (D % 8 == 0)."""
    return table.shape[1] % 8 == 0


def host_embedding(table: torch.Tensor) -> torch.Tensor | None:
    """table [V, D] as fp16 pinned host memory for a GPU model (what embedding() reads), or None where the kernel
    cannot (no CUDA kernels here, not host_rows) or the host has no room to pin it."""
    if not cuda_kernels() or not host_rows(table):
        return None
    try:
        return table.to("cpu", torch.float16).pin_memory()
    except RuntimeError:
        return None


def rope_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    """Rotate-half RoPE, in place, on the first `heads` heads of each row of qkv [rows, ld] (the q heads then the
    k heads of a fused projection); row r is at position r % T of cos/sin [T, head_dim / 2]."""
    if _fused(qkv):
        from .kernels import fused
        return fused.rope_(qkv, cos, sin, heads, head_dim)
    T = cos.shape[0]
    x = qkv[:, : heads * head_dim].view(-1, T, heads, head_dim)
    x1, x2 = x.float().chunk(2, dim=-1)  # [B, T, H, D/2]
    c, s = cos[:, None, :], sin[:, None, :]
    x.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(gate) * up for gu = [gate | up] along the last dim."""
    if _fused(gu):
        from .kernels import fused
        return fused.silu_mul(gu)
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


def quantize_tokens(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] with each row rounded to 8 bits: s = max|row| / 127 (fp32), rint(row / s) in [-127, 127], times s
    (an all-zero row stays zero). What the int8 prompt GEMM (kernels/prefill_a8.cu) multiplies the weights by."""
    xf = x.float()
    s = xf.abs().amax(-1, keepdim=True) / 127.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    return (torch.round(xf / s).clamp(-127, 127) * s).to(x.dtype)


def fused_decode_attention(h: torch.Tensor, cache, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether attend_decode's fused kernel serves a step whose hidden state is h: one token, fp16 on a GPU with the
    kernels, an fp16 or quantized (model.KVCache) cache, a supported head shape. Otherwise model.Block runs the torch
    path (RoPE, cache append, SDPA over the dequantized cache)."""
    if not (_fused(h) and h.shape[:-1].numel() == 1 and (cache.bits < 16 or cache.k.dtype == torch.float16)):
        return False
    from .kernels import attention
    return attention.supported(heads, kv_heads, head_dim)


def attend_decode(qkv: torch.Tensor, inv_freq: torch.Tensor, layer_cache: tuple, pos: torch.Tensor, heads: int,
                  kv_heads: int, span: int, leave_runs: bool = False):
    """RoPE, KV-cache append at pos (quantized in the kernel at 8 or 4 bits) and attention over the cache up to pos,
    for one token, in one fused kernel pair (one kernel where span, the positions pos may take (pos < span), needs
    one run); the same function as model.Block's torch path. layer_cache: KVCache.layer(). Returns fp16
    [heads * head_dim], or with leave_runs, where kernels.attention.leaves_runs says (two runs; up to 8 for small
    models without clusters), the runs for o's GEMV to merge (kernels.attention.Runs, which model.Linear takes as its
    input)."""
    from .kernels import attention
    D = qkv.shape[-1] // (heads + 2 * kv_heads)
    return attention.attend(qkv.reshape(-1), inv_freq, *layer_cache[:2], pos, heads,
                            kv_heads, D ** -0.5, *layer_cache[2:], span=span, leave_runs=leave_runs)
