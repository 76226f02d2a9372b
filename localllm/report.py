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
already in -o (each section records the machine and command that measured it).

Long runs keep their work: report.unfinished.json in -o is rewritten (atomically) after every measurement, with
the run's identity (model digest, options, sections, evaluation text, a digest of localllm's code, torch version) and
what it measured so far under "in_progress"; a finished report.json there stays as it was meanwhile. Rerunning the
same command resumes: what is saved is not measured again; another command (or changed code) is refused rather than
mixed in. Once every section is measured, report.md and the plots are moved in (each file atomically), the plots of
sections the report no longer has are removed, report.json is written and the unfinished file removed. Nothing else
in -o (the user's notes, data, dotfiles) is touched, with --force or --update too.
"""
from __future__ import annotations

import datetime
import hashlib
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from . import __version__, atomic
from .errors import LocalLLMError
from .report_render import FILES, width_k

FORMAT = 1
UNFINISHED = "report.unfinished.json"  # a run's measurements until the report is finished
SECTIONS = ("quality", "outliers", "kernel", "pareto")
GPU_SECTIONS = ("kernel", "pareto")
SELECTION_MODES = ("exact", "static", "random")  # compared with approx at --compare-bits (Fig. 15, 16)
KERNEL_K = (1, 2, 4, 8, 16, 32, 64, 128)  # k_chunk values of the kernel sweep (Fig. 17); 1: the tuner's first step
KERNEL_MAX_N_TB = 6  # n_tb values per layer type in the kernel sweep, spread over the viable ones
ALL_CHANNELS = 1024  # k_chunk that selects every channel of a chunk
VARIANT_HEAD_BITS = 16  # the variants' output head: unquantized, as in the paper (variant)
BUDGETS = (0.025, 0.05, 0.1, 0.2, 0.5, 1.0)  # the Pareto section's tuner budgets: the paper's four, and two large
# ones for models whose GEMVs are so short that QDEC's fixed cost per call exceeds the small budgets
# --checks auto: the all-channels check gathers the whole fp16 residual for every token (~17 min for a 1.5B model on
# one CPU thread, seconds for the demo model); auto runs it below this many weights in the linear layers
CHEAP_CHECK_WEIGHTS = 500_000_000


@dataclass
class Options:
    model: str | None = None  # a checkpoint folder, .gguf file or hub id; None: the demo model's GGUF
    out: str | None = None  # None: report-<model name> here
    tokens: int = 2048  # predicted tokens of the evaluation text
    ctx: int | None = None  # tokens per window; None: 512, or the model's context where shorter
    bits: tuple = (2, 3, 4)
    k_chunks: tuple = (8, 16, 32, 64, 128)
    compare_bits: int = 3  # the base width of the selection-mode and residual-width comparisons
    # residual widths compared with the runtime's 4 bits (Table 1; 16: fp16). Quantizing R at many levels is slow
    # (the MSE scale search at 8 bits takes ~10 us per weight): leave 8 out for models of a billion weights
    residual_bits: tuple = (2, 8, 16)
    group_size: int = 128
    budgets: tuple = BUDGETS
    sections: tuple | None = None  # None: all, the GPU ones only where a GPU is usable
    seed: int = 0
    text: str | None = None  # None: the evaluation text shipped with localllm
    gguf_file: str | None = None
    force: bool = False  # replace -o
    update: bool = False  # replace -o, keeping its sections that this run does not measure
    shapes_8b: bool = True  # the kernel section also times Llama-3-8B shapes (random weights)
    checks: str = "auto"  # the all-channels check (an evaluation of its own): on, off, or auto (on for small models)
    argv: list = field(default_factory=list)  # how the command was called, for the report


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise LocalLLMError("localllm report draws its plots with matplotlib, which is not installed: "
                            "pip install 'localllm[report]'") from None


def _listed(values) -> str:
    return ",".join(map(str, values)) or "none"


def _check(o: Options) -> None:
    from .quant import BASE_BITS, GROUP_SIZES, RESIDUAL_BITS, RESIDUAL_WIDTHS
    if not o.bits or any(b not in BASE_BITS for b in o.bits):
        raise LocalLLMError(f"--bits takes base widths from {', '.join(map(str, BASE_BITS))}; got {_listed(o.bits)}")
    if o.compare_bits not in BASE_BITS:
        raise LocalLLMError(f"--compare-bits must be one of {', '.join(map(str, BASE_BITS))}; got {o.compare_bits}")
    if not o.k_chunks or any(not 1 <= k <= ALL_CHANNELS for k in o.k_chunks):
        raise LocalLLMError(f"--k-chunk takes channels per 1024 within 1..{ALL_CHANNELS}; got {_listed(o.k_chunks)}")
    if o.group_size not in GROUP_SIZES:
        raise LocalLLMError(f"--group-size must be one of {', '.join(map(str, GROUP_SIZES))}; got {o.group_size}")
    if any(b not in RESIDUAL_WIDTHS or b == RESIDUAL_BITS for b in o.residual_bits):
        raise LocalLLMError(f"--residual-bits takes widths from {', '.join(str(b) for b in RESIDUAL_WIDTHS if b != 4)}"
                            f" (4 is always there); got {_listed(o.residual_bits)}")
    if o.tokens < 2:
        raise LocalLLMError(f"--tokens must be at least 2; got {o.tokens}")
    bad = [s for s in (o.sections or ()) if s not in SECTIONS]
    if bad or o.sections == ():
        raise LocalLLMError(f"--sections takes a comma-separated list of {', '.join(SECTIONS)}; got {bad or 'none'}")
    if o.checks not in ("auto", "on", "off"):
        raise LocalLLMError(f"--checks takes auto, on or off; got {o.checks!r}")
    if o.checks == "on" and 16 not in o.residual_bits:  # (auto says in the report why it did not run)
        raise LocalLLMError(f"--checks on needs the FP16 residuals of Table 1: add 16 to --residual-bits (got "
                            f"{_listed(o.residual_bits)})")
    if o.force and o.update:
        raise LocalLLMError("--force and --update exclude each other: --force replaces the report whole, --update "
                            "keeps the sections this run does not measure")


def model_name(src: str, ckpt) -> str:
    p = Path(ckpt.source.get("gguf_file") or ckpt.source.get("hub_id") or src)
    return (p.stem if p.suffix == ".gguf" else p.name) or "model"


def _slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-") or "model"


def variant(ckpt, sha: str, name: str, bits: int, group_size: int, src: str) -> Path:
    """The checkpoint quantized to `bits` (with 4-bit residuals and calibration), made once and cached. The output
    head stays in fp16, as in the paper: QDEC compensates the decoder's linears only, so with every channel
    compensated the variant is the source model up to the fp16 rounding of R (the report's check)."""
    from .demo import cache_dir
    from .modelfile import read_manifest
    from .quantize import quantize
    out = cache_dir() / "models" / f"{_slug(name)}-{sha[:12]}-w{bits}g{group_size}"

    def made() -> bool:  # this variant, whole, in the cache
        try:
            m = read_manifest(out)
            return m["source"].get("sha256") == sha and bool(m.get("residual")) and m["quant"].get("head") is None
        except (LocalLLMError, KeyError, TypeError, AttributeError):
            return False
    if made():
        return out
    if out.exists():
        shutil.rmtree(out)  # our own cache, from another localllm or an interrupted write: make it again
    print(f"localllm: quantizing {name} to {bits} bits for the report (cached in {out})", file=sys.stderr)
    seq_len = min(512, ckpt.config.max_position_embeddings)
    try:
        return quantize(src, str(out), bits=bits, group_size=group_size, seq_len=seq_len, ckpt=ckpt,
                        head_bits=VARIANT_HEAD_BITS, device="auto")
    except LocalLLMError:
        if not made():
            raise
        return out  # another report (another terminal) put the same variant in place meanwhile: use it


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


def code_digest() -> str:
    """sha256 of the code that measures (localllm, its kernels and tuner: sources and shipped data), so a resumed
    run is known to compute what the interrupted one did, with or without a git checkout."""
    h = hashlib.sha256()
    for pkg in ("localllm", "localllm.kernels", "localllm.tuner"):
        for root in importlib.util.find_spec(pkg).submodule_search_locations:
            base = Path(root)
            files = [f for pat in ("*.py", "*.cu", "*.cuh", "data/*.txt") for f in base.glob(pat)]
            for f in sorted(files):
                h.update(f"{pkg}/{f.relative_to(base).as_posix()}\n".encode())
                h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def full_check(o: Options, cfg) -> tuple[bool, str]:
    """Whether the all-channels check runs, and why (for the report)."""
    if o.checks == "off":
        return False, "--checks off"
    if 16 not in o.residual_bits:
        return False, "it needs the FP16 residuals of Table 1 (--residual-bits with 16)"
    if o.checks == "on":
        return True, "--checks on"
    n = cfg.linear_weights
    if n < CHEAP_CHECK_WEIGHTS:
        return True, f"--checks auto: {n / 1e9:.2g}e9 weights, under {CHEAP_CHECK_WEIGHTS / 1e9:.2g}e9"
    return False, (f"--checks auto: the model's {n / 1e9:.2g}e9 linear weights are over the "
                   f"{CHEAP_CHECK_WEIGHTS / 1e9:.2g}e9 below which it runs by default (it gathers the whole FP16 "
                   "residual for every token); `--checks on` runs it")


class Run:
    """One `localllm report` run: what it measures (the evaluation tokens, the quantized variants, a progress bar)
    and report.json as it grows, saved after every measurement so that the same command can resume it."""

    def __init__(self, o: Options, ckpt, sha: str, name: str, src: str, text: tuple[str, str], report: dict,
                 index: int, state: dict, out: Path, bar):
        self.o, self.ckpt, self.sha, self.name, self.src, self.bar = o, ckpt, sha, name, src, bar
        self.text, self.report, self.index, self.state, self.out = text, report, index, state, out
        self.record = report["runs"][index]
        self.session = self.record["sessions"][-1]
        self.full_check = state["key"]["settings"]["full_check"]
        self._ids = None
        self._t = time.perf_counter()
        self.section = None

    def variant(self, bits: int) -> Path:
        return variant(self.ckpt, self.sha, self.name, bits, self.o.group_size, self.src)

    def load(self, bits: int, device: str = "cpu"):
        from .runtime import load
        return load(self.variant(bits), qdec="off", device=device)

    def ids(self, lm) -> list[int]:
        """The evaluation tokens (the first --tokens + 1 of the text), tokenized once."""
        if self._ids is None:
            from .evaluate import tokenize
            text, name = self.text
            self._ids = tokenize(lm, text, self.o.tokens + 1)
            self.record["data"] = {"text": name, "sha256": hashlib.sha256(text.encode()).hexdigest(),
                                   "tokens": len(self._ids) - 1, "ctx": self.o.ctx, "seed": self.o.seed}
        return self._ids

    def perplexity(self, lm, desc: str) -> float:
        from .evaluate import perplexity
        ids = self.ids(lm)
        ppl = perplexity(lm, ids, self.o.ctx, self.o.seed, desc=desc)
        self.bar.update(1)
        return ppl

    def measure(self, key: str, fn, steps: int = 1):
        """fn()'s result, measured once: saved under `key` (with the section's name in front) as soon as it is
        made; a resumed run returns the saved value (and advances the progress bar by its steps)."""
        key = f"{self.section}/{key}"
        done = self.state["done"]
        if key in done:
            self.bar.update(steps)
            return done[key]
        done[key] = fn()
        self.session["measured"].append(key)
        self.save()
        return done[key]

    def finish(self, section: str, result: dict) -> None:
        """The section is complete: it joins the report's sections, its single measurements leave the state."""
        self.tick()
        secs = self.state["seconds"].pop(section, 0.0)
        self.report["sections"][section] = {**result, "run": self.index, "seconds": round(secs, 1)}
        self.state["done"] = {k: v for k, v in self.state["done"].items() if not k.startswith(section + "/")}
        self.session["sections"].append(section)
        self.section = None
        self.save()

    def tick(self) -> None:
        """Add the time since the last tick to the session, the run and the section under way."""
        now = time.perf_counter()
        dt, self._t = now - self._t, now
        self.session["seconds"] = round(self.session["seconds"] + dt, 1)
        self.record["seconds"] = round(sum(s["seconds"] for s in self.record["sessions"]))
        if self.section is not None:
            self.state["seconds"][self.section] = self.state["seconds"].get(self.section, 0.0) + dt

    def save(self) -> None:
        self.tick()
        self.out.mkdir(parents=True, exist_ok=True)
        atomic.write_text(self.out / UNFINISHED, json.dumps(self.report, indent=1) + "\n")


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


def quality_plan(o: Options, kmax: dict, full: bool) -> list[tuple[int, str, int, int]]:
    """Every (bits, mode, k_chunk, residual bits) the quality section evaluates, in order; kmax: bits -> the variant's
    largest calibrated k_chunk. The --compare-bits model comes last: its residuals are replaced (Table 1)."""
    plan = []
    for bits in [b for b in o.bits if b != o.compare_bits] + [o.compare_bits]:
        plan += [(bits, "off", 0, 4)] + [(bits, "approx", k, 4) for k in o.k_chunks if k <= kmax[bits]]
        if bits != o.compare_bits:
            continue
        plan += [(bits, mode, k, 4) for mode in SELECTION_MODES for k in o.k_chunks]
        for res_bits in o.residual_bits:  # k_chunk scaled to the bytes of 4-bit residuals
            ks = (width_k(k4, res_bits) for k4 in o.k_chunks)
            plan += [(bits, "approx", k, res_bits) for k in ks if k is not None and k <= kmax[bits]]
            if res_bits == 16 and full:  # check: every channel compensated with the fp16 residual is the source
                plan.append((bits, "exact", ALL_CHANNELS, 16))
    return plan


def quality_evals(o: Options, full: bool) -> int:
    """Evaluations of the quality section (the source model and the plan; k_chunk taken as calibrated)."""
    return 1 + len(quality_plan(o, {b: ALL_CHANNELS for b in (*o.bits, o.compare_bits)}, full))


def true_residuals(ckpt, path: Path, lm):
    """(linear, R = W - W_hat) for each decoder linear of lm, the variant at path: W is the source's weights as the
    variant quantized them, with SmoothAttention's factors folded into qkv where it was on (else R would hold
    (1 - lambda) W_q, and compensating a channel would undo part of the smoothing)."""
    from safetensors import safe_open

    from .model import KINDS
    from .modelfile import FILES
    from .smooth_attention import fold
    with safe_open(path / FILES[0], "pt") as f:
        smooth = {n: f.get_tensor(n) for n in f.keys() if n.endswith(".k_smooth")}
    for i, blk in enumerate(lm.model.blocks):
        dense = ckpt.block_tensors(i)
        if (lam := smooth.get(f"blocks.{i}.k_smooth")) is not None:
            dense = fold(dense, lm.model.cfg, lam)
        for kind in KINDS:
            lin = getattr(blk, kind)
            yield lin, dense[kind]["weight"] - lin.dense()


def measure_quality(r: Run) -> dict:
    """Perplexity of the source model, of every base width off and approx per k_chunk, and at --compare-bits the
    other selection modes and residual widths (each selection's recall vs exact top-k per layer type). Each
    evaluation is saved as it is made; models are loaded only for what is not saved yet."""
    from .modelfile import read_manifest
    from .outliers import SelectionRecall
    from .quant import quantize_residual
    from .runtime import LocalModel, dense_model
    o = r.o

    def source() -> float:
        src_lm = LocalModel(dense_model(r.ckpt), r.ckpt.tokenizer, None, r.src, r.ckpt.eos_ids)
        return r.perplexity(src_lm, "eval source model")

    held = {"bits": None, "res": None, "lm": None}

    def model(bits: int, res_bits: int):
        """The variant at `bits` with `res_bits`-bit residuals (the true R = W - W_hat, requantized for Table 1)."""
        if held["bits"] != bits or (held["res"] != res_bits and res_bits == 4):
            held["lm"] = None  # free the old one before loading
            held.update(bits=bits, res=4, lm=r.load(bits))
        lm = held["lm"]
        if held["res"] != res_bits:
            for lin, res in true_residuals(r.ckpt, r.variant(bits), lm):
                lin.residual = quantize_residual(res, res_bits)
            held["res"] = res_bits
        return lm

    def evaluate(bits: int, mode: str, k: int, res_bits: int) -> dict:
        lm = model(bits, res_bits)
        probe = SelectionRecall() if mode != "off" else None
        lm.set_qdec("off" if mode == "off" else {"mode": mode, "k_chunk": k})
        lm.settings.observer = probe
        desc = f"eval W{bits} {mode}" + (f" k={k}" if mode != "off" else "")
        desc += f" R{res_bits}" if res_bits != 4 else ""
        try:
            ppl = r.perplexity(lm, desc)
        finally:
            lm.settings.observer = None
        return {"bits": bits, "mode": mode, "k_chunk": k, "residual_bits": res_bits, "ppl": ppl,
                "recall": probe.table() if probe else None, "pcie_bytes": pcie_bytes(lm, k, res_bits),
                "share": selected_share(lm, k)}

    source_ppl = r.measure("source", source)
    kmax = {b: read_manifest(r.variant(b))["calibration"]["kmax"] for b in dict.fromkeys((*o.bits, o.compare_bits))}
    rows = [r.measure(f"W{b}/{mode}/k{k}/R{rb}", lambda a=(b, mode, k, rb): evaluate(*a))
            for b, mode, k, rb in quality_plan(o, kmax, r.full_check)]
    held["lm"] = None
    return {"source_ppl": source_ppl, "kmax": kmax[o.compare_bits], "rows": rows,
            "full_check": {"run": r.full_check, "why": r.state["key"]["settings"]["full_check_why"]}}


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
        own[layer.kind] = {"N": layer.N, "K": layer.K, "count": layer.count, "base_us": 1e6 * base,
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
    perplexity on the GPU (token by token through the decode graph, as generation computes it). Each width is saved
    as it is done."""
    out = {str(bits): r.measure(f"W{bits}", lambda b=bits: _pareto_width(r, b), steps=1 + len(r.o.budgets))
           for bits in r.o.bits}
    return {"budgets": list(r.o.budgets), "bits": out}


def _pareto_width(r: Run, bits: int) -> dict:
    from .model import KINDS
    from .tuner.timing import setting
    from .tuner.tune import tune
    lm = r.load(bits, device="cuda")
    res = tune(lm, list(r.o.budgets), evaluate=False, write=False)
    lm.set_qdec("off")
    off = r.perplexity(lm, f"GPU eval W{bits} off")
    points, seen = [], {}
    for row in res.rows:
        c = row.choice
        if not c.compensates:
            ppl = off
        elif c.key in seen:
            ppl = seen[c.key]
        else:
            lm.set_qdec(setting(c))
            ppl = seen[c.key] = r.perplexity(lm, f"GPU eval W{bits} {row.budget:.1%}")
        points.append({"budget": row.budget, "n_tb_max": c.n_tb_max, "k_chunk": {k: c.k_chunk[k] for k in KINDS},
                       "blocks": {k: list(b) for k, b in c.blocks.items()},
                       "predicted": c.predicted, "slowdown": row.slowdown, "ms": 1e3 * row.decode,
                       "ms_off": 1e3 * row.decode_off, "ppl": ppl})
    result = {"ms_off": 1e3 * res.problem.step_time, "ppl_off": off, "points": points}
    del lm
    torch.cuda.empty_cache()
    return result


MEASURE = {"quality": measure_quality, "outliers": measure_outliers, "kernel": measure_kernel,
           "pareto": measure_pareto}


def _steps(o: Options, sections, full: bool) -> int:
    """Progress-bar steps (mostly evaluations) of the sections."""
    n = {"quality": quality_evals(o, full), "outliers": 1, "kernel": 5, "pareto": len(o.bits) * (1 + len(o.budgets))}
    return sum(n[s] for s in sections)


def make_report(o: Options) -> Path:
    """Measure what the options ask for and write the report folder (atomically); returns its path. Measurements
    are saved in -o/report.unfinished.json as they are made (UNFINISHED; report.json at the end); an unfinished
    run of the same command is resumed."""
    from .demo import demo_gguf
    from .evaluate import check_ctx, read_text
    from .loader import is_model_folder, open_checkpoint
    from .progress import progress
    from .report_render import render
    require_matplotlib()
    _check(o)
    src = o.model or str(demo_gguf())
    p = Path(src).expanduser()
    if is_model_folder(p):
        from .modelfile import read_manifest
        origin = read_manifest(p).get("source", {}).get("path", "?")
        raise LocalLLMError(f"{p} is a quantized localllm model; the report quantizes the source checkpoint itself "
                            f"at each width: pass that checkpoint ({origin})")
    from .kernels import cuda
    why_no_gpu = cuda.unusable()  # why the GPU sections cannot run here
    asked = o.sections
    sections = tuple(s for s in SECTIONS if s in (asked or SECTIONS))
    if why_no_gpu:
        if asked and all(s in GPU_SECTIONS for s in asked):
            raise LocalLLMError(f"--sections {','.join(asked)} measures the GPU and needs one: {why_no_gpu}")
        sections = tuple(s for s in sections if s not in GPU_SECTIONS)
    if o.out:  # a refusal comes at once, before a GGUF converts
        _check_out(o, Path(o.out).expanduser())
    text = read_text(o.text)  # before the checkpoint opens (a GGUF converts then)
    ckpt = open_checkpoint(src, o.gguf_file)
    limit = ckpt.config.max_position_embeddings
    o = replace(o, ctx=min(512, limit) if o.ctx is None else o.ctx)
    check_ctx(o.ctx, ckpt.config)  # (the windows the report states are the ones it runs)
    name = model_name(src, ckpt)
    out = Path(o.out or f"report-{_slug(name)}").expanduser()
    prior = _check_out(o, out)  # before hashing the model
    sha = ckpt.fingerprint()
    full, full_why = full_check(o, ckpt.config)
    key = {"model": sha, "sections": list(sections), "text": hashlib.sha256(text[0].encode()).hexdigest(),
           "code": code_digest(), "torch": torch.__version__,
           "settings": {"bits": list(o.bits), "k_chunks": list(o.k_chunks), "compare_bits": o.compare_bits,
                        "residual_bits": list(o.residual_bits), "group_size": o.group_size,
                        "budgets": list(o.budgets), "tokens": o.tokens, "ctx": o.ctx, "seed": o.seed,
                        "gguf_file": o.gguf_file, "shapes_8b": o.shapes_8b, "head_bits": VARIANT_HEAD_BITS,
                        "full_check": full, "full_check_why": full_why}}
    report, index, state = _start(o, out, prior, key, sha, name, ckpt, sections)

    commit = git_commit()  # the code that measures, before any edit during a long run
    record = report["runs"][index]
    record["sessions"].append({"date": _now(), "commit": commit, "localllm": __version__,
                               "machine": machine(any(s in GPU_SECTIONS for s in sections)),
                               "seconds": 0.0, "measured": [], "sections": []})
    record.setdefault("commit", commit)
    record.setdefault("machine", record["sessions"][0]["machine"])
    with progress(total=_steps(o, sections, full), desc="report", unit="step") as bar:
        r = Run(o, ckpt, sha, name, src, text, report, index, state, out, bar)
        try:
            for s in sections:
                if report["sections"].get(s, {}).get("run") == index:  # finished before the interruption
                    bar.update(_steps(o, (s,), full))
                    continue
                bar.set_description(f"report: {s}")
                r.section = s
                r.finish(s, MEASURE[s](r))
            record["settings"]["calibration"] = _calibration(r)
        except BaseException:
            measured = state["done"] or any(sec.get("run") == index for sec in report["sections"].values())
            if measured and (out / UNFINISHED).exists():  # (not where the first save itself failed: a full disk)
                print(f"localllm: the report's measurements so far are saved in {out / UNFINISHED}; rerun the "
                      "same command to go on from there", file=sys.stderr)
            raise
    r.tick()
    r.save()  # the last session's seconds, should writing the report below be interrupted
    report.pop("in_progress")
    report["skipped"] = {s: why_no_gpu for s in GPU_SECTIONS if s not in report["sections"] and why_no_gpu}
    _write(out, report, render)
    return out


def _write(out: Path, report: dict, render) -> None:
    """The finished report into out beside the user's files: report.md and plots rendered apart and moved in, the
    report's plots that this one lacks removed, then report.json, then the unfinished file removed (interrupted on the
    way, the same command finishes it again)."""
    with atomic.temp_folder(out / "render") as tmp:
        render(report, tmp)
        made = {f.name for f in Path(tmp).iterdir()}
        for name in made:
            os.replace(Path(tmp) / name, out / name)
    for name in set(FILES) - made:
        (out / name).unlink(missing_ok=True)
    atomic.write_text(out / "report.json", json.dumps(report, indent=1) + "\n")
    (out / UNFINISHED).unlink(missing_ok=True)


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def _check_out(o: Options, out: Path) -> dict | None:
    """Refuse an -o this run may not write (--force and --update apply to a report's folder only); the report
    to go on with: an unfinished one, else the finished report.json, if any."""
    if not out.exists():
        if o.update:  # (a mistyped folder would start a whole new report: hours on a real model)
            raise LocalLLMError(f"--update adds to an earlier report, and there is no {out}; give that report's "
                                "folder, or run without --update")
        atomic.check_writable(out)
        return None
    if not out.is_dir():
        raise LocalLLMError(f"{out} is a file; choose a folder for -o")
    atomic.check_writable(out / UNFINISHED)
    for name in (UNFINISHED, "report.json", "render"):  # what a killed run of ours left is not the user's
        atomic.remove_orphans(out / name)
    unfinished = _read_report(out / UNFINISHED)
    if unfinished is not None and "in_progress" in unfinished:
        return unfinished
    prior = _read_report(out / "report.json")
    if prior is None and any(out.iterdir()):
        raise LocalLLMError(f"{out} exists and holds no localllm report (no readable report.json of one); --force "
                            "and --update replace or extend a report in its folder only: choose another -o")
    if o.update and prior is None:
        raise LocalLLMError(f"--update needs the report.json of an earlier report in {out}; there is none "
                            "readable: run without --update")
    if prior is not None and not (o.update or o.force):
        raise LocalLLMError(f"{out} already holds a report; choose another -o, --force to replace it, or "
                            "--update to add sections to it")
    return prior


def _read_report(path: Path) -> dict | None:
    """A localllm report's JSON at path (None when there is none, or it is unreadable or not one: a report.json
    another program wrote is not ours to replace)."""
    try:
        r = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    ok = isinstance(r, dict) and isinstance(r.get("format"), int) and isinstance(r.get("runs"), list) \
        and isinstance(r.get("sections"), dict) and isinstance(r.get("model"), dict)
    return r if ok else None


def _start(o: Options, out: Path, prior: dict | None, key: dict, sha: str, name: str, ckpt,
           sections) -> tuple[dict, int, dict]:
    """(the report to grow, the index of this run in its runs, the in-progress state): an unfinished run of the same
    command in -o resumes; an unfinished run of another command is refused (--force starts over); a finished
    report (make_report refused it without --force or --update) is extended with --update, else replaced."""
    state = (prior or {}).get("in_progress")
    if state is not None:
        if state.get("key") == key:
            print(f"localllm: resuming the unfinished report in {out} ({len(state['done'])} measurements and "
                  f"{sum(1 for s in prior['sections'].values() if s.get('run') == state['run'])} sections saved)",
                  file=sys.stderr)
            return prior, state["run"], state
        if not o.force:
            old = state.get("key") or {}
            diff = [k for k in key if old.get(k) != key[k] and k != "settings"]
            diff += [k for k in key["settings"] if (old.get("settings") or {}).get(k) != key["settings"][k]]
            raise LocalLLMError(f"{out} holds an unfinished report of another run (it differs in: "
                                f"{', '.join(diff) or '?'}); rerun the command that started it to resume it, or "
                                "--force to start over")
        prior = None
    elif not o.update:
        prior = None
    if prior is not None and prior.get("model", {}).get("sha256") != sha:
        raise LocalLLMError(f"the report in {out} is of another model (sha256 {prior.get('model', {}).get('sha256')}"
                            f"); --update adds sections of the same model: use another -o")
    cfg = ckpt.config
    runs = (prior or {}).get("runs", [])
    runs.append({"command": command_of(o), "sections": list(sections), "localllm": __version__, "date": _now(),
                 "seconds": 0, "settings": {k: v for k, v in key["settings"].items() if k != "full_check_why"},
                 "code": key["code"], "data": {}, "sessions": []})
    report = {
        "format": FORMAT,
        "model": {"name": name, "sha256": sha, "source": ckpt.source,
                  "architecture": f"{cfg.model_type}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
                                  f"intermediate {cfg.intermediate_size}, heads {cfg.num_heads}/{cfg.num_kv_heads}, "
                                  f"vocab {cfg.vocab_size}"},
        "runs": runs,
        "sections": dict((prior or {}).get("sections", {})),
        "in_progress": {"run": len(runs) - 1, "key": key, "done": {}, "seconds": {}},
    }
    return report, len(runs) - 1, report["in_progress"]


def _calibration(r: Run) -> dict | None:
    """How the variants were calibrated (from the --compare-bits variant's manifest)."""
    from .modelfile import read_manifest
    c = read_manifest(r.variant(r.o.compare_bits)).get("calibration") or {}
    return {k: c.get(k) for k in ("text", "tokens", "seq_len", "kmax")}
