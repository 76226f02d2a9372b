"""`localllm eval`: teacher-forced perplexity of a text, under each QDEC setting asked for.

The text is cut into consecutive windows of `ctx` tokens, each predicting its own next tokens. Perplexity =
exp(mean negative log-likelihood) over all predicted tokens. On the CPU a window runs as one forward pass (every
position selects its own salient channels when QDEC is on, exactly as decoding would for that token). On a GPU
with QDEC on it runs token by token through the decode step's CUDA graph, because there the compensation lives
in the decode GEMV (prompts run uncompensated); with QDEC off a window is one prompt-style forward pass. With an 8-
or 4-bit KV cache (LocalModel.kv_bits) a window's forward pass fills such a cache and attends over it, as a decode
of the same tokens would.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F

from .errors import LocalLLMError
from .model import KVCache
from .progress import progress
from .runtime import LocalModel


@dataclass
class EvalResult:
    mode: str
    k_chunk: int
    perplexity: float


def read_text(path: str | Path | None) -> tuple[str, str]:
    """(text, its name): a UTF-8 file, or with no path the evaluation text shipped with localllm."""
    if path is None:
        return resources.files("localllm").joinpath("data", "eval.txt").read_text(encoding="utf-8"), "eval.txt (shipped)"
    p = Path(path).expanduser()
    if not p.is_file():
        raise LocalLLMError(f"no text file at {p}: give --text a UTF-8 text file")
    try:
        return p.read_text(encoding="utf-8"), str(p)
    except UnicodeDecodeError:
        raise LocalLLMError(f"{p} is not UTF-8 text: convert it (e.g. iconv -t UTF-8) or pick another file") from None


def tokenize(lm: LocalModel, text: str, max_tokens: int | None = None) -> list[int]:
    ids = list(lm.tokenizer(text)["input_ids"])[:max_tokens]
    if len(ids) < 2:
        raise LocalLLMError(f"the text has {len(ids)} token(s); perplexity needs at least 2: give a longer text")
    return ids


def perplexity(lm: LocalModel, ids: list[int], ctx: int = 512, seed: int = 0, desc: str = "evaluating") -> float:
    """Perplexity of the token ids under the model's current QDEC settings (LocalModel.set_qdec) and KV cache width
    (LocalModel.set_kv_bits)."""
    limit = lm.model.cfg.max_position_embeddings
    if not 2 <= ctx <= limit:
        raise LocalLLMError(f"--ctx must be within 2..{limit} (the model's context); got {ctx}")
    model, dev = lm.model, lm.model.device
    lm.settings.generator = torch.Generator(device=dev).manual_seed(seed)  # boundary-bucket and random picks
    stepwise = dev.type == "cuda" and lm.settings.mode != "off"
    nll, count = torch.zeros((), dtype=torch.float64, device=dev), 0
    with torch.inference_mode():
        for s in progress(range(0, len(ids) - 1, ctx), desc=desc, unit="window"):
            w = torch.tensor(ids[s: s + ctx + 1], device=dev)
            if stepwise:
                nll += _decoded_nll(lm, w)
            else:
                cache = None if lm.kv_bits == 16 else \
                    KVCache(model.cfg, len(w) - 1, dtype=model.embed.dtype, device=dev, bits=lm.kv_bits)
                nll += F.cross_entropy(model(w[None, :-1], 0, cache)[0].float(), w[1:], reduction="sum")
            count += len(w) - 1
    return math.exp(nll.item() / count)


def _decoded_nll(lm: LocalModel, w: torch.Tensor) -> torch.Tensor:
    """Summed negative log-likelihood of w[1:] given the tokens before, one decode step (graph replay) per token."""
    dec = lm.decoder(len(w))
    nll = F.cross_entropy(dec.prefill(w[:1].tolist())[None].float(), w[1:2], reduction="sum")
    for pos in range(1, len(w) - 1):
        nll += F.cross_entropy(dec.step(w[pos], pos)[None].float(), w[pos + 1: pos + 2], reduction="sum")
    return nll


def sweep(lm: LocalModel, ids: list[int], modes: list[str], k_chunks: list[int], ctx: int = 512,
          seed: int = 0) -> list[EvalResult]:
    """Perplexity for "off" (once) and for every other mode at every k_chunk. Every setting is checked by
    LocalModel.set_qdec before the first one is evaluated, so a bad one fails at once, not after minutes."""
    settings = [(m, k) for m in modes for k in ([0] if m == "off" else k_chunks)]
    for mode, k in settings:
        lm.set_qdec("off" if mode == "off" else {"mode": mode, "k_chunk": k})
    results = []
    for mode, k in settings:
        lm.set_qdec("off" if mode == "off" else {"mode": mode, "k_chunk": k})
        name = "off" if mode == "off" else f"{mode} k={k}"
        results.append(EvalResult(mode, k, perplexity(lm, ids, ctx, seed, desc=f"eval {name}")))
    lm.set_qdec("off")
    return results
