"""Choosing the next token on the device: greedy or sampled (repetition penalty, temperature, top-k, top-p, as
transformers' processors), with the settings and the random draws as tensors, no host sync and no shape that depends
on the data, so that a decode step's CUDA graph can end with it (decode.Decoder.advance)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import LocalLLMError


@dataclass
class SamplingParams:
    temperature: float = 0.7   # 0 = greedy
    top_p: float = 0.9
    top_k: int = 0             # 0 = off
    repetition_penalty: float = 1.0

    def check(self) -> None:
        # written as what must hold, so that NaN (which fails every comparison) is refused too
        ok = {"temperature": self.temperature >= 0, "top_p": 0 < self.top_p <= 1, "top_k": self.top_k >= 0,
              "repetition_penalty": self.repetition_penalty > 0}
        bad = ", ".join(f"{k}={getattr(self, k)}" for k, good in ok.items() if not good)
        if bad:
            raise LocalLLMError(f"bad sampling settings ({bad}): need temperature >= 0, 0 < top_p <= 1, top_k >= 0, "
                                "repetition_penalty > 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """float32 [4]: temperature (1 when greedy: unused), top_p, top_k, repetition penalty, as next_token takes
        them."""
        t = self.temperature if self.temperature > 0 else 1.0
        return torch.tensor([t, self.top_p, self.top_k, self.repetition_penalty], dtype=torch.float32, device=device)


def penalized(logits: torch.Tensor, seen: torch.Tensor, rep: torch.Tensor) -> torch.Tensor:
    """Repetition penalty: the logits [V] of tokens already in the context (seen, bool [V]) divided by rep where
    positive, multiplied where not; float32."""
    x = logits.float()
    return torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)


def warp(logits: torch.Tensor, seen: torch.Tensor, params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits to sample from, sorted in descending order, and their token ids: repetition penalty, temperature,
    top-k (ties with the k-th kept), top-p (the smallest prefix whose probability reaches top_p, at least one token);
    removed tokens are -inf. params: SamplingParams.tensor()."""
    t, top_p, top_k, rep = params.unbind()
    s, order = (penalized(logits, seen, rep) / t).sort(descending=True)
    kth = s.index_select(0, (top_k.long() - 1).clamp(0, s.numel() - 1).view(1))
    s = torch.where((top_k > 0) & (s < kth), float("-inf"), s)
    probs = s.softmax(-1)
    drop = (probs.cumsum(-1) - probs > top_p) & (top_p < 1)  # tokens entirely past the nucleus
    return torch.where(drop, float("-inf"), s), order


def next_token(logits: torch.Tensor, seen: torch.Tensor, params: torch.Tensor, u: torch.Tensor,
               greedy: bool) -> torch.Tensor:
    """The next token id, a 0-dim int64 tensor on logits' device: the largest penalized logit when greedy, else the
    token whose interval of warp()'s cumulative distribution holds the uniform draw u (a 0-dim tensor in [0, 1)), so
    that the same draws choose the same tokens on every device."""
    if greedy:
        return penalized(logits, seen, params[3]).argmax()
    s, order = warp(logits, seen, params)
    cdf = s.softmax(-1).cumsum(-1)
    i = torch.searchsorted(cdf, (u * cdf[-1]).reshape(1)).clamp_(max=cdf.numel() - 1)
    return order.index_select(0, i).view(())
