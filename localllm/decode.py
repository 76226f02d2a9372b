"""One token at a time: eager on the CPU, one captured CUDA graph per decode step on a GPU.

The cache outlives a reply: prefill(reuse=True) runs only the tokens after the longest prefix a prompt shares with what
the cache holds (the last prompt and the tokens of its reply that were run), so a chat's next turn reads only what is
new. The kept entries were computed in other batches (or by decode steps), which round differently from one prompt's
pass, and QDEC's selection can carry such a difference into other tokens: the same seed then gives the same text only
after the same earlier calls, so reuse is the caller's choice.

The graphs are captured once per Decoder over static buffers (token, position, KV cache, sampling state). step()
copies a given token and position in and replays the model alone (teacher-forced evaluation); advance() replays the
model and the choice of the next token, which stays on the GPU as the next step's input, so generation needs no host
round trip between steps: the host reads each token (read()) while the next step already runs.

Each kind of graph comes in three spans, four with thread-block clusters (sm_90+): positions below SHORT_SPAN, below
PAIR_SPAN, (with clusters) below CLUSTER_SPAN, and the rest of the cache. The position is read from device memory, so
one graph would serve them all, but the short one attends in a single run per kv head, which writes the output itself,
and the cluster one in at most 8 runs that merge inside their cluster: the kernel that merges runs, and its place in
every layer's chain, is left out (an 8B step 2.7-3.3% faster at the short span, kernels/NOTES.md, session 47; 1.7-1.9%
at the middle one with a chat-sized cache, session 73). Below PAIR_SPAN the runs are few enough to take a block per
query head, whose two runs o's GEMV merges as it stages its input (kernels.attention.Runs; sessions 75-76: positions
128-255 2.6% faster on the 8B W3 with runs merged in clusters of two, 2.7% more with the merge in o instead; with plain
launches, as GPUs before Hopper run them, the merge in o saves the merging kernel: demo shapes 8% faster there).
One run over more than one chunk is slower than the runs and their merge, so the short span is one chunk.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from .graphs import capture
from .model import KVCache, Transformer
from .sampling import SamplingParams, choose

SHORT_SPAN = 128  # one chunk of the decode attention (kernels/attention.py's CHUNK): a single run covers it
PAIR_SPAN = 256  # two chunks, whose two runs take a block a query head (and merge in o's GEMV)
CLUSTER_SPAN = 1024  # kernels/attention.py's CLUSTER_SPAN: 8 chunks, whose runs merge in one cluster


def _clusters(dev: torch.device) -> bool:
    from .kernels import cuda
    return dev.type == "cuda" and cuda.clusters(dev.index if dev.index is not None else torch.cuda.current_device())


class Decoder:
    def __init__(self, model: Transformer, max_len: int, use_graph: bool | None = None, kv_bits: int = 16):
        self.model = model
        dev = model.device
        self.cache = KVCache(model.cfg, max_len, dtype=model.act_dtype, device=dev, bits=kv_bits)
        self.use_graph = dev.type == "cuda" if use_graph is None else use_graph
        middle = ((PAIR_SPAN,) + ((CLUSTER_SPAN,) if self._wide(model, dev) else ())) if self.use_graph else ()
        self.spans = [s for s in (SHORT_SPAN, *middle) if s < max_len] + [max_len]  # the graphs' spans, in order
        self._step_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # by span: graph, logits
        self.graph: torch.cuda.CUDAGraph | None = None  # the step graph replayed last
        self.tok = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        # sampling state (start()): tokens in the context, settings, one uniform draw per token and the next one's index
        self.seen = torch.zeros(model.cfg.vocab_size, dtype=torch.bool, device=dev)
        self.params = SamplingParams().tensor(dev)
        self.draws = torch.zeros(max_len, device=dev)
        self.drawn = torch.zeros((), dtype=torch.long, device=dev)
        self.greedy = True
        self._advance_graphs: dict[tuple[bool, int], torch.cuda.CUDAGraph] = {}  # by (greedy, span)
        self._at = 0  # the position advance() runs next (self.pos, known here without reading it back)
        self._reads = 0  # tokens read since start()
        # the cache's positions 0.._at-1 hold the keys and values of (_prompt + _out)[:_at] (cached())
        self._prompt: list[int] = []
        self._out: list[int] = []  # the tokens tokens() gave since start()
        self.reused = 0  # prompt tokens the last prefill() found in the cache
        if self.use_graph:  # read(): a pinned slot per token, so every token's copy stays until the next start()
            self._host = torch.zeros(max_len + 1, dtype=torch.long, pin_memory=True)

    @staticmethod
    def _wide(model: Transformer, dev: torch.device) -> bool:
        """Whether a CLUSTER_SPAN graph pays: its runs merge in their clusters, or in o's GEMV (small models)."""
        from .kernels.attention import leaves_runs
        cfg = model.cfg
        return _clusters(dev) or leaves_runs(CLUSTER_SPAN // SHORT_SPAN, cfg.num_heads, cfg.head_dim, False)

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def cached(self) -> list[int]:
        """The tokens whose keys and values the cache holds, from position 0."""
        return (self._prompt + self._out)[:self._at]

    def kept(self) -> tuple[list[int], dict[str, torch.Tensor]]:
        """What the cache holds (cached()) and its entries, on the CPU (a GPU frees this cache before a larger one is
        made), for restore() into a larger Decoder."""
        n = self._at
        return self.cached(), {name: t[:, :, :, :n].to("cpu", copy=True) for name, t in self.cache.named_buffers()}

    def restore(self, ids: list[int], entries: dict[str, torch.Tensor]) -> None:
        """Take over kept()'s tokens and entries from a Decoder of the same model and KV cache width."""
        for name, t in entries.items():
            getattr(self.cache, name)[:, :, :, :t.shape[3]].copy_(t)
        self._prompt, self._out, self._at = list(ids), [], len(ids)

    def prefill(self, ids: list[int], cancel=None, reuse: bool = False) -> torch.Tensor:
        """Logits [V] after the prompt, from position 0 or (reuse) from the first token that differs from what the
        cache holds (at least the last token is run: its logits are the result); cancel: see Transformer.forward."""
        old = self.cached() if reuse else []
        keep = next((i for i, (a, b) in enumerate(zip(old, ids[:-1])) if a != b), min(len(old), len(ids) - 1))
        self._prompt, self._out, self._at = ids[:keep], [], keep  # what stays true if this is cancelled
        t = torch.tensor([ids[keep:]], device=self.model.device)
        desc = f"reading the prompt ({t.shape[1]} tokens)" if t.device.type == "cpu" else None  # (a GPU queues it)
        logits = self.model(t, keep, self.cache, last=True, cancel=cancel, desc=desc)[0, -1]
        self._prompt, self._at, self.reused = list(ids), len(ids), keep
        self.pos.fill_(len(ids))  # a capture before start() writes past the prompt
        return logits

    def step(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        """Logits [V] after `token` (a 0-dim device tensor) at position `pos`. With a CUDA graph they are a view of
        the graph's output buffer: read them before the next step."""
        self._fits(pos)
        self._prompt, self._out, self._at = [], [], 0  # the cache is the caller's now
        if not self.use_graph:
            return self.model(token.view(1, 1), pos, self.cache)[0, -1]
        self.tok.copy_(token.view(1, 1))
        self.pos.fill_(pos)
        span = self.span(pos)
        if span not in self._step_graphs:
            self._step_graphs[span] = self._graph_of(lambda: self.model.step(self.tok, self.pos, self.cache, span))
        self.graph, logits = self._step_graphs[span]
        self.graph.replay()
        return logits[0, -1]

    def start(self, logits: torch.Tensor, pos: int, seen: torch.Tensor, params: SamplingParams,
              draws: torch.Tensor) -> None:
        """Begin generating after a prompt of `pos` tokens whose last logits are `logits`: choose the first token
        (read() gives it) and set up advance(). seen: bool [V], the prompt's tokens (for the repetition penalty);
        draws: float [n] uniforms in [0, 1), one per token to generate (at most max_len)."""
        self.greedy = params.greedy
        self.params.copy_(params.tensor())
        self.seen.copy_(seen)
        self.draws[:len(draws)].copy_(draws)
        self.drawn.zero_()
        self.pos.fill_(pos)
        self._at = pos
        self._reads = 0
        self._out = []
        self._choose(logits)

    def advance(self) -> None:
        """Run the last chosen token through the model and choose the next (read() gives it)."""
        pos = self._at
        self._fits(pos)
        # _at moves past the token only once its keys and values are written (or queued, on a GPU): a step cut short
        # (Ctrl+C) leaves the token out of cached(), so a reused cache runs it again
        if not self.use_graph:
            self._choose(self.model(self.tok, pos, self.cache)[0, -1])
            self.pos += 1
            self._at = pos + 1
            return
        span = self.span(pos)
        if (self.greedy, span) not in self._advance_graphs:
            self.capture(self.greedy)
        self._advance_graphs[self.greedy, span].replay()
        self._at = pos + 1

    def _fits(self, pos: int) -> None:
        # (a graph would write the next kv head's rows, or past the buffer: the CPU's append refuses it as well)
        if not 0 <= pos < self.max_len:
            raise ValueError(f"position {pos} is outside the KV cache (0..{self.max_len - 1})")

    def span(self, pos: int) -> int:
        """The span of the graphs that serve position pos: the first that holds it."""
        return next((s for s in self.spans if pos < s), self.max_len)

    def capture(self, greedy: bool) -> None:
        """Capture advance()'s graphs for a greedy or a sampled choice now (their first use would), e.g. while a UI
        loads: the span of the position advance() runs next and the longer ones, which generation may reach. The
        capture's warm-up step writes the cache at the current position, which generation overwrites."""
        if not self.use_graph:
            return
        was, self.greedy = self.greedy, greedy
        try:
            for span in self.spans[self.spans.index(self.span(self._at)):]:
                if (greedy, span) not in self._advance_graphs:
                    self._advance_graphs[greedy, span] = self._graph_of(lambda: self._advance_once(span),
                                                                        keep_state=True)[0]
        finally:
            self.greedy = was

    def tokens(self, n: int) -> Iterator[int]:
        """The next n tokens, the first the one start() chose. On a GPU, from the second on, each step is queued
        before the token before it is read, so the GPU keeps busy while the caller handles a token; the first step is
        queued only when the caller asks for the second token (a new Decoder's first advance() captures its graph,
        which the first token need not wait for). On the CPU a step runs when the caller asks for its token: there
        it would only delay the token before it (and run once more past an end of turn)."""
        token = self.read()
        for i in range(n):
            more = i + 1 < n
            ahead = i and more and self.use_graph
            if ahead:
                self.advance()
                following = self.read()
            self._out.append(token())
            yield self._out[-1]
            if more and not ahead:
                self.advance()
                following = self.read()
            if more:
                token = following

    def read(self) -> Callable[[], int]:
        """The token just chosen, as a function that returns it (until the next start()): on a GPU its copy to the
        host is queued now and waited for only when called, so the caller can queue the next advance() first."""
        if not self.use_graph:
            t = int(self.tok)
            return lambda: t
        i = self._reads
        self._reads += 1
        self._host[i:i + 1].copy_(self.tok.view(1), non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return lambda: (copied.synchronize(), int(self._host[i]))[1]

    def _choose(self, logits: torch.Tensor) -> None:
        choose(logits, self.seen, self.params, self.draws, self.drawn, self.tok, self.greedy)

    def _advance_once(self, span: int) -> None:
        self._choose(self.model.step(self.tok, self.pos, self.cache, span)[0, -1])
        self.pos += 1

    def _graph_of(self, run: Callable, keep_state: bool = False) -> tuple[torch.cuda.CUDAGraph, object]:
        """run captured as a CUDA graph, and what it returned. keep_state: the warm-up run's changes to the token,
        position and sampling state are undone (its KV-cache write is the one the replay makes again)."""
        live = (self.tok, self.pos, self.seen, self.drawn)
        state = [t.clone() for t in live] if keep_state else []
        return capture(run, lambda: [t.copy_(saved) for t, saved in zip(live, state)])


def captured_decoder(model: Transformer, prompt: int = 16, ctx: int = 256, kv_bits: int = 16) -> Decoder:
    """A Decoder after a prompt of `prompt` tokens, its step graph captured at the next position (its .graph: what
    graphs.replay_time times in the benchmarks and the tuner)."""
    dec = Decoder(model, ctx, kv_bits=kv_bits)
    with torch.inference_mode():
        logits = dec.prefill(list(range(1, prompt + 1)))
        dec.step(logits.argmax(), prompt)  # captures the graph
    return dec
