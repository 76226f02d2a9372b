"""Launchers of the next-token kernels (sampling.cu): what localllm.sampling.choose computes, on the GPU."""
from __future__ import annotations

import numpy as np
import torch

from . import cuda

GREEDY_SPAN = 16384   # logits per block per round of greedy_token
CHUNK = 4096          # tokens per chunk of sample_token (a block takes whole chunks)
CAP = 2048            # the most gathered tokens sample_token sorts (sampling.cu CAP; past ~2K the selection over
                      # the whole vocabulary is faster than the sort, H100)
WORK_BYTES = 56 << 10  # >= sizeof(Work) in sampling.cu (55,328 bytes)


def _k(name: str):
    return cuda.kernel("sampling", name, ("greedy_token", "sample_token"))


def choose(logits: torch.Tensor, seen: torch.Tensor, params: torch.Tensor, draws: torch.Tensor,
           drawn: torch.Tensor, tok: torch.Tensor, greedy: bool, cap: int = CAP, max_blocks: int | None = None
           ) -> None:
    """logits float32 [V], seen bool [V], params float32 [5], draws float32 [n], drawn int64 0-dim, tok int64 [1, 1]
    (all contiguous, on one GPU); tok, seen and drawn are updated in place. cap (<= CAP): the most tokens the sampled
    choice sorts before it selects over the whole vocabulary instead; max_blocks: fewer blocks than SMs (tests use
    both to reach the other path, and several chunks per block as on a GPU with few SMs)."""
    V, p, s, dev = logits.numel(), cuda.ptr, cuda.stream(), logits.device
    sms = min(cuda.sm_count(dev.index if dev.index is not None else torch.cuda.current_device()), max_blocks or 1 << 30)
    cap = min(cap, CAP)
    if greedy:
        blocks = min(-(-V // GREEDY_SPAN), sms)
        part_best = torch.empty(blocks, dtype=torch.float32, device=dev)
        part_at = torch.empty(blocks, dtype=torch.int32, device=dev)
        done = torch.zeros(1, dtype=torch.int32, device=dev)
        _k("greedy_token")((blocks,), (1024,), (p(logits), p(seen), p(params), np.int32(V), p(part_best), p(part_at),
                                                p(done), p(tok), p(drawn)), stream=s)
        return
    # blocks meet at grid barriers, so all must be resident at once: at most one per SM (1024 threads each)
    blocks = min(-(-V // CHUNK), sms)
    z = torch.empty(V, dtype=torch.float32, device=dev)
    block_max = torch.empty(blocks, dtype=torch.float32, device=dev)
    cand = torch.empty(max(cap, 1), dtype=torch.int64, device=dev)
    work = torch.zeros(WORK_BYTES // 8, dtype=torch.int64, device=dev)  # counters and histograms start at zero
    _k("sample_token")((blocks,), (1024,), (p(logits), p(seen), p(params), p(draws), p(z), p(block_max), p(cand),
                                           p(work), np.int32(cap), np.int32(V), p(tok), p(drawn)), stream=s)
