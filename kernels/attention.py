"""Launcher of the fused decode attention (attention.cu): RoPE + KV-cache append + attention for one new token, over an
fp16 cache or an 8- / 4-bit one (localllm.kvquant's format)."""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch

from . import cuda

CHUNK, GQ_MAX, SPLITS_MAX, CLUSTER_MAX = 128, 8, 1024, 8  # as in attention.cu
CLUSTER_SPAN = CHUNK * CLUSTER_MAX  # the longest span whose runs merge in a cluster (never more runs than chunks)
PER_HEAD_CHUNKS = 2  # the longest span, in chunks, whose attention runs a block per query head
# The runs of a launch of exactly this many o's GEMV merges while it stages its input (gemv.cu's GEMV_RUNS, merged_x):
# each of its blocks reads every run's fp32 outputs from L2, 4 x GEMV_RUNS bytes a channel, in one round trip.
GEMV_RUNS = 2
# Up to this many runs o's GEMV merges before its staging (gemv.cu's MR 8), where no cluster merges them and every
# block reads at most GEMV_RUNS_BYTES of them (small models: the demo's 8 runs of 576 channels are 18 KB), of at most
# GEMV_RUNS_HEADS heads (gemv.cu's per-head arrays).
# Where clusters merge them, they stay there: on the H200 the demo's shapes stepped 0.5-1.8% slower at 600-1000 with
# MR 8, and 2.4-3.5% faster with plain launches (session 77).
GEMV_RUNS_MAX, GEMV_RUNS_BYTES, GEMV_RUNS_HEADS = 8, 32 << 10, 64


def leaves_runs(splits: int, heads: int, D: int, clustered: bool) -> bool:
    """Whether attend(leave_runs=True) leaves a launch of `splits` runs to o's GEMV (clustered: a cluster could
    merge them)."""
    return splits == GEMV_RUNS or (not clustered and 1 < splits <= GEMV_RUNS_MAX and heads <= GEMV_RUNS_HEADS
                                   and 4 * splits * heads * D <= GEMV_RUNS_BYTES)


class Runs(NamedTuple):
    """The attention's runs of one token, left unmerged for the next GEMV to merge while it stages its input
    (kernels.gemv.gemv(runs, ...)): each run's unnormalized output o, float32 [heads, splits, D], and its softmax's
    (max, sum) ml, float32 [heads, splits, 2]; the runs that hold some of the context follow from pos, int64 [1]."""
    o: torch.Tensor
    ml: torch.Tensor
    pos: torch.Tensor

    def merged(self) -> torch.Tensor:
        """The attention output, fp16 [heads * D], as attend_combine makes it (in torch: the same function, not
        necessarily the same bits)."""
        heads, splits, D = self.o.shape
        used = self.pos // CHUNK + 1
        per = (used + splits - 1) // splits
        live = torch.arange(splits, device=self.o.device) < (used + per - 1) // per  # no reading past the context
        m = torch.where(live, self.ml[..., 0], float("-inf"))
        w = torch.where(live, torch.exp(m - m.amax(1, keepdim=True)), 0.0)
        o = torch.where(live[:, None], self.o, 0.0)
        out = (w[..., None] * o).sum(1) / (w * torch.where(live, self.ml[..., 1], 0.0)).sum(1, keepdim=True)
        return out.to(torch.float16).reshape(-1)


def supported(heads: int, kv_heads: int, head_dim: int) -> bool:
    return head_dim in (64, 128) and heads % kv_heads == 0 and heads // kv_heads <= GQ_MAX


def attend(qkv: torch.Tensor, inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           pos: torch.Tensor, heads: int, kv_heads: int, scale: float, k_sz: torch.Tensor | None = None,
           v_sz: torch.Tensor | None = None, span: int | None = None, splits: int | None = None,
           cluster: bool = True, per_head: bool = True, leave_runs: bool = False) -> torch.Tensor | Runs:
    """qkv: fp16 [(heads + 2 kv_heads) * D] of the new token (before RoPE); inv_freq: float32 [D/2], RoPE's
    frequencies (the kernel rotates by the angles pos * inv_freq, as model.rope_tables computes them);
    k_cache/v_cache: one layer's cache, fp16 [kv_heads, max_len, D], or int32 codes [kv_heads, max_len, D * bits / 32]
    with k_sz/v_sz, fp16 [kv_heads, max_len, 2] (scale, zero); the new key and value are written (quantized) at pos;
    pos: int64 [1] on the GPU; span: the positions this launch may be asked to attend (pos < span; default the whole
    cache), which sizes the split; splits: runs of the context per kv head (default n_splits; tests force a few chunks
    per run). One run needs no combine kernel: attend_part writes the output; nor do at most CLUSTER_MAX runs where
    the GPU has thread-block clusters (cuda.clusters): a kv head's runs are one cluster and merge in it, the same bits
    as attend_combine's (cluster=False forces the combine, as on GPUs without clusters). Where the span is at most
    PER_HEAD_CHUNKS chunks, each a run (the short decode graphs), a block takes one query head (per_head=False: a kv
    head's, as longer spans do), the same bits. Returns the attention output, fp16 [heads * D]; with leave_runs,
    where leaves_runs says, the Runs unmerged instead: o's GEMV merges them (no cluster merge, no combine kernel; the
    same bits)."""
    D = qkv.numel() // (heads + 2 * kv_heads)
    kvh, max_len, words = k_cache.shape
    bits = 16 if k_sz is None else words * 32 // D
    gq = heads // kv_heads
    span = min(span or max_len, max_len)
    chunks = -(-span // CHUNK)

    def plan(per: int):
        smem = shared_bytes(D, per, bits)
        k = cuda.kernel("attention", f"attend_part<{D},{per},{bits}>")
        threads = k.max_threads_per_block  # attention.cu's Tiles::NT, its __launch_bounds__
        return per, k, smem, threads, splits or n_splits(span, kv_heads, smem, threads, k.num_regs, qkv.device.index)

    # up to PER_HEAD_CHUNKS chunks, a block per query head where every run is one chunk: the blocks each do a query
    # head's work (the 8B: a quarter), reading their kv head's chunk side by side, and the appending run's blocks but
    # one keep the new row in their first chunk's tiles only. (Longer spans lose by it: 4x the blocks, in clusters.)
    one = plan(1) if per_head and gq > 1 and chunks <= PER_HEAD_CHUNKS else None
    per, k, smem, threads, splits = one if one is not None and one[4] >= chunks else plan(gq)  # query heads a block
    ws_o = torch.empty(heads, splits, D, dtype=torch.float32, device=qkv.device)
    ws_ml = torch.empty(heads, splits, 2, dtype=torch.float32, device=qkv.device)
    out = torch.empty(heads * D, dtype=torch.float16, device=qkv.device)
    sz = (np.uint64(0), np.uint64(0)) if k_sz is None else (cuda.ptr(k_sz), cuda.ptr(v_sz))
    clustered = cluster and 1 < splits <= CLUSTER_MAX and cuda.clusters(qkv.device.index)
    left = leave_runs and leaves_runs(splits, heads, D, clustered)
    merge = not left and clustered
    cuda.allow_shared(k, smem)
    cuda.launch(k, (kvh, splits, gq // per), (threads,), (
        cuda.ptr(qkv), cuda.ptr(inv_freq), cuda.ptr(k_cache), cuda.ptr(v_cache), *sz, cuda.ptr(pos),
        cuda.ptr(ws_o), cuda.ptr(ws_ml), cuda.ptr(out), np.int32(heads), np.int32(kv_heads), np.int32(max_len),
        np.float32(scale), np.int32(2 if left else merge)), shared_mem=smem, early=True,
        cluster=(1, splits, 1) if merge else None)
    if left:
        return Runs(ws_o, ws_ml, pos)
    if splits == 1 or merge:
        return out
    cuda.launch(cuda.kernel("attention", "attend_combine"), (heads,), (D,), (
        cuda.ptr(ws_o), cuda.ptr(ws_ml), cuda.ptr(pos), cuda.ptr(out), np.int32(splits), np.int32(D)), early=True)
    return out


def shared_bytes(D: int, gq: int, bits: int) -> int:
    """attend_part's dynamic shared memory (attention.cu's Tiles): q and p in fp32, the key tile (rows padded by
    4 * bits / 4 words), the value tile, the (scale, zero) buffers; the output streams' sums reuse the tiles."""
    rw = D * bits // 32
    return 4 * (gq * D + gq * CHUNK + CHUNK * (rw + bits) + CHUNK * rw + (4 * CHUNK if bits < 16 else 0))


@functools.cache
def n_splits(span: int, kv_heads: int, smem: int, threads: int, regs: int, device: int) -> int:
    """Runs per kv head: enough blocks to fill every SM once at the occupancy its threads, registers and shared
    memory allow (the flash-decoding split: each block streams its run of chunks, so one wave keeps the memory system
    busy), at least one chunk per run (never more runs than chunks)."""
    resident = cuda.sm_count(device) * cuda.resident_blocks(device, threads, regs, smem + 2048)
    return max(1, min(-(-span // CHUNK), -(-resident // kv_heads), SPLITS_MAX))
