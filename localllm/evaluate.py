"""`localllm eval`: teacher-forced perplexity of a text, under each QDEC setting asked for.

The text is cut into consecutive windows of `ctx` tokens, each predicting its own next tokens. Perplexity =
exp(mean negative log-likelihood) over all predicted tokens. The windows are plain slices of the text's tokens:
where the tokenizer adds a BOS token (Llama's does; SmolLM's and Qwen's do not) only the first window starts with
it. On the CPU a window runs as one forward pass (every position selects its own salient channels when QDEC is on,
by the rule decoding uses for that token: the same picks up to the rounding of the input, whose last bits the
approximate selection's boundary order hashes). On a GPU
it runs token by token through the decode step's CUDA graph, QDEC on or off: there the compensation lives in the
decode GEMV (prompts run uncompensated), and settings compared with each other must differ in nothing else (a
prompt-style pass rounds in another order). With an 8-
or 4-bit KV cache (LocalModel.kv_bits) a window's forward pass fills such a cache and attends over it, as a decode
of the same tokens would.

With a reference model (`--reference`, usually the source checkpoint the model was quantized from), each setting
also gets the mean per-token KL divergence KL(reference || model) of the next-token distributions on the same
windows: how far quantization (and what QDEC recovers of it) moves the model from its source, token by token. It is
steadier than perplexity between settings far apart; between close ones it is about as noisy (README). How much of
a perplexity change is noise is measured too (paired_change): settings scored on the same tokens are compared token
by token, with a 95% interval from the spread of the differences over blocks of tokens (or over windows, where that
is wider).
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from . import texts
from .errors import LocalLLMError
from .loader import check_token_ids
from .model import KVCache
from .progress import progress
from .runtime import LocalModel


REFERENCE_CACHE_BYTES = 2 << 30  # reference log-probabilities kept between settings; windows beyond are recomputed
# tokens per block of paired_change's interval: neighbouring tokens' losses may be correlated, blocks of 64 apart far
# less (Qwen2.5-Coder-1.5B, AWQ vs RTN at 4 bits, 12012 tokens: standard error 0.40% token by token, 0.42-0.45% with
# blocks of 16-256; few blocks make the estimate itself noisy: 0.36% from the 23 windows of 512)
PAIR_BLOCK = 64
# a window starts fresh and its tokens may share a topic, so errors can be correlated across a whole window: given
# at least this many, paired_change takes the larger of the two standard errors (on 40k tokens of code, W3 against
# W4, the windows' was 1.5x the blocks'; on the shipped prose 1.25x)
PAIR_WINDOWS = 10


@dataclass
class EvalResult:
    mode: str
    k_chunk: int
    perplexity: float
    kl: float | None = None  # mean KL(reference || model) per predicted token, nats; None without a reference
    losses: torch.Tensor | None = field(default=None, repr=False)  # per predicted token, float64 (paired_change)
    kls: torch.Tensor | None = field(default=None, repr=False)  # per predicted token, with a reference


def _mean_se(d: torch.Tensor, block: int, window: int | None) -> tuple[float, float, int]:
    """The mean of per-token differences d, its standard error from their means over consecutive blocks of `block`
    tokens (so that correlated neighbours do not count as independent) or, given the evaluation's `window` (ctx) and
    at least PAIR_WINDOWS of them, over windows where that is larger, and the number of means it came from (< 2: no
    standard error, nan)."""
    def stderr(size: int) -> tuple[float, int]:
        n = len(d) // size
        return (d[: n * size].view(n, size).mean(1).std().item() / math.sqrt(n) if n > 1 else math.nan), n

    se, n = stderr(block)
    if n >= 2 and window and len(d) // window >= PAIR_WINDOWS:
        se_w, n_w = stderr(window)
        if se_w > se:
            se, n = se_w, n_w
    return d.mean().item(), se, n


def _paired(a: torch.Tensor, b: torch.Tensor, what: str) -> torch.Tensor:
    if a.shape != b.shape:
        raise ValueError(f"paired {what} need the same tokens: {tuple(a.shape)} vs {tuple(b.shape)}")
    return (a.double() - b.double()).cpu()


def paired_change(a: torch.Tensor, b: torch.Tensor, block: int = PAIR_BLOCK,
                  window: int | None = None) -> tuple[float, float | None]:
    """How much higher perplexity is with the per-token losses a than with b, scored on the same tokens, in percent,
    and the half-width of its 95% interval in percentage points (None: fewer than two blocks): its longer side, as
    the interval, symmetric in the mean loss, is not in percent, so that "c ± h" holds it whole. The difference of
    the two mean losses is a mean of per-token differences, with _mean_se's standard error."""
    mean, se, n = _mean_se(_paired(a, b, "losses"), block, window)
    if n < 2:
        return 100 * math.expm1(mean), None
    t = t975(n - 1)  # Student's t: the standard error comes from n block means (1.96 would cover 70% at n = 2)
    c, lo, hi = math.expm1(mean), math.expm1(mean - t * se), math.expm1(mean + t * se)
    return 100 * c, 100 * max(hi - c, c - lo)


def paired_kl_change(a: torch.Tensor, b: torch.Tensor, block: int = PAIR_BLOCK,
                     window: int | None = None) -> tuple[float, float | None]:
    """How much higher the mean KL divergence is with the per-token divergences a than with b (the same tokens), in
    percent of b's, and the half-width of its 95% interval (None: fewer than two blocks), as paired_change."""
    mean, se, n = _mean_se(_paired(a, b, "divergences"), block, window)
    base = b.double().mean().item()
    if base <= 0:
        return math.nan, None
    return 100 * mean / base, (None if n < 2 else 100 * t975(n - 1) * se / base)


def t975(df: int) -> float:
    """The 97.5% quantile of Student's t with df degrees of freedom: exact for 1 and 2, else the Cornish-Fisher
    expansion around the normal's (within 0.004 at df 3, 1e-4 from df 6)."""
    if df == 1:
        return math.tan(math.pi * 0.475)
    if df == 2:
        return 0.95 / math.sqrt(2 * 0.975 * 0.025)
    z = 1.959963984540054
    terms = ((z**3 + z) / 4, (5 * z**5 + 16 * z**3 + 3 * z) / 96, (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384,
             (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160)
    return z + sum(g / df ** (i + 1) for i, g in enumerate(terms))


def source_path(lm: LocalModel) -> str | None:
    """The source checkpoint a quantized model was made from, as its folder records it (None: not recorded)."""
    return ((lm.manifest or {}).get("source") or {}).get("path")


def load_source(lm: LocalModel, device: str = "cpu") -> LocalModel:
    """The source checkpoint as recorded (its GGUF file too, where a folder holds several), QDEC off."""
    from .loader import fingerprint
    from .runtime import load
    src = (lm.manifest or {}).get("source") or {}
    ref = load(src.get("path"), gguf_file=src.get("gguf_file"), qdec="off", device=device)
    if src.get("sha256") and fingerprint(ref.source_files) != src["sha256"]:  # (changed since: re-downloaded, edited)
        print(f"localllm: warning: {ref.path} is not the checkpoint {lm.path} was quantized from (its weights' sha256 "
              "differs from the one recorded): the KL column is the distance from another model", file=sys.stderr)
    return ref


class Reference:
    """A reference model's next-token log-probabilities per window, for KL(reference || model). It runs on the
    evaluated model's device; windows are cached (float16, on the CPU) up to REFERENCE_CACHE_BYTES."""

    def __init__(self, ref: LocalModel, lm: LocalModel):
        v_ref, v = ref.model.cfg.vocab_size, lm.model.cfg.vocab_size
        if v_ref != v:
            raise LocalLLMError(f"the reference {ref.path} has a vocabulary of {v_ref} tokens, the model {v}: give "
                                "the checkpoint the model was quantized from as --reference")
        shape = lambda c: (c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads)  # noqa: E731
        if shape(ref.model.cfg) != shape(lm.model.cfg):  # allowed (a larger teacher), but rarely what was meant
            print(f"localllm: warning: the reference {ref.path} is not shaped as {lm.path} (hidden, MLP, layers, heads "
                  f"{shape(ref.model.cfg)} vs {shape(lm.model.cfg)}), so it is not its source: the KL column is the "
                  "distance from another model", file=sys.stderr)
        self.lm, self.cache, self.cached = ref, {}, 0

    def log_probs(self, start: int, w: torch.Tensor) -> torch.Tensor:
        """float32 [len(w) - 1, vocab] on w's device: the reference's log-probabilities of the tokens after w[:-1]
        (the window at `start`; a cached window is found by its tokens too, so another text or ctx is not mistaken for
        it). A window cached is returned as cached (float16 values, renormalized) from its first use on, so that every
        setting of a sweep is measured against the same numbers."""
        key = (start, w.cpu().numpy().tobytes())
        if key not in self.cache:
            with torch.inference_mode():
                lp = F.log_softmax(self.lm.model(w[None, :-1].to(self.lm.model.device))[0].float(), dim=-1)
            if self.cached + lp.numel() * 2 > REFERENCE_CACHE_BYTES:
                return lp.to(w.device)
            self.cache[key] = lp.to("cpu", torch.float16)
            self.cached += lp.numel() * 2
        lp = self.cache[key].to(w.device, torch.float32)
        return lp - lp.logsumexp(-1, keepdim=True)  # a distribution again after the rounding: KL >= 0


def read_text(path: str | Path | None) -> tuple[str, str]:
    """(text, its name): a UTF-8 file, or with no path the evaluation text shipped with localllm."""
    if path is None:
        return texts.shipped("eval.txt"), "eval.txt (shipped)"
    return texts.read(path, "the text", "--text"), str(Path(path).expanduser())


def tokenize(lm: LocalModel, text: str, max_tokens: int | None = None) -> list[int]:
    ids = list(lm.tokenizer(text)["input_ids"])[:max_tokens]
    check_token_ids(ids, lm.model.cfg.vocab_size)
    if len(ids) < 2:
        raise LocalLLMError(f"the text has {len(ids)} token(s); perplexity needs at least 2: give a longer text")
    return ids


def perplexity(lm: LocalModel, ids: list[int], ctx: int = 512, seed: int = 0, desc: str = "evaluating") -> float:
    """Perplexity of the token ids under the model's current QDEC settings (LocalModel.set_qdec) and KV cache width
    (LocalModel.set_kv_bits)."""
    return score(lm, ids, ctx, seed, desc)[0]


def score(lm: LocalModel, ids: list[int], ctx: int = 512, seed: int = 0, desc: str = "evaluating",
          reference: Reference | None = None) -> tuple[float, float | None]:
    """(perplexity, mean KL(reference || model) per predicted token, or None without a reference)."""
    return losses(lm, ids, ctx, seed, desc, reference)[:2]


def check_ctx(ctx: int, cfg) -> None:
    """Refuse, in one line, a window (--ctx) the model's context (a config.ModelConfig) cannot hold."""
    if not 2 <= ctx <= cfg.max_position_embeddings:
        raise LocalLLMError(f"--ctx must be within 2..{cfg.max_position_embeddings}, got {ctx}: the model's context "
                            f"is {cfg.context}")


def losses(lm: LocalModel, ids: list[int], ctx: int = 512, seed: int = 0, desc: str = "evaluating",
           reference: Reference | None = None) -> tuple[float, float | None, torch.Tensor, torch.Tensor | None]:
    """score's (perplexity, KL), the per-token losses (negative log-likelihoods, float64 [len(ids) - 1], on the CPU)
    for paired_change, and with a reference the per-token KL divergences (likewise) for paired_kl_change."""
    check_ctx(ctx, lm.model.cfg)
    model, dev = lm.model, lm.model.device
    lm.settings.generator = torch.Generator(device=dev).manual_seed(seed)  # random mode's picks
    stepwise = dev.type == "cuda"  # (see the module doc)
    nll, kls = [], []
    with torch.inference_mode():
        for s in progress(range(0, len(ids) - 1, ctx), desc=desc, unit="window"):
            w = torch.tensor(ids[s: s + ctx + 1], device=dev)
            if stepwise:
                logits = _decoded_logits(lm, w)
            else:
                cache = None if lm.kv_bits == 16 else \
                    KVCache(model.cfg, len(w) - 1, dtype=model.act_dtype, device=dev, bits=lm.kv_bits)
                logits = model(w[None, :-1], 0, cache)[0]
            logits = logits.float()
            nll.append(F.cross_entropy(logits, w[1:], reduction="none").double())
            if reference is not None:
                ref = reference.log_probs(s, w)
                kls.append((ref.exp() * (ref - F.log_softmax(logits, dim=-1))).sum(-1).double())
    nll = torch.cat(nll).cpu()
    kls = torch.cat(kls).cpu() if reference is not None else None
    mean = nll.mean().item()  # (past ~709 nats a token, a perplexity past what a float holds: inf)
    return (math.inf if mean >= 709 else math.exp(mean)), (kls.mean().item() if kls is not None else None), nll, kls


def _decoded_logits(lm: LocalModel, w: torch.Tensor) -> torch.Tensor:
    """Logits [len(w) - 1, vocab] after each of w[:-1], one decode step (graph replay) per token after the first."""
    dec = lm.decoder(len(w) - 1)  # (positions 0..len(w) - 2)
    out = [dec.prefill(w[:1].tolist()).float()]
    for pos in range(1, len(w) - 1):  # a step's logits are the graph's buffer: copied before the next step
        out.append(dec.step(w[pos], pos).to(torch.float32, copy=True))
    return torch.stack(out)


def sweep(lm: LocalModel, ids: list[int], modes: list[str], k_chunks: list[int], ctx: int = 512,
          seed: int = 0, reference: Reference | None = None) -> list[EvalResult]:
    """Perplexity (and with a reference, KL divergence from it) for "off" (once) and for every other mode at every
    k_chunk. Every setting is checked by LocalModel.set_qdec before the first one is evaluated, so a bad one fails
    at once, not after minutes."""
    settings = list(dict.fromkeys((m, k) for m in modes for k in ([0] if m == "off" else k_chunks)))  # (no repeats)
    for mode, k in settings:
        lm.set_qdec("off" if mode == "off" else {"mode": mode, "k_chunk": k})
    results = []
    for mode, k in settings:
        lm.set_qdec("off" if mode == "off" else {"mode": mode, "k_chunk": k})
        name = "off" if mode == "off" else f"{mode} k={k}"
        results.append(EvalResult(mode, k, *losses(lm, ids, ctx, seed, desc=f"eval {name}", reference=reference)))
    lm.set_qdec("off")
    return results
