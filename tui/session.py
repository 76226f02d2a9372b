"""The chat apart from its widgets: the conversation sent to generate(), the settings of the next reply, one reply
at a time with cancellation, QDEC on/off, and errors as one readable line.

Threads: the UI thread owns a ChatSession (send, finish, new_chat, settings); only Reply.run and sync_qdec touch
the model, on worker threads, one at a time under the session's model lock.
"""
from __future__ import annotations

import secrets
import threading
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch

from localllm.errors import LocalLLMError
from localllm.generate import Stats, encode_prompt, generate
from localllm.runtime import LocalModel, load, qdec_off
from localllm.sampling import SamplingParams


@dataclass(frozen=True)
class ReplySettings:
    """What the next reply is generated with; the settings panel edits them, each reply keeps a copy."""
    system: str = ""
    temperature: float = SamplingParams.temperature
    top_p: float = SamplingParams.top_p
    min_p: float = SamplingParams.min_p
    top_k: int = SamplingParams.top_k
    repetition_penalty: float = SamplingParams.repetition_penalty
    max_new_tokens: int = 512
    seed: int | None = None  # None: a fresh seed per reply (the history records the one drawn)

    def check(self) -> None:
        SamplingParams(self.temperature, self.top_p, self.top_k, self.repetition_penalty, self.min_p).check()
        if self.max_new_tokens < 1:
            raise LocalLLMError(f"max new tokens must be at least 1, got {self.max_new_tokens}")

    def updated(self, name: str, text: str) -> "ReplySettings":
        """A copy with field `name` set from what the user typed; ValueError when that is not valid."""
        kind = {"system": str, "temperature": float, "top_p": float, "min_p": float, "top_k": int,
                "repetition_penalty": float, "max_new_tokens": int}[name]
        try:
            if kind is not str and "_" in text:  # Python's literals take 1_0 for 10; a settings field does not
                raise ValueError(f"{text!r} is not a number")
            new = replace(self, **{name: kind(text if kind is str else text.strip())})
            new.check()
        except (ValueError, LocalLLMError) as e:
            raise ValueError(str(e)) from None
        return new


def open_model(src: str | None, gguf_file: str | None = None, qdec: str | int = "on", device: str = "cpu",
               budget: float | None = None, kv_bits: int = 16, prefill_int8: bool = False,
               tune: bool | None = None) -> LocalModel:
    """load() for chatting: the model must have a chat template."""
    lm = load(src, gguf_file=gguf_file, qdec=qdec, device=device, budget=budget, kv_bits=kv_bits,
              prefill_int8=prefill_int8, tune=tune)
    if not getattr(lm.tokenizer, "chat_template", None):
        raise LocalLLMError(f"{lm.path} has no chat template, so it cannot chat; use a chat (instruct) model, or "
                            "`localllm generate --raw` to continue plain text")
    return lm


@dataclass(eq=False)
class Reply:
    """One assistant reply. run() generates it on a worker thread; the UI thread reads it once run() returned."""
    prompt: list[dict]  # the messages sent: system, earlier turns, the new user message
    settings: ReplySettings
    seed: int
    chat: int  # the chat it belongs to (a reply of a chat cleared meanwhile is dropped)
    text: str = ""
    pieces: int = 0
    stats: Stats = field(default_factory=Stats)
    qdec: dict = field(default_factory=dict)  # the QDEC setting in force: mode, k_chunk per layer type, source
    error: str | None = None
    left_out: int = 0  # the oldest exchanges not sent, so that the conversation fits the model's context
    keep_out: int = 0  # the previous reply's left_out: the prompt starts where that one did (its KV cache stays)

    @property
    def user_text(self) -> str:
        return self.prompt[-1]["content"]

    @property
    def cancelled(self) -> bool:
        return self.stats.finish_reason == "cancelled"

    @property
    def dropped(self) -> bool:
        """Not part of the conversation, with its user message: it failed, or was cancelled before its first word."""
        return self.error is not None or self.cancelled and not self.text.strip()

    def run(self, session: "ChatSession", emit: Callable[[str], None], stop: threading.Event) -> None:
        """Generate, calling emit(piece) for each text piece; `stop` set: end after the current token (the piece
        decoded meanwhile is not shown), on the CPU also between layers while the prompt is read. Errors end up in
        `error`, as one line."""
        with session.model_lock:
            try:
                session.sync_qdec()
                s = session.lm.settings
                self.qdec = {"mode": s.mode, "k_chunk": dict(s.k_chunk), "source": session.lm.qdec_source}
                st = self.settings
                prompt, self.left_out = fit_context(session.lm, self.prompt, st.max_new_tokens, self.keep_out)
                stream = generate(session.lm, prompt, max_new_tokens=st.max_new_tokens, temperature=st.temperature,
                                  top_p=st.top_p, min_p=st.min_p, top_k=st.top_k,
                                  repetition_penalty=st.repetition_penalty, seed=self.seed, stream=True, cancel=stop,
                                  reuse_cache=True)  # each turn reads only the new messages
                self.stats = stream.stats
                for piece in stream:
                    self.text += piece
                    self.pieces += 1
                    emit(piece)
                stream.close()
            except Exception as e:  # noqa: BLE001 - any failure becomes a message in the transcript, not a crash
                self.error = readable(e)


def fit_context(lm: LocalModel, prompt: list[dict], room: int, at_least: int = 0) -> tuple[list[dict], int]:
    """`prompt` without its oldest exchanges (user message and reply), at least `at_least` of them (what the previous
    reply left out, so that the prompt starts as its did and the KV cache serves it), and as many more as it takes
    for the rest and `room` tokens of reply (at most half the context) to fit the model's context; and how many were
    left out. Where more must go, they go until a quarter of the context is free besides, so that the next turns
    fit too and read only their new messages (leaving out one exchange per turn would change the prompt's start,
    and so re-read all of it, every turn). The system message and the new user message always stay."""
    limit = lm.model.cfg.max_position_embeddings
    room = min(room, limit // 2)
    first = 1 if prompt and prompt[0]["role"] == "system" else 0
    without = lambda n: prompt[:first] + prompt[first + 2 * n:]  # noqa: E731 - the n oldest exchanges left out
    cached = lm.cached_tokens()
    # measured as generate(reuse_cache=True) sends them: earlier replies as the model's own tokens, which can be more
    # than their text tokenized anew
    length = lambda n: len(encode_prompt(lm, without(n), cached))  # noqa: E731
    most = max(0, (len(prompt) - first - 1) // 2)
    lo = min(at_least, most)
    if length(lo) + room <= limit:
        return without(lo), lo
    if (need := length(most)) >= limit:  # the new message (and system prompt) alone
        what = "your message and the system prompt (F2) take" if first else "your message takes"
        raise LocalLLMError(f"{what} {need} tokens, and this model's context is {lm.model.cfg.context}: shorten "
                            f"{'them' if first else 'it'}")
    slack = limit // 4
    fits = lambda n: length(n) + room + slack <= limit  # noqa: E731
    if not fits(most):  # (with less than `room` left, the reply ends when the context is full)
        return without(most), most
    # the fewest more to leave out: the length only shrinks as more go, so bisect (a long chat re-encodes a few times)
    hi = most
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return without(hi), hi


class ChatSession:
    def __init__(self, lm: LocalModel, settings: ReplySettings | None = None, qdec: str | int | dict = "on"):
        """qdec: what the model was loaded with; turning QDEC on applies it again ("on" when it was "off")."""
        self.lm = lm
        self.settings = settings or ReplySettings()
        self.turns: list[dict] = []  # finished turns: user, then assistant (with its settings and stats)
        self.resumed = 0  # how many of them came from a saved chat (go_on)
        self.saved = 0  # how many of them a file holds (saved, or resumed from)
        self.chat = 0
        self.running: Reply | None = None
        self.model_lock = threading.RLock()
        self.qdec_on = "on" if qdec_off(qdec) else qdec
        # what the settings panel asks for; sync_qdec makes the model follow
        self.want_qdec, self.want_budget = self.qdec_in_force, lm.budget

    def send(self, text: str) -> Reply:
        """Start a reply to the user's `text`: the conversation so far plus it. Run it with Reply.run, then
        finish() it."""
        if self.running is not None:
            raise LocalLLMError("a reply is still running; cancel it (Esc) or wait for it")
        st = self.settings
        system = [{"role": "system", "content": st.system}] if st.system.strip() else []
        prompt = system + [{"role": t["role"], "content": t["content"]} for t in self.turns] + \
            [{"role": "user", "content": text}]
        seed = st.seed if st.seed is not None else secrets.randbelow(2**31)
        # a saved reply's left_out was of its own model's context and cache: a resumed chat has no cache to keep
        last = next((t for t in reversed(self.turns[self.resumed:]) if t["role"] == "assistant"), {})
        self.running = Reply(prompt, st, seed, self.chat, keep_out=last.get("left_out", 0))
        return self.running

    def finish(self, reply: Reply) -> None:
        """Record a reply that run() finished. A cancelled reply stays in the conversation with the text that was
        shown (the model sees what the user saw); one cancelled before its first word, or a failed one, is dropped
        with its user message."""
        if reply is self.running:
            self.running = None
        if reply.dropped or reply.chat != self.chat:
            return
        self.turns.append({"role": "user", "content": reply.user_text})
        self.turns.append({"role": "assistant", "content": reply.text, "cancelled": reply.cancelled,
                           "left_out": reply.left_out,  # the oldest exchanges this reply's prompt did not hold
                           "settings": {**asdict(reply.settings), "seed": reply.seed, "qdec": reply.qdec},
                           "stats": {**asdict(reply.stats), "tokens_per_second": reply.stats.tokens_per_second}})

    def go_on(self, saved: dict) -> None:
        """Go on with a saved chat (history.load): its turns are the conversation the next reply gets."""
        self.turns = [dict(t) for t in saved["turns"]]
        self.resumed = self.saved = len(self.turns)

    def new_chat(self) -> None:
        """Forget the conversation; a reply still running belongs to the old chat and is not recorded."""
        self.turns, self.resumed, self.saved = [], 0, 0
        self.chat += 1

    @property
    def unsaved(self) -> bool:
        """Whether exchanges were made since the chat was last saved (or resumed)."""
        return len(self.turns) > self.saved

    def last_reply(self) -> str | None:
        return next((t["content"] for t in reversed(self.turns) if t["role"] == "assistant" and t["content"]), None)

    @property
    def qdec_in_force(self) -> bool:
        return self.lm.settings.mode != "off"

    @property
    def tunable(self) -> bool:
        """Whether the tuning budget matters: QDEC "on" takes the tuning profile for it, on a GPU (on the CPU the
        default k_chunk applies)."""
        return self.lm.has_residuals and self.qdec_on == "on" and self.lm.model.device.type == "cuda"

    def sync_qdec(self) -> None:
        """Make the model's QDEC setting what want_qdec and want_budget ask (on a GPU, turning QDEC on the first time
        pins the residuals: seconds). Holds the model lock: a reply never runs halfway through it."""
        with self.model_lock:
            on, budget = self.want_qdec, self.want_budget
            if on == self.qdec_in_force and (not on or budget == self.lm.budget):
                return  # (a budget changed while QDEC is off applies when it is turned on)
            try:
                self.lm.set_qdec(self.qdec_on if on else "off", budget)
            finally:  # it may have failed or fallen back to off: want what is in force, so it is not retried,
                # unless the panel asked for something else meanwhile (its worker applies that next)
                if (self.want_qdec, self.want_budget) == (on, budget):
                    self.want_qdec, self.want_budget = self.qdec_in_force, self.lm.budget


def readable(e: BaseException) -> str:
    """One line for the transcript: what went wrong and what to do."""
    if isinstance(e, LocalLLMError):
        return str(e)
    lines = str(e).strip().splitlines()
    msg = (lines[0] if lines else type(e).__name__)[:200]
    if isinstance(e, torch.OutOfMemoryError) or "CUDA out of memory" in msg:
        return (f"out of GPU memory ({msg}); start a new chat (a shorter context), lower max new tokens, or use a "
                "smaller model")
    if isinstance(e, MemoryError) or "can't allocate memory" in msg or "not enough memory" in msg:
        return f"out of memory ({msg}); close other programs, start a new chat, or use a smaller model"
    if "CUDA" in msg or type(e).__name__ in ("AcceleratorError", "CUDADriverError", "CUDARuntimeError"):
        return f"the GPU failed ({msg}); restart `localllm chat`, or run on the CPU with --device cpu"
    return f"unexpected error: {type(e).__name__}: {msg}"
