"""Launchers of the next-token kernels (sampling.cu): what localllm.sampling.choose computes, on the GPU."""
from __future__ import annotations

import numpy as np
import torch

from . import cuda

NAMES = ("greedy_token", "warped_logits", "sample_sorted")


def _k(name: str):
    return cuda.kernel("sampling", name, NAMES)


def choose(logits: torch.Tensor, seen: torch.Tensor, params: torch.Tensor, draws: torch.Tensor,
           drawn: torch.Tensor, tok: torch.Tensor, greedy: bool) -> None:
    """logits float32 [V], seen bool [V], params float32 [4], draws float32 [n], drawn int64 0-dim, tok int64 [1, 1]
    (all contiguous, on one GPU); tok, seen and drawn are updated in place."""
    V, p = logits.numel(), cuda.ptr
    if greedy:
        _k("greedy_token")((1,), (1024,), (p(logits), p(seen), p(params), np.int32(V), p(tok), p(drawn)),
                           stream=cuda.stream())
        return
    z = torch.empty(V, dtype=torch.float32, device=logits.device)
    _k("warped_logits")((-(-V // 256),), (256,), (p(logits), p(seen), p(params), p(z), np.int32(V)),
                        stream=cuda.stream())
    s, order = z.sort(descending=True, stable=True)
    _k("sample_sorted")((1,), (1024,), (p(s), p(order), p(params), p(draws), np.int32(V), p(tok), p(seen),
                                        p(drawn)), stream=cuda.stream())
