"""Launchers of the low-bit GEMV and dequantize kernels (gemv.cu), and the GPU-resident weights they read: Packed
for uniform (RTN/AWQ) weights, PackedLUT for table (SqueezeLLM) weights."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from localllm.errors import LocalLLMError
from localllm.quant import GROUP_SIZES, HEAD_BITS, QuantLUT, QuantWeight, as_int32, unpack_codes

from . import cuda, qdec
from .attention import GEMV_RUNS, GEMV_RUNS_HEADS, GEMV_RUNS_MAX, Runs

META_BYTES = 48  # per (16-row tile, group): 16 fp16 scales, then 16 uint8 zeros
LUT_GROUP_BYTES = 64  # grouped tables, per (tile, group) after the tile's tables: 16 fp16 scales, 16 fp16 offsets

# (warps per block, ring depth in slots per warp, pairs of steps per slot): gemv.cu's variants. The first
# two, at one block per SM, are what decode runs (with and without QDEC): two pairs per slot where a warp's share of a
# tile is two pairs (fits: K = 4096, as in every 7-8B model's qkv, o and gate_up), else one; the sweep
# (`localllm bench gemv-sweep`) also times the third. On the H100 (kernels/NOTES.md), depth 3 pairs beat 2 and 4 on o
# and gate_up (W4 80 and 96% of copy bandwidth vs 71 and 93% at 4) and lost to 4 on qkv (77 vs 86%); two slots of two
# pairs keep as many in flight. Table weights, whose slots also hold a tile's tables, want 2 slots of one pair.
VARIANTS = ((16, 3, 1), (16, 2, 2), (8, 5, 1))
TABLE_VARIANT = (16, 2, 1)
# 8-bit weights (the output head, quant.HEAD_BITS): a pair is 2 KB, so depth 2 keeps 64 KB in flight per SM and the
# rings within the 99 KB of shared memory of sm_89 (RTX 40-series)
HEAD_VARIANT = (16, 2, 1)
# Where a variant's rings and staged x exceed a GPU's shared memory per block (99 KB on the RTX 30/40 series: the
# down of Qwen2.5-32B, K = 27648, at any width; of Qwen2.5-7B, K = 18944, with 4-bit tables), decode takes the first
# of these that fits: two slots per warp (2/3 of the rings at one pair a slot), then half the warps with three, then
# with two. On the H200 (`bench gemv-sweep`, one block per SM) they take the 8B down W4 from 95 to 86 / 78 / 60% of
# copy bandwidth (docs/gpu.md).
SMALLER_VARIANTS = ((16, 2, 1), (8, 3, 1), (8, 2, 1))
# the group sizes compiled with two pairs per slot (larger ones spill under the 64-register cap; gemv.cu's INST_BITS2)
TWO_PAIR_GROUPS = (64, 128)


def lane_rows(device: torch.device | str) -> torch.Tensor:
    """The order a tile's 16 per-row values take in a record: 0, 8, 1, 9, ..., 7, 15 (a lane's rows g, g + 8 side by
    side, one load for both)."""
    return torch.arange(16, device=device).view(2, 8).T.reshape(-1)


@dataclass
class Packed:
    """A QuantWeight as the GPU kernels read it: the packed codes as they are (3 bits: laid out again at load time,
    bytes3_layout), and each 16-row tile's scales and zeros of one group side by side (one 48-byte record), so a warp
    fetches them with its weights."""
    qweight: torch.Tensor  # int32 [N/16, K*bits/2], quant.pack_codes layout (3 bits: bytes3_layout)
    meta: torch.Tensor  # uint8 [N/16, G, 48]: fp16 scales then zeros of rows 0, 8, 1, 9, ..., 7, 15
    bits: int
    group_size: int
    in_features: int

    @classmethod
    def from_quant(cls, q: QuantWeight, device: torch.device | str = "cuda") -> "Packed":
        N, G = q.scales.shape
        rows = lane_rows(device)
        sc = q.scales.to(device).view(N // 16, 16, G)[:, rows].transpose(1, 2).contiguous().view(torch.uint8)
        zr = q.zeros.to(device).view(N // 16, 16, G)[:, rows].transpose(1, 2)
        qw = q.qweight.to(device)
        if q.bits == 3:
            qw = qw.clone() if qw is q.qweight else qw
            step = max(1, (1 << 18) // q.in_features)  # tiles of 2^22 codes at a time: bytes3_layout's int64
            for t in range(0, qw.shape[0], step):     # temporaries (~40 bytes a code) stay near 200 MB
                qw[t:t + step] = bytes3_layout(unpack_codes(qw[t:t + step], 3))
        return cls(qw, torch.cat([sc, zr], dim=2).contiguous(), q.bits, q.group_size, q.in_features)

    @property
    def out_features(self) -> int:
        return self.meta.shape[0] * 16

    def tiles(self, t0: int, t1: int) -> "Packed":
        """Rows 16 t0 .. 16 t1 (views)."""
        return Packed(self.qweight[t0:t1], self.meta[t0:t1], self.bits, self.group_size, self.in_features)

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() * 4 + self.meta.numel()


@dataclass
class PackedLUT:
    """A QuantLUT as the GPU kernels read it: the codes rearranged at load time so that a lane's four codes of one row
    and mma tile are the nibbles of one byte-permute selector (kernels/lut.cuh, lut_fragments), and one record per
    16-row tile of the rows' 8-bit tables (QuantLUT.grid) and their scales and offsets (lut_record_bytes); grouped
    tables, then one LUT_GROUP_BYTES record per group: the rows' fp16 group scales, then offsets (rows 0, 8, 1,
    9, ...)."""
    qweight: torch.Tensor  # int32 [N/16, K*bits/2]
    lut: torch.Tensor  # uint8 [N/16, lut_record_bytes(bits) (+ G * LUT_GROUP_BYTES)]
    bits: int
    in_features: int
    group_size: int | None = None  # grouped tables: TABLE_GROUP

    @classmethod
    def from_quant(cls, q: QuantLUT, device: torch.device | str = "cuda") -> "PackedLUT":
        v, scale, offset = (t.to(device) for t in q.grid())
        table, place = lut_pairs(v) if q.bits == 4 else (v, None)
        qw = q.qweight.to(device)
        out = torch.empty_like(qw)
        for t in range(0, qw.shape[0], 256):  # 4096 rows at a time: the int64 temporaries stay small
            codes = unpack_codes(qw[t:t + 256], q.bits)
            if place is not None:
                codes = place[16 * t:16 * (t + 256)].gather(1, codes.long())
            out[t:t + 256] = select_layout(codes, q.bits)
        tiles = v.shape[0] // 16
        rows = lane_rows(device)
        per_row = [f.view(tiles, 16)[:, rows].contiguous().view(torch.uint8) for f in (scale, offset)]
        parts = [table.view(tiles, -1), *per_row]
        if q.scales is not None:  # [tiles, G, 16 scales + 16 offsets] as bytes
            G = q.scales.shape[1]
            grp = [f.to(device).view(tiles, 16, G)[:, rows].transpose(1, 2) for f in (q.scales, q.offsets)]
            parts.append(torch.cat(grp, dim=2).contiguous().view(torch.uint8).view(tiles, G * LUT_GROUP_BYTES))
        return cls(out, torch.cat(parts, dim=1).contiguous(), q.bits, q.in_features, q.group_size)

    @property
    def groups(self) -> int:
        """Group records per tile: grouped tables, the groups of input channels; per-row tables, 0."""
        return -(-self.in_features // self.group_size) if self.group_size else 0

    @property
    def out_features(self) -> int:
        return self.lut.shape[0] * 16

    def tiles(self, t0: int, t1: int) -> "PackedLUT":
        """Rows 16 t0 .. 16 t1 (views)."""
        return PackedLUT(self.qweight[t0:t1], self.lut[t0:t1], self.bits, self.in_features, self.group_size)

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() * 4 + self.lut.numel()


def lut_pairs(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit tables v uint8 [N, 16] (QuantLUT.grid: an even number of entries below 128 per row) -> (the bytes the
    GPU looks up [N, 16], where each entry goes [N, 16]: the code the kernel reads for code c is place[c]).
    Entries go in pairs of slots (i, i + 8) whose values share their sign bit, so that one byte permute of slots 0-7
    and one of 8-15, each replicating the sign bit of the slot i or i + 8 it was not asked for (selector bit 3),
    combine by XOR: a pair of entries below 128 is stored as it is, one above 128 with slot i + 8 complemented
    (kernels/lut.cuh, lut_fragments)."""
    low = v < 128
    rank_low, rank_high = low.long().cumsum(1) - 1, (~low).long().cumsum(1) - 1
    n_low = low.long().sum(1, keepdim=True)
    if (n_low % 2).any():
        raise ValueError("each 4-bit table needs an even number of entries below 128 (QuantLUT.grid)")
    rank = torch.where(low, rank_low, rank_high)
    place = torch.where(low, 0, n_low // 2) + rank // 2 + 8 * (rank % 2)
    stored = torch.where(~low & (rank % 2 == 1), 255 - v, v)
    return torch.empty_like(v).scatter_(1, place, stored), place


def lut_record_bytes(bits: int) -> int:
    """A table weight's record per tile (gemv.cu): 16 tables of 2^bits bytes, 16 fp32 scales, 16 fp32 offsets."""
    return (16 << bits) + 128


def select_layout(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes uint8 [N, K] -> int32 [N/16, K*bits/2] in PackedLUT's layout: per (tile, 64-channel step, lane 4g + t)
    `bits` words; code p of selector (mma tile m, row half r) is element (row g + 8r, column 16m + 2t + p % 2 +
    8 (p // 2)). 2 and 3 bits: its low two bits at bit 16r + 4p + 2 (m % 2) of word m // 2, its third bit at
    16r + 4p + m of word 2; 4 bits: the code at bit 16r + 4p of word m (lut.cuh, lut_selectors)."""
    n, k = codes.shape
    dev = codes.device
    g, t, m, r, p = (v.reshape(-1) for v in torch.meshgrid(*(torch.arange(i, device=dev) for i in (8, 4, 4, 2, 4)),
                                                              indexing="ij"))
    row, col = g + 8 * r, 16 * m + 2 * t + p % 2 + 8 * (p // 2)  # [lane-major: 32 lanes x 32 codes]
    c = codes.long().view(n // 16, 16, k // 64, 64).permute(0, 2, 1, 3)[:, :, row, col]  # [T, S, 32 * 32]
    c = c.view(n // 16, k // 64, 32, 32)
    shape = (n // 16, k // 64, 32)
    m, r, p = (v.view(32, 32)[0] for v in (m, r, p))  # per code of a lane
    words = torch.zeros(*shape, bits, dtype=torch.int64, device=dev)
    if bits == 4:
        for w in range(4):
            words[..., w] = ((c << (16 * r + 4 * p)) * (m == w)).sum(-1)
        return as_int32(words).view(n // 16, -1)
    low = (c & 3) << (16 * r + 4 * p + 2 * (m % 2))
    for w in range(2):
        words[..., w] = (low * (m // 2 == w)).sum(-1)
    if bits == 3:
        words[..., 2] = ((c >> 2) << (16 * r + 4 * p + m)).sum(-1)
    return as_int32(words).view(n // 16, -1)


def bytes3_layout(codes: torch.Tensor) -> torch.Tensor:
    """3-bit codes uint8 [N, K] -> int32 [N/16, K*3/2] in Packed's GPU layout for 3 bits (kernels/codes.cuh), where
    a lane's codes are bytes the int8 tensor cores take with one mask: per (tile, 64-channel step, lane 4g + t) three
    words W0-W2 (a step holds every lane's W0 and W1 side by side, then every lane's W2); byte b of the four codes of
    row g + 8r and mma tile m is column 16m + (2t, 2t + 8, 2t + 1, 2t + 9)[b]. Tiles 0-2: byte b of W_m holds row
    g's code at bits 2-4 and row g + 8's at bits 5-7. Tile 3, from the bits 0-1 of every byte: row g's code bits 0-1
    in W0, bit 2 in W1's bit 0; row g + 8's bit 0 in W1's bit 1, bits 1-2 in W2."""
    n, k = codes.shape
    dev = codes.device
    g, t, m, r, b = (v.reshape(-1) for v in torch.meshgrid(*(torch.arange(i, device=dev) for i in (8, 4, 4, 2, 4)),
                                                              indexing="ij"))
    row, col = g + 8 * r, 16 * m + 2 * t + 8 * (b % 2) + b // 2
    c = codes.long().view(n // 16, 16, k // 64, 64).permute(0, 2, 1, 3)[:, :, row, col]
    c = c.view(n // 16, k // 64, 32, 4, 2, 4)  # [T, S, lane, m, r, byte]
    shift = 8 * torch.arange(4, device=dev)
    byte = lambda v: (v << shift).sum(-1)  # noqa: E731  (four bytes [..., 4] -> a word)
    words = torch.stack([byte((c[..., w, 0, :] << 2) | (c[..., w, 1, :] << 5)) for w in range(3)], -1)
    lo, hi = c[..., 3, 0, :], c[..., 3, 1, :]
    words[..., 0] |= byte(lo & 3)
    words[..., 1] |= byte((lo >> 2) | ((hi & 1) << 1))
    words[..., 2] |= byte(hi >> 1)
    # per step: every lane's W0, W1 side by side, then every lane's W2 (codes.cuh, step_words)
    words = torch.cat([words[..., :2].reshape(n // 16, k // 64, 64), words[..., 2]], -1)
    return as_int32(words).view(n // 16, -1)


# Every GEMV launches early (cuda.launch) and lets the next kernel launch at its start, so that kernel's prologue
# (a GEMV's first weights) overlaps its stream, unless both are GEMVs of at least this many bytes: the next would hold
# half of each SM's registers through this one's whole long stream (session 3), so it launches only as this one's
# blocks end their streams (hold_next; at their exit until session 24: 8B decode -0.3%). After a short GEMV (8B o
# before gate_up) the early launch pays: H100, 8B decode, 8-bit head, W3 1.85 -> 1.80 ms per step, W4 2.03 -> 1.98
# (kernels/NOTES.md, session 23).
HOLD_BYTES = 16 << 20
# A GEMV that starts with x ready (held, or no early launch) stages x before it requests its first weights, whose HBM
# misses would otherwise delay x's L2 hits by ~1.4 us. H100, 8B decode, 8-bit head: W3 1.777 -> 1.768 ms per step, W4
# 1.986 -> 1.972 (down and the head are held); without early launch W3 2.043 -> 2.002; `bench gemv` down W4 82 -> 86%
# of copy bandwidth. Not at two blocks per SM, where it lost (gate_up W4 96 -> 93%; kernels/NOTES.md, session 24).
# A QDEC GEMV does so wherever it launches: its selection starts sooner (8B W3 decode with k_chunk 8 on one kind:
# gate_up -1.5%, qkv and o -0.5% per step), though x is not ready at its start after o or the attention.

# A uniform GEMV without QDEC whose blocks would each take this many tiles or more at one block per SM runs two blocks
# per SM where two fit: one block's tile ends (a barrier, the reduction) then leave the other streaming. H100, 8B
# decode with the 8-bit head (scratch A/B, three rounds): gate_up (13.6 tiles a block) at two blocks, W4 487 -> 494
# tok/s, W3 535 -> 540; down too (1.9 tiles a block), 540 -> 489: its neighbours lose more than it gains.
TWO_BLOCK_TILES = 8


def uses_int8(w: Packed | PackedLUT, qdec: bool, device: int) -> bool:
    """Whether gemv.cu multiplies w on the int8 tensor cores (U8: the codes as bytes, one LOP3 per four weights, two
    mma per step instead of four, x staged as three int8 planes): 4- and 3-bit uniform weights at group size 128
    without QDEC whose x is staged in one round (K <= 4096) and whose blocks compute ~2 tiles or more (N / 16 >= 1.5 x
    SMs), which pays for staging the planes. H200, 8B decode (kernels/NOTES.md, sessions 70, 71): with qkv, o and
    gate_up on it W4 +1.7%, W3 +4.9%; with down (K = 14336) too W4 -4%, W3 -1.7%; the demo model's layers (<= 1.5
    tiles per SM) at 4 bits -2%. With QDEC, whose selection reads x in fp16 (staged both ways), only where blocks
    compute TWO_BLOCK_TILES tiles or more (the 8B gate_up): W3 gate_up's k_chunk 2 / 8 +41 / +48% -> +25 / +32%
    over the plain GEMV, 8B W3 decode with k_chunk 8 everywhere +1.2%; qkv and o lose (k_chunk 8 +72 -> +83%, +117 ->
    +133%)."""
    if not (isinstance(w, Packed) and w.bits in (3, 4) and w.group_size == 128 and w.in_features <= 4096):
        return False
    return w.out_features // 16 >= (TWO_BLOCK_TILES if qdec else 1.5) * cuda.sm_count(device)


def slot_meta_bytes(w: Packed | QuantWeight | PackedLUT | QuantLUT, pairs: int = 1) -> int:
    """Bytes of the meta a ring slot holds beside its weights (gemv.cu, SLOT): for table weights a tile's tables
    (lut_record_bytes) and, grouped, the pair's group record; else room for two META_BYTES records per pair."""
    if isinstance(w, (PackedLUT, QuantLUT)):
        return lut_record_bytes(w.bits) + (LUT_GROUP_BYTES if w.group_size else 0)
    return 2 * pairs * META_BYTES


def fits(variant: tuple[int, int, int], K: int, group_size: int | None) -> bool:
    """Whether gemv.cu runs `variant` for K at group_size: slots of one pair always; of two pairs where a warp's
    share of a tile is exactly two pairs (one slot a tile, no cursor within it), at TWO_PAIR_GROUPS."""
    warps, _, pairs = variant
    return pairs == 1 or (K == 256 * warps and group_size in TWO_PAIR_GROUPS)


def tiles_per_barrier(limit: int | None) -> int:
    """How many tiles' partial sums gemv.cu's warps keep in shared memory between barriers on a GPU whose blocks may
    opt in to `limit` bytes of it (None: no limit): 4 with an H100's / H200's 227 KB (H200: 8B decode 3-4% faster than
    one), 1 below 200 KB (an RTX 30/40/50's 99 KB, where a large model's down needs the room for its variant; an
    A100's 163 KB). The kernel applies the same rule (kernels.cuda.options: SHARED_LIMIT)."""
    return 1 if limit is not None and limit < 200 * 1024 else 4


MR8_STATIC = 4 * GEMV_RUNS_HEADS * (GEMV_RUNS_MAX + 1)  # gemv.cu's MR 8 arrays rw (heads x runs) and rl (heads), float


def static_shared_bytes(warps: int, limit: int | None = None) -> int:
    """gemv.cu's static shared arrays on a GPU of `limit` bytes per block (red: 2 banks x tiles_per_barrier x warps x
    16 floats; wsum; seq), with room to spare."""
    return (128 * tiles_per_barrier(limit) + 4) * warps + 256


def decode_variant(w: Packed | QuantWeight | PackedLUT | QuantLUT, limit: int | None = None) -> tuple[int, int, int]:
    """The (warps, depth, pairs per slot) variant decode runs for w (QDEC runs the same one): the fastest measured
    (H100 / H200), or where its shared memory would exceed `limit` bytes per block (cuda.shared_limit; None: no
    limit), the first of SMALLER_VARIANTS that fits. A shape none fits is refused in one line."""
    table = isinstance(w, (PackedLUT, QuantLUT))
    first = TABLE_VARIANT if table else HEAD_VARIANT if w.bits == HEAD_BITS else \
        VARIANTS[1] if fits(VARIANTS[1], w.in_features, w.group_size) else VARIANTS[0]
    if limit is None:
        return first
    need = {}
    for v in (first, *SMALLER_VARIANTS):
        if fits(v, w.in_features, w.group_size):
            need[v] = shared_bytes(w, *v) + static_shared_bytes(v[0], limit)
            if need[v] <= limit:
                return v
    fix = "; quantize it with --method rtn or awq (table weights stage x in 3 bytes a channel, uniform ones in 2)" \
        if table else ""
    raise LocalLLMError(f"the GEMV of {w.in_features}-input {w.bits}-bit {'table' if table else 'uniform'} weights "
                        f"needs {min(need.values())} bytes of shared memory per block at the least, and this GPU "
                        f"has {limit}{fix}")


def int8_fits(w: Packed | PackedLUT, variant: tuple[int, int, int], limit: int, qdec: bool = False,
              qdec_bytes: int = 0) -> bool:
    """Whether `variant` of w's GEMV on the int8 path (x staged as three int8 planes, and with QDEC in fp16 too, with
    QDEC's own qdec_bytes) fits `limit` bytes of shared memory a block; where it does not, gemv runs the fp16 path."""
    return shared_bytes(w, *variant, qdec=qdec, int8=True) + qdec_bytes + static_shared_bytes(variant[0], limit) <= limit


def _meta(w: Packed | PackedLUT) -> tuple[torch.Tensor, int, bool]:
    """What the kernel reads besides the codes: (records, records per tile, table weight?)."""
    if isinstance(w, PackedLUT):  # one record per tile, or grouped, the number of groups
        return w.lut, w.groups or 1, True
    return w.meta, w.meta.shape[1], False


def gemv(x: torch.Tensor | Runs, w: Packed | PackedLUT, out: torch.Tensor | None = None,
         residual: torch.Tensor | None = None,
         norm: tuple[torch.Tensor, float] | None = None, glu: bool = False, variant: tuple[int, int, int] | None = None,
         blocks_per_sm: int | None = None, hold_next: bool | None = None, held: bool | None = None,
         comp: "qdec.Call | None" = None) -> torch.Tensor:
    """y = W_hat f(x) (+ residual, added in the epilogue); x, residual, y: fp16 [K], [N], [N] on the GPU.
    f, applied while the kernel stages x: norm = (float32 weight [K], eps) -> ops.rmsnorm(x, weight, eps);
    glu -> ops.silu_mul(x) for x = [gate | up] of 2K halves; else x itself. x may be the decode attention's Runs
    (kernels.attention.attend(leave_runs=True)), which the kernel merges into its input as it stages it (Runs.merged).
    variant: one of VARIANTS or SMALLER_VARIANTS (default decode_variant on this GPU); blocks_per_sm default: 2 where
    TWO_BLOCK_TILES says, else 1.
    hold_next: this GEMV and the next kernel are GEMVs of HOLD_BYTES or more (the next launches as this one's blocks
    end their streams); default: the next kernel is taken to be a GEMV of w's size (the benchmarks' repeated calls).
    held: the kernel before this one holds its launch (hold_next), so x is ready when it starts; default: the one before
    is taken to be a GEMV of w's size. Without early launches (cuda.early_launch), and after a compensating GEMV that
    holds it (it then launches plain: cuda.next_is_plain), every GEMV is held. A held GEMV at one block per SM, and
    every QDEC GEMV (its selection waits for x), stages x before it requests its first weights (x_first).
    comp: QDEC, y += R_hat[:, S] f(x)[S] (S chosen in the kernel); needs decode_variant and the grid that
    comp.state was numbered with."""
    N, K = w.out_features, w.in_features
    meta, G, lut = _meta(w)
    runs = x if isinstance(x, Runs) else None
    mr = 0
    if runs is not None:
        heads, splits, D = runs.o.shape
        assert heads * D == K and 1 < splits <= GEMV_RUNS_MAX and (splits == GEMV_RUNS or heads <= GEMV_RUNS_HEADS) \
            and not (glu or norm), "the attention's runs (2, or up to 8 of at most 64 heads), nothing else"
        mr = 2 if splits == GEMV_RUNS else 8  # merged by the staging, or first (gemv.cu, MR)
    else:
        assert x.dtype == torch.float16 and x.shape == ((2 * K,) if glu else (K,)) and not (glu and norm)
        if not x.is_contiguous() or x.data_ptr() % 16:
            x = x.clone()  # the kernel reads x 16 bytes at a time
    assert w.qweight.shape == (N // 16, K * w.bits // 2)
    device = (x if runs is None else runs.o).device
    if out is None:
        out = torch.empty(N, dtype=torch.float16, device=device)
    dev = device.index or 0
    limit = cuda.shared_limit(dev)
    warps, depth, pairs = variant = variant or decode_variant(w, limit)
    qw = qdec.QW if comp is not None and comp.k_chunk > 0 else 0
    assert not lut or variant in (TABLE_VARIANT, *SMALLER_VARIANTS), "table weights: one pair a slot, two slots"
    assert w.bits != HEAD_BITS or (variant in (HEAD_VARIANT, *SMALLER_VARIANTS) and not qw), \
        "8 bits: two slots of one pair, no QDEC"
    assert fits(variant, K, w.group_size), "two pairs per slot: K = 256 x warps, group size 64 or 128"
    gs = GROUP_SIZES.index(w.group_size) if w.group_size else 0
    qdec_smem = qdec.shared_bytes(K, N, comp.k_chunk, comp.grid, comp.n_tb) if qw else 0
    mrx = 2 * K if mr == 8 else 0  # MR 8: the merged x in shared memory (and its static rw, rl: MR8_STATIC)
    int8 = uses_int8(w, qw > 0, dev) and int8_fits(w, variant, limit, qw > 0,
                                                   qdec_smem + mrx + (MR8_STATIC if mr == 8 else 0))
    k = cuda.kernel("gemv", f"gemv<{w.bits},{warps},{depth},{gs},{qw},{str(lut).lower()},{pairs},{str(int8).lower()}"
                            + (f",{mr}>" if runs is not None else ">"))  # MR: an instance of its own
    smem = shared_bytes(w, *variant, qdec=qw > 0, int8=int8) + mrx
    if blocks_per_sm is None:
        many = not (qw or lut or w.bits == HEAD_BITS) and N // 16 >= TWO_BLOCK_TILES * cuda.sm_count(dev)
        blocks_per_sm = 2 if many and cuda.resident_blocks(dev, 32 * warps, k.num_regs,
                                                           smem + k.shared_size_bytes + 1024) >= 2 else 1
    grid = grid_of(N, device, blocks_per_sm)
    repeated = w.nbytes >= HOLD_BYTES  # the defaults: this GEMV's neighbours are GEMVs of w's size
    hold_next = repeated if hold_next is None else hold_next
    held = cuda.next_is_plain(dev) or (repeated if held is None else held)
    x_first = (held or qw > 0) and blocks_per_sm == 1
    null = np.uint64(0)
    if qw:
        assert variant == decode_variant(w, limit) and comp.grid == grid, "QDEC state numbered for another grid"
        smem += qdec_smem
        extra = comp.args(K, N)
    else:
        extra = (null, null, null, null, null, np.int32(0), np.int32(0), *(np.float32(0),) * 4)  # as comp.args
    merge = (null, null, null, np.int32(0), np.int32(0)) if runs is None else (
        cuda.ptr(runs.o), cuda.ptr(runs.ml), cuda.ptr(runs.pos), np.int32(splits), np.int32(D))
    cuda.allow_shared(k, smem)
    cuda.launch(k, (grid,), (32 * (warps + qw),), (
        cuda.ptr(w.qweight), cuda.ptr(meta), null if runs is not None else cuda.ptr(x),
        null if residual is None else cuda.ptr(residual),
        cuda.ptr(out), np.int32(N), np.int32(K), np.int32(G), np.uint32(0x64006400),
        null if norm is None else cuda.ptr(norm[0]), np.float32(norm[1] if norm else 0.0), np.int32(glu),
        np.int32(hold_next), np.int32(x_first), *extra, *merge),
        shared_mem=smem, early=True, plain_next=qw > 0 and hold_next)
    return out


def shared_bytes(w: Packed | QuantWeight | PackedLUT | QuantLUT, warps: int, depth: int, pairs: int = 1,
                 qdec: bool = False, int8: bool = False) -> int:
    """Dynamic shared memory of the GEMV before QDEC's part (qdec.shared_bytes): x as B fragments (fp16; table
    weights without QDEC and uniform ones on the int8 path (uses_int8): three int8 planes, and with QDEC fp16 as well),
    its sums per step or pair (float4), each warp's ring of slots (pairs of steps: weights, then a tile's tables or
    the records)."""
    K = w.in_features
    xb = (3 + 2 * qdec) if int8 else 3 if isinstance(w, (PackedLUT, QuantLUT)) and not qdec else 2
    return K * xb + K // 64 * 16 + warps * depth * (pairs * 256 * w.bits + slot_meta_bytes(w, pairs))


def grid_of(N: int, device: torch.device, blocks_per_sm: int = 1) -> int:
    """The GEMV's grid for N outputs (QDEC numbers its calls per grid)."""
    return min(N // 16, cuda.sm_count(device.index or 0) * blocks_per_sm)


def dequantize(w: Packed | PackedLUT) -> torch.Tensor:
    """W_hat as fp16 [N, K] on the GPU: what quant.QuantWeight/QuantLUT.dequantize(torch.float16) computes."""
    N, K = w.out_features, w.in_features
    out = torch.empty(N, K, dtype=torch.float16, device=w.qweight.device)
    threads = N // 16 * (K // 64) * 32
    if isinstance(w, PackedLUT):
        cuda.kernel("gemv", f"dequant_lut<{w.bits}>")(
            (-(-threads // 256),), (256,), (cuda.ptr(w.qweight), cuda.ptr(w.lut), cuda.ptr(out), np.int32(N),
                                            np.int32(K), np.int32(w.groups), np.int32(w.group_size or 0)),
            stream=cuda.stream())
        return out
    G = w.meta.shape[1]
    cuda.kernel("gemv", f"dequant<{w.bits}>")(
        (-(-threads // 256),), (256,), (cuda.ptr(w.qweight), cuda.ptr(w.meta), cuda.ptr(out), np.int32(N),
                                        np.int32(K), np.int32(G), np.int32(w.group_size)), stream=cuda.stream())
    return out
