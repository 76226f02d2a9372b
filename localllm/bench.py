"""`localllm bench`: GPU benchmarks that print tables (times inside CUDA graphs, ratios to measured ceilings).

Speed targets live here, never in unit tests. Every table row is measured in the same run as the ceiling it
is compared with.
"""
from __future__ import annotations

import statistics

import torch

from .errors import LocalLLMError

LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
L2_FLUSH_BYTES = 256 << 20  # rotate among weight copies totalling more than this, so L2 cannot serve them


def time_graph(calls: list, reps: int = 20) -> float:
    """Seconds per call: the calls captured once in a CUDA graph, replayed `reps` times, median replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:  # warm-up outside the graph: compiles kernels, allocates outputs
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times) / len(calls)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / time_graph([lambda: dst.copy_(src)] * 4)


def _copies(one_bytes: int) -> int:
    return max(2, -(-L2_FLUSH_BYTES // one_bytes))


def bench_gemv(bits_list=(4, 3, 2), group_size: int = 128) -> list[dict]:
    from .kernels.gemv import gemv
    from .quant import pack_codes
    bw = copy_bandwidth()
    rows = []
    for name, (N, K) in LLAMA3_8B.items():
        x = torch.randn(K, device="cuda").half()
        w16 = torch.randn(N, K, device="cuda").half()
        fp16_bytes = N * K * 2
        ws = [w16] + [torch.randn_like(w16) for _ in range(_copies(fp16_bytes) - 1)]
        t16 = time_graph([lambda w=w: torch.mv(w, x) for w in ws])
        del ws, w16
        for bits in bits_list:
            G = -(-K // group_size)
            sets = []
            for _ in range(_copies(N * K * bits // 8)):
                q = pack_codes(torch.randint(0, 2**bits, (N, K), device="cuda"), bits)
                sets.append((q, torch.rand(N, G, device="cuda").half(),
                             torch.randint(0, 2**bits, (N, G), device="cuda", dtype=torch.uint8),
                             torch.empty(N, device="cuda", dtype=torch.float16)))
            t = time_graph([lambda s=s: gemv(x, s[0], s[1], s[2], bits, group_size, out=s[3]) for s in sets])
            nbytes = N * K * bits // 8 + N * G * 3 + K * 2 + N * 2
            rows.append({"layer": name, "N": N, "K": K, "bits": bits, "us": t * 1e6, "GB/s": nbytes / t / 1e9,
                         "of_copy_bw": nbytes / t / bw, "fp16_us": t16 * 1e6, "speedup_vs_fp16": t16 / t})
            del sets
    print(f"\nLow-bit GEMV, batch 1, group size {group_size}, inside CUDA graphs "
          f"(measured copy bandwidth {bw / 1e9:.0f} GB/s)")
    print(f"{'layer':8} {'N x K':>13} {'bits':>4} {'time us':>8} {'GB/s':>7} {'% copy bw':>9} "
          f"{'fp16 us':>8} {'vs fp16':>7}")
    for r in rows:
        print(f"{r['layer']:8} {r['N']:>6}x{r['K']:<6} {r['bits']:>4} {r['us']:8.2f} {r['GB/s']:7.0f} "
              f"{100 * r['of_copy_bw']:8.1f}% {r['fp16_us']:8.2f} {r['speedup_vs_fp16']:6.2f}x")
    return rows


def main(argv: list[str] | None = None) -> None:
    if not torch.cuda.is_available():
        raise LocalLLMError("localllm bench measures the GPU kernels and needs a CUDA GPU; none is visible")
    print(f"device: {torch.cuda.get_device_name()}")
    bench_gemv()


if __name__ == "__main__":
    main()
