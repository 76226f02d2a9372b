"""`localllm report`: the QDEC paper's experiments on a real model, as a Markdown report with PNG plots.

checkpoint -> quantized variants (cached under LOCALLLM_CACHE/models) -> measurements (report.json) -> report.md and
plots (localllm.report_render). The sections:

  quality   perplexity on the CPU reference path (every selection mode; other residual widths emulated): vs k_chunk
            for each base width (paper Fig. 12), approximate vs exact top-k with the selection's recall (Fig. 15),
            dynamic vs static vs random selection (Fig. 16), residual width at equal PCIe bytes (Table 1), checks
  outliers  activation outliers of the --compare-bits model on the evaluation text (Fig. 5b)
  kernel    GPU: QDEC GEMV time over the base GEMV vs k_chunk and n_tb, this model's layers and 8B shapes (Fig. 17)
  pareto    GPU: perplexity vs time per token at the tuner's budgets, each base width (Fig. 18)

The GPU sections run when a CUDA GPU (with CuPy) is usable, else the report says why they were skipped and how to
add them later: `--sections kernel,pareto --update` measures only those and keeps the other sections of the report
already in --out (each section records the machine and command that measured it).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import __version__, atomic
from .errors import LocalLLMError

FORMAT = 1
SECTIONS = ("quality", "outliers", "kernel", "pareto")
GPU_SECTIONS = ("kernel", "pareto")
SELECTION_MODES = ("exact", "static", "random")  # compared with approx at --compare-bits (Fig. 15, 16)
KERNEL_K = (2, 4, 8, 16, 32, 64, 128)  # k_chunk values of the kernel sweep (Fig. 17)
KERNEL_MAX_N_TB = 6  # n_tb values per layer type in the kernel sweep, spread over the viable ones
ALL_CHANNELS = 1024  # k_chunk that selects every channel of a chunk


@dataclass
class Options:
    model: str | None = None  # a checkpoint folder, .gguf file or hub id; None: the demo model's GGUF
    out: str | None = None  # None: report-<model name> here
    tokens: int = 2048  # predicted tokens of the evaluation text
    ctx: int = 512
    bits: tuple = (2, 3, 4)
    k_chunks: tuple = (8, 16, 32, 64, 128)
    compare_bits: int = 3  # the base width of the selection-mode and residual-width comparisons
    # residual widths compared with the runtime's 4 bits (Table 1; 16: fp16). Quantizing R at many levels is slow
    # (the MSE scale search at 8 bits takes ~10 us per weight): leave 8 out for models of a billion weights
    residual_bits: tuple = (2, 8, 16)
    group_size: int = 128
    budgets: tuple = (0.025, 0.05, 0.1, 0.2)
    sections: tuple | None = None  # None: all, the GPU ones only where a GPU is usable
    seed: int = 0
    text: str | None = None  # None: the evaluation text shipped with localllm
    gguf_file: str | None = None
    force: bool = False  # replace --out
    update: bool = False  # replace --out, keeping its sections that this run does not measure
    shapes_8b: bool = True  # the kernel section also times Llama-3-8B shapes (random weights)
    argv: list = field(default_factory=list)  # how the command was called, for the report


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise LocalLLMError("localllm report draws its plots with matplotlib, which is not installed: "
                            "pip install 'localllm[report]'") from None


def gpu_unusable() -> str | None:
    """Why the GPU sections cannot run here, or None when they can."""
    from .kernels import cuda
    if cuda.available():
        return None
    try:
        cuda.require()
    except LocalLLMError as e:
        return str(e)
    return "the CUDA kernels are switched off (LOCALLLM_NO_CUDA_KERNELS=1)"


def _check(o: Options) -> None:
    from .quant import BASE_BITS, GROUP_SIZES, RESIDUAL_BITS, RESIDUAL_WIDTHS
    if not o.bits or any(b not in BASE_BITS for b in o.bits):
        raise LocalLLMError(f"--bits takes base widths from {', '.join(map(str, BASE_BITS))}; got {o.bits}")
    if o.compare_bits not in BASE_BITS:
        raise LocalLLMError(f"--compare-bits must be one of {', '.join(map(str, BASE_BITS))}; got {o.compare_bits}")
    if not o.k_chunks or any(not 1 <= k <= ALL_CHANNELS for k in o.k_chunks):
        raise LocalLLMError(f"--k-chunk takes channels per 1024 within 1..{ALL_CHANNELS}; got {o.k_chunks}")
    if o.group_size not in GROUP_SIZES:
        raise LocalLLMError(f"--group-size must be one of {', '.join(map(str, GROUP_SIZES))}; got {o.group_size}")
    if any(b not in RESIDUAL_WIDTHS or b == RESIDUAL_BITS for b in o.residual_bits):
        raise LocalLLMError(f"--residual-bits takes widths from {', '.join(str(b) for b in RESIDUAL_WIDTHS if b != 4)}"
                            f" (4 is always there); got {o.residual_bits}")
    if o.tokens < 2:
        raise LocalLLMError(f"--tokens must be at least 2; got {o.tokens}")
    bad = [s for s in (o.sections or ()) if s not in SECTIONS]
    if bad or o.sections == ():
        raise LocalLLMError(f"--sections takes a comma-separated list of {', '.join(SECTIONS)}; got {bad or 'none'}")
    if o.force and o.update:
        raise LocalLLMError("--force and --update exclude each other: --force replaces the report whole, --update "
                            "keeps the sections this run does not measure")


def model_name(src: str, ckpt) -> str:
    p = Path(ckpt.source.get("gguf_file") or ckpt.source.get("hub_id") or src)
    return (p.stem if p.suffix == ".gguf" else p.name) or "model"


def _slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-") or "model"


def variant(ckpt, sha: str, name: str, bits: int, group_size: int, src: str) -> Path:
    """The checkpoint quantized to `bits` (with 4-bit residuals and calibration), made once and cached."""
    from .demo import cache_dir
    from .modelfile import read_manifest
    from .quantize import quantize
    out = cache_dir() / "models" / f"{_slug(name)}-{sha[:12]}-w{bits}g{group_size}"
    if out.exists():
        try:
            m = read_manifest(out)
            if m["source"].get("sha256") == sha and m.get("residual"):
                return out
        except (LocalLLMError, KeyError, TypeError):
            pass
        shutil.rmtree(out)  # our own cache, from another localllm or an interrupted write: make it again
    print(f"localllm: quantizing {name} to {bits} bits for the report (cached in {out})", file=sys.stderr)
    seq_len = min(512, ckpt.config.max_position_embeddings)
    return quantize(src, str(out), bits=bits, group_size=group_size, seq_len=seq_len, ckpt=ckpt)


def machine(gpu: bool) -> dict:
    """The machine a section ran on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    m = {"cpu": cpu, "cpu_threads": torch.get_num_threads(), "python": platform.python_version(),
         "torch": torch.__version__, "os": platform.platform(terse=True)}
    if gpu:
        from .tuner.profile import gpu_identity
        g = gpu_identity()
        m["gpu"] = {k: g[k] for k in ("name", "compute_capability", "sm_count", "memory_bytes", "driver",
                                      "torch_cuda")}
    return m


def git_commit() -> str | None:
    """The localllm checkout's commit (+ "-dirty" with uncommitted changes), when it runs from one."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("-dirty" if dirty else "")) or None


def command_of(o: Options) -> str:
    return "localllm report " + " ".join(shlex.quote(a) for a in o.argv) if o.argv else "localllm report"


class Run:
    """What one `localllm report` run measures: the evaluation tokens, the quantized variants, a progress bar."""

    def __init__(self, o: Options, ckpt, sha: str, name: str, src: str, bar):
        self.o, self.ckpt, self.sha, self.name, self.src, self.bar = o, ckpt, sha, name, src, bar
        self._ids = None
        self.text_info: dict = {}

    def variant(self, bits: int) -> Path:
        return variant(self.ckpt, self.sha, self.name, bits, self.o.group_size, self.src)

    def load(self, bits: int, device: str = "cpu"):
        from .runtime import load
        return load(self.variant(bits), qdec="off", device=device)

    def ids(self, lm) -> list[int]:
        """The evaluation tokens (the first --tokens + 1 of the text), tokenized once."""
        if self._ids is None:
            from .evaluate import read_text, tokenize
            text, name = read_text(self.o.text)
            self._ids = tokenize(lm, text, self.o.tokens + 1)
            self.text_info = {"text": name, "sha256": hashlib.sha256(text.encode()).hexdigest(),
                              "tokens": len(self._ids) - 1, "ctx": self.o.ctx, "seed": self.o.seed}
        return self._ids

    def perplexity(self, lm, desc: str) -> float:
        from .evaluate import perplexity
        ids = self.ids(lm)
        ppl = perplexity(lm, ids, min(self.o.ctx, lm.model.cfg.max_position_embeddings), self.o.seed, desc=desc)
        self.bar.update(1)
        return ppl


def pcie_bytes(lm, k_chunk: int, bits: int) -> int:
    """Residual bytes one token reads over PCIe at k_chunk on every layer with `bits`-bit residuals: the selected
    rows plus the per-output-channel scales (none at 16 bits)."""
    from .qdec import k_total
    total = 0
    for lin in lm.model.linears():
        n = lin.out_features
        total += k_total(k_chunk, lin.in_features) * n * bits // 8 + (0 if bits == 16 else 2 * n)
    return total


def selected_share(lm, k_chunk: int) -> float:
    """The share of a layer's input channels compensated at k_chunk, averaged over the layers (what random selection's
    recall should come to)."""
    from .qdec import k_total
    lins = list(lm.model.linears())
    return sum(k_total(k_chunk, lin.in_features) / lin.in_features for lin in lins) / len(lins)


def width_k(k4: int, bits: int) -> int | None:
    """k_chunk at `bits`-bit residuals that reads the bytes of k4 at 4 bits (None when it is not a whole k)."""
    return k4 * 4 // bits if (k4 * 4) % bits == 0 and k4 * 4 >= bits else None


def quality_evals(o: Options) -> int:
    n = 1 + len(o.bits) * (1 + len(o.k_chunks))
    n += (0 if o.compare_bits in o.bits else 1 + len(o.k_chunks)) + len(SELECTION_MODES) * len(o.k_chunks)
    return n + sum(1 for b in o.residual_bits for k in o.k_chunks if width_k(k, b)) + (16 in o.residual_bits)


def measure_quality(r: Run) -> dict:
    """Perplexity of the source model, of every base width off and approx per k_chunk, and at --compare-bits the
    other selection modes and residual widths (each selection's recall vs exact top-k per layer type)."""
    from .model import KINDS
    from .outliers import SelectionRecall
    from .quant import quantize_residual
    from .runtime import LocalModel, dense_model
    o, rows = r.o, []
    src_lm = LocalModel(dense_model(r.ckpt), r.ckpt.tokenizer, None, r.src, r.ckpt.eos_ids)
    source = r.perplexity(src_lm, "eval source model")
    del src_lm

    def run(lm, bits: int, mode: str, k: int, res_bits: int = 4) -> None:
        probe = SelectionRecall() if mode != "off" else None
        lm.set_qdec("off" if mode == "off" else {"mode": mode, "k_chunk": k})
        lm.settings.observer = probe
        desc = f"eval W{bits} {mode}" + (f" k={k}" if mode != "off" else "")
        desc += f" R{res_bits}" if res_bits != 4 else ""
        try:
            ppl = r.perplexity(lm, desc)
        finally:
            lm.settings.observer = None
        rows.append({"bits": bits, "mode": mode, "k_chunk": k, "residual_bits": res_bits, "ppl": ppl,
                     "recall": probe.table() if probe else None, "pcie_bytes": pcie_bytes(lm, k, res_bits),
                     "share": selected_share(lm, k)})

    order = [b for b in o.bits if b != o.compare_bits] + [o.compare_bits]  # the last one is changed in place below
    kmax = None
    for bits in order:
        lm = r.load(bits)
        kmax = lm.manifest["calibration"]["kmax"]
        run(lm, bits, "off", 0)
        for k in o.k_chunks:
            if k <= kmax:
                run(lm, bits, "approx", k)
        if bits != o.compare_bits:
            del lm
            continue
        for mode in SELECTION_MODES:
            for k in o.k_chunks:
                run(lm, bits, mode, k)
        # Table 1: the true residual R = W - W_hat at other widths, k_chunk scaled to the bytes of 4-bit residuals
        for res_bits in o.residual_bits:
            for i, blk in enumerate(lm.model.blocks):
                dense = r.ckpt.block_tensors(i)
                for kind in KINDS:
                    lin = getattr(blk, kind)
                    lin.residual = quantize_residual(dense[kind]["weight"] - lin.dense(), res_bits)
            for k4 in o.k_chunks:
                k = width_k(k4, res_bits)
                if k is not None and k <= kmax:
                    run(lm, bits, "approx", k, res_bits)
            if res_bits == 16:  # check: every channel compensated with the fp16 residual is the source model
                run(lm, bits, "exact", ALL_CHANNELS, 16)
        del lm
    return {"source_ppl": source, "kmax": kmax, "rows": rows}


def measure_outliers(r: Run) -> dict:
    """Fig. 5b on the --compare-bits model (QDEC off) over the evaluation text."""
    from .outliers import OutlierStats
    lm = r.load(r.o.compare_bits)
    layer = lm.model.cfg.num_layers // 2
    stats = OutlierStats(lm.model, (layer, "down"))
    try:
        r.perplexity(lm, "outlier statistics")
    finally:
        stats.remove()
    return stats.result()


def measure_kernel(r: Run) -> dict:
    """Fig. 17: the QDEC GEMV's time over the base GEMV per layer type, k_chunk and n_tb, on this model's own layers
    (the tuner's timer: CUDA graphs over several layers, calibration-like inputs) and on Llama-3-8B shapes."""
    from .bench import bench_qdec
    from .tuner.timing import GemvTimer, problem_of
    lm = r.load(r.o.compare_bits, device="cuda")
    problem, timer = problem_of(lm), GemvTimer(lm)
    own = {}
    for layer in problem.layers:
        base = timer(layer.kind, layer.n_tb[0], 0)
        n_tbs = _spread(layer.n_tb, KERNEL_MAX_N_TB)
        ks = [k for k in KERNEL_K if k <= layer.k_max]
        own[layer.kind] = {"N": layer.N, "K": layer.K, "base_us": 1e6 * base,
                           "ratio": {str(n): {str(k): timer(layer.kind, n, k) / base for k in ks} for n in n_tbs}}
        r.bar.update(1)
    del lm, timer
    torch.cuda.empty_cache()
    eight = {}
    for row in bench_qdec(r.o.compare_bits, r.o.group_size) if r.o.shapes_8b else []:
        d = eight.setdefault(row["layer"], {"N": row["N"], "K": row["K"], "base_us": row["base_us"], "ratio": {}})
        d["ratio"][str(row["n_tb"])] = {str(k): us / row["base_us"] for k, us in row["us"].items()}
    r.bar.update(1)
    return {"bits": r.o.compare_bits, "model": own, "llama3_8b": eight}


def _spread(values, n: int) -> list:
    """At most n of the ascending values, first and last included, evenly spread."""
    values = list(values)
    if len(values) <= n:
        return values
    return sorted({values[round(i * (len(values) - 1) / (n - 1))] for i in range(n)})


def measure_pareto(r: Run) -> dict:
    """Fig. 18: per base width, the tuner's settings for each budget (measured decode time per token) and their
    perplexity on the GPU (token by token through the decode graph, as generation computes it)."""
    from .model import KINDS
    from .tuner.tune import tune
    out = {}
    for bits in r.o.bits:
        lm = r.load(bits, device="cuda")
        res = tune(lm, list(r.o.budgets), evaluate=False, write=False)
        lm.set_qdec("off")
        off = r.perplexity(lm, f"GPU eval W{bits} off")
        points, seen = [], {}
        for row in res.rows:
            c = row.choice
            key = (tuple(sorted(c.k_chunk.items())), tuple(sorted(c.n_tb.items())))
            if not c.compensates:
                ppl = off
            elif key in seen:
                ppl = seen[key]
            else:
                lm.set_qdec({"mode": "approx", "k_chunk": dict(c.k_chunk), "n_tb": dict(c.n_tb)})
                ppl = seen[key] = r.perplexity(lm, f"GPU eval W{bits} {row.budget:.1%}")
            points.append({"budget": row.budget, "n_tb_max": c.n_tb_max, "k_chunk": {k: c.k_chunk[k] for k in KINDS},
                           "predicted": c.predicted, "slowdown": row.slowdown, "ms": 1e3 * row.decode,
                           "ms_off": 1e3 * row.decode_off, "ppl": ppl})
        out[str(bits)] = {"ms_off": 1e3 * res.problem.step_time, "ppl_off": off, "points": points}
        del lm
        torch.cuda.empty_cache()
    return {"budgets": list(r.o.budgets), "bits": out}


MEASURE = {"quality": measure_quality, "outliers": measure_outliers, "kernel": measure_kernel,
           "pareto": measure_pareto}


def _steps(o: Options, sections) -> int:
    """Progress-bar steps (mostly evaluations) of the sections."""
    n = {"quality": quality_evals(o), "outliers": 1, "kernel": 5,
         "pareto": len(o.bits) * (1 + len(o.budgets))}
    return sum(n[s] for s in sections)


def make_report(o: Options) -> Path:
    """Measure what the options ask for and write the report folder (atomically); returns its path."""
    from .demo import demo_gguf
    from .loader import MANIFEST, open_checkpoint
    from .progress import progress
    from .report_render import render
    require_matplotlib()
    _check(o)
    src = o.model or str(demo_gguf())
    p = Path(src).expanduser()
    if p.is_dir() and (p / MANIFEST).exists():
        from .modelfile import read_manifest
        origin = read_manifest(p).get("source", {}).get("path", "?")
        raise LocalLLMError(f"{p} is a quantized localllm model; the report quantizes the source checkpoint itself "
                            f"at each width: pass that checkpoint ({origin})")
    why_no_gpu = gpu_unusable()
    asked = o.sections
    sections = tuple(s for s in SECTIONS if s in (asked or SECTIONS))
    if why_no_gpu:
        if asked and all(s in GPU_SECTIONS for s in asked):
            raise LocalLLMError(f"--sections {','.join(asked)} measures the GPU and needs one: {why_no_gpu}")
        sections = tuple(s for s in sections if s not in GPU_SECTIONS)
    ckpt = open_checkpoint(src, o.gguf_file)
    name = model_name(src, ckpt)
    out = Path(o.out or f"report-{_slug(name)}").expanduser()
    old = None
    if out.exists():
        if o.update:
            try:
                old = json.loads((out / "report.json").read_text())
            except (OSError, ValueError):
                raise LocalLLMError(f"--update needs the report.json of an earlier report in {out}; there is none "
                                    "readable: run without --update (and --force to replace the folder)") from None
        elif not o.force:
            raise LocalLLMError(f"{out} already exists; choose another --out, --force to replace it, or --update to "
                                "add sections to it")
    sha = ckpt.fingerprint()
    if old is not None and old.get("model", {}).get("sha256") != sha:
        raise LocalLLMError(f"the report in {out} is of another model (sha256 {old.get('model', {}).get('sha256')}"
                            f"); --update adds sections of the same model: use another --out")

    t0, commit = time.perf_counter(), git_commit()  # the code that measures, before any edit during a long run
    with progress(total=_steps(o, sections), desc="report", unit="step") as bar:
        r = Run(o, ckpt, sha, name, src, bar)
        measured = {}
        for s in sections:
            ts = time.perf_counter()
            bar.set_description(f"report: {s}")
            measured[s] = {**MEASURE[s](r), "run": len((old or {}).get("runs", [])),
                           "seconds": round(time.perf_counter() - ts, 1)}
    cfg = ckpt.config
    runs = (old or {}).get("runs", [])
    runs.append({"command": command_of(o), "sections": list(sections), "commit": commit, "localllm": __version__,
                 "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                 "machine": machine(any(s in GPU_SECTIONS for s in sections)),
                 "seconds": round(time.perf_counter() - t0),
                 "settings": {"bits": list(o.bits), "k_chunks": list(o.k_chunks), "compare_bits": o.compare_bits,
                              "residual_bits": list(o.residual_bits), "group_size": o.group_size,
                              "budgets": list(o.budgets), "tokens": o.tokens, "ctx": o.ctx, "seed": o.seed,
                              "calibration": _calibration(r)},
                 "data": r.text_info})
    report = {
        "format": FORMAT,
        "model": {"name": name, "sha256": sha, "source": ckpt.source,
                  "architecture": f"{cfg.model_type}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
                                  f"intermediate {cfg.intermediate_size}, heads {cfg.num_heads}/{cfg.num_kv_heads}, "
                                  f"vocab {cfg.vocab_size}"},
        "runs": runs,
        "sections": {**(old or {}).get("sections", {}), **measured},
    }
    report["skipped"] = {s: why_no_gpu for s in GPU_SECTIONS if s not in report["sections"] and why_no_gpu}
    with atomic.new_folder(out, replace=o.force or o.update) as tmp:
        (tmp / "report.json").write_text(json.dumps(report, indent=1) + "\n")
        render(report, tmp)
    return out


def _calibration(r: Run) -> dict | None:
    """How the variants were calibrated (from the --compare-bits variant's manifest)."""
    from .modelfile import read_manifest
    c = read_manifest(r.variant(r.o.compare_bits)).get("calibration") or {}
    return {k: c.get(k) for k in ("text", "tokens", "seq_len", "kmax")}
