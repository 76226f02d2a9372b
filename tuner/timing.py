"""The tuner's GPU side: the search problem of a loaded model on this GPU, and the timings the search asks for.

GEMV times (gemv_time) come from CUDA graphs of several of the model's own layers of one kind, back to back (their
packed weights, their pinned residuals, enough layers that L2 cannot serve a repeat, up to all of them), each with
the input transform and residual add it has in the decode step (RMSNorm for qkv and gate_up, the SwiGLU gate for
down, the residual add for o and down) and decode's launch order (Linear.held: whether x is ready at the start, which
kernels.gemv.gemv would otherwise guess from the weight size), timed by localllm.graphs.time_graph (median replay over
CUDA events). The inputs are random with the spread the calibration saw per channel, and b0 / b15 are the layer's
calibration boundaries, as the runtime sets them. The decode step (decode_time) is the captured graph of generation, with QDEC
off or at a setting (LocalModel.set_qdec with per-kind n_tb), the median of a few timings of one capture (the graph
without QDEC is captured once per tune). H200, value search, 2026-11-29: demo shapes 12-13 s -> 4 s, 8B shapes
33-42 s -> 13-14 s, from a 50 ms warm-up per GEMV point (now per kind), a new decoder (prompt, capture) per timing,
200 replays a timing (now 100) and tuner.blocks.gain dequantizing each layer at every ask (now once).

n_tb: kernels.qdec.viable_n_tb, the number of compensating blocks, each taking ceil(chunks / n_tb) whole
1024-channel chunks (Appendix A's rule over the chunks). They are among the GEMV's own blocks (one per SM) and
stream no weights, so Phase 1's limit on n_tb_max is half the SM count, as in the paper. k_chunk is bounded by the GPU's shared memory per block (opt-in maximum) for
the QDEC GEMV of that shape (kernels.qdec.shared_bytes_total) and by the calibration's kmax.
"""
from __future__ import annotations

import functools
import statistics

import torch

from localllm.model import KINDS

from .search import Choice, Layer, Problem, largest_k

DECODE_RUNS = 3  # decode-step timings per setting (median)
DECODE_REPS = 100  # graph replays per timing (H200, 8B W3: repeated timings of one graph agree within 0.05%)
WARM_S = 0.002  # untimed replays before a GEMV point's timing, once its kind's first point warmed its layers


def compensable(lm, kind: str) -> list:
    """The `kind` layers of a LocalModel that have residuals, in block order."""
    return [lin for lin in lm.model.linears() if lin.kind == kind and lin.residual is not None]


def problem_of(lm, sm_count: int | None = None, smem: int | None = None, grid_of=None) -> Problem:
    """The search problem of a LocalModel: per kind its shape, count, viable n_tb and k_chunk bound. On a GPU the
    defaults come from the device; sm_count, smem (bytes per block) and grid_of (N -> GEMV grid) make it usable
    anywhere."""
    from localllm.kernels import qdec
    from localllm.qdec import CHUNK
    dev = lm.model.device
    if sm_count is None or smem is None:
        from localllm.kernels import cuda
        sm_count = cuda.sm_count(dev.index or 0) if sm_count is None else sm_count
        smem = cuda.shared_limit(dev.index or 0) if smem is None else smem
    if grid_of is None:
        from localllm.kernels.gemv import grid_of as g
        grid_of = functools.partial(g, device=dev)
    kmax = min(lm.manifest["calibration"]["kmax"], CHUNK)
    layers = []
    for kind in KINDS:
        lins = compensable(lm, kind)
        if not lins:
            continue
        # mixed bits (--bits 3.5): the widest layer of the kind needs the most shared memory
        w = max((lin.packed or lin.quant for lin in lins), key=lambda q: q.bits)
        N, K = lins[0].out_features, lins[0].in_features
        grid = grid_of(N)
        k_max = largest_k(lambda k: qdec.shared_bytes_total(w, k, grid, smem), smem, kmax)  # noqa: B023
        layers.append(Layer(kind, N, K, len(lins), tuple(qdec.viable_n_tb(K, N, grid)), k_max))
    return Problem(tuple(layers), max(1, sm_count // 2))


def _spread(lin, n: int, gen: torch.Generator) -> torch.Tensor:
    """Random fp32 values [n] with the per-channel spread of the layer's calibration (std 1 without it)."""
    z = torch.randn(n, generator=gen)
    st = lin.stats
    if st is not None and st.count > 0:
        z = z * st.sq_mean.sqrt()
    return z


class GemvTimer:
    """gemv_time(kind, n_tb, k_chunk): seconds per GEMV of one `kind` layer, with QDEC at (n_tb, k_chunk) (k_chunk
    0: the base GEMV), over several of the model's own layers in one CUDA graph."""

    def __init__(self, lm, reps: int = 20, seed: int = 0):
        from localllm.graphs import L2_FLUSH_BYTES
        from localllm.kernels import qdec
        from localllm.kernels.gemv import grid_of
        self.reps = reps
        dev = lm.model.device
        gen = torch.Generator().manual_seed(seed)
        self.sets: dict[str, list[dict]] = {}
        for kind in KINDS:
            picked, nbytes = [], 0
            for blk in lm.model.blocks:
                lin = getattr(blk, kind)
                if lin.residual is None:
                    continue
                picked.append((blk, lin))
                nbytes += lin.nbytes
                if nbytes >= L2_FLUSH_BYTES and len(picked) >= 2:
                    break
            self.sets[kind] = [self._inputs(kind, blk, lin, dev, gen) for blk, lin in picked]
        for kind, sets in self.sets.items():
            for s in sets:
                qdec.pin(s["lin"])  # once; the runtime reuses it
                s["grid"] = grid_of(s["lin"].out_features, dev)
                s["state"] = qdec.new_state(s["lin"].in_features, s["lin"].out_features, dev)
        self.part = qdec.new_part([(s["lin"].in_features, s["lin"].out_features)
                                   for sets in self.sets.values() for s in sets], dev)
        self.warm: set[str] = set()  # kinds whose layers have been replayed to the steady state

    @staticmethod
    def _inputs(kind: str, blk, lin, dev, gen) -> dict:
        """The GEMV's arguments as Block.forward passes them, with inputs whose transformed value f(x) has the
        calibration's spread (exactly for o and down, up to one scale factor for the RMSNorm kinds)."""
        K, N = lin.in_features, lin.out_features
        z = _spread(lin, K, gen)
        s = {"lin": lin, "out": torch.empty(N, dtype=torch.float16, device=dev), "norm": None, "glu": False,
             "residual": None}
        if kind in ("qkv", "gate_up"):
            norm = blk.attn_norm if kind == "qkv" else blk.mlp_norm
            w = norm.weight.float().cpu()
            x = z / torch.where(w.abs() > 1e-3, w, torch.ones_like(w))
            x = x / x.square().mean().sqrt()  # the norm undoes any scale: keep x well inside fp16
            s["norm"] = (norm.weight, norm.eps)
        elif kind == "down":
            gate = 6.0  # silu(6) = 5.985: f(x) = silu(gate) * up
            x = torch.cat([torch.full((K,), gate), z / (gate / (1 + torch.exp(torch.tensor(-gate))))])
            s["glu"] = True
        else:
            x = z
        if kind in ("o", "down"):
            s["residual"] = torch.randn(N, generator=gen).half().to(dev)
        s["x"] = x.clamp(-6e4, 6e4).half().to(dev)
        return s

    def __call__(self, kind: str, n_tb: int, k_chunk: int) -> float:
        from localllm.graphs import time_graph
        from localllm.kernels import qdec
        from localllm.kernels.gemv import gemv
        calls = []
        for s in self.sets[kind]:
            lin, comp = s["lin"], None
            if k_chunk > 0:
                comp = qdec.Call(lin.host_residual, s["state"], self.part, k_chunk, n_tb, lin.stats.b0,
                                 lin.stats.b15(k_chunk), s["grid"])
            calls.append(functools.partial(gemv, s["x"], lin.packed, out=s["out"], residual=s["residual"],
                                           norm=s["norm"], glu=s["glu"], held=lin.held, comp=comp))
        # the first point of a kind replays its layers until they reach decode's steady state (time_graph's warm_s);
        # the later points find them there, as the tuner times one point after another: a few replays do
        warm_s = WARM_S if kind in self.warm else 0.05
        self.warm.add(kind)
        return time_graph(calls, self.reps, warm_s=warm_s)


def setting(choice: Choice) -> dict:
    """The LocalModel.set_qdec argument of a tuner setting."""
    return {"mode": "approx", "k_chunk": dict(choice.k_chunk), "n_tb": dict(choice.n_tb),
            "blocks": {k: list(b) for k, b in choice.blocks.items()}}


class GpuBench:
    """tuner.tune.Bench on the GPU for a LocalModel loaded with device='cuda'."""

    def __init__(self, lm, reps: int = 20, tokens: int = 512, ctx: int = 256):
        self.lm, self.ctx = lm, min(ctx, lm.model.cfg.max_position_embeddings)
        self.gemv_time = GemvTimer(lm, reps)
        self._off = None  # the decode graph without QDEC (decode_time)
        # memos per bench, in plain dicts: a class-level functools.cache kept every tuned model (its weights, pinned
        # residuals) alive for the process's life, and one of bound methods stored on the bench made a reference
        # cycle, whose decode graph (_off) the garbage collector then destroyed at a random time, once inside
        # another capture (the capture failed: CUDA error 901)
        self._values: dict[tuple[str, int], dict[int, float] | None] = {}
        self._weights: dict[str, float | None] = {}
        self.ids, self.tokens = None, 0
        if tokens:
            from localllm.evaluate import read_text, tokenize
            self.ids = tokenize(lm, read_text(None)[0], tokens + 1)
            self.tokens = len(self.ids) - 1

    def _set(self, choice: Choice | None) -> None:
        self.lm.set_qdec("off" if choice is None else setting(choice))

    def block_order(self, kind: str, k_chunk: int) -> tuple[int, ...]:
        from .blocks import counted_rows, order
        return order(compensable(self.lm, kind), k_chunk, counted_rows(self.lm.model.cfg, kind))

    @property
    def _measured(self) -> dict | None:
        return self.lm.manifest.get("calibration", {}).get("qdec_value")

    def _kind_weight(self, kind: str) -> float | None:
        from .blocks import counted_rows, kind_weight
        if kind not in self._weights:
            measured = self._measured
            self._weights[kind] = None if measured is None else \
                kind_weight(compensable(self.lm, kind), measured, counted_rows(self.lm.model.cfg, kind))
        return self._weights[kind]

    def block_values(self, kind: str, k_chunk: int) -> dict[int, float] | None:
        """Quantize's first-order values where it recorded them, else the kind's value split by the estimate."""
        from .blocks import counted_rows, first_order, values
        if (kind, k_chunk) not in self._values:
            measured = self._measured
            fo = None if measured is None else first_order(compensable(self.lm, kind), measured, k_chunk)
            if fo is None:
                w = self._kind_weight(kind)
                fo = None if w is None else \
                    values(compensable(self.lm, kind), k_chunk, w, counted_rows(self.lm.model.cfg, kind))
            self._values[kind, k_chunk] = fo
        return self._values[kind, k_chunk]

    def decode_time(self, choice: Choice | None) -> float:
        """Median of DECODE_RUNS timings of one captured decode graph. The graph without QDEC is captured once per
        tune and timed again beside every setting (the pair's ratio is what counts); a setting's own graph once."""
        from localllm.decode import captured_decoder
        from localllm.graphs import replay_time
        self._set(choice)
        if choice is None:
            if self._off is None:
                self._off = captured_decoder(self.lm.model, ctx=self.ctx)
            dec = self._off
        else:
            dec = captured_decoder(self.lm.model, ctx=self.ctx)
        return statistics.median(replay_time(dec.graph, DECODE_REPS) for _ in range(DECODE_RUNS))

    def perplexity(self, choice: Choice | None) -> float:
        from localllm.evaluate import perplexity
        self._set(choice)
        limit = self.lm.model.cfg.max_position_embeddings
        return perplexity(self.lm, self.ids, ctx=min(512, limit, len(self.ids) - 1), desc="tune: perplexity")
