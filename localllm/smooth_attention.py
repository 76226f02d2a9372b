"""SmoothAttention (QServe, sec. 3.2): per-channel factors that flatten the keys before the KV cache quantizes them.

Keys have a few fixed outlier channels per head, ~10x the rest, and a 4-bit grid per (token, head) spends its
levels on them. With lambda_i = max|K_i|^alpha (alpha 0.5, as the paper), queries times lambda and keys divided by
it leave every q.k unchanged while the keys' channels come closer in size. RoPE rotates channel i with i + D/2, so
both get the larger of their two maxima: a rotation of a pair scaled by one factor is the scaled rotation, and the
factors fold exactly into the q and k rows of the qkv projection (and its bias). `localllm quantize` measures max|K|
on the post-RoPE keys of the calibration text (what the cache stores) and folds before quantizing, so the runtime
and the GPU kernels run unchanged; the factors are kept in model.safetensors (blocks.N.k_smooth) for the record.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import ops
from .model import RMSNorm

ALPHA = 0.5
FLOOR = 1e-3  # a channel's max is taken as at least this share of its head's largest: never divide by ~0


def key_max(cfg, t: dict, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """max |k| per key channel [kv_heads * head_dim] of the block with tensors t (Checkpoint.block_tensors) on the
    calibration hidden states h [n_seq, T, hidden], after RoPE (cos/sin [T, head_dim / 2])."""
    norm, w, b = RMSNorm(t["attn_norm"], cfg.rms_norm_eps), t["qkv"]["weight"], t["qkv"].get("bias")
    m = torch.zeros(cfg.kv_size, device=h.device)
    with torch.no_grad():
        for hb in h.split(4):
            qkv = F.linear(norm(hb), w, b).flatten(0, 1)  # [n * T, q + k + v]: row r at position r % T
            ops.rope_(qkv, cos, sin, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
            m = torch.maximum(m, qkv[:, cfg.q_size: cfg.q_size + cfg.kv_size].abs().amax(0))
    return m


def factors(kmax: torch.Tensor, head_dim: int, alpha: float = ALPHA) -> torch.Tensor:
    """lambda [kv_heads * head_dim] from max |k| per channel: the pair (i, i + D/2) shares max(max_i, max_i+D/2)."""
    m = kmax.float().view(-1, 2, head_dim // 2).amax(1, keepdim=True)  # [kv_heads, 1, D/2]
    m = torch.maximum(m, FLOOR * m.amax(-1, keepdim=True)).clamp(min=1e-6)
    return m.expand(-1, 2, -1).reshape(-1) ** alpha


def fold(t: dict, cfg, lam: torch.Tensor) -> dict:
    """Block tensors with the q rows of qkv (and bias) times lambda of their kv head and the k rows divided by it."""
    q = lam.view(cfg.num_kv_heads, 1, -1).expand(-1, cfg.num_heads // cfg.num_kv_heads, -1).reshape(-1)
    rows = torch.cat([q, 1 / lam, torch.ones_like(lam)]).to(t["qkv"]["weight"].dtype)
    qkv = {**t["qkv"], "weight": t["qkv"]["weight"] * rows[:, None]}
    if qkv.get("bias") is not None:
        qkv["bias"] = qkv["bias"] * rows
    return {**t, "qkv": qkv}
