"""How fast a few SMs read scattered rows of pinned host memory (zero-copy), idle and under a saturating HBM stream
on the other SMs: 4-, 8-, 16-byte loads (v1, v5, v2), the bulk-copy engine into shared memory (v3, sm_90) and
16-byte cp.async (v4). kernels/NOTES.md (q5) has the H100's table and what did and did not carry over to the GEMV.

python scripts/zero_copy_bench.py   (on a GPU machine)
"""
from pathlib import Path

import cupy
import numpy as np
import torch

src = open(Path(__file__).with_suffix(".cu")).read()
names = [f"zc<{v}>" for v in (1, 2, 3, 4, 5, 6)]
mod = cupy.RawModule(code=src, options=("-std=c++17", "--gpu-architecture=sm_90"), name_expressions=names)
SM = torch.cuda.get_device_properties(0).multi_processor_count
HOST = torch.randint(0, 255, (512 << 20,), dtype=torch.uint8).pin_memory()  # 512 MB pinned
hbm = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # 64 MB: ~27 us of streaming
sink = torch.zeros(8, dtype=torch.int32, device="cuda")
marks = torch.zeros(2 * SM, dtype=torch.int64, device="cuda")
T = 640
def run(var, nrows, row_bytes, nf, load, reps=15):
    k = mod.get_function(f"zc<{var}>")
    smem = 200 * 1024 if var in (3, 4) else 0
    if smem: k.max_dynamic_shared_size_bytes = smem
    fet, tot = [], []
    for _ in range(reps):
        rows = torch.randperm(len(HOST) // row_bytes)[:nrows].int().cuda()
        k((SM,), (T,), (HOST.data_ptr(), rows.data_ptr(), np.int32(nrows), np.int32(row_bytes), np.int32(nf),
                        hbm.data_ptr(), np.uint64(hbm.numel() // 16), np.int32(load), sink.data_ptr(), marks.data_ptr()),
          shared_mem=smem)
        torch.cuda.synchronize()
        m = marks.view(SM, 2).cpu().numpy().astype(np.int64)
        t0 = m[:, 0].min()
        fet.append((m[:nf, 1].max() - t0) / 1e3)
        tot.append((m[nf:, 1].max() - t0) / 1e3)
    return np.median(fet), np.median(tot)

def run_segments(nrows, row_bytes, stream_bytes, reps=25):
    """v6: every SM reads its own segment of every row, and streams its share of `stream_bytes` of HBM while the
    reads are out. Returns (fetch alone, stream alone, both), us from kernel start to the last block's end."""
    k = mod.get_function("zc<6>")
    out = []
    for n, load in ((nrows, 0), (0, 1), (nrows, 1)):
        ts = []
        for _ in range(reps):
            rows = torch.randperm(len(HOST) // row_bytes)[:max(n, 1)].int().cuda()
            k((SM,), (T,), (HOST.data_ptr(), rows.data_ptr(), np.int32(n), np.int32(row_bytes), np.int32(SM),
                            hbm.data_ptr(), np.uint64(stream_bytes // 16), np.int32(load), sink.data_ptr(),
                            marks.data_ptr()))
            torch.cuda.synchronize()
            m = marks.view(SM, 2).cpu().numpy().astype(np.int64)
            ts.append((m[:, 1].max() - m[:, 0].min()) / 1e3)
        out.append(float(np.median(ts)))
    return out


print("v6, every SM reads its segment of every row (a GEMV block's own outputs), under its own HBM stream of the")
print("layer's W3 weight bytes; us from kernel start to the last block's end")
print(f"{'case':22}{'rows x bytes':>16}{'fetch alone':>13}{'stream alone':>14}{'both':>8}{'added':>8}")
for name, nrows, rb, mb in [("qkv k8", 32, 3072, 9.4), ("o k8", 32, 2048, 6.3), ("gate_up k8", 32, 14336, 44.0),
                            ("down k8", 112, 2048, 22.0), ("qkv k32", 128, 3072, 9.4), ("o k32", 128, 2048, 6.3),
                            ("gate_up k32", 128, 14336, 44.0), ("down k32", 448, 2048, 22.0)]:
    f, st, both = run_segments(nrows, rb, int(mb * 1e6))
    print(f"{name:22}{nrows:>8} x {rb:5}{f:13.2f}{st:14.2f}{both:8.2f}{both - st:+8.2f}", flush=True)
print()
print("fetch time (us, kernel start -> last fetch block end), idle | with HBM load; GB/s at load")
cases = [(1, 128, 1), (8, 2048, 4), (32, 2048, 4), (32, 2048, 16), (32, 3072, 4), (32, 3072, 16), (112, 2048, 14),
         (112, 2048, 28), (32, 14336, 4), (32, 14336, 16), (128, 14336, 32)]
print(f"{'rows x bytes, nf':24}" + "".join(f"{'v'+str(v):>22}" for v in (1, 5, 2, 3, 4)))
for nrows, rb, nf in cases:
    line = f"{nrows:4} x {rb:5}, nf {nf:3}       "
    for v in (1, 5, 2, 3, 4):
        if v == 3 and nrows * rb / nf > 190 * 1024 or v == 4 and -(-nrows * rb // (nf * T * 16)) * T * 16 > 200 * 1024:
            line += f"{'-':>22}"; continue
        fi, _ = run(v, nrows, rb, nf, 0)
        fl, st = run(v, nrows, rb, nf, 1)
        line += f"  {fi:5.2f} | {fl:5.2f} {nrows*rb/fl/1e3:5.1f}GB/s"
    print(line, flush=True)
_, st = run(1, 1, 128, 1, 1)
print(f"HBM stream alone (64 MB over {SM-1} blocks): {st:.2f} us")
