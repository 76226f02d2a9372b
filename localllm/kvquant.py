"""KV cache quantization (QServe's KV8/KV4 format): per (token, head) asymmetric, fp16 scale and zero.

One head's key (or value) vector x [head_dim] at one position is stored as codes c = round((x - z) / s), clamped
to 0..2^bits - 1, with z = min(x) and s = (max(x) - z) / (2^bits - 1) both rounded to fp16 first (so the codes are
for the stored scale and zero); it reads back as s * c + z. The codes are packed into int32 words, code i of a
word at bits * i (quant's word packing), so a 4-bit head of 128 channels is 16 words + 4 bytes of scale and zero.
kernels/attention.cu computes the same function on the GPU (its float32 arithmetic, fp16-rounded s and z).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .errors import LocalLLMError, is_whole
from .quant import pack_words, unpack_words

KV_BITS = (16, 8, 4)  # 16: the model's dtype (fp16 on a GPU), no quantization


def check_bits(bits) -> int:
    """The kv-bits setting as an int, or a one-line error naming the choices."""
    if not is_whole(bits) or bits not in KV_BITS:  # (not 8.0 or True)
        raise LocalLLMError(f"kv-bits {bits!r} is not supported; use one of {', '.join(map(str, KV_BITS))} "
                            "(16: no KV cache quantization)")
    return int(bits)


def words_per_head(head_dim: int, bits: int) -> int:
    if head_dim * bits % 32:
        raise LocalLLMError(f"a {bits}-bit KV cache needs head_dim * {bits} to be a multiple of 32 (head_dim is "
                            f"{head_dim}); use --kv-bits 16")
    return head_dim * bits // 32


def quantize(x: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """x [..., head_dim] (any float dtype) -> (codes int32 [..., head_dim * bits / 32], fp16 [..., 2]: scale, zero)."""
    words_per_head(x.shape[-1], bits)
    levels = 2**bits - 1
    x = x.float()
    zero = x.amin(-1, keepdim=True).half()
    z = zero.float()
    scale = ((x.amax(-1, keepdim=True) - z) / levels).half()
    s = scale.float()
    # a constant vector (s == 0) is all zero points; the division there is discarded
    codes = torch.where(s > 0, (x - z) / s, 0.0).round().clamp(0, levels).to(torch.int32)
    return pack_words(codes, bits), torch.cat([scale, zero], -1)


def dequantize(codes: Tensor, sz: Tensor, bits: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Inverse of quantize(): s * c + z, computed in float32 (float64 for dtype=float64), returned in `dtype`."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    c = unpack_words(codes, bits).to(wide)
    s, z = sz.to(wide).unbind(-1)
    return (c * s[..., None] + z[..., None]).to(dtype)


def bytes_per_token(cfg, bits: int, cpu: bool = False) -> int:
    """Bytes one token takes in the KV cache: keys and values of every layer and kv head (at 16 bits the activations'
    dtype: fp16 on a GPU, float32 on the CPU; codes + fp16 scale and zero otherwise)."""
    per_head = (4 if cpu else 2) * cfg.head_dim if bits == 16 else 4 * words_per_head(cfg.head_dim, bits) + 4
    return 2 * cfg.num_layers * cfg.num_kv_heads * per_head
