"""How far the GEMV's weight stream alone can take o and down (issue 3's W3 rows): the kernel with its math switched
off (GEMV_LOADS_ONLY: the copies, their waits, the staging of x and the tile barriers stay; the decode, the mma and the
sums go), beside the kernel as it is, at ring depths 2-6, W4 and W3, % of copy bandwidth, as `localllm bench gemv`
times them, in one run. Where the loads alone stay below a target at every depth, no math on top can reach it.

Beside them, the bound of any kernel at that size: a plain read of the same number of bytes (16-byte streaming loads,
8 in flight per thread, the best of six grid shapes), back to back on distinct copies as the GEMVs are,
launched three ways: plain; early (programmatic dependent launch) and waiting for its predecessor only before its
one write, as a GEMV may stream weights before x is ready; early and waiting before its reads.

    python3 scripts/gemv_bound.py [ROUNDS] [SHAPES]      e.g.  2 o,down

On the device machine, install the package first. The loads-only outputs are meaningless; only their times count.
"""
import sys

import numpy as np
import torch

from localllm import bench, graphs
from localllm.kernels import cuda
from localllm.kernels import gemv as gemv_mod

DEPTHS = (2, 3, 4, 5, 6)
READ_UNROLL = 8  # 16-byte loads a thread keeps in flight (47 registers)
READ = """
// a plain read of n16 16-byte words; mode 0: plain launch, 1: early, waits for the previous kernel before its write,
// 2: early, waits before its reads. Writes only if the words' XOR hits a constant (so that the loads stay).
extern "C" __global__ void __launch_bounds__(1024, 1) read_stream(const uint4* __restrict__ p, unsigned long long n16,
                                                                  unsigned* out, int mode) {
    if (mode) start_next();
    if (mode == 2) wait_previous();
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned acc = 0;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n16;
         i += READ_UNROLL * stride) {
        uint4 v[READ_UNROLL];
#pragma unroll
        for (int u = 0; u < READ_UNROLL; u++)  // past the end: the last word again (no branch between the loads)
            v[u] = __ldcs(p + min(i + u * stride, n16 - 1));
#pragma unroll
        for (int u = 0; u < READ_UNROLL; u++) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (mode == 1) wait_previous();
    if (acc == 0x9E3779B9u) out[blockIdx.x] = acc;
}
"""
READ_THREADS = (256, 512, 1024)  # per block; the grid: one block per SM, or as many as fit at once
MODES = ("plain", "early, wait to write", "early, wait to read")


def build(loads_only: bool) -> None:
    """gemv.cu from now on: the plain read beside the GEMV (any ring depth instantiates by name), with or without
    the math."""
    cuda.BUILD["gemv"] = (("-DGEMV_LOADS_ONLY",) if loads_only else (), f"#define READ_UNROLL {READ_UNROLL}\n" + READ)


def read_percent(nbytes: int, bw: float) -> dict[str, tuple[float, str]]:
    """Per launch mode: the plain read's best % of copy bandwidth over its grids, and that grid (blocks per SM x
    threads)."""
    build(False)
    func = cuda.kernel("gemv", "read_stream")
    n16 = -(-nbytes // 16)
    bufs = [torch.empty(n16 * 16, dtype=torch.uint8, device="cuda").random_() for _ in range(bench._copies(nbytes))]
    out = torch.empty(8 * 1024, dtype=torch.int32, device="cuda")
    dev = torch.cuda.current_device()
    sm = cuda.sm_count(dev)
    best = {}
    for mode, label in enumerate(MODES):
        for threads in READ_THREADS:
            for per_sm in sorted({1, cuda.resident_blocks(dev, threads, func.num_regs, 1024)}):
                t = graphs.time_graph([lambda b=b: cuda.launch(
                    func, (per_sm * sm,), (threads,), (cuda.ptr(b), np.uint64(n16), cuda.ptr(out), np.int32(mode)),
                    early=mode > 0) for b in bufs])
                pct = 100 * nbytes / t / bw
                if pct > best.get(label, (0.0, ""))[0]:
                    best[label] = (pct, f"{per_sm}x{threads}")
    return best


def main(rounds: int, shapes: list[str]) -> None:
    bw = bench.copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; % of it, one value per round; columns: ring depth (pairs per warp)")
    rows, reads = {}, {}
    for r in range(rounds):
        for bits in (3, 4):
            for name in shapes:
                N, K = bench.LLAMA3_8B[name]
                sets, nbytes = bench.gemv_sets(N, K, bits, 128)
                x = torch.randn(K, device="cuda").half()
                for label, (pct, grid) in read_percent(nbytes, bw).items():
                    print(f"round {r + 1}: {name} W{bits} plain read, {label}: {pct:.1f} ({grid})", flush=True)
                    reads.setdefault((f"{name} W{bits}", label), []).append(f"{pct:.1f}")
                for loads_only in (True, False):
                    build(loads_only)
                    key = (f"{name} W{bits}", "loads only" if loads_only else "GEMV")
                    for d in DEPTHS:
                        t = graphs.time_graph([lambda s=s, d=d: gemv_mod.gemv(x, s[0], out=s[1], variant=(16, d, 1))
                                              for s in sets])
                        rows.setdefault(key, {}).setdefault(d, []).append(f"{100 * nbytes / t / bw:.1f}")
                    print(f"round {r + 1}: {key[0]} {key[1]}: " + " ".join(rows[key][d][-1] for d in DEPTHS),
                          flush=True)
                del sets
    print(f"{'shape':10} {'kernel':10} " + " ".join(f"{d:>11}" for d in DEPTHS))
    for (shape, kind), by_depth in rows.items():
        print(f"{shape:10} {kind:10} " + " ".join(f"{'/'.join(by_depth[d]):>11}" for d in DEPTHS))
    print("plain read of the same bytes, % of copy bandwidth, one value per round:")
    for (shape, label), vals in reads.items():
        print(f"{shape:10} {label:22} {'/'.join(vals)}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2, (sys.argv[2] if len(sys.argv) > 2 else "o,down").split(","))
