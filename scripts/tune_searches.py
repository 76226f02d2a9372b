"""Both tuner searches on one quantized model on this GPU, and what each budget's setting buys: `localllm tune`
(without writing profiles) with the value search (tuner.search.allocate, from the model's calibration.qdec_value)
and with the row-count search (the paper's, what a model without the measurement gets), then perplexity and KL
divergence from the source of every setting on --tokens tokens of the shipped text (QDEC by the decode kernel,
token by token), and of each kind at k_chunk 8 in every block for scale.

    python scripts/tune_searches.py MODEL_DIR [--budgets 2.5,5,10,20] [--tokens 4096]
"""
from __future__ import annotations

import argparse

from localllm.errors import script_main
from localllm.evaluate import Reference, load_source, losses, read_text, tokenize
from localllm.kernels import cuda
from localllm.model import KINDS
from localllm.runtime import load
from localllm.tuner.timing import setting
from localllm.tuner.tune import describe, table, tune


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--budgets", default="2.5,5,10,20", help="percent, comma-separated")
    ap.add_argument("--tokens", type=int, default=4096)
    a = ap.parse_args()
    cuda.require_for("this script times the kernels on the GPU")  # (load's advice, --device cpu, is not this script's)
    budgets = [float(b) / 100 for b in a.budgets.split(",")]
    lm = load(a.model, device="cuda", qdec="off")
    calib = lm.manifest["calibration"]
    if "qdec_value" not in calib:
        raise SystemExit(f"{a.model} has no calibration.qdec_value: quantize it again with this version")
    results = {"value": tune(lm, budgets, evaluate=False, write=False)}
    value = calib.pop("qdec_value")  # the model as one quantized before the measurement
    try:
        results["rows"] = tune(lm, budgets, evaluate=False, write=False)
    finally:
        calib["qdec_value"] = value
    for name, res in results.items():
        print(table(res, f"{name} search on this GPU"), flush=True)
    ids = tokenize(lm, read_text(None)[0], a.tokens + 1)
    ref = Reference(load_source(lm, "cuda"), lm)

    def score(qdec) -> str:
        lm.set_qdec(qdec)
        ppl, kl, _, _ = losses(lm, ids, 512, reference=ref)
        return f"perplexity {ppl:.2f} / KL {kl:.3f}"
    print(f"off: {score('off')}")
    for name, res in results.items():
        for r in res.rows:
            c = r.choice
            where = describe(c, res.problem)
            print(f"{name} {100 * r.budget:g}%: {where}, measured {100 * r.slowdown:+.1f}%: "
                  + (score(setting(c)) if c.compensates else "as off"), flush=True)
    for kind in KINDS:
        print(f"{kind} k8 in every block: {score({'mode': 'approx', 'k_chunk': {kind: 8}})}", flush=True)


if __name__ == "__main__":
    script_main(main)
