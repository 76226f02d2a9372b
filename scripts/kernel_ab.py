"""A/B timing of kernel changes on the GPU: the tree's kernels/ against copies of it with a change (folders holding
every .cu and .cuh, e.g. scratch/ef/), alternating in one process so that each round compares them on the same
machine and clock. Prints one row per measurement, one column per build, every round's value side by side.

    python3 scripts/kernel_ab.py scratch/a,scratch/b ROUNDS [ROWS]

ROWS (comma-separated, default all but qdec3): qkv, o, gate_up, down (8B shapes, W4 and W3, % of copy bandwidth,
as `localllm bench gemv`, and in the first round each build's max |y - ref| / max |ref| against float64 on the tree's
dequantized weights, fp16 rounding being ~5e-4), down+glu (down staging SwiGLU of [gate | up]), decode3 / decode4 (the 8B-shaped decode
step with the 8-bit head, ms), qdec3 (the W3 step with QDEC at k_chunk 8 on every layer, ms). On the device machine,
carry the folders (`run`'s carry) and install the package first.
"""
import sys
from pathlib import Path

import torch

from localllm import bench, graphs, ops, synthetic
from localllm.config import ModelConfig
from localllm.kernels import cuda
from localllm.kernels.gemv import dequantize, gemv

TREE = cuda.HERE
ROWS = "qkv,o,gate_up,down,down+glu,decode3,decode4"


def use(build: str) -> None:
    """Compile kernels from `build` from now on (the tree's folder for 'tree')."""
    cuda.HERE = TREE if build == "tree" else Path(build).resolve()
    cuda.forget()


def main(argv: list[str]) -> None:
    builds = ["tree"] + argv[0].split(",")
    for b in builds[1:]:
        if not (Path(b) / "gemv.cu").is_file():
            sys.exit(f"{b}: no gemv.cu there; pass folders holding a copy of kernels/*.cu and *.cuh")
    rounds = int(argv[1])
    rows = (argv[2] if len(argv) > 2 else ROWS).split(",")
    cfg = ModelConfig(**synthetic.LLAMA3_8B_CONFIG)
    bw = bench.copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    res: dict[tuple[str, str], list[str]] = {}
    models = {}
    for r in range(rounds):
        for name in rows:
            if name in ("decode3", "decode4", "qdec3"):
                if name not in models:
                    if name == "qdec3":
                        models[name] = synthetic.random_local_model(cfg, 3, copies=1)
                        models[name].set_qdec(8)
                    else:
                        models[name] = synthetic.random_model(cfg, int(name[-1]), head_bits=8)
                model = getattr(models[name], "model", models[name])
                for b in builds:
                    use(b)
                    res.setdefault((name, b), []).append(f"{bench.decode_time(model) * 1e3:.3f}ms")
                continue
            glu = name.endswith("+glu")
            N, K = bench.LLAMA3_8B[name.removesuffix("+glu")]
            for bits in (4, 3):
                sets, nbytes = bench.gemv_sets(N, K, bits, 128)
                x = torch.randn(2 * K if glu else K, device="cuda").half()
                if r == 0:  # each build's output against float64 on the tree's dequantized weights, once
                    use("tree")
                    xf = ops.silu_mul(x.double()) if glu else x.double()
                    ref = dequantize(sets[0][0]).double() @ xf
                    for b in builds:
                        use(b)
                        y = gemv(x, sets[0][0], glu=glu).double()
                        err = ((y - ref).abs().max() / ref.abs().max()).item()
                        res.setdefault((f"{name} W{bits} err", b), []).append(f"{err:.1e}")
                for b in builds:
                    use(b)
                    t = graphs.time_graph([lambda s=s: gemv(x, s[0], out=s[1], glu=glu) for s in sets])
                    res.setdefault((f"{name} W{bits}", b), []).append(f"{100 * nbytes / t / bw:.1f}")
                del sets
        print(f"round {r + 1} done", flush=True)
    width = max(24, *(len(b) for b in builds))
    print(f"{'row':14} " + " ".join(f"{b:>{width}}" for b in builds))
    for k in dict.fromkeys(k for k, _ in res):
        print(f"{k:14} " + " ".join(f"{' '.join(res[(k, b)]):>{width}}" for b in builds))


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1:])
