"""`localllm bench`: GPU benchmarks that print tables (times inside CUDA graphs, ratios to measured ceilings).

Speed targets live here, never in unit tests. Every table row is measured in the same run as the ceiling it
is compared with.
"""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from .decode import Decoder, captured_decoder
from .errors import LocalLLMError
from .graphs import L2_FLUSH_BYTES, replay_time, time_graph
from .synthetic import LLAMA3_8B_CONFIG, random_local_model, random_lut, random_model, random_quant

LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device memory copy bandwidth in bytes/s, counting bytes read plus written: the faster of a cudaMemcpy (torch's
    copy_) and an elementwise kernel (torch.add(src, 0, out=dst)). In a CUDA graph a 1 GiB cudaMemcpy is not the
    memory's bound: on the H200 it moved 2.76 TB/s where the elementwise kernel moved 4.27 (a 256 MiB cudaMemcpy,
    4.18); until 2026-11-30 the benchmarks divided by the cudaMemcpy alone (H100: 2.43 TB/s, where the shared
    note's copy measured 2.97), so their percentages before then are 1.2x (H100) to 1.55x (H200) too high."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    return max(2 * nbytes / time_graph([call] * 4)
               for call in (lambda: dst.copy_(src), lambda: torch.add(src, 0, out=dst)))


def read_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device memory read bandwidth in bytes/s: a plain read of 1 GiB (plain_read), what a weight stream can reach at
    most. H200: 4.5 TB/s, where torch's fp16 sum, which the benchmarks divided by until 2026-11-30, reads 4.16."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    return nbytes / plain_read([buf])[0]


def plain_read(bufs: list[torch.Tensor], mode: int = 0) -> tuple[float, str]:
    """Seconds per read of one of bufs (equal byte sizes, read in turn inside a CUDA graph, so that several defeat L2)
    by kernels/bandwidth.cu's read_stream launched as `mode` says (0 plain; 1, 2 early: see there), at the fastest of
    its grids, and that grid (blocks per SM x threads)."""
    from .kernels import cuda
    func = cuda.kernel("bandwidth", "read_stream")
    n16 = -(-bufs[0].numel() * bufs[0].element_size() // 16)
    out = torch.empty(8 * 1024, dtype=torch.int32, device="cuda")
    dev = torch.cuda.current_device()
    sm = cuda.sm_count(dev)
    best = (float("inf"), "")
    for threads in (256, 512, 1024):
        for per_sm in sorted({1, cuda.resident_blocks(dev, threads, func.num_regs, 1024)}):
            t = time_graph([lambda b=b: cuda.launch(
                func, (per_sm * sm,), (threads,), (cuda.ptr(b), np.uint64(n16), cuda.ptr(out), np.int32(mode)),
                early=mode > 0) for b in bufs])
            best = min(best, (t, f"{per_sm}x{threads}"))
    return best


def _copies(one_bytes: int) -> int:
    return max(2, -(-L2_FLUSH_BYTES // one_bytes))


def random_packed(N: int, K: int, bits: int, group_size: int):
    """A random GPU weight (kernels.gemv.Packed) of N x K."""
    from .kernels.gemv import Packed
    return Packed.from_quant(random_quant(N, K, bits, group_size, "cuda"))


def gemv_sets(N: int, K: int, bits: int, group_size: int) -> tuple[list, int]:
    """Enough random (Packed weight, output) pairs to defeat L2, and the bytes one GEMV moves."""
    sets = [(random_packed(N, K, bits, group_size), torch.empty(N, device="cuda", dtype=torch.float16))
            for _ in range(_copies(N * K * bits // 8))]
    return sets, sets[0][0].nbytes + K * 2 + N * 2


def gemv_sweep(group_size: int = 128, blocks_per_sm=(1, 2)) -> None:
    """Time each compiled (warps, depth, pairs per slot) variant of the GEMV at several grid sizes on the 8B shapes,
    W4 and W3 (-: the variant does not fit the shape); the smaller ones are what a GPU short of shared memory runs."""
    from .kernels.gemv import SMALLER_VARIANTS, VARIANTS, fits, gemv
    bw = copy_bandwidth()
    cols = [(v, b) for v in dict.fromkeys(VARIANTS + SMALLER_VARIANTS) for b in blocks_per_sm]
    print(f"\nGEMV variants, % of copy bandwidth ({bw / 1e9:.0f} GB/s); columns: (warps, ring depth, pairs per slot)/"
          "blocks per SM")
    print(f"{'layer':8} {'bits':>4} " + " ".join(f"{f'{v[0]},{v[1]},{v[2]}/{b}':>9}" for v, b in cols))
    for name, (N, K) in LLAMA3_8B.items():
        x = torch.randn(K, device="cuda").half()
        for bits in (4, 3):
            sets, nbytes = gemv_sets(N, K, bits, group_size)
            cells = []
            for v, b in cols:
                if not fits(v, K, group_size):
                    cells.append(f"{'-':>9}")
                    continue
                t = time_graph([lambda s=s, v=v, b=b: gemv(x, s[0], out=s[1], variant=v, blocks_per_sm=b)
                                for s in sets])
                cells.append(f"{100 * nbytes / t / bw:8.1f}%")
            print(f"{name:8} {bits:>4} " + " ".join(cells))
            del sets


def bench_gemv(bits_list=(4, 3, 2), group_size: int = 128) -> list[dict]:
    from .kernels.gemv import gemv
    from .quant import HEAD_BITS
    bw, rd = copy_bandwidth(), read_bandwidth()
    rows = []
    # the block projections at bits_list, and the output head at the 8 bits `localllm quantize` writes
    shapes = [(name, N, K, bits_list) for name, (N, K) in LLAMA3_8B.items()] + [("head", 128256, 4096, (HEAD_BITS,))]
    for name, N, K, widths in shapes:
        x = torch.randn(K, device="cuda").half()
        w16 = torch.randn(N, K, device="cuda").half()
        fp16_bytes = N * K * 2
        ws = [w16] + [torch.randn_like(w16) for _ in range(_copies(fp16_bytes) - 1)]
        t16 = time_graph([lambda w=w: torch.mv(w, x) for w in ws])
        del ws, w16
        for bits in widths:
            sets, nbytes = gemv_sets(N, K, bits, group_size)
            t = time_graph([lambda s=s: gemv(x, s[0], out=s[1]) for s in sets])
            rows.append({"layer": name, "N": N, "K": K, "bits": bits, "us": t * 1e6, "GB/s": nbytes / t / 1e9,
                         "of_copy_bw": nbytes / t / bw, "of_read_bw": nbytes / t / rd, "fp16_us": t16 * 1e6,
                         "speedup_vs_fp16": t16 / t})
            del sets
    print(f"\nLow-bit GEMV, batch 1, group size {group_size}, inside CUDA graphs (measured copy bandwidth, read + "
          f"write: {bw / 1e9:.0f} GB/s; read only: {rd / 1e9:.0f} GB/s)")
    print(f"{'layer':8} {'N x K':>13} {'bits':>4} {'time us':>8} {'GB/s':>7} {'% copy bw':>9} {'% read bw':>9} "
          f"{'fp16 us':>8} {'vs fp16':>7}")
    for r in rows:
        print(f"{r['layer']:8} {r['N']:>6}x{r['K']:<6} {r['bits']:>4} {r['us']:8.2f} {r['GB/s']:7.0f} "
              f"{100 * r['of_copy_bw']:8.1f}% {100 * r['of_read_bw']:8.1f}% {r['fp16_us']:8.2f} "
              f"{r['speedup_vs_fp16']:6.2f}x")
    return rows


def bench_gemv_lut(bits_list=(4, 3), group_size: int = 128) -> list[dict]:
    """The non-uniform (table) GEMV on the 8B shapes next to the uniform GEMV of the same bits, in one run."""
    from .kernels.gemv import PackedLUT, gemv
    bw = copy_bandwidth()
    rows = []
    for name, (N, K) in LLAMA3_8B.items():
        x = torch.randn(K, device="cuda").half()
        for bits in bits_list:
            sets, nbytes = gemv_sets(N, K, bits, group_size)
            t_uni = time_graph([lambda s=s: gemv(x, s[0], out=s[1]) for s in sets])
            del sets
            luts = [(PackedLUT.from_quant(random_lut(N, K, bits, "cuda")),
                     torch.empty(N, device="cuda", dtype=torch.float16)) for _ in range(_copies(N * K * bits // 8))]
            lut_bytes = luts[0][0].nbytes + K * 2 + N * 2
            t = time_graph([lambda s=s: gemv(x, s[0], out=s[1]) for s in luts])
            del luts
            rows.append({"layer": name, "N": N, "K": K, "bits": bits, "us": t * 1e6, "of_copy_bw": lut_bytes / t / bw,
                         "uniform_us": t_uni * 1e6, "uniform_of_copy_bw": nbytes / t_uni / bw})
    print(f"\nNon-uniform (table, grouped by 128) GEMV vs the uniform GEMV (group size {group_size}), batch 1, inside "
          f"CUDA graphs (measured copy bandwidth {bw / 1e9:.0f} GB/s)")
    print(f"{'layer':8} {'N x K':>13} {'bits':>4} {'table us':>9} {'% copy bw':>9} {'uniform us':>10} {'% copy bw':>9}")
    for r in rows:
        print(f"{r['layer']:8} {r['N']:>6}x{r['K']:<6} {r['bits']:>4} {r['us']:9.2f} {100 * r['of_copy_bw']:8.1f}% "
              f"{r['uniform_us']:10.2f} {100 * r['uniform_of_copy_bw']:8.1f}%")
    return rows


def pcie_bandwidth(nbytes: int = 64 << 20) -> float:
    """Pinned host -> device memcpy bandwidth, bytes/s."""
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return nbytes / time_graph([lambda: dst.copy_(src, non_blocking=True)] * 4)


QDEC_K = (0, 2, 4, 8, 16, 32, 64)


def bench_qdec(bits: int = 3, group_size: int = 128) -> list[dict]:
    """Base GEMV alone vs with QDEC (the paper's Figure 17 as a table) on the 8B shapes, for k_chunk in QDEC_K and
    every viable n_tb (the tuner's choices), then the best n_tb per k_chunk; the zero-copy bandwidth at the largest
    k vs a pinned memcpy."""
    from .kernels import qdec
    from .kernels.gemv import gemv, grid_of
    from .quant import QuantResidual
    from .model import holds
    pcie = pcie_bandwidth()
    rows = []
    kinds = list(LLAMA3_8B)
    size = {name: random_packed(N, K, bits, group_size).nbytes for name, (N, K) in LLAMA3_8B.items()}
    for i, (name, (N, K)) in enumerate(LLAMA3_8B.items()):
        sets, nbytes = gemv_sets(N, K, bits, group_size)
        prev = kinds[i - 1]  # the GEMV before this one in decode (down before qkv): whether it holds this one's launch,
        held = holds(prev, size[prev], size[name])  # so that base and QDEC take decode's x_first (kernels.gemv.gemv)
        C, grid = qdec.chunks(K), grid_of(N, torch.device("cuda"))
        xs = [torch.randn(K, device="cuda").half() * torch.where(torch.rand(K, device="cuda") < 0.02, 8.0, 1.0).half()
              for _ in sets]
        # one residual per weight copy, so no call finds its rows in L2
        res = [qdec.HostResidual.pin(QuantResidual(torch.randint(-2**31, 2**31 - 1, (K, N // 8), dtype=torch.int32),
                                                   (torch.rand(N) * 0.01).half())) for _ in sets]
        part = qdec.new_part([(K, N)], "cuda")
        base = time_graph([lambda s=s, x=x: gemv(x, s[0], out=s[1], held=held) for s, x in zip(sets, xs)])
        for n_tb in qdec.viable_n_tb(K, N, grid):
            row = {"layer": name, "N": N, "K": K, "n_tb": n_tb, "base_us": base * 1e6, "us": {}}
            for k in QDEC_K[1:]:
                a = xs[0].float().abs()
                b0, b15 = float(a.max()), float(a[:1024].topk(k).values[-1])
                comps = [qdec.Call(r, qdec.new_state(K, N, "cuda"), part, k, n_tb, b0, b15, grid) for r in res]
                t = time_graph([lambda s=s, x=x, c=c: gemv(x, s[0], out=s[1], held=held, comp=c)
                                for s, x, c in zip(sets, xs, comps)])
                row["us"][k] = t * 1e6
            kmax = QDEC_K[-1]
            fetched = C * kmax * (N // 2) + N * 2  # residual rows and the scales
            row["zero_copy_GBs"] = fetched / (row["us"][kmax] * 1e-6) / 1e9
            rows.append(row)
        del sets, res
    print(f"\nQDEC: base W{bits} GEMV vs GEMV + dynamic error compensation, inside CUDA graphs; time in us and "
          f"slowdown over the base (pinned memcpy {pcie / 1e9:.1f} GB/s)")
    print(f"{'layer':8} {'n_tb':>4} {'base':>6} " + " ".join(f"{f'k={k}':>13}" for k in QDEC_K[1:])
          + f" {'zero-copy GB/s at k=' + str(QDEC_K[-1]):>22}")
    for r in rows:
        cells = " ".join(f"{r['us'][k]:6.2f} {100 * (r['us'][k] / r['base_us'] - 1):+5.0f}%" for k in QDEC_K[1:])
        print(f"{r['layer']:8} {r['n_tb']:>4} {r['base_us']:6.2f} {cells} "
              f"{r['zero_copy_GBs']:8.1f} ({100 * r['zero_copy_GBs'] * 1e9 / pcie:3.0f}% of memcpy)")
    print("best n_tb per k_chunk (slowdown, n_tb); issue 4's target: k_chunk 8 within +10% on every layer type")
    for name in LLAMA3_8B:
        mine = [r for r in rows if r["layer"] == name]
        best = {k: min(mine, key=lambda r: r["us"][k]) for k in QDEC_K[1:]}  # noqa: B023
        print(f"{name:8}      {mine[0]['base_us']:6.2f} " + " ".join(
            f"{100 * (b['us'][k] / b['base_us'] - 1):+6.0f}% ({b['n_tb']:>2})" for k, b in best.items()))
    return rows


def if_it_fits(what: str, f):
    """f(), or None where this GPU runs out of memory for it, saying so in a line: a consumer GPU holds the packed
    8B-shaped models but not the 16 GB of their fp16 baselines."""
    import gc
    try:
        return f()
    except torch.OutOfMemoryError:
        pass  # its traceback holds the frames that hold f's tensors: they are freed once it is gone, below
    gc.collect()
    torch.cuda.empty_cache()
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    print(f"{what}: out of GPU memory on this GPU ({gib:.0f} GiB); left out")
    return None


def dense_decode_time(cfg, **kw) -> float:
    """decode_time of the fp16 decoder of cfg's shapes (random weights), its memory given back after."""
    dense = random_model(cfg, None)
    try:
        return decode_time(dense, **kw)
    finally:
        del dense
        torch.cuda.empty_cache()


def dense_bytes(cfg) -> int:
    """weight_bytes of cfg's fp16 decoder: its projections and output head at 2 bytes a weight."""
    return 2 * (cfg.vocab_size * cfg.hidden_size + cfg.linear_weights)


def weight_bytes(model) -> int:
    """Bytes a decode step must read: packed (or dense) projections and the output head."""
    return model.head.nbytes + sum(lin.nbytes for lin in model.linears())


MEM_CTX = 256  # the context of the decode whose GPU memory bench_e2e reports


def decode_time(model, prompt: int = 16, ctx: int = 256, reps: int = 200, kv_bits: int = 16) -> float:
    """Seconds per decode step: the captured graph replayed back to back (no sampling, no host sync)."""
    return replay_time(captured_decoder(model, prompt, ctx, kv_bits).graph, reps)


def sampled_decode_time(model, params, prompt: int = 16, ctx: int = 256, n: int = 128) -> float:
    """Seconds per token of generate()'s loop without the tokenizer: each step's graph ends by choosing the next
    token (sampling.choose with `params`), and the host reads each token while the next step runs (Decoder.tokens)."""
    dec = Decoder(model, ctx)
    seen = torch.zeros(model.cfg.vocab_size, dtype=torch.bool, device=model.device)
    draws = torch.rand(n)
    with torch.inference_mode():
        for _ in range(2):  # the first round captures the graph
            dec.start(dec.prefill(list(range(1, prompt + 1))), prompt, seen, params, draws)
            tokens = dec.tokens(n)
            next(tokens)
            t0 = time.perf_counter()
            for _ in tokens:
                pass
            dt = (time.perf_counter() - t0) / (n - 1)
    return dt


def prefill_time(model, tokens: int = 512) -> float:
    """Seconds to run a prompt of `tokens` tokens (the model's prompt path, the head on the last position only, as
    generate() runs it), eager, median of 3."""
    from .model import KVCache
    ids = torch.randint(0, model.cfg.vocab_size, (1, tokens), device="cuda")
    cache = KVCache(model.cfg, tokens, dtype=model.act_dtype, device="cuda")
    with torch.inference_mode():
        return time_eager(lambda: model(ids, 0, cache, last=True), reps=3)


def hf_generate_tps(cfg, new_tokens: int = 64) -> float:
    """transformers fp16 generate (its default path) on a random model of the same shape, tokens/s."""
    from transformers import LlamaConfig, LlamaForCausalLM
    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                         head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings)
    with torch.device("cuda"):
        m = LlamaForCausalLM._from_config(hf_cfg, dtype=torch.float16).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 16), device="cuda")
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        m.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        torch.cuda.synchronize()
        t = time.perf_counter()
        m.generate(ids, **kw)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
    del m
    torch.cuda.empty_cache()
    return new_tokens / dt


def bench_e2e(bits_list=(4, 3), kv_bits: int = 16) -> list[dict]:
    from .config import ModelConfig
    from .kvquant import bytes_per_token
    from .sampling import SamplingParams
    cfg = ModelConfig(**LLAMA3_8B_CONFIG)
    bw, rd = copy_bandwidth(), read_bandwidth()
    rows = []
    t16 = if_it_fits("fp16 decoder (CUDA graph)", lambda: dense_decode_time(cfg))
    fp16_bytes = dense_bytes(cfg)
    hf_tps = if_it_fits("transformers fp16 generate", lambda: hf_generate_tps(cfg))
    # uniform weights with either head; table (SqueezeLLM-format) weights with the 8-bit head `localllm quantize`
    # writes for every method
    for bits, head, table in [(b, h, False) for h in (16, 8) for b in bits_list] + [(b, 8, True) for b in bits_list]:
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()

        def row(bits=bits, head=head, table=table) -> dict:
            m = random_model(cfg, bits, head_bits=head, table=table)
            nbytes = weight_bytes(m)
            torch.cuda.reset_peak_memory_stats()
            t = decode_time(m, ctx=MEM_CTX, kv_bits=kv_bits)
            # the GPU memory a decode takes at its peak (weights, the decoder's buffers and graph, the prompt's
            # dequantized layer, workspaces), less its KV cache: against the packed bytes that must be on the GPU
            used = torch.cuda.max_memory_allocated() - base - bytes_per_token(cfg, kv_bits) * MEM_CTX
            return {"bits": bits, "head": head, "weights": "table" if table else "uniform", "ms": t * 1e3,
                    "ms_1k": decode_time(m, prompt=1000, ctx=1024, kv_bits=kv_bits) * 1e3,
                    "prefill512_ms": prefill_time(m) * 1e3, "tok/s": 1 / t,
                    "sampled_tok/s": 1 / sampled_decode_time(m, SamplingParams()),
                    "roofline_tok/s": bw / nbytes,
                    "of_roofline": nbytes / bw / t, "of_read_roofline": nbytes / rd / t,
                    "vs_fp16_graph": t16 / t if t16 else None, "bytes_ratio": fp16_bytes / nbytes,
                    "vs_hf": (1 / t) / hf_tps if hf_tps else None, "gpu_mem_GB": used / 1e9,
                    "packed_GB": nbytes / 1e9, "gpu_overhead": used / nbytes - 1}
        r = if_it_fits(f"{bits}-bit {'table' if table else 'uniform'} weights, {head}-bit head", row)
        if r:
            rows.append(r)
    print(f"\nDecode, batch 1, Llama-3-8B shapes, random weights, context 256 ({kv_bits}-bit KV cache), CUDA graph "
          f"replay at position 16 (ms@1k: at position 1000 of a 1024-position cache, past the short graphs' span); "
          f"roofline: weight bytes at the copy bandwidth ({bw / 1e9:.0f} GB/s), also at the read-only bandwidth "
          f"({rd / 1e9:.0f} GB/s)")
    tps = lambda t: "-" if t is None else f"{t:.1f}"  # noqa: E731 - left out where it did not fit
    fp16_roof = "" if t16 is None else f" ({100 * fp16_bytes / bw / t16:.1f}% of its roofline)"
    print(f"fp16 (same decoder, CUDA graph): {tps(t16 and 1 / t16)} tok/s{fp16_roof}; transformers fp16 generate: "
          f"{tps(hf_tps)} tok/s; sampled: generate()'s token loop at its default sampling (temperature 0.7, "
          "top-p 0.9), tokenizer aside (random weights give a near-uniform next-token distribution, whose nucleus is "
          "most of the vocabulary: the sampler's slowest case); head: the output head fp16 (16) or 8-bit (8, what "
          "`localllm quantize` writes); weights: group-wise uniform (rtn, awq) or tables grouped by 128 (squeezellm); "
          f"GPU GB: the decode's peak GPU memory (torch's allocations, context {MEM_CTX}) less its KV cache, against "
          "the packed GB that must be on the GPU (projections and head; the embeddings stay in host memory; the CUDA "
          "context aside)")
    print(f"{'bits':>4} {'head':>4} {'weights':>7} {'ms/tok':>7} {'ms@1k':>6} {'tok/s':>7} {'roofline':>8} "
          f"{'% roof':>7} {'% read':>7} {'vs fp16':>8} {'bytes x':>8} {'vs HF':>6} {'GPU GB':>7} {'packed GB':>9} "
          f"{'over':>6} {'prefill 512 ms':>14} {'sampled tok/s':>13}")
    x = lambda v, w, d: f"{'-':>{w + 1}}" if v is None else f"{v:{w}.{d}f}x"  # noqa: E731
    for r in rows:
        print(f"{r['bits']:>4} {r['head']:>4} {r['weights']:>7} {r['ms']:7.2f} {r['ms_1k']:6.2f} {r['tok/s']:7.1f} "
              f"{r['roofline_tok/s']:8.1f} {100 * r['of_roofline']:6.1f}% {100 * r['of_read_roofline']:6.1f}% "
              f"{x(r['vs_fp16_graph'], 7, 2)} {r['bytes_ratio']:7.2f}x "
              f"{x(r['vs_hf'], 5, 1)} {r['gpu_mem_GB']:7.2f} {r['packed_GB']:9.2f} {100 * r['gpu_overhead']:+5.1f}% "
              f"{r['prefill512_ms']:14.1f} "
              f"{r['sampled_tok/s']:13.1f}")
    return rows


def bench_breakdown(bits: int = 4, kv_bits: int = 16) -> None:
    """Where a decode step's GPU time goes: kernel times (torch.profiler) of one eager step of the 8B shape,
    summed per kernel name. Eager launches leave gaps between kernels, but each kernel's own time is what it is
    inside the graph, give or take the overlap of early launch."""
    from torch.profiler import ProfilerActivity, profile

    from .config import ModelConfig
    m = random_model(ModelConfig(**LLAMA3_8B_CONFIG), bits)
    dec = Decoder(m, 256, use_graph=False, kv_bits=kv_bits)
    with torch.inference_mode():
        logits = dec.prefill(list(range(1, 17)))
        dec.step(logits.argmax(), 16)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            dec.step(logits.argmax(), 17)
            torch.cuda.synchronize()
    rows = sorted(((e.key, e.device_time_total, e.count) for e in prof.key_averages() if e.device_time_total > 0),
                  key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    print(f"\nOne eager decode step, Llama-3-8B shape, W{bits}, {kv_bits}-bit KV cache: GPU time per kernel name "
          f"({total / 1e3:.2f} ms in all)")
    print(f"{'kernel':60} {'calls':>5} {'us':>9} {'share':>6}")
    for name, us, n in rows[:20]:
        print(f"{name[:60]:60} {n:5d} {us:9.1f} {100 * us / total:5.1f}%")


def bench_e2e_qdec(bits: int = 3, k_chunk: int = 8, kv_bits: int = 16) -> None:
    """8B-shaped decode with QDEC on every layer (k_chunk each, default n_tb; residuals pinned, one per layer kind)
    vs the same model without it; group-wise uniform weights, then table (SqueezeLLM-format) weights."""
    from .config import ModelConfig
    cfg = ModelConfig(**LLAMA3_8B_CONFIG)
    for table in (False, True):
        lm = random_local_model(cfg, bits, copies=1, table=table)
        t_off = decode_time(lm.model, kv_bits=kv_bits)
        lm.set_qdec(k_chunk)
        t_on = decode_time(lm.model, kv_bits=kv_bits)
        m = lm.model
        print(f"\nDecode with QDEC, Llama-3-8B shapes W{bits} {'table' if table else 'uniform'} weights, 8-bit head, "
              f"k_chunk={k_chunk} on every layer (default n_tb): {1 / t_on:.1f} tok/s vs {1 / t_off:.1f} without "
              f"({100 * (t_on / t_off - 1):+.1f}% per token); GPU memory for QDEC: "
              f"{next(m.linears()).comp.part.numel() * 4 / 1e6:.2f} MB partials + "
              f"{sum(lin.comp.state.numel() * 8 for lin in m.linears()) / 1e3:.0f} KB flags")
        del lm, m
        torch.cuda.empty_cache()


# calibration.qdec_value of the demo model quantized to 3 bits (RTN) on the CPU, 2026-11-29
DEMO_QDEC_VALUE = {"metric": "kl", "tokens": 1024, "mode": "approx", "k_chunk": 8, "off": 1.7828,
                   "kl": {"qkv": 1.5988, "o": 1.7441, "gate_up": 1.4906, "down": 1.4607}}


def bench_tune(bits: int = 3, budgets=(0.025, 0.05, 0.1, 0.2)) -> None:
    """`localllm tune` on an 8B-shaped random model (random pinned residuals, calibration-like b0/b15), without
    the perplexity column and without writing profiles: the tuner's table on this GPU and how long it takes."""
    from .config import ModelConfig
    from .tuner.tune import table, tune
    t0 = time.perf_counter()
    lm = random_local_model(ModelConfig(**LLAMA3_8B_CONFIG), bits)
    t1 = time.perf_counter()
    res = tune(lm, budgets, evaluate=False, write=False)
    print(f"\n{table(res, f'QDEC tuner on {torch.cuda.get_device_name()}, Llama-3-8B shapes W{bits}, random weights')}")
    print(f"model set-up {t1 - t0:.0f} s (random weights, pinning residuals); tuning {res.seconds:.0f} s")
    # what a model quantized with qdec_value gets (tuner.search.allocate): the demo model's measured value per kind
    lm.manifest["calibration"]["qdec_value"] = DEMO_QDEC_VALUE
    res = tune(lm, budgets, evaluate=False, write=False)
    title = "The same, with the demo model W3's value per kind (allocate; random residuals: the blocks differ little)"
    print(f"\n{table(res, title)}")


def greedy_tokens(model, ids: list[int], n: int, kv_bits: int = 16) -> list[int]:
    """n greedy tokens after ids (no stopping), through the same Decoder generate() uses."""
    dec = Decoder(model, len(ids) + n, kv_bits=kv_bits)
    out = []
    with torch.inference_mode():
        logits = dec.prefill(ids)
        for i in range(n):
            tok = logits.argmax()
            out.append(int(tok))
            if i + 1 < n:
                logits = dec.step(tok, len(ids) + i)
    return out


DEMO_PROMPTS = ("What is the capital of France?", "Write a Python function that reverses a string.",
                "Give me three tips for sleeping better.", "Explain photosynthesis to a child.")


def bench_demo(new_tokens: int = 32, kv_bits: int = 16) -> None:
    """The demo model on the GPU: greedy agreement with the CPU reference, decode tokens/s, memory."""
    from .demo import GGUF, cache_dir, demo_model
    from .generate import encode_prompt, generate
    from .runtime import load
    if not (cache_dir() / "demo" / GGUF).exists():
        print(f"\ndemo model: {cache_dir() / 'demo' / GGUF} is not here (no network on this machine); skipped")
        return
    path = demo_model()
    cpu, gpu = load(path, qdec="off"), load(path, device="cuda", qdec="off")
    print(f"\nDemo model {path.name} on {torch.cuda.get_device_name()}: greedy tokens, GPU (fp16, CUDA graph) "
          f"vs CPU reference (fp32), QDEC off, {kv_bits}-bit KV cache")
    for p in DEMO_PROMPTS:
        ids = encode_prompt(cpu, [{"role": "user", "content": p}])
        a, b = greedy_tokens(cpu.model, ids, new_tokens, kv_bits), greedy_tokens(gpu.model, ids, new_tokens, kv_bits)
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        print(f"  {same:>2}/{new_tokens} identical  {p!r} -> {gpu.tokenizer.decode(b)[:60]!r}")
    t = decode_time(gpu.model, ctx=512, kv_bits=kv_bits)
    sizes = gpu.sizes()
    print(f"  decode: {t * 1e3:.3f} ms/token = {1 / t:.0f} tok/s (llama.cpp Q4_1 on an H100: 923 tok/s); "
          f"GPU weights {sizes['gpu_bytes'] / 2**20:.0f} MiB")
    if gpu.has_residuals:  # what `localllm chat` runs by default: QDEC on, untuned unless a profile applies
        gpu.set_qdec("on")
        tq = decode_time(gpu.model, ctx=512, kv_bits=kv_bits)
        print(f"  with {gpu.qdec_summary()}: {tq * 1e3:.3f} ms/token = {1 / tq:.0f} tok/s "
              f"({100 * (tq / t - 1):+.0f}%)")
        if gpu.qdec_untuned:  # what `localllm chat` does then, once per GPU and model
            t0 = time.perf_counter()
            gpu.autotune()
            took = time.perf_counter() - t0
            tq = decode_time(gpu.model, ctx=512, kv_bits=kv_bits)
            print(f"  tuned in {took:.0f} s ({gpu.qdec_summary()}): {tq * 1e3:.3f} ms/token = {1 / tq:.0f} tok/s "
                  f"({100 * (tq / t - 1):+.0f}%)")
        gpu.set_qdec("off")
    eos, gpu.eos_ids = gpu.eos_ids, []  # 256 tokens whatever they are

    def reply_rate(temp: float) -> float:
        s = generate(gpu, [{"role": "user", "content": DEMO_PROMPTS[0]}], max_new_tokens=256, temperature=temp,
                     seed=0, stream=True)
        s.text()
        return s.stats.tokens_per_second

    kinds = (("greedy", 0.0), ("default sampling", 0.7))
    for label, temp in kinds:
        rates = [reply_rate(temp) for _ in range(2)]  # the first reply of a kind captures its graph (~40 ms)
        print(f"  generate(), {label}, 256 tokens: {rates[1]:.0f} tok/s, the first reply {rates[0]:.0f} (tokenizer "
              f"included: what the chat shows)")
    gpu._decoder = None  # as loaded
    t0 = time.perf_counter()
    gpu.warm_up(256 + 512)
    warm = time.perf_counter() - t0
    firsts = " / ".join(f"{reply_rate(temp):.0f}" for _, temp in kinds)
    print(f"  after warm_up ({warm * 1e3:.0f} ms; `localllm chat` runs it while it loads): first replies {firsts} "
          "tok/s, greedy / sampled")

    gpu.eos_ids = eos  # a reply that ends as in a chat (past its end its text would tokenize anew otherwise)

    def second_turn(reuse: bool):
        msgs = [{"role": "user", "content": DEMO_PROMPTS[1]}]
        first = generate(gpu, msgs, max_new_tokens=256, seed=0, reuse_cache=True)
        msgs += [{"role": "assistant", "content": first}, {"role": "user", "content": DEMO_PROMPTS[3]}]
        s = generate(gpu, msgs, max_new_tokens=4, seed=0, stream=True, reuse_cache=reuse)
        s.text()
        return s.stats

    turns = {reuse: sorted((second_turn(reuse) for _ in range(3)), key=lambda st: st.time_to_first_token)[1]
             for reuse in (True, False)}  # medians of three
    st = turns[True]
    print(f"  a chat's second turn ({st.prompt_tokens} prompt tokens, {st.prompt_tokens - st.cached_tokens} not in "
          f"the KV cache): first token {turns[True].time_to_first_token * 1e3:.1f} ms as the chat reads it (the rest "
          f"kept), {turns[False].time_to_first_token * 1e3:.1f} ms read whole")


def bench_prefill(bits_list=(4, 3), lengths=(512, 2048, 8192)) -> list[dict]:
    """Prompts with 8-bit activations (kernels/prefill_a8.cu) vs the fp16 path (dequantize per layer + cuBLAS):
    per-GEMM time on the 8B shapes at 2048 tokens, and time to first token of a Llama-3-8B-shaped model."""
    from .config import ModelConfig
    from .kernels import prefill_a8
    from .kernels.gemv import dequantize
    rows = []
    print("\nPrompt GEMMs, 2048 tokens, Llama-3-8B shapes: fp16 (dequantize + cuBLAS) vs int8 activations x packed "
          "weights")
    print(f"{'layer':8} {'N x K':>13} {'bits':>4} {'fp16 ms':>8} {'int8 ms':>8} {'int8 TOPS':>9} {'speedup':>7}")
    x = torch.randn(2048, 4096, device="cuda").half()
    for name, (N, K) in LLAMA3_8B.items():
        xx = x if K == 4096 else torch.randn(2048, K, device="cuda").half()
        for bits in bits_list:
            w = random_packed(N, K, bits, 128)
            t16 = time_eager(lambda: torch.nn.functional.linear(xx, dequantize(w)))
            t8 = time_eager(lambda: prefill_a8.linear(xx, w))
            print(f"{name:8} {N:>6}x{K:<6} {bits:>4} {t16 * 1e3:8.3f} {t8 * 1e3:8.3f} "
                  f"{2 * 2048 * N * K / t8 / 1e12:9.0f} {t16 / t8:6.2f}x", flush=True)
    print("\nTime to first token, Llama-3-8B shapes, random weights (eager prompt, median of 3)")
    print(f"{'bits':>4} {'tokens':>6} {'fp16 ms':>8} {'int8 ms':>8} {'speedup':>7}")
    cfg = ModelConfig(**LLAMA3_8B_CONFIG)
    for bits in bits_list:
        m = random_model(cfg, bits)
        for T in lengths:
            m.settings.act8 = False
            t16 = prefill_time(m, T)
            m.settings.act8 = True
            t8 = prefill_time(m, T)
            rows.append({"bits": bits, "tokens": T, "fp16_ms": t16 * 1e3, "int8_ms": t8 * 1e3})
            print(f"{bits:>4} {T:>6} {t16 * 1e3:8.1f} {t8 * 1e3:8.1f} {t16 / t8:6.2f}x", flush=True)
        del m
        torch.cuda.empty_cache()
    return rows


def time_eager(fn, reps: int = 10) -> float:
    """Median seconds of fn() on the GPU (CUDA events, after one warm-up)."""
    fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


KV_CONTEXTS = (1024, 8192, 32768)
GPU_GIB = (8, 12, 16, 24, 48, 80)  # memory sizes for the longest-context table


def fill_cache(cache) -> None:
    """Random keys and values in every position of a KVCache (what a long prompt would have left there)."""
    if cache.bits == 16:
        cache.k.normal_(), cache.v.normal_()
        return
    for n in ("k", "v"):
        getattr(cache, n).random_(-2**31, 2**31 - 1)
        sz = getattr(cache, n + "_sz")
        sz[..., 0].uniform_(0.01, 0.1)
        sz[..., 1].uniform_(-1.0, -0.1)


def bench_kv(bits: int = 4, contexts=KV_CONTEXTS) -> list[dict]:
    """Decode with a 16 / 8 / 4-bit KV cache on Llama-3-8B shapes (W`bits`, random weights), the position at the end
    of a 1k / 8k / 32k context (the cache filled with random entries): tokens/s and % of the roofline of weights +
    cache bytes; then the longest context that fits GPUs of several sizes at each width, from the measured bytes of
    the model and of the cache per token."""
    from .config import ModelConfig
    from .kvquant import KV_BITS, bytes_per_token
    from .devices import WORKSPACE_BYTES
    cfg = ModelConfig(**{**LLAMA3_8B_CONFIG, "max_position_embeddings": max(contexts)})
    bw = copy_bandwidth()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    m = random_model(cfg, bits)
    model_bytes = torch.cuda.memory_allocated() - base
    wbytes = weight_bytes(m)
    rows = []
    for kv in KV_BITS:
        row = {"kv_bits": kv, "tok/s": {}, "of_roofline": {}}
        for ctx in contexts:
            torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated()
            dec = Decoder(m, ctx, kv_bits=kv)
            row["bytes_per_token"] = (torch.cuda.memory_allocated() - before) / ctx
            fill_cache(dec.cache)
            with torch.inference_mode():
                dec.step(torch.tensor(1, device="cuda"), ctx - 1)  # captures the graph at the last position
                t = replay_time(dec.graph, 20)
            row["tok/s"][ctx] = 1 / t
            row["of_roofline"][ctx] = (wbytes + bytes_per_token(cfg, kv) * ctx) / bw / t
            del dec
        rows.append(row)
    del m
    print(f"\nDecode with a quantized KV cache, Llama-3-8B shapes W{bits}, 8-bit head, random weights, position at "
          f"the end of the context, CUDA graph replay (copy bandwidth {bw / 1e9:.0f} GB/s); tok/s (% of the roofline of "
          "weight + cache bytes)")
    print(f"{'kv bits':>7} {'bytes/token':>11} " + " ".join(f"{f'ctx {c}':>16}" for c in contexts))
    for r in rows:
        print(f"{r['kv_bits']:>7} {r['bytes_per_token']:11.0f} " + " ".join(
            f"{r['tok/s'][c]:8.1f} ({100 * r['of_roofline'][c]:4.1f}%)" for c in contexts))
    print(f"\nLongest context that fits (model {model_bytes / 2**30:.2f} GiB as allocated + "
          f"{WORKSPACE_BYTES >> 20} MiB workspace; cache bytes per token as allocated above), in tokens")
    print(f"{'kv bits':>7} " + " ".join(f"{f'{g} GiB':>9}" for g in GPU_GIB))
    for r in rows:
        print(f"{r['kv_bits']:>7} " + " ".join(
            f"{max(0, int((g * 2**30 - model_bytes - WORKSPACE_BYTES) / r['bytes_per_token'])):9d}" for g in GPU_GIB))
    return rows


def bench_kv_ppl(ctx: int = 4096, max_tokens: int | None = None) -> list[dict]:
    """The demo model's perplexity (W4, QDEC off) on the longest shipped text with a 16 / 8 / 4-bit KV cache, with
    the SmoothAttention factors folded in (the default quantization) and without (quantized again without them).
    Runs on the CPU (the reference semantics); on a GPU machine too, still on the CPU."""
    from .demo import demo_model
    from .evaluate import perplexity, read_text, tokenize
    from .kvquant import KV_BITS
    from .runtime import load
    rows = []
    for smooth in (False, True):
        lm = load(demo_model(smooth_attention=smooth), qdec="off")
        text, name = read_text(None)
        ids = tokenize(lm, text, max_tokens)
        for kv in KV_BITS:
            lm.set_kv_bits(kv)
            ppl = perplexity(lm, ids, ctx, desc=f"kv {kv} bits, SmoothAttention {'on' if smooth else 'off'}")
            rows.append({"smooth_attention": smooth, "kv_bits": kv, "perplexity": ppl})
    print(f"\nDemo model (W4 g128, QDEC off), perplexity of {name} ({len(ids) - 1} predicted tokens, windows of "
          f"{ctx}), CPU, by KV cache width")
    print(f"{'SmoothAttention':>15} " + " ".join(f"{f'KV{b}':>15}" for b in KV_BITS))
    for smooth in (False, True):
        rs = [r for r in rows if r["smooth_attention"] == smooth]
        ref = rs[0]["perplexity"]
        print(f"{'on' if smooth else 'off':>15} " + " ".join(
            f"{r['perplexity']:8.3f} {100 * (r['perplexity'] / ref - 1):+5.2f}%" for r in rs))
    return rows


CPU_PARTS = ("kv-ppl",)


# `bench quantize`: one block of these shapes (random weights; the vocabulary cut to 32768, which only the embedding
# lookup sees), name -> (model type, the real model's blocks, Hugging Face config)
QUANT_SHAPES = {
    "Qwen2.5-1.5B": ("qwen2", 28, dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                                       num_key_value_heads=2)),
    "Llama-3-8B": ("llama", 32, dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                     num_key_value_heads=8)),
}


def bench_quantize(bits: int = 4, methods=("rtn", "awq", "squeezellm"), cpu_shapes=("Qwen2.5-1.5B",),
                   cap_gib: float = 5.0) -> list[dict]:
    """`localllm quantize` on the GPU vs the CPU (all of this machine's cores): seconds per block (quantize, residuals,
    calibration) of one block of each QUANT_SHAPES model, and the whole model's blocks at that rate; then the 8B block
    on the GPU with torch's memory capped at cap_gib (the row blocks it settles on)."""
    import tempfile
    from pathlib import Path

    from . import synthetic
    from .modelfile import read_manifest
    from .quantize import quantize
    rows = []
    print(f"\nQuantizing, {bits} bits, 4096 calibration tokens: seconds per block (the whole model's blocks at that "
          f"rate); CPU: {torch.get_num_threads()} threads")
    print(f"{'model':13} {'method':10} {'GPU s/block':>11} {'GPU min':>7} {'GPU GiB':>7} {'CPU s/block':>11} "
          f"{'CPU min':>7} {'speedup':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        def quantized_on(name: str, method: str, dev: str, tag: str) -> dict:  # name's block quantized: its record
            out = quantize(str(Path(tmp) / name), str(Path(tmp) / f"{name}-{method}-{tag}"), bits, method=method,
                           head_bits=16, device=dev)
            return read_manifest(out)["quantized_on"]

        for name, (arch, layers, cfg) in QUANT_SHAPES.items():
            synthetic.checkpoint(Path(tmp) / name, arch, std=0.02, tokenizer_vocab=4096, dtype=torch.float16,
                                 vocab_size=32768, num_hidden_layers=1, tie_word_embeddings=True, **cfg)
            for method in methods:
                on = {dev: quantized_on(name, method, dev, dev)
                      for dev in (("cuda", "cpu") if name in cpu_shapes else ("cuda",))}
                g, c = on["cuda"]["block_seconds"][0], on["cpu"]["block_seconds"][0] if "cpu" in on else None
                gib = on["cuda"]["peak_gpu_bytes"] / 2**30  # the whole run's peak: a block and its calibration
                cpu_cols = f"{c:11.1f} {c * layers / 60:7.1f} {c / g:6.1f}x" if c else f"{'':11} {'':7} {'':7}"
                print(f"{name:13} {method:10} {g:11.2f} {g * layers / 60:7.1f} {gib:7.1f} {cpu_cols}", flush=True)
                rows.append({"model": name, "method": method, "gpu_s": g, "cpu_s": c, "peak_gpu_gib": gib})
        # a small GPU: torch may allocate cap_gib at most, so the row blocks shrink where a block does not fit
        name = "Llama-3-8B"
        total = torch.cuda.get_device_properties(0).total_memory
        print(f"\n{name}, torch's allocations capped at {cap_gib:g} GiB (a laptop GPU): row blocks reached, seconds per "
              f"block, peak")
        print(f"{'method':10} {'row blocks':>10} {'GPU s/block':>11} {'GPU min':>7} {'GPU GiB':>7}")
        torch.cuda.set_per_process_memory_fraction(cap_gib * 2**30 / total)
        try:
            for method in methods:
                torch.cuda.empty_cache()
                try:
                    on = quantized_on(name, method, "cuda", "cap")
                except LocalLLMError as e:
                    print(f"{method:10} {e}", flush=True)
                    continue
                g, layers = on["block_seconds"][0], QUANT_SHAPES[name][1]
                print(f"{method:10} {str(on['gpu_row_blocks']) + 'x':>10} {g:11.2f} {g * layers / 60:7.1f} "
                      f"{on['peak_gpu_bytes'] / 2**30:7.1f}", flush=True)
                rows.append({"model": name, "method": method, "cap_gib": cap_gib, "gpu_s": g,
                             "row_blocks": on["gpu_row_blocks"], "peak_gpu_gib": on["peak_gpu_bytes"] / 2**30})
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
    return rows


def main(parts: list[str] | None = None, kv_bits: int = 16) -> None:
    import functools
    parts = parts or ["gemv", "e2e", "demo"]
    with_kv = lambda f: functools.partial(f, kv_bits=kv_bits)  # noqa: E731 - the decoders' KV cache width
    runs = {"gemv": bench_gemv, "gemv-lut": bench_gemv_lut, "gemv-sweep": gemv_sweep, "e2e": with_kv(bench_e2e),
            "demo": with_kv(bench_demo), "breakdown": with_kv(bench_breakdown), "qdec": bench_qdec,
            "e2e-qdec": with_kv(bench_e2e_qdec), "tune": bench_tune, "prefill": bench_prefill, "kv": bench_kv,
            "kv-ppl": bench_kv_ppl, "quantize": bench_quantize}
    bad = [p for p in parts if p not in runs]
    if bad:
        raise LocalLLMError(f"unknown benchmark {', '.join(bad)}; choose from {', '.join(runs)}")
    gpu = [p for p in parts if p not in CPU_PARTS]
    if gpu:  # said before the first measurement (quantize times torch's CUDA; the others the kernels, and CuPy)
        from .kernels import cuda
        if why := cuda.unusable(kernels=bool(set(gpu) - {"quantize"})):
            raise LocalLLMError(f"`localllm bench {' '.join(gpu)}` measures the GPU, and cannot here: {why}; of the "
                                f"benchmarks only {', '.join(CPU_PARTS)} runs on the CPU")
    print(f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}")
    for p in parts:
        runs[p]()


if __name__ == "__main__":  # python -m localllm.bench [PART...] [--kv-bits N]: `localllm bench` (scripts/gpu_check.sh)
    import sys

    from .cli import main as cli_main
    sys.exit(cli_main(["bench", *sys.argv[1:]]))
