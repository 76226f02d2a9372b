"""One token at a time: eager on the CPU, one captured CUDA graph per decode step on a GPU.

The graph is captured once per Decoder over static buffers (token, position, KV cache); each step copies the
new token and position in and replays it, so Python does nothing per layer per token.
"""
from __future__ import annotations

import torch

from .model import KVCache, Transformer


class Decoder:
    def __init__(self, model: Transformer, max_len: int, use_graph: bool | None = None, kv_bits: int = 16):
        self.model = model
        dev = model.device
        self.cache = KVCache(model.cfg, max_len, dtype=model.embed.dtype, device=dev, bits=kv_bits)
        self.use_graph = dev.type == "cuda" if use_graph is None else use_graph
        self.graph: torch.cuda.CUDAGraph | None = None
        self.tok = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.logits: torch.Tensor | None = None

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def prefill(self, ids: list[int]) -> torch.Tensor:
        """Logits [V] after the prompt (fills the cache from position 0)."""
        t = torch.tensor([ids], device=self.model.device)
        return self.model(t, 0, self.cache)[0, -1]

    def step(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        """Logits [V] after `token` (a 0-dim device tensor) at position `pos`. With a CUDA graph they are a view of
        the graph's output buffer: read them before the next step."""
        if not self.use_graph:
            return self.model(token.view(1, 1), pos, self.cache)[0, -1]
        self.tok.copy_(token.view(1, 1))
        self.pos.fill_(pos)
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.logits[0, -1]

    def _capture(self) -> None:
        # the whole cache length is attended (masked by position), so one graph serves every position
        run = lambda: self.model.step(self.tok, self.pos, self.cache, self.max_len)  # noqa: E731
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: kernel compilation and allocations stay out of the graph
            run()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = run()
