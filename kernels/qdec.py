"""QDEC on the GPU: the pinned residuals, the layer's flags, and the parameters of the compensating GEMV (gemv.cu
with QDEC warps, see qdec.cuh). localllm/qdec.py is the reference these compute."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from localllm.errors import LocalLLMError
from localllm.qdec import CHUNK, bucket_widths, k_for_chunk
from localllm.quant import QuantResidual

QW = 4  # QDEC warps per block, as compiled in gemv.cu
SEGMENT = 256  # outputs per segment, qdec.cuh's QDEC_SEG
SCRATCH_BYTES = 256 + CHUNK  # qdec_select's counters (QdecScratch) and bucket bytes


@dataclass
class HostResidual:
    """A layer's 4-bit residual in pinned host memory, read by the kernel through its host pointer (zero-copy)."""
    codes: torch.Tensor  # int32 [K, N / 8], quant.QuantResidual.packed
    scales: torch.Tensor  # fp16 [N]

    @classmethod
    def pin(cls, r: QuantResidual) -> "HostResidual":
        if r.bits != 4:  # other widths are the CPU path's emulation (the report's Table 1), not a kernel format
            raise ValueError(f"the QDEC kernel reads 4-bit residuals, not {r.bits}-bit ones")
        try:
            return cls(r.packed.contiguous().pin_memory(), r.scales.contiguous().pin_memory())
        except RuntimeError as e:
            raise LocalLLMError(f"could not pin {r.nbytes / 2**20:.0f} MiB of host memory for QDEC residuals ({e}); "
                                "free host RAM, or run with qdec='off'") from None


def pin(lin) -> HostResidual:
    """A model Linear's residual in pinned host memory, made once; lin.residual then views that memory, so the host
    keeps one copy (the model file's mapped pages are let go: the paper's code keeps a pageable copy beside)."""
    if lin.host_residual is None:
        h = HostResidual.pin(lin.residual)
        lin.host_residual, lin.residual = h, QuantResidual(h.codes, h.scales, lin.residual.bits)
    return lin.host_residual


def chunks(K: int) -> int:
    return -(-K // CHUNK)


def viable_groups(s: int) -> list[int]:
    """Appendix A's rule: q groups of ceil(s / q) items are viable when no group is left empty, i.e. fewer
    groups could not do with the same largest group."""
    return [q for q in range(1, s + 1) if -(-s // -(-s // q)) == q]


def segments(N: int) -> int:
    """256-output segments of a residual row (the fetch's unit: 32 lanes x one word of 8 codes)."""
    return -(-N // SEGMENT)


def viable_n_tb(K: int, N: int, grid: int) -> list[int]:
    """The n_tb (compensating blocks) worth trying for a K -> N layer under a GEMV grid of `grid` blocks, by
    Appendix A's rule on both of the fetch's dimensions: up to one per chunk, each taking ceil(chunks / n_tb)
    whole chunks (the rule on the chunks); beyond that, chunks x p, each chunk's rows split into p parts of
    ceil(segments / p) segments (the rule on the segments), while the compensating blocks leave at least three
    quarters of the grid streaming."""
    C = chunks(K)
    whole = [n for n in viable_groups(C) if n < grid]
    split = [C * p for p in viable_groups(segments(N))[1:] if C * p <= grid // 4]
    return whole + split


# residual bytes one compensating block fetches per call, at most, without a tuned n_tb: an SM reads zero-copy at
# ~4.7 GB/s (H100), so more bytes per block outlast the weight stream. From the 8B-shape table of `localllm report`
# (H200, every viable n_tb timed): at k_chunk 8 this keeps one chunk per block but for gate_up (12 blocks, the same
# time), within 7% of the best; at 32-64 it is at most 1.11x the best, where one chunk per block was up to 1.61x it
# (gate_up 5.89x the plain GEMV against 4.25x at k_chunk 64)
FETCH_PER_BLOCK = 48 * 1024


def default_n_tb(K: int, N: int, grid: int, k_chunk: int) -> int:
    """Without a tuned profile: one chunk per compensating block while they take at most an eighth of the grid
    (each is an SM taken from the weight stream), and more where the chunks' residual rows (k_chunk per chunk, N / 2
    bytes each) would give a block over FETCH_PER_BLOCK: the smallest viable n_tb that keeps under it, or the
    largest viable one."""
    viable = viable_n_tb(K, N, grid)
    one_each = [n for n in viable if n <= min(chunks(K), max(1, grid // 8))][-1]
    need = math.ceil(chunks(K) * k_chunk * N / 2 / FETCH_PER_BLOCK)
    return next((n for n in viable if n >= max(one_each, need)), viable[-1])


@dataclass
class Call:
    """Everything one QDEC GEMV launch needs besides the weights and x."""
    residual: HostResidual
    state: torch.Tensor  # int64 [1 + flags]: arrival counter, then the items' uint32 flags
    part: torch.Tensor  # fp32 [C * N] or larger, the partial corrections (may be shared by layers run in turn)
    k_chunk: int
    n_tb: int
    b0: float
    b15: float
    grid: int  # the GEMV grid this state was numbered with
    sel_out: torch.Tensor | None = None  # int32 [2 * C * k_chunk]: chosen channels, then x bits, per chunk

    def args(self, K: int, N: int) -> tuple:
        if self.n_tb not in viable_n_tb(K, N, self.grid):
            raise ValueError(f"n_tb={self.n_tb} is not viable for a {K} -> {N} layer; use one of qdec.viable_n_tb")
        inv_hi, inv_lo = bucket_widths(self.b0, self.b15)
        p = lambda t: np.uint64(0 if t is None else t.data_ptr())  # noqa: E731
        return (p(self.residual.codes), p(self.residual.scales), p(self.part), p(self.state), p(self.sel_out),
                np.int32(self.k_chunk), np.int32(self.n_tb), np.float32(self.b0), np.float32(self.b15),
                np.float32(inv_hi), np.float32(inv_lo))


def new_part(shapes, device) -> torch.Tensor:
    """The partial-correction buffer layers run in turn can share: fp32, chunks(K) * N for the largest of the
    (K, N) shapes."""
    return torch.empty(max((chunks(K) * N for K, N in shapes), default=0), device=device)


def new_state(K: int, N: int, device) -> torch.Tensor:
    """Zeroed arrival counter, then one uint32 flag per (chunk, part): room for the most parts, one per segment."""
    return torch.zeros(1 + (chunks(K) * segments(N) + 1) // 2, dtype=torch.int64, device=device)


def shared_bytes(K: int, N: int, k_chunk: int, grid: int, n_tb: int) -> int:
    """Dynamic shared memory QDEC adds to the GEMV: fp32 results and fp16 residual scales of a streaming block's
    outputs (16 per tile), the selection's scratch and buckets, the selection."""
    return (64 + 32) * math.ceil(N / 16 / (grid - n_tb)) + SCRATCH_BYTES + 8 * k_chunk


def shared_bytes_total(w, k_chunk: int, grid: int, limit: int | None = None) -> int:
    """All shared memory (dynamic and static) of the QDEC GEMV for a kernels.gemv.Packed weight w, at its largest
    viable n_tb, in the variant decode runs on a GPU of `limit` bytes per block (kernels.gemv.decode_variant)."""
    from .gemv import decode_variant, static_shared_bytes
    from .gemv import shared_bytes as base
    K, N = w.in_features, w.out_features
    v = decode_variant(w, limit)
    return base(w, *v, qdec=True) + static_shared_bytes(v[0], limit) + \
        shared_bytes(K, N, k_chunk, grid, viable_n_tb(K, N, grid)[-1])


def selection(sel_out: torch.Tensor, K: int, k_chunk: int) -> list[tuple[list[int], list[float]]]:
    """Per chunk, the channels the kernel chose and x at them, from a Call's sel_out."""
    C = chunks(K)
    v = sel_out.view(2, C, k_chunk).cpu()
    out = []
    for c in range(C):
        k = k_for_chunk(k_chunk, min(CHUNK, K - c * CHUNK))
        out.append((v[0, c, :k].tolist(), v[1, c, :k].view(torch.float32).tolist()))
    return out
