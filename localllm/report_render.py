"""report.json -> report.md + PNG plots (matplotlib, no display needed). Only reads the measurements: every number
and every sentence about them comes from report.json (localllm.report measures)."""
from __future__ import annotations

import math
import shlex
from pathlib import Path

from .model import KINDS

WIDTH_COLORS = {2: "tab:purple", 4: "tab:blue", 8: "tab:orange", 16: "tab:green"}
MODE_STYLE = {"approx": ("tab:blue", "o", "dynamic, approximate top-k (QDEC)"),
              "exact": ("tab:green", "s", "dynamic, exact top-k"),
              "static": ("tab:orange", "^", "static (calibration mean x²)"),
              "random": ("tab:gray", "v", "random")}


def width_k(k4: int, bits: int) -> int | None:
    """k_chunk at `bits`-bit residuals that reads the bytes of k4 at 4 bits (None when it is not a whole k)."""
    return k4 * 4 // bits if (k4 * 4) % bits == 0 and k4 * 4 >= bits else None


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


# every file render() may write: a report folder's own files (the rest of it is the user's, and stays)
FILES = ("report.md", "fig12_perplexity_vs_k.png", "fig15_approx_vs_exact.png", "fig16_selection_modes.png",
         "table1_residual_bits.png", "fig5b_outliers.png", "fig17_kernel_model.png", "fig17_kernel_8b.png",
         "fig18_pareto.png")


def _save(fig, folder: Path, name: str) -> str:
    assert name in FILES, name
    fig.tight_layout()
    fig.savefig(folder / name, dpi=110)
    _plt().close(fig)
    return name


def _f(x: float) -> str:
    """A perplexity or ratio, to 4 significant digits."""
    if x is None or not math.isfinite(x):
        return "—"
    return f"{x:.4g}" if abs(x) < 1e4 else f"{x:.3e}"


def _bytes(n: float) -> str:
    for unit, size in (("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _rows(q: dict, **match) -> list[dict]:
    return [r for r in q["rows"] if all(r.get(k) == v for k, v in match.items())]


def _ppl(q: dict, **match) -> float | None:
    rows = _rows(q, **match)
    return rows[0]["ppl"] if rows else None


def _run(report: dict, section: str) -> dict:
    return report["runs"][report["sections"][section]["run"]]


# --- quality ----------------------------------------------------------------------------------------------------

def fig12(q: dict, s: dict, folder: Path) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ks = s["k_chunks"]
    xs = list(range(len(ks) + 1))
    for bits in sorted({r["bits"] for r in q["rows"]}):
        ys = [_ppl(q, bits=bits, mode="off")] + [_ppl(q, bits=bits, mode="approx", k_chunk=k, residual_bits=4)
                                                 for k in ks]
        line, = ax.plot(xs[1:], ys[1:], "o-", label=f"W{bits} + QDEC")
        ax.plot(xs[:1], ys[:1], "x", ms=10, mew=2, color=line.get_color())
    ax.axhline(q["source_ppl"], ls="--", color="k", lw=1, label="source model")
    ax.set_xticks(xs, ["0 (off)"] + [str(k) for k in ks])
    ax.set_yscale("log")
    ax.set_xlabel("k_chunk (channels compensated per 1024)")
    ax.set_ylabel("perplexity (log scale)")
    ax.set_title("Perplexity vs k_chunk (paper Fig. 12)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, folder, "fig12_perplexity_vs_k.png")


def fig15(q: dict, s: dict, folder: Path) -> str:
    plt = _plt()
    b, ks = s["compare_bits"], s["k_chunks"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    xs = list(range(len(ks)))
    rec = [(_rows(q, bits=b, mode="approx", k_chunk=k, residual_bits=4) or [{}])[0].get("recall") or {} for k in ks]
    ax2 = ax.twinx()
    ax2.bar(xs, [r.get("all", float("nan")) for r in rec], width=0.5, color="tab:blue", alpha=0.25,
            label="recall of approx top-k")
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("recall vs exact top-k")
    for mode in ("approx", "exact"):
        color, marker, label = MODE_STYLE[mode]
        ax.plot(xs, [_ppl(q, bits=b, mode=mode, k_chunk=k, residual_bits=4) for k in ks], marker=marker, color=color,
                label=label)
    ax.set_zorder(ax2.get_zorder() + 1)
    ax.patch.set_visible(False)
    ax.set_xticks(xs, [str(k) for k in ks])
    ax.set_xlabel("k_chunk")
    ax.set_ylabel("perplexity")
    ax.set_title(f"W{b}: approximate vs exact top-k (paper Fig. 15)")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper right")
    ax.grid(alpha=0.3)
    return _save(fig, folder, "fig15_approx_vs_exact.png")


def fig16(q: dict, s: dict, folder: Path) -> str:
    plt = _plt()
    b, ks = s["compare_bits"], s["k_chunks"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for mode, (color, marker, label) in MODE_STYLE.items():
        ax.plot(ks, [_ppl(q, bits=b, mode=mode, k_chunk=k, residual_bits=4) for k in ks], marker=marker,
                color=color, label=label)
    ax.axhline(_ppl(q, bits=b, mode="off"), ls=":", color="tab:red", lw=1, label=f"W{b}, QDEC off")
    ax.axhline(q["source_ppl"], ls="--", color="k", lw=1, label="source model")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("k_chunk")
    ax.set_ylabel("perplexity")
    ax.set_title(f"W{b}: dynamic vs static vs random selection (paper Fig. 16)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, folder, "fig16_selection_modes.png")


def _width_table(q: dict, s: dict) -> list[tuple[int, dict]]:
    """[(k_chunk at 4 bits, {residual bits: row})] for the equal-bytes groups."""
    b = s["compare_bits"]
    out = []
    for k4 in s["k_chunks"]:
        cells = {}
        for w in (2, 4, 8, 16):
            k = width_k(k4, w)
            rows = _rows(q, bits=b, mode="approx", k_chunk=k, residual_bits=w) if k else []
            if rows:
                cells[w] = rows[0]
        out.append((k4, cells))
    return out


def fig_table1(q: dict, s: dict, folder: Path) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    groups = _width_table(q, s)
    for w in (2, 4, 8, 16):
        pts = sorted((c[w]["pcie_bytes"], c[w]["ppl"]) for _, c in groups if w in c)
        if pts:
            ax.plot([p[0] / 1e6 for p in pts], [p[1] for p in pts], "o-", color=WIDTH_COLORS[w],
                    label=f"{w}-bit residuals" if w < 16 else "FP16 residuals")
    ax.axhline(_ppl(q, bits=s["compare_bits"], mode="off"), ls=":", color="tab:red", lw=1, label="QDEC off")
    ax.axhline(q["source_ppl"], ls="--", color="k", lw=1, label="source model")
    ax.set_xscale("log")
    from matplotlib.ticker import FormatStrFormatter
    ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.set_xlabel("residual bytes read per token over PCIe (MB, all layers)")
    ax.set_ylabel("perplexity")
    ax.set_title(f"W{s['compare_bits']}: residual width at equal PCIe bytes (paper Table 1)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, folder, "table1_residual_bits.png")


def quality_md(q: dict, s: dict, folder: Path) -> list[str]:
    b, ks = s["compare_bits"], s["k_chunks"]
    src = q["source_ppl"]
    out = ["## 1. Perplexity vs k_chunk (paper Fig. 12)", "",
           f"QDEC's approximate top-k (the runtime's selection) with 4-bit residuals, every layer at the same "
           f"k_chunk; `off` is the quantized model alone. Source model: **{_f(src)}**.", "",
           "| base | off | " + " | ".join(f"k={k}" for k in ks) + " |",
           "|---|---|" + "---|" * len(ks)]
    bits_all = sorted({r["bits"] for r in q["rows"]})
    for bits in bits_all:
        out.append(f"| W{bits} | {_f(_ppl(q, bits=bits, mode='off'))} | "
                   + " | ".join(_f(_ppl(q, bits=bits, mode="approx", k_chunk=k, residual_bits=4)) for k in ks) + " |")
    out += ["", f"![perplexity vs k_chunk]({fig12(q, s, folder)})", "",
            f"No intervals in this report: on {s.get('tokens', 'these')} scored tokens, perplexities a few percent apart "
            "can be so by noise in either direction (`localllm eval` compares settings token by token, with 95% "
            "intervals).", ""]
    for bits in bits_all:
        off, k0 = _ppl(q, bits=bits, mode="off"), ks[0]
        first = _ppl(q, bits=bits, mode="approx", k_chunk=k0, residual_bits=4)
        if off and first and off > src:  # in mean loss (log perplexity): in perplexity itself low widths look closer
            out.append(f"- W{bits}: k_chunk {k0} takes perplexity from {_f(off)} to {_f(first)}, "
                       f"{_pct(math.log(off / first) / math.log(off / src))} of the way to the source model in "
                       "mean loss.")
    out.append("")

    out += [f"## 2. Approximate vs exact top-k (paper Fig. 15), W{b}", "",
            "Recall: the share of each token's exact per-chunk top-k channels that the selection also picked, "
            "measured on the real inputs of every compensated layer during the evaluation, averaged over tokens "
            "and layers.", "",
            "| k_chunk | approx ppl | exact ppl | recall (all) | " + " | ".join(f"recall {k}" for k in KINDS) + " |",
            "|---|---|---|---|" + "---|" * len(KINDS)]
    for k in ks:
        ra = (_rows(q, bits=b, mode="approx", k_chunk=k, residual_bits=4) or [{}])[0]
        rec = ra.get("recall") or {}
        out.append(f"| {k} | {_f(ra.get('ppl'))} | {_f(_ppl(q, bits=b, mode='exact', k_chunk=k, residual_bits=4))} | "
                   f"{_f(rec.get('all'))} | " + " | ".join(_f(rec.get(kind)) for kind in KINDS) + " |")
    out += ["", f"![approximate vs exact top-k]({fig15(q, s, folder)})", ""]

    out += [f"## 3. Dynamic vs static vs random selection (paper Fig. 16), W{b}", "",
            "Static: the calibration's highest mean x² channels per chunk, the same for every token; random: a "
            "uniform draw per token and chunk (seeded). Recall vs exact top-k in brackets.", "",
            "| k_chunk | " + " | ".join(MODE_STYLE) + " |", "|---|" + "---|" * len(MODE_STYLE)]
    for k in ks:
        cells = []
        for mode in MODE_STYLE:
            r = (_rows(q, bits=b, mode=mode, k_chunk=k, residual_bits=4) or [{}])[0]
            rec = (r.get("recall") or {}).get("all")
            cells.append(f"{_f(r.get('ppl'))} ({_f(rec)})" if r else "—")
        out.append(f"| {k} | " + " | ".join(cells) + " |")
    out += ["", f"![selection modes]({fig16(q, s, folder)})", ""]
    for k in ks:
        st = _ppl(q, bits=b, mode="static", k_chunk=k, residual_bits=4)
        dyn = [kk for kk in ks
               if (_ppl(q, bits=b, mode="approx", k_chunk=kk, residual_bits=4) or math.inf) <= (st or 0)]
        if st and dyn and dyn[0] < k:
            out.append(f"- static selection at k_chunk {k} ({_f(st)}): dynamic selection reads as low at k_chunk "
                       f"{dyn[0]} ({_f(_ppl(q, bits=b, mode='approx', k_chunk=dyn[0], residual_bits=4))}), "
                       f"{k // dyn[0]}x fewer channels.")
    out.append("")
    # --residual-bits "": nothing to compare (reports before 2026-11-23 did not record the widths: the defaults ran)
    if "residual_bits" in s and not any(w != 4 for w in s["residual_bits"]):
        return out + [f"## 4. Residual bit width at equal PCIe bytes (paper Table 1), W{b}", "",
                      "Not measured (`--residual-bits` was empty).", ""]

    out += [f"## 4. Residual bit width at equal PCIe bytes (paper Table 1), W{b}", "",
            "The residual R = W − Ŵ quantized per output channel at 2, 4 or 8 bits (symmetric, MSE-searched "
            "scale, as the 4-bit residuals are) or kept in FP16, each with k_chunk scaled so a token reads the "
            "same residual bytes (k × bits constant; the scales, 2 bytes per output channel, are added to the "
            "bytes). Each row is one byte budget (its 4-bit cell's bytes); the best perplexity of a row is in bold. "
            "Where a layer's input is narrower than 1024 channels its k is rounded up, so cells can differ a little "
            "in bytes: the plot places each at its own. The CPU path emulates the other widths; the GPU kernel "
            "reads 4-bit residuals.", "",
            "| k_chunk at 4 bits | bytes/token | 2-bit | 4-bit | 8-bit | FP16 |", "|---|---|---|---|---|---|"]
    for k4, cells in _width_table(q, s):
        if not cells:
            continue
        best = min(c["ppl"] for c in cells.values())
        nbytes = cells.get(4, next(iter(cells.values())))["pcie_bytes"]
        row = []
        for w in (2, 4, 8, 16):
            c = cells.get(w)
            txt = f"{_f(c['ppl'])} (k={c['k_chunk']})" if c else "—"
            row.append(f"**{txt}**" if c and c["ppl"] == best else txt)
        out.append(f"| {k4} | {_bytes(nbytes)} | " + " | ".join(row) + " |")
    out += ["", f"![residual width]({fig_table1(q, s, folder)})", ""]
    return out


def checks_md(q: dict) -> list[str]:
    out = ["## Checks", "", "Numbers the report computes that theory pins down:", ""]
    exact = [r["recall"]["all"] for r in q["rows"] if r["mode"] == "exact" and r.get("recall")]
    if exact:
        n = len(exact)
        out.append(f"- recall of exact top-k against itself, over {n} evaluation{'s' if n != 1 else ''}: min "
                   f"{_f(min(exact))} (1 by construction).")
    full = _rows(q, mode="exact", k_chunk=1024, residual_bits=16)
    if full:
        f, src = full[0]["ppl"], q["source_ppl"]
        out.append(f"- every channel compensated with the FP16 residual (W{full[0]['bits']}, exact, k_chunk 1024): "
                   f"{_f(f)} vs the source model's {_f(src)} ({100 * (f / src - 1):+.3f}%; the difference is the "
                   "FP16 rounding of R).")
    elif q.get("full_check"):
        out.append("- not run: every channel compensated with the FP16 residual gives the source model "
                   f"({q['full_check']['why']}).")
    rnd = [r for r in q["rows"] if r["mode"] == "random" and r.get("recall")]
    if rnd:
        out.append("- recall of random selection vs the share of channels it draws (what it should come to): "
                   + ", ".join(f"k={r['k_chunk']}: {_f(r['recall']['all'])} vs {_f(r['share'])}" for r in rnd) + ".")
    return out + [""]


# --- outliers ---------------------------------------------------------------------------------------------------

def outliers_md(o: dict, s: dict, folder: Path) -> list[str]:
    plt = _plt()
    per = o["per_kind"]
    names = [("share_1", "energy in top 1%"), ("share_5", "energy in top 5%"),
             ("static_recall_1", "static top-1% recall"), ("static_recall_5", "static top-5% recall")]
    kinds = [k for k in KINDS + ("all",) if k in per]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    w = 0.2
    for i, (key, label) in enumerate(names):
        ax.bar([j + (i - 1.5) * w for j in range(len(kinds))], [per[k].get(key, 0) for k in kinds], w, label=label)
    ax.set_xticks(range(len(kinds)), kinds)
    ax.set_ylim(0, 1)
    ax.set_title("Per layer type, mean over tokens and layers")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    ser = o["series"]
    for key, label in (("static_recall_1", "static top-1% recall"), ("static_recall_5", "static top-5% recall")):
        if ser.get(key):
            ax2.plot(range(len(ser[key])), ser[key], label=label)
    ax2.set_ylim(0, 1.05)
    ax2.set_xlabel("token")
    ax2.set_title(f"Block {ser['layer']} {ser['kind']} projection, per token (paper Fig. 5b)")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    png = _save(fig, folder, "fig5b_outliers.png")
    out = [f"## 5. Activation outliers (paper Fig. 5b), W{s['compare_bits']}, QDEC off", "",
           "On the inputs each layer's weights multiply (after RMSNorm or the SwiGLU gate), over the evaluation "
           "text: the share of a token's energy Σx² in its largest 1% / 5% of channels, and the recall of the "
           "static top 1% / 5% set (the calibration's highest mean x², what static selection compensates) "
           "against the token's own top 1% / 5%.", "",
           "| layer type | " + " | ".join(label for _, label in names) + " |", "|---|" + "---|" * len(names)]
    for k in kinds:
        out.append(f"| {k} | " + " | ".join(_pct(per[k][key]) if key in per[k] else "—" for key, _ in names) + " |")
    out += ["", f"![activation outliers]({png})", ""]
    return out


# --- GPU --------------------------------------------------------------------------------------------------------

def _kernel_fig(d: dict, title: str, folder: Path, name: str) -> str:
    plt = _plt()
    kinds = [k for k in KINDS if k in d] or list(d)
    fig, axes = plt.subplots(1, len(kinds), figsize=(3.2 * len(kinds), 3.4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        e = d[kind]
        for n_tb, ratios in e["ratio"].items():
            ks = [int(k) for k in ratios]
            ax.plot(ks, [ratios[str(k)] for k in ks], "o-", ms=3, label=f"n_tb={n_tb}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ticks = sorted({int(k) for r in e["ratio"].values() for k in r})
        ax.set_xticks(ticks, [str(k) for k in ticks])
        ax.set_title(f"{kind} {e['K']}→{e['N']} ({e['base_us']:.1f} µs)", fontsize=9)
        ax.set_xlabel("k_chunk")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("time / base GEMV")
    fig.suptitle(title, fontsize=10)
    return _save(fig, folder, name)


def _kernel_table(d: dict) -> list[str]:
    ks = sorted({int(k) for e in d.values() for r in e["ratio"].values() for k in r})
    out = ["| layer | K→N | base µs | n_tb | " + " | ".join(f"k={k}" for k in ks) + " |",
           "|---|---|---|---|" + "---|" * len(ks)]
    for kind, e in d.items():
        for n_tb, r in e["ratio"].items():
            out.append(f"| {kind} | {e['K']}→{e['N']} | {e['base_us']:.2f} | {n_tb} | "
                       + " | ".join(f"{r[str(k)]:.2f}" if str(k) in r else "—" for k in ks) + " |")
    return out


def kernel_md(kd: dict, report: dict, folder: Path) -> list[str]:
    gpu = _run(report, "kernel")["machine"].get("gpu", {}).get("name", "the GPU")
    out = [f"## 6. QDEC kernel time vs k_chunk and n_tb (paper Fig. 17), W{kd['bits']}, {gpu}", "",
           "Time of the GEMV with dynamic error compensation over the plain GEMV of the same layer, inside CUDA "
           "graphs; n_tb = compensating thread blocks. This model's own layers (several layers per graph, inputs "
           "with the calibration's per-channel spread):", ""]
    out += _kernel_table(kd["model"])
    png = _kernel_fig(kd["model"], "this model's layers", folder, "fig17_kernel_model.png")
    out += ["", f"![kernel, this model]({png})", ""]
    if kd["llama3_8b"]:
        png = _kernel_fig(kd["llama3_8b"], "Llama-3-8B shapes", folder, "fig17_kernel_8b.png")
        out += ["Llama-3-8B shapes, random weights and residuals (`localllm bench qdec`):", ""]
        out += _kernel_table(kd["llama3_8b"]) + ["", f"![kernel, 8B shapes]({png})", ""]
    return out


def pareto_md(pd: dict, report: dict, folder: Path) -> list[str]:
    plt = _plt()
    gpu = _run(report, "pareto")["machine"].get("gpu", {}).get("name", "the GPU")
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    budgets = "/".join(f"{100 * b:g}" for b in pd["budgets"])
    out = [f"## 7. Perplexity vs time per token (paper Fig. 18), {gpu}", "",
           f"`localllm tune` for each budget ({budgets}% of the decode step; its measured decode step, CUDA graph), "
           "then the perplexity of that setting on the GPU, token by token through the decode graph.", "",
           "| base | budget | n_tb_max / (k_qkv, k_o, k_gu, k_d) | measured slowdown | ms/token | perplexity |",
           "|---|---|---|---|---|---|"]
    for bits, d in pd["bits"].items():
        xs = [d["ms_off"]] + [p["ms"] for p in d["points"]]
        ys = [d["ppl_off"]] + [p["ppl"] for p in d["points"]]
        line, = ax.plot(xs[1:], ys[1:], "o-", label=f"W{bits}")
        ax.plot(xs[:1], ys[:1], "x", ms=10, mew=2, color=line.get_color())
        for p in d["points"]:
            ax.annotate(f"{100 * p['budget']:g}%", (p["ms"], p["ppl"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        out.append(f"| W{bits} | off | | | {d['ms_off']:.3f} | {_f(d['ppl_off'])} |")
        for p in d["points"]:
            ks = ", ".join(str(p["k_chunk"][k]) for k in KINDS) + "".join(
                f"; {k} in {len(b)} blocks" for k, b in p.get("blocks", {}).items())
            out.append(f"| W{bits} | {100 * p['budget']:g}% | {p['n_tb_max'] or '-'} / ({ks}) | "
                       f"{100 * p['slowdown']:+.1f}% | {p['ms']:.3f} | {_f(p['ppl'])} |")
    ax.set_yscale("log")
    ax.set_xlabel("time per token (ms)")
    ax.set_ylabel("perplexity (log scale)")
    ax.set_title(f"Perplexity vs time per token: × QDEC off, ● budgets {budgets}%", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    out += ["", f"![pareto]({_save(fig, folder, 'fig18_pareto.png')})", ""]
    return out + _budget_notes(pd, report.get("sections", {}).get("kernel"))


def _budget_notes(pd: dict, kd: dict | None) -> list[str]:
    """Which budgets bought nothing, and why, from the measured numbers: the cheapest compensating call of each
    layer type in section 6 against the decode step."""
    out = []
    for bits, d in pd["bits"].items():
        empty = [p for p in d["points"] if not any(p["k_chunk"].values())]
        if not empty:
            continue
        bought = [p for p in d["points"] if any(p["k_chunk"].values())]
        if not bought:
            out.append(f"- W{bits}: no budget ({_budget_list(empty)}) bought any compensation (k_chunk 0 on every "
                       "layer: the plain model).")
            continue
        p, ks = bought[0], ", ".join(str(bought[0]["k_chunk"][k]) for k in KINDS)
        out.append(f"- W{bits}: budget{'s' if len(empty) > 1 else ''} {_budget_list(empty)} bought no compensation "
                   f"(k_chunk 0 on every layer: the plain model); the smallest budget that bought some, "
                   f"{100 * p['budget']:g}%, took ({ks}) at {100 * p['slowdown']:+.1f}%, perplexity "
                   f"{_f(d['ppl_off'])} → {_f(p['ppl'])}.")
    own = (kd or {}).get("model") or {}
    if not out or not own or not all("count" in e for e in own.values()):
        return out + ([""] if out else [])
    # the cheapest compensating call of each layer type: (added µs per call, ratio, n_tb, k, entry)
    cheap = {}
    for kind, e in own.items():
        ratio, n_tb, k = min((r, n, k) for n, rs in e["ratio"].items() for k, r in rs.items())
        cheap[kind] = ((ratio - 1) * e["base_us"], ratio, n_tb, k, e)
    ms = {b: d["ms_off"] for b, d in pd["bits"].items()}
    step = ms.get(str(kd["bits"]), next(iter(ms.values())))
    kind, (added, ratio, n_tb, k, e) = min(cheap.items(), key=lambda c: c[1][0] * c[1][4]["count"])
    share = added * e["count"] / (1e3 * step)
    if share <= 0:  # a call timed no slower than the plain GEMV: the GEMV times do not explain it
        return out + [""]
    lo = lambda i: min(c[i] for c in cheap.values())  # noqa: E731
    hi = lambda i: max(c[i] for c in cheap.values())  # noqa: E731
    base = [c[4]["base_us"] for c in cheap.values()]
    out += ["", f"Why: in section 6 (W{kd['bits']}) the cheapest compensating call of each layer type costs "
            f"{lo(1):.2f}–{hi(1):.2f}× its plain GEMV, +{lo(0):.1f}–{hi(0):.1f} µs per call on GEMVs of "
            f"{min(base):.1f}–{max(base):.1f} µs: a cost per call that hardly depends on the layer's size "
            "(selecting the channels, then fetching their residual rows over PCIe), large next to this model's "
            f"GEMVs. The cheapest single step, {kind} at k_chunk {k} (n_tb {n_tb}), adds {e['count']} × "
            f"{added:.1f} µs = {1e-3 * added * e['count']:.3f} ms to the {step:.3f} ms decode step (W{kd['bits']}, "
            f"QDEC off), {_pct(share)}: a budget below about {_pct(share)} cannot compensate any layer of this model "
            "on this GPU."]
    eight = kd.get("llama3_8b") or {}
    if eight:
        r8 = [min(r for rs in e8["ratio"].values() for r in rs.values()) for e8 in eight.values()]
        out[-1] += (f" On the Llama-3-8B shapes (section 6, second table) the cheapest call costs {min(r8):.2f}–"
                    f"{max(r8):.2f}× a layer.")
    return out + [""]


def _budget_list(points: list[dict]) -> str:
    names = [f"{100 * p['budget']:g}%" for p in points]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


# --- the report -------------------------------------------------------------------------------------------------

def _machine(m: dict) -> str:
    n = m["cpu_threads"]
    s = f"{m['cpu']} ({n} thread{'s' if n != 1 else ''}), torch {m['torch']}, Python {m['python']}"
    if m.get("gpu"):
        g = m["gpu"]
        s += f"; GPU {g['name']} (sm {g['compute_capability']}, {g['sm_count']} SMs, driver {g.get('driver')})"
    return s


def render(report: dict, folder: Path) -> None:
    """Write report.md and its PNGs into folder."""
    m, secs = report["model"], report["sections"]
    lines = [f"# QDEC report: {m['name']}", "",
             "What QDEC's dynamic error compensation buys on this model, measured the way the QDEC paper measures "
             "it (the figure and table numbers refer to the paper). Every number below was computed by "
             "`localllm report` in the runs listed under *How this was made*; report.json holds them all.", ""]
    lines += ["## How this was made", "",
              f"- Model: `{m['source'].get('hub_id') or m['source'].get('path')}`"
              + (f" (`{m['source']['gguf_file']}`)" if m["source"].get("gguf_file") else "")
              + f", sha256 `{m['sha256'][:16]}…`; {m['architecture']}.", ""]
    lines += ["| run | sections | date | localllm | machine | seconds |", "|---|---|---|---|---|---|"]
    for i, run in enumerate(report["runs"]):
        if any(sec.get("run") == i for sec in secs.values()):
            lines.append(f"| {i} | {', '.join(run['sections'])} | {run['date']} | {run['localllm']}"
                         f" ({run['commit'] or 'no git'}) | {_machine(run['machine'])} | {run['seconds']} |")
    lines.append("")
    for i, run in enumerate(report["runs"]):
        if any(sec.get("run") == i for sec in secs.values()):
            lines += _run_md(i, run)
    if "quality" in secs:
        q, s = secs["quality"], report["runs"][secs["quality"]["run"]]["settings"]
        lines += quality_md(q, s, folder)
    if "outliers" in secs:
        lines += outliers_md(secs["outliers"], report["runs"][secs["outliers"]["run"]]["settings"], folder)
    for name, fn in (("kernel", kernel_md), ("pareto", pareto_md)):
        if name in secs:
            lines += fn(secs[name], report, folder)
        else:
            why = report.get("skipped", {}).get(name) or "not asked for (--sections)"
            title = {"kernel": "## 6. QDEC kernel time vs k_chunk and n_tb (paper Fig. 17)",
                     "pareto": "## 7. Perplexity vs time per token (paper Fig. 18)"}[name]
            missing = ",".join(n for n in ("kernel", "pareto") if n not in secs)
            lines += [title, "", f"Skipped: {why}. On a machine with an NVIDIA GPU and CuPy "
                      f"(`pip install -e '.[cuda12,report]'`), add the GPU sections to this report with "
                      f"`{_gpu_command(report, missing)}` (DIR: this report's folder).", ""]
    if "quality" in secs:
        lines += checks_md(secs["quality"])
    (folder / "report.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def _run_md(i: int, run: dict) -> list[str]:
    """What one run used (only that: a run that timed kernels evaluated no text) and, when it was interrupted and
    resumed, what each session measured."""
    st, d, secs = run["settings"], run.get("data"), set(run["sections"])
    cal = st.get("calibration") or {}
    bits = set(st["bits"]) if secs & {"quality", "pareto"} else set()
    bits |= {st["compare_bits"]} if secs & {"quality", "outliers", "kernel"} else set()
    # runs before 2026-11-27 did not record the head (the default went to 8 bits on 2026-11-26)
    head = f", output head {'fp16' if st['head_bits'] == 16 else str(st['head_bits']) + '-bit'}" \
        if "head_bits" in st else ""
    out = [f"Run {i}: `{run['command']}`", "",
           f"- Quantized variants: RTN, group size {st['group_size']}, {', '.join(f'W{b}' for b in sorted(bits))}"
           f"{head}, 4-bit QDEC residuals; calibration: {cal.get('tokens')} tokens of {cal.get('text')} (k_chunk up "
           f"to {cal.get('kmax')})."]
    if "quality" in secs:
        widths = (" " + ", ".join(str(w) for w in sorted({4, *st["residual_bits"]})) + " bits"
                  if "residual_bits" in st else "")  # reports before 2026-11-23 did not record them
        out.append(f"- Evaluated: k_chunk {', '.join(map(str, st['k_chunks']))}; at W{st['compare_bits']} also the "
                   f"other selections and residual widths{widths}.")
    if "pareto" in secs:
        out.append(f"- Tuner budgets: {', '.join(f'{100 * b:g}%' for b in st['budgets'])} of the decode step.")
    if d:
        out.append(f"- Data: the first {d['tokens']} predicted tokens of {d['text']} (sha256 `{d['sha256'][:16]}…`), "
                   f"windows of {d['ctx']} tokens, seed {d['seed']} (boundary-bucket and random picks).")
    sessions = run.get("sessions") or []
    if len(sessions) > 1:
        out.append(f"- Interrupted and resumed: the same command, options and code (sha256 `{run['code'][:12]}…`) "
                   f"measured it in {len(sessions)} sessions:")
        for j, ses in enumerate(sessions):
            per = {}
            for key in ses["measured"]:
                per[key.split("/")[0]] = per.get(key.split("/")[0], 0) + 1
            what = [f"{n} {s} measurement{'s' if n > 1 else ''}" for s, n in per.items()]
            what += [f"completed section{'s' if len(ses['sections']) > 1 else ''} {', '.join(ses['sections'])}"] \
                if ses["sections"] else []
            out.append(f"  - session {j + 1}: {ses['date']}, {_machine(ses['machine'])}, {ses['seconds']:.0f} s: "
                       + ("; ".join(what) or "nothing new") + ".")
    return out + [""]


def _gpu_command(report: dict, sections: str) -> str:
    """The last run's command (its model and settings as given) measuring `sections` into DIR with --update."""
    args, out, skip = shlex.split(report["runs"][-1]["command"])[2:], [], False
    for a in args:
        name = a.split("=", 1)[0]
        if skip or name in ("--force", "--update"):
            skip = False
        elif name in ("-o", "--out", "--output", "--sections"):
            skip = "=" not in a  # its value is the next argument
        elif a.startswith("-o") and len(a) > 2:  # -oDIR
            pass
        else:
            out.append(a)
    return "localllm report " + " ".join(map(shlex.quote, out + ["-o", "DIR", "--sections", sections, "--update"]))
