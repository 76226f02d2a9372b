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

import torch

from localllm import bench, graphs
from localllm.kernels import cuda
from localllm.kernels import gemv as gemv_mod

DEPTHS = (2, 3, 4, 5, 6)
MODES = ("plain", "early, wait to write", "early, wait to read")  # kernels/bandwidth.cu read_stream's modes


def build(loads_only: bool) -> None:
    """gemv.cu from now on: with or without the math (any ring depth instantiates by name)."""
    cuda.BUILD["gemv"] = (("-DGEMV_LOADS_ONLY",) if loads_only else (), "")


def read_percent(nbytes: int, bw: float) -> dict[str, tuple[float, str]]:
    """Per launch mode: a plain read's best % of copy bandwidth over its grids (bench.plain_read), and that grid
    (blocks per SM x threads)."""
    bufs = [torch.empty(-(-nbytes // 16) * 16, dtype=torch.uint8, device="cuda").random_()
            for _ in range(bench._copies(nbytes))]
    best = {}
    for mode, label in enumerate(MODES):
        t, grid = bench.plain_read(bufs, mode)
        best[label] = (100 * nbytes / t / bw, grid)
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
    if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0)
    if why := cuda.unusable():
        sys.exit(f"gemv_bound.py times the GEMV on a GPU, and cannot here: {why}")
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2, (sys.argv[2] if len(sys.argv) > 2 else "o,down").split(","))
