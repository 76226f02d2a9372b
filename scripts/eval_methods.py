"""Perplexity table of quantized models (rtn / awq / squeezellm, 3 / 3.5 / 4 bits) without and with QDEC, on the CPU.

    python scripts/eval_methods.py MODEL_DIR... [--tokens 4096] [--ctx 512]

Columns: QDEC off; approx k_chunk 8 on every layer; approx k_chunk 8 on gate_up only (what `localllm tune` picked
for a 5% budget on the H100 for the 8B W3 shapes: n_tb 4, k (0, 0, 8, 0), measured +4.3%), a small-budget setting.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

SETTINGS = {"off": "off", "k8": {"mode": "approx", "k_chunk": 8},
            "k8 gate_up": {"mode": "approx", "k_chunk": {"qkv": 0, "o": 0, "gate_up": 8, "down": 0}}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("models", nargs="+")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--ctx", type=int, default=512)
    a = p.parse_args()
    from localllm.evaluate import perplexity, read_text, tokenize
    from localllm.modelfile import quant_label
    from localllm.runtime import load
    print(f"| model | {' | '.join(SETTINGS)} |")
    print("|---|" + "---|" * len(SETTINGS))
    for m in a.models:
        lm = load(m, qdec="off")
        ids = tokenize(lm, read_text(None)[0], a.tokens)
        cells = []
        for name, s in SETTINGS.items():
            if s != "off" and not lm.has_residuals:
                cells.append("")
                continue
            lm.set_qdec(s)
            cells.append(f"{perplexity(lm, ids, a.ctx, desc=name):.2f}")
        label = quant_label(lm.manifest["quant"]) if lm.manifest else "source (dense)"
        print(f"| {label} ({Path(m).name}) | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
