"""CUDA graphs: capture after an eager warm-up, and timing by replay (the benchmarks' and the tuner's clock)."""
from __future__ import annotations

import contextlib
import gc
import statistics
import time
from typing import Callable, Iterator

import torch

L2_FLUSH_BYTES = 256 << 20  # rotate among weight copies totalling more than this, so L2 cannot serve them


def capture(run: Callable, after_warmup: Callable | None = None) -> tuple[torch.cuda.CUDAGraph, object]:
    """run captured as a CUDA graph, and what the captured run returned. run is first called once on a side stream:
    kernel compilation and allocations stay out of the graph; after_warmup may undo what that call changed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    if after_warmup is not None:
        after_warmup()
    g = torch.cuda.CUDAGraph()
    # No garbage collection while capturing: a dead object's graph destroyed mid-capture ends the capture (CUDA error
    # 901 at the next launch; seen in `bench tune`, whose previous tune left a cycle holding a decode graph). Other
    # threads (the chat UI's) may call the CUDA API meanwhile: thread_local keeps their calls out of this capture.
    with gc_paused(), torch.cuda.graph(g, capture_error_mode="thread_local"):
        out = run()
    return g, out


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No automatic garbage collection inside (as it was before, on or off, after)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def time_graph(calls: list, reps: int = 20, warm_s: float = 0.05) -> float:
    """Seconds per call: the calls captured once in a CUDA graph, replayed for warm_s untimed, then `reps` times;
    the median replay. The untimed replays reach the steady state that decode runs in: on the H100 the first timing of
    freshly made 4096x28672 weights gave 79% of copy bandwidth, a second one of the same weights 88%."""
    g, _ = capture(lambda: [c() for c in calls])
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warm_s:
        g.replay()
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times) / len(calls)


def replay_time(graph: torch.cuda.CUDAGraph, reps: int = 200, warmup: int = 20) -> float:
    """Seconds per replay of graph, after `warmup` untimed ones (the first replays after a model is built read
    ~1% slower: steady decoding is what is measured)."""
    for _ in range(warmup):
        graph.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for i in range(reps):
        graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / reps
