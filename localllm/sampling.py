"""Choosing the next token on the device: greedy or sampled (repetition penalty, temperature, top-k, top-p, min-p, as
transformers' processors), with the settings and the random draws as tensors, no host sync and no shape that depends
on the data, so that a decode step's CUDA graph can end with it (decode.Decoder.advance). The torch code here defines
the function; on a GPU choose() runs it as one kernel that sorts only the tokens near the cuts and the draw
(kernels/sampling.cu)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import LocalLLMError, is_real, is_whole
from .ops import cuda_kernels


# temperatures below this choose greedily: their limit, and float32 logits divided by ~1e-38 overflow into NaN
GREEDY_BELOW = 1e-4
FLOAT32_MAX = 3.4028234663852886e38


@dataclass
class SamplingParams:
    temperature: float = 0.7   # 0 (or below GREEDY_BELOW) = greedy
    top_p: float = 0.9
    top_k: int = 0             # 0 = off
    repetition_penalty: float = 1.0
    min_p: float = 0.0         # 0 = off; else drop tokens less likely than min_p times the most likely one

    def check(self) -> None:
        # written as what must hold, so that NaN (which fails every comparison) is refused too
        real = {k: is_real(v := getattr(self, k)) and abs(v) <= FLOAT32_MAX  # (NaN and inf fail; next_token's float32)
                for k in ("temperature", "top_p", "repetition_penalty", "min_p")}
        ok = {"temperature": real["temperature"] and self.temperature >= 0,
              "top_p": real["top_p"] and 0 < self.top_p <= 1,
              "top_k": is_whole(self.top_k) and self.top_k >= 0,
              "repetition_penalty": real["repetition_penalty"] and self.repetition_penalty > 0,
              "min_p": real["min_p"] and 0 <= self.min_p <= 1}
        bad = ", ".join(f"{k}={getattr(self, k)!r}" for k, good in ok.items() if not good)
        if bad:
            raise LocalLLMError(f"bad sampling settings ({bad}): need finite numbers temperature >= 0, 0 < top_p <= 1, "
                                "a whole top_k >= 0, repetition_penalty > 0, 0 <= min_p <= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """float32 [5]: temperature (1 when greedy: unused), top_p, top_k, repetition penalty, min_p, as next_token
        takes them."""
        t = 1.0 if self.greedy else self.temperature
        return torch.tensor([t, self.top_p, self.top_k, self.repetition_penalty, self.min_p], dtype=torch.float32,
                            device=device)


def penalized(logits: torch.Tensor, seen: torch.Tensor, rep: torch.Tensor) -> torch.Tensor:
    """Repetition penalty: the logits [V] of tokens already in the context (seen, bool [V]) divided by rep where
    positive, multiplied where not; float32."""
    x = logits.float()
    return torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)


def nucleus(logits: torch.Tensor, seen: torch.Tensor, params: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The distribution to sample from, over the tokens in descending order of their warped logits: (order, e, c, n)
    with e the unnormalized probabilities (0 where top-k removes a token), c = cumsum(e) and n the number of tokens
    kept (a prefix, at least one token): top-p's (the smallest prefix whose probability reaches top_p), cut further
    by min-p (the tokens with e >= min_p, e being relative to the largest). Repetition penalty, temperature, top-k
    (ties with the k-th kept), top-p and min-p in that order, as transformers' processors. params:
    SamplingParams.tensor().

    No reduction over the vocabulary besides the sort: the largest logit is the sorted first, and the total is the
    last of the cumulative sum (on the H100 a softmax or a max over 128K logits took 14-34 us, a cumsum 4.5)."""
    t, top_p, top_k, rep, min_p = params.unbind()
    s, order = (penalized(logits, seen, rep) / t).sort(descending=True, stable=True)  # ties: the same order anywhere
    kth = s.index_select(0, (top_k.long() - 1).clamp(0, s.numel() - 1).view(1))
    e = torch.where((top_k > 0) & (s < kth), 0.0, (s - s[:1]).exp_())
    c = e.cumsum(-1)
    # a token stays while the probability of the tokens before it is below top_p (transformers' rule: [1, 1, 1, 1] at
    # top_p 0.5 keeps two); the mass before a token never decreases, so the kept tokens are the first n (the first
    # always, its mass before being 0); top_p = 1 keeps every token (those of zero or rounded-away mass are never drawn)
    n = torch.searchsorted(c - e, top_p * c[-1:], right=False)
    n = torch.where(top_p < 1, n, c.numel())
    # min-p after top-p: e never increases along the order, so the tokens it keeps are a prefix too (the first one,
    # e = 1, always)
    return order, e, c, torch.minimum(n, torch.searchsorted(-e, -min_p.view(1), right=True))


def next_token(logits: torch.Tensor, seen: torch.Tensor, params: torch.Tensor, u: torch.Tensor,
               greedy: bool) -> torch.Tensor:
    """The next token id, a 0-dim int64 tensor on logits' device: the largest penalized logit when greedy, else the
    token whose interval of nucleus()'s cumulative distribution holds the uniform draw u (a 0-dim tensor in [0, 1)),
    so that the same draws choose the same tokens on every device."""
    if greedy:
        return penalized(logits, seen, params[3]).argmax()
    order, _, c, n = nucleus(logits, seen, params)
    last = n - 1
    # the first token whose cumulative mass exceeds u times the kept mass: zero-probability tokens never are
    i = torch.searchsorted(c, u * c.index_select(0, last), side="right").clamp_(max=last)
    return order.index_select(0, i).view(())


def choose(logits: torch.Tensor, seen: torch.Tensor, params: torch.Tensor, draws: torch.Tensor, drawn: torch.Tensor,
           tok: torch.Tensor, greedy: bool) -> None:
    """A decoder's next token, in place: tok = next_token(logits, seen, params, draws[drawn], greedy), the token marked
    seen and drawn advanced by one. logits float32 [V], seen bool [V], draws float32 [n], drawn int64 0-dim, tok int64
    [1, 1]."""
    if logits.is_cuda and cuda_kernels():
        from .kernels import sampling
        return sampling.choose(logits.contiguous(), seen, params, draws, drawn, tok, greedy)
    t = next_token(logits, seen, params, draws.index_select(0, drawn.view(1)).view(()), greedy)
    seen.index_fill_(0, t.view(1), True)
    tok.copy_(t.view(1, 1))
    drawn += 1
