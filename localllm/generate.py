"""Text generation: chat templates, the token loop (sampling.py chooses the tokens), stop strings and streaming."""
from __future__ import annotations

import os
import secrets
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .errors import Cancelled, LocalLLMError, is_whole
from . import kvquant
from .loader import check_token_ids
from .runtime import LocalModel, load
from .sampling import SamplingParams


@dataclass
class Stats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of those, the ones whose keys and values the KV cache already held (Decoder.prefill)
    new_tokens: int = 0
    time_to_first_token: float = 0.0
    decode_seconds: float = 0.0
    # "eos" | "stop" | "length" (max_new_tokens) | "context" (the model's context is full) | "cancelled" (cancel set,
    # Stream.close() before the end, or a later reply on the model, which makes this stream raise)
    finish_reason: str = ""

    @property
    def tokens_per_second(self) -> float:
        return (self.new_tokens - 1) / self.decode_seconds if self.new_tokens > 1 and self.decode_seconds else 0.0

    def counts(self, none: str = "-", sep: str = ", ") -> str:
        """'N tokens, R tok/s' for people; R is `none` where the reply had no decode step to time (one token)."""
        rate = f"{self.tokens_per_second:.1f}" if self.tokens_per_second else none
        return f"{self.new_tokens} token{'' if self.new_tokens == 1 else 's'}{sep}{rate} tok/s"


@dataclass
class Stream:
    """Iterate for the text pieces as they decode; `stats` is filled when done (Stats: new_tokens, prompt_tokens,
    cached_tokens, time_to_first_token, tokens_per_second, finish_reason)."""
    pieces: Iterator[str]
    stats: Stats = field(default_factory=Stats)
    closed: threading.Event = field(default_factory=threading.Event, repr=False)  # close() was called

    def __iter__(self):
        return self.pieces

    def text(self) -> str:
        """The rest of the reply: what iterating has not given yet, joined (all of it on a fresh stream)."""
        return "".join(self.pieces)

    def close(self) -> None:
        """Stop decoding now (the user cancelled): nothing more is generated, `stats` count what was, and the model
        is ready for the next generate(). From any thread: where another thread is inside the stream's next step,
        that step is its last."""
        self.closed.set()
        try:
            self.pieces.close()  # GeneratorExit at the yield: the decoder is between tokens
        except ValueError:  # "generator already executing": another thread's next(); it sees `closed` and ends
            pass
        if not self.stats.finish_reason:
            self.stats.finish_reason = "cancelled"


class _AnyOf:
    """A cancel flag (threading.Event's is_set) set where any of the given ones is."""
    def __init__(self, *events):
        self.events = [e for e in events if e is not None]

    def is_set(self) -> bool:
        return any(e.is_set() for e in self.events)


def encode_prompt(lm: LocalModel, prompt: str | list[dict], cached: list[int] | None = None) -> list[int]:
    """The token ids of a plain prompt, or of chat messages through the model's chat template. A template that
    takes no system message (Mistral v0.1/v0.2's) gets it at the start of the first user message, as chat apps do.
    cached: the tokens a KV cache holds (LocalModel.cached_tokens); where the messages' text begins with theirs, they
    are its first tokens (_splice)."""
    ids = _encode(lm, prompt)
    check_token_ids(ids, lm.model.cfg.vocab_size)
    return _splice(lm.tokenizer, prompt, ids, cached)


def _splice(tok, prompt: str | list[dict], ids: list[int], cached: list[int] | None) -> list[int]:
    """ids of chat messages (a plain prompt's stay as they are) with their start replaced by `cached` where the two
    decode to the same text: a chat's earlier reply is then the model's own tokens, which the KV cache holds, not its
    text tokenized anew (a model's tokens are not always the canonical tokenization of their text: the demo model's
    sampled replies on the CPU with QDEC part from it within ~130 tokens, and everything after that point was read
    again)."""
    if not cached or isinstance(prompt, str) or ids[:len(cached)] == cached:
        return ids
    decode = lambda t: tok.decode(t, skip_special_tokens=False, clean_up_tokenization_spaces=False)  # noqa: E731
    text, head = decode(ids), decode(cached)
    if not text.startswith(head):
        return ids
    spliced = cached + tok(text[len(head):], add_special_tokens=False)["input_ids"]
    return spliced if decode(spliced) == text else ids  # a tokenizer that adds a space at a piece's start: as it was


def _encode(lm: LocalModel, prompt: str | list[dict]) -> list[int]:
    tok = lm.tokenizer
    for text in [prompt] if isinstance(prompt, str) else [m.get("content") for m in prompt if isinstance(m, dict)]:
        if isinstance(text, str) and not _is_unicode(text):
            raise LocalLLMError("the prompt is not UTF-8 text (bytes that decode to no character: another encoding, "
                                "or binary data); convert it, e.g. `iconv -f LATIN1 -t UTF-8`")
    if isinstance(prompt, str):
        return tok(prompt, add_special_tokens=True)["input_ids"]
    if not getattr(tok, "chat_template", None):
        raise LocalLLMError(f"{lm.path} has no chat template; pass a plain string prompt instead of messages")
    from jinja2 import TemplateError, TemplateSyntaxError
    try:
        out = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    except TemplateSyntaxError as e:  # the file, not the messages
        raise LocalLLMError(f"the chat template of {lm.path} is not a valid template ({e}, line {e.lineno}); fix it, "
                            "or copy chat_template.jinja (or tokenizer_config.json's chat_template) from its source "
                            "checkpoint") from None
    except TemplateError as e:  # the template's own check, e.g. Mistral's "roles must alternate"
        refused = LocalLLMError(f"the model's chat template refused these messages ({e})")
        folded = _fold_system(prompt)
        if folded is None:
            raise refused from None
        try:
            out = tok.apply_chat_template(folded, add_generation_prompt=True, tokenize=True)
        except TemplateError:
            raise refused from None
        if tok not in _TOLD_NO_SYSTEM:  # once per tokenizer, not at every reply
            _TOLD_NO_SYSTEM.add(tok)
            print("localllm: this model's chat template takes no system message: the system prompt goes at the "
                  "start of the first user message", file=sys.stderr)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


_TOLD_NO_SYSTEM = weakref.WeakSet()
MAX_SEED = 2**63 - 2  # _run seeds torch with seed + 1, a signed 64-bit number


def _is_unicode(text: str) -> bool:
    """No lone surrogates: what Python makes of bytes that are not UTF-8 in arguments and standard input."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _fold_system(messages: list[dict]) -> list[dict] | None:
    """messages with a leading system message joined to the first user message, or None (no system message)."""
    if len(messages) < 2 or messages[0].get("role") != "system" or messages[1].get("role") != "user":
        return None
    first = {**messages[1], "content": f"{messages[0]['content']}\n\n{messages[1]['content']}"}
    return [first] + messages[2:]


class Detokenizer:
    """The text of a growing list of tokens, decoding a few tokens per new one: decoding the whole reply at every token
    costs O(length) each (42 us at 256 tokens for the demo's tokenizer, more than a step of the demo on the GPU).
    A window starts a few tokens back (`prefix`), so that a tokenizer that drops the first token's leading space
    (SentencePiece) or a character split across tokens decodes the same in the window as in the whole; the new text is
    what the window gained past its decoding up to `read`. While the window ends in an incomplete character (U+FFFD)
    it stays where it is, so that the character's later bytes complete it."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.text = tokenizer, [], ""  # text: the decoding of ids[:read]
        self.prefix = self.read = 0

    def add(self, token: int) -> str:
        """What decoding the whole list with `token` appended gives."""
        self.ids.append(token)
        decode = lambda ids: self.tok.decode(ids, skip_special_tokens=True)  # noqa: E731
        before, after = decode(self.ids[self.prefix:self.read]), decode(self.ids[self.prefix:])
        text = self.text + after[len(before):]
        if len(after) > len(before) and not after.endswith("\ufffd"):  # the window moves on past new, whole text
            self.text, self.prefix, self.read = text, self.read, len(self.ids)
        return text


def _ready(text: str, stops: list[str]) -> int:
    """How much of the text decoded so far can be shown: not an incomplete multi-byte character at its end (it
    decodes to U+FFFD until its later bytes come), nor the longest tail before it that could still grow into a stop
    string."""
    whole = text.rstrip("\ufffd")
    return len(whole) - max((n for s in stops for n in range(min(len(s) - 1, len(whole)), 0, -1)
                             if s.startswith(whole[-n:])), default=0)


def special_stops(tok, stops: list[str]) -> set[int]:
    """The token ids of the stop strings that are a special token's text (e.g. "<|im_end|>"): the reply's text is
    decoded without special tokens, so such a stop string never appears in it and ends the reply as its token."""
    special = set(tok.all_special_tokens) | {t.content for t in getattr(tok, "added_tokens_decoder", {}).values()
                                              if t.special}
    return {tok.convert_tokens_to_ids(s) for s in stops if s in special}


def _run(lm: LocalModel, me: object, ids: list[int], max_new_tokens: int, params: SamplingParams, stops: list[str],
         seed: int, stats: Stats, cancel, reuse: bool) -> Iterator[str]:
    model, tok = lm.model, lm.tokenizer
    dev = model.device
    limit = lm.model.cfg.max_position_embeddings
    _check_length(ids, lm.model.cfg)
    full = limit - len(ids) < max_new_tokens  # the context ends the reply first
    max_new_tokens = min(max_new_tokens, limit - len(ids))
    eos, stop_ids = set(lm.eos_ids), special_stops(tok, stops)
    stats.prompt_tokens = len(ids)
    t0 = time.perf_counter()
    detok = Detokenizer(tok)
    text, emitted = "", 0  # the decoded text, and how many of its characters were yielded
    as_token = False  # the reply ended at a stop string that is a special token's (special_stops)
    # inference mode only around the model's work, never across a yield: the caller's code between pieces runs in
    # its own grad mode (and streams closed in another order than opened restore no stale mode)
    with lm.lock:
        _check_latest(lm, me, stats)  # (a stream read after a later call would run with that call's settings)
        lm.settings.generator = torch.Generator(device=dev).manual_seed(seed + 1)
        # (the decoder's buffers made outside inference mode: code that reuses it later may run outside it)
        dec = lm.decoder(len(ids) + max_new_tokens, keep=reuse)
        seen = torch.zeros(model.cfg.vocab_size, dtype=torch.bool, device=dev)
        seen[torch.tensor(ids, device=dev)] = True
        # one uniform draw per token, made on the CPU: the same seed chooses the same tokens on every device
        draws = torch.rand(max_new_tokens, generator=torch.Generator().manual_seed(seed))
        with torch.inference_mode():
            try:
                logits = dec.prefill(ids, cancel, reuse)
            except Cancelled:
                stats.finish_reason = "cancelled"
                return
            stats.cached_tokens = dec.reused
            dec.start(logits, len(ids), seen, params, draws)
    for step, t in enumerate(_steps(lm, me, stats, dec.tokens(max_new_tokens))):
        if step == 0:
            stats.time_to_first_token = time.perf_counter() - t0
            t1 = time.perf_counter()
        if cancel is not None and cancel.is_set():
            stats.finish_reason = "cancelled"
            break
        if t in stop_ids:  # (first: a stop string the caller named that is also an end token is the caller's)
            stats.finish_reason, as_token = "stop", True
            break
        if t in eos:
            stats.finish_reason = "eos"
            break
        text = detok.add(t)
        stats.new_tokens = len(detok.ids)
        stats.decode_seconds = time.perf_counter() - t1  # kept current: a closed stream's stats stay true
        cut = min((i for i in (text.find(s, max(0, emitted - len(s))) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            if cut > emitted:
                yield text[emitted:cut]
            stats.finish_reason = "stop"
            break
        end = _ready(text, stops)
        if end > emitted:
            yield text[emitted:end]
            emitted = end
    else:
        stats.finish_reason = "context" if full else "length"
    if text.endswith("\ufffd"):  # ended inside a multi-byte character (one U+FFFD stands for its bytes so far):
        text = text[:-1]  # the rest never comes
    if (stats.finish_reason in ("eos", "length", "context") or as_token) and len(text) > emitted:
        yield text[emitted:]  # what _ready held back: no stop string came in the text (as decode gives it)


def _steps(lm: LocalModel, me: object, stats: Stats, tokens: Iterator[int]) -> Iterator[int]:
    """tokens, each step taken under the model's lock and only while this reply is the model's latest (the decoder
    advances inside next(): a reply started since then holds the cache now)."""
    while True:
        with lm.lock, torch.inference_mode():
            _check_latest(lm, me, stats)
            t = next(tokens, None)
        if t is None:
            return
        yield t


def _check_latest(lm: LocalModel, me: object, stats: Stats) -> None:
    """Raise where a reply began on this model after this one's call (the replies share its KV cache)."""
    if lm.reply is not me:
        stats.finish_reason = "cancelled"
        raise LocalLLMError("another reply on this model began, or its QDEC or KV cache setting changed, before this "
                            "stream ended (the KV cache it read is gone): finish or close() a stream before the next "
                            "generate(), set_qdec() or set_kv_bits()")


def _check_length(ids: list[int], cfg) -> None:
    if len(ids) >= cfg.max_position_embeddings:
        raise LocalLLMError(f"the prompt has {len(ids)} tokens; this model's context is {cfg.context}: shorten it")


def _check_prompt(prompt) -> None:
    """Refuse, in one line, a prompt that is neither a string nor chat messages of string role and content."""
    if isinstance(prompt, list) and prompt:
        for i, m in enumerate(prompt):
            if not isinstance(m, dict):
                got = f"a {type(m).__name__}"
            elif not isinstance(m.get("content"), str):
                got = f"content {type(m['content']).__name__}" if "content" in m else "no 'content'"
            elif not isinstance(m.get("role"), str):
                got = f"role {type(m['role']).__name__}" if "role" in m else "no 'role'"
            else:
                continue
            raise LocalLLMError(f"chat message {i} must be a dict with 'role' and 'content' (strings), got {got}")
    elif not isinstance(prompt, str):
        raise LocalLLMError(f"the prompt must be a string or a non-empty list of chat messages ({{'role': ..., "
                            f"'content': str}}), got {type(prompt).__name__}{' (empty)' if prompt == [] else ''}")


def _check_call(model, prompt, max_new_tokens, stop, seed, stream, cancel, reuse_cache) -> list[str]:
    """Refuse, in one line, arguments of the wrong kind (before anything about the model changes); the stop strings."""
    if not (model is None or isinstance(model, (LocalModel, str, os.PathLike))):
        raise LocalLLMError(f"model must be what localllm.load() returns, a model path, or None (the demo model), "
                            f"got {type(model).__name__}")
    _check_prompt(prompt)
    for name, v in (("stream", stream), ("reuse_cache", reuse_cache)):
        if not isinstance(v, bool):  # ("no" would be true)
            raise LocalLLMError(f"{name}={v!r}: give True or False")
    if cancel is not None and not callable(getattr(cancel, "is_set", None)):
        raise LocalLLMError(f"cancel must be a threading.Event (or None), got {type(cancel).__name__}")
    if not (is_whole(max_new_tokens) and max_new_tokens >= 1):
        raise LocalLLMError(f"max_new_tokens must be a whole number, at least 1, got {max_new_tokens!r}")
    if seed is not None and not (is_whole(seed) and 0 <= seed <= MAX_SEED):
        raise LocalLLMError(f"seed must be a whole number from 0 to {MAX_SEED}, got {seed!r}")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not (isinstance(stops, (list, tuple)) and all(isinstance(x, str) for x in stops)):
        raise LocalLLMError(f"stop must be a string or a list of strings, got {stop!r}")
    return [x for x in stops if x]  # an empty one would match at once


def generate(model: LocalModel | str | os.PathLike | None, prompt: str | list[dict], max_new_tokens: int = 256,
             temperature: float = SamplingParams.temperature, top_p: float = SamplingParams.top_p,
             top_k: int = SamplingParams.top_k, repetition_penalty: float = SamplingParams.repetition_penalty,
             stop: str | list[str] | None = None, seed: int | None = None, stream: bool = False,
             qdec: str | int | dict | None = None, kv_bits: int | None = None, min_p: float = SamplingParams.min_p,
             cancel=None, reuse_cache: bool = False) -> str | Stream:
    """Generate a reply to `prompt` (a string, or chat messages [{"role": ..., "content": ...}] which get the
    model's chat template). `model` is a LocalModel, a model path, or None for the demo model (a path or None loads
    the model on the CPU for this call alone: load() once and pass the LocalModel to keep it).
    Sampling as transformers' processors, in this order: repetition penalty, temperature (0, or under 1e-4: greedy),
    top-k (0 = off), top-p, min-p (0 = off: else tokens less likely than min_p times the most likely one are dropped).
    One reply at a time per model (they share its KV cache): a call from another thread waits while a reply without
    stream runs, and a stream still open when the next reply begins raises LocalLLMError at its next piece.

    stream=True returns a Stream that yields text pieces as they decode (stats: Stats, close() from any thread);
    otherwise the whole text. A stop string ends the reply and is left out of it.
    qdec: None keeps the model's setting; "on" / "off" / a k_chunk / a dict sets it, for this call and the later ones
    (LocalModel.set_qdec). kv_bits: likewise the KV cache width, 16, 8 or 4 (LocalModel.set_kv_bits).
    seed: None draws a new one each call.
    cancel: a threading.Event another thread may set to stop the reply before its next token (stats.finish_reason
    "cancelled"); on the CPU also between layers while the prompt is read (a GPU queues the prompt's kernels at once,
    and they finish first).
    reuse_cache: read only the prompt's tokens after what it shares with the model's KV cache (the previous prompt
    and the part of its reply that was run; messages whose text begins with those tokens' keep them, so an earlier
    reply is its own tokens, not its text tokenized anew): a chat's next turn then reads only the new messages
    (`localllm chat` does this). The cache's entries round differently from one pass over the prompt, and QDEC's
    channel selection, or an 8- or 4-bit cache's rounding, can turn that into other tokens.
    The same seed gives the same text (with reuse_cache, after the same earlier calls)."""
    params = SamplingParams(temperature, top_p, top_k, repetition_penalty, min_p)
    params.check()
    stops = _check_call(model, prompt, max_new_tokens, stop, seed, stream, cancel, reuse_cache)
    if kv_bits is not None:
        kvquant.check_bits(kv_bits)
    lm = model if isinstance(model, LocalModel) else load(model)
    with lm.lock:  # not while another thread's reply takes a step
        ids = encode_prompt(lm, prompt)  # the prompt's refusals too come before the model changes
        if not ids:
            raise LocalLLMError("the prompt is empty (no tokens): give some text")
        # where the cache stays, an earlier reply goes as its own tokens (which can be more, or fewer); where a
        # setting below may drop the cache, the prompt as encoded too: what may be sent must fit, checked before
        # anything changes (the plain ids alone, checked always, jammed a chat whose replies re-encode longer)
        cached = lm.cached_tokens() if reuse_cache else []
        spliced = _splice(lm.tokenizer, prompt, ids, cached)
        for sent in (ids, spliced) if qdec is not None or kv_bits is not None else (spliced,):
            _check_length(sent, lm.model.cfg)
        if qdec is not None:
            lm.set_qdec(qdec)
        if kv_bits is not None:
            lm.set_kv_bits(kv_bits)
        if lm.cached_tokens() == cached:  # (a changed setting empties the cache: nothing to splice onto)
            ids = spliced
        # (a new seed from the OS, not torch's generator: the caller's torch.manual_seed neither moves nor fixes it)
        seed = secrets.randbelow(MAX_SEED + 1) if seed is None else int(seed)  # (numpy's as Python's)
        s = Stream(iter(()))
        me = lm.reply = object()  # a stream opened before, or this one read after a later call, raises when read
        s.pieces = _run(lm, me, ids, int(max_new_tokens), params, stops, seed, s.stats, _AnyOf(cancel, s.closed),
                        reuse_cache)
        if stream:
            return s
        return s.text()  # the whole reply under the lock: a reply another thread asks for meanwhile waits for it
