"""Perplexity table of quantized models (rtn / awq / squeezellm, 3 / 3.5 / 4 bits) without and with QDEC, on the CPU
(or --device cuda: the GPU's fp16 decode step and its QDEC kernel, token by token, QDEC on or off).

    python scripts/eval_methods.py MODEL_DIR... [--tokens 4096] [--ctx 512] [--settings off,k8,k32] [--device cuda]
        [--text FILE]

Each cell: perplexity / mean KL divergence per token from the source checkpoint each model was quantized from (the
source is loaded once per model; --no-kl skips it). Columns: QDEC off; approx k_chunk 8 on every layer; approx k_chunk 8
on gate_up only, a small-budget setting (what `localllm tune` picked for a 5% budget on the H100 for the 8B W3 shapes
until the faster kernel of 2026-11-24: n_tb 4, k (0, 0, 8, 0), measured +4.3%; now k_chunk 14 on gate_up).
Any kN (k16, k32, ...) is approx k_chunk N on every layer. A second table puts each model's perplexity against the
first model's in the same column (--versus-off: against the first model's QDEC off, e.g. 3 bits + QDEC against plain
3.5 bits), with the 95% interval of the token-by-token comparison (evaluate.paired_change): whether a method's
difference from another is more than noise.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from localllm.errors import script_main

SETTINGS = {"off": "off", "k8": {"mode": "approx", "k_chunk": 8},
            "k8 gate_up": {"mode": "approx", "k_chunk": {"qkv": 0, "o": 0, "gate_up": 8, "down": 0}}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("models", nargs="+")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--text", help="UTF-8 text file (default: the evaluation text shipped with localllm)")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--no-kl", action="store_true", help="perplexity only")
    p.add_argument("--settings", default=",".join(SETTINGS), help="columns, of " + ", ".join(SETTINGS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--versus-off", action="store_true", help="compare every cell with the first model's QDEC off")
    a = p.parse_args()
    bad = [n for n in a.settings.split(",") if n not in SETTINGS and not (n[:1] == "k" and n[1:].isdigit())]
    if bad:
        p.error(f"unknown setting {', '.join(bad)}: use off, kN (approx k_chunk N on every layer) or 'k8 gate_up'")
    settings = {n: SETTINGS.get(n) or {"mode": "approx", "k_chunk": int(n[1:])} for n in a.settings.split(",")}
    from localllm.evaluate import Reference, load_source, losses, paired_change, read_text, source_path, tokenize
    from localllm.modelfile import quant_label
    from localllm.runtime import load
    def header() -> None:
        print(f"| model | {' | '.join(settings)} |")
        print("|---|" + "---|" * len(settings))

    header()
    scored, labels = [], []  # per model: {setting: per-token losses}
    for m in a.models:
        lm = load(m, qdec="off", device=a.device)
        ids = tokenize(lm, read_text(a.text)[0], a.tokens)
        src = source_path(lm)
        ref = None if a.no_kl or not src else Reference(load_source(lm, a.device), lm)
        cells, scored_m = [], {}
        for name, s in settings.items():
            if s != "off" and not lm.has_residuals:
                cells.append("")
                continue
            lm.set_qdec(s)
            ppl, kl, scored_m[name], _ = losses(lm, ids, a.ctx, desc=name, reference=ref)
            cells.append(f"{ppl:.2f}" + (f" / {kl:.4f}" if kl is not None else ""))
        label = quant_label(lm.manifest["quant"]) if lm.manifest else "source (dense)"
        labels.append(f"{label} ({Path(m).name})")
        scored.append(scored_m)
        print(f"| {labels[-1]} | {' | '.join(cells)} |", flush=True)
    if len(scored) > 1:
        against = f"{labels[0]}, QDEC off" if a.versus_off else labels[0]
        print(f"\nperplexity vs {against}, 95% interval of the token-by-token comparison\n")
        header()
        for label, sm in zip(labels[1:], scored[1:]):
            cells = []
            for name in settings:
                base = scored[0].get("off" if a.versus_off else name)
                if name not in sm or base is None or len(sm[name]) != len(base):
                    cells.append("")
                    continue
                change, half = paired_change(sm[name], base, window=a.ctx)
                cells.append(f"{change:+.2f}%" + (f" ± {half:.2f}" if half is not None else ""))
            print(f"| {label} | {' | '.join(cells)} |")


if __name__ == "__main__":
    sys.exit(script_main(main))
