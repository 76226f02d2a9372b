"""Where a QDEC GEMV's time goes: globaltimer stamps of each block's phases (kernels/qdec.cuh, QDEC_MARKS build).

python scripts/qdec_timeline.py [layer] [bits] [k_chunk,...] [n_tb,...] [fused]   e.g.  qkv 3 0,2,8,32 4,8
(n_tb default: qdec.default_n_tb and the largest viable one; n_tb "-" for the default. k_chunk 0: the plain GEMV, no
QDEC. fused: the input transform decode applies, RMSNorm for qkv and gate_up, SwiGLU for down; else plain x)

python scripts/qdec_timeline.py [layer] [bits] chain   e.g.  o 3 chain
the plain GEMV as `bench gemv` times it: 8 calls on distinct weight copies back to back in one CUDA graph (early
launches), each call's phases after the previous call's last block ended (kernels/NOTES.md, session 25)
"""
import os
import sys

import numpy as np
import torch

from localllm.kernels import cuda, qdec
from localllm.kernels.gemv import gemv, grid_of
from localllm.bench import LLAMA3_8B, gemv_sets, random_packed
from localllm.quant import QuantResidual

cuda.BUILD["gemv"] = (("-DQDEC_MARKS", *os.environ.get("QDEC_FLAGS", "").split()), "")  # the phase stamps
layer = sys.argv[1] if len(sys.argv) > 1 else "qkv"
bits = int(sys.argv[2]) if len(sys.argv) > 2 else 3
chain_mode = sys.argv[3:4] == ["chain"]
ks = [] if chain_mode else [int(k) for k in (sys.argv[3] if len(sys.argv) > 3 else "2,8,32").split(",")]
fused = len(sys.argv) > 5 and sys.argv[5] == "fused"
N, K = LLAMA3_8B[layer]
sets, _ = gemv_sets(N, K, bits, 128)
w, out = sets[0]
x = torch.randn(K, device="cuda").half()
kw = {}
if fused and layer == "down":
    kw = {"glu": True}
elif fused and layer in ("qkv", "gate_up"):
    kw = {"norm": (torch.rand(K, device="cuda") + 0.5, 1e-5)}
xin = torch.randn(2 * K, device="cuda").half() if kw.get("glu") else x
grid = grid_of(N, torch.device("cuda"))
res = qdec.HostResidual.pin(QuantResidual(torch.randint(-2**31, 2**31 - 1, (K, N // 8), dtype=torch.int32),
                                          (torch.rand(N) * 0.01).half()))
part = qdec.new_part([(K, N)], "cuda")
names = ["start", "x ready", "staged", "selected", "fetched", "flagged", "streamed", "flags seen", "end",
         "tiles 1-4 done", "select: A", "select: B", "fetch: start", "word 1 landed", "round landed", "pair 1 landed"]
FETCH_ONLY = (3, 4, 5, 10, 11, 12, 13, 14)


def stamps(name: str, mod):
    """The marked module's device array `name`: qdec_marks [slot, block, mark] (uint64) or qdec_mark_calls [block]."""
    import cupy
    return cupy.ndarray((8, 1024, 16) if name == "qdec_marks" else (1024,),
                        dtype=cupy.uint64 if name == "qdec_marks" else cupy.uint32, memptr=mod.get_global(name))


def zero_calls() -> None:
    """Zero every compiled gemv instance's call counters (each kernel instance is its own module)."""
    for mod in cuda.modules("gemv"):
        stamps("qdec_mark_calls", mod).fill(0)


def stamped():
    """The marks of the one gemv instance that ran since zero_calls()."""
    ran = [mod for mod in cuda.modules("gemv") if int(stamps("qdec_mark_calls", mod).sum()) > 0]
    assert len(ran) == 1, f"{len(ran)} gemv instances stamped; expected one"
    return stamps("qdec_marks", ran[0])


def run(call, times=5):
    """call() `times` times, the last one stamped into slot 0 (qdec_mark_calls zeroed before it)."""
    for _ in range(times - 1):
        call()
    torch.cuda.synchronize()
    zero_calls()
    call()
    torch.cuda.synchronize()


def marks(blocks):
    m = stamped()[0, :blocks].get()
    m = m.astype(np.int64)
    return (m - m[:, 0].min()) / 1e3  # us since the first block started


CHAIN = ("start", "x ready", "staged", "pair 1 landed", "tiles 1-4 done", "streamed", "end")


def chain(calls: int = 8) -> None:
    ws = [(random_packed(N, K, bits, 128), torch.empty(N, device="cuda", dtype=torch.float16)) for _ in range(calls)]
    for wc, oc in ws:  # compile, allocate
        gemv(x, wc, out=oc)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for wc, oc in ws:
            gemv(x, wc, out=oc)
    for _ in range(200):
        g.replay()
    torch.cuda.synchronize()
    zero_calls()  # the next replay's call c stamps slot c
    g.replay()
    torch.cuda.synchronize()
    m = stamped()[:calls, :grid].get().astype(np.int64)
    print(f"\n{layer} W{bits}, {calls} calls in one graph: calls 2-{calls - 1}, us after the previous call's last "
          "block ended, median / min / max over the blocks (the stamps cost ~0.7 us per call)")
    for nm in CHAIN:
        i = names.index(nm)
        a = np.concatenate([(m[c, :, i] - m[c - 1, :, 8].max()) / 1e3 for c in range(2, calls)])
        print(f"  {nm:13} {np.median(a):7.2f} {a.min():7.2f} {a.max():7.2f}")
    per = np.median([(m[c, :, 8].max() - m[c - 1, :, 8].max()) / 1e3 for c in range(2, calls)])
    print(f"  last end to last end: {per:.2f} us per call")


if chain_mode:
    chain()
for k in ks:
    if k == 0:  # the plain GEMV: its phases over all blocks (pair 1 landed: warp 0's first pair, first tile only)
        run(lambda: gemv(xin, w, out=out, **kw))
        rel = marks(grid)
        print(f"\n{layer} W{bits} plain GEMV{' (fused input)' if kw else ''}: us since the first block's start, "
              "median / max over the blocks")
        for i in (0, 1, 15, 2, 9, 6, 8):
            print(f"  {names[i]:13} {np.median(rel[:, i]):7.2f} {rel[:, i].max():7.2f}")
        continue
    n_tbs = [int(n) for n in sys.argv[4].split(",")] if len(sys.argv) > 4 and sys.argv[4] != "-" else \
        sorted({qdec.default_n_tb(K, N, grid, k), qdec.viable_n_tb(K, N, grid)[-1]})
    for n_tb in n_tbs:
        a = x.float().abs()
        comp = qdec.Call(res, qdec.new_state(K, N, "cuda"), part, k, n_tb, float(a.max()),
                         float(a[:1024].topk(k).values[-1]), grid)
        run(lambda: gemv(xin, w, out=out, comp=comp, **kw))
        rel = marks(grid)
        print(f"\n{layer} W{bits} k_chunk={k} n_tb={n_tb}: us since the first block's start, median / max over "
              "the fetching blocks | the others")
        for i, nm in enumerate(names):
            f, o = rel[:n_tb, i], rel[n_tb:, i]
            other = "" if i in FETCH_ONLY or not len(o) else f" | {np.median(o):7.2f} {o.max():7.2f}"
            print(f"  {nm:11} {np.median(f):7.2f} {f.max():7.2f}{other}")
