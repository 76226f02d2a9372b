"""How far the GEMV's weight stream alone can take o and down (issue 3's W3 rows): the kernel with its math switched
off (GEMV_LOADS_ONLY: the copies, their waits, the staging of x and the tile barriers stay; the decode, the mma and the
sums go), beside the kernel as it is, at ring depths 2-6, W4 and W3, % of copy bandwidth, as `localllm bench gemv`
times them, in one run. Where the loads alone stay below a target at every depth, no math on top can reach it.

    python3 scripts/gemv_bound.py [ROUNDS] [SHAPES]      e.g.  2 o,down

On the device machine, install the package first. The loads-only outputs are meaningless; only their times count.
"""
import functools
import sys

import torch

from localllm import bench
from localllm.kernels import cuda
from localllm.kernels import gemv as gemv_mod

DEPTHS = (2, 3, 4, 5, 6)
GS = 1  # gemv.cu's GSHIFT of group size 128, what bench gemv times
EXTRA = [(b, d) for b in (3, 4) for d in DEPTHS if d != 3]  # (bits, depth) beyond the tree's: depth 3 is compiled
loads_only = False


@functools.cache
def _module(name, device, names, loads):
    import cupy
    code = cuda.source(name)
    if name == "gemv":  # the extra ring depths, instantiated after the tree's own
        code += "".join(f"INST({b}, 16, {d}, {GS}, 0)\n" for b, d in EXTRA)
    with cupy.cuda.Device(device):
        mod = cupy.RawModule(code=code, name_expressions=list(names),
                             options=(*cuda.options(device), *(("-DGEMV_LOADS_ONLY",) if loads else ())))
        mod.compile()
        return mod


cuda.module = lambda name, device, names: _module(name, device, names, loads_only)
gemv_mod.NAMES = gemv_mod.NAMES + tuple(f"gemv<{b},16,{d},{GS},0,false>" for b, d in EXTRA)


def main(rounds: int, shapes: list[str]) -> None:
    global loads_only
    bw = bench.copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; % of it, one value per round; columns: ring depth (pairs per warp)")
    rows = {}
    for r in range(rounds):
        for bits in (3, 4):
            for name in shapes:
                N, K = bench.LLAMA3_8B[name]
                sets, nbytes = bench.gemv_sets(N, K, bits, 128)
                x = torch.randn(K, device="cuda").half()
                for loads_only in (True, False):
                    key = (f"{name} W{bits}", "loads only" if loads_only else "GEMV")
                    for d in DEPTHS:
                        t = bench.time_graph([lambda s=s, d=d: gemv_mod.gemv(x, s[0], out=s[1], variant=(16, d))
                                              for s in sets])
                        rows.setdefault(key, {}).setdefault(d, []).append(f"{100 * nbytes / t / bw:.1f}")
                    print(f"round {r + 1}: {key[0]} {key[1]}: " + " ".join(rows[key][d][-1] for d in DEPTHS),
                          flush=True)
                del sets
    print(f"{'shape':10} {'kernel':10} " + " ".join(f"{d:>11}" for d in DEPTHS))
    for (shape, kind), by_depth in rows.items():
        print(f"{shape:10} {kind:10} " + " ".join(f"{'/'.join(by_depth[d]):>11}" for d in DEPTHS))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2, (sys.argv[2] if len(sys.argv) > 2 else "o,down").split(","))
