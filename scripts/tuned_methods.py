"""3 bits + QDEC at a small budget against plain 3.5 bits, with what `localllm tune` buys on this GPU: each model
given is tuned for 2.5 / 5% budgets (without writing profiles), and QDEC off, each budget's setting and each
--k-chunks value on every layer (default 8; for 2.5-5% the paper's tuner chose 15-35 on an RTX 4070 Super, 44-59 on
an RTX 4050 laptop) are scored on 4096 tokens of the shipped text through the decode kernel (perplexity / KL
divergence from the source, which must be on this machine). A model folder named NAME-3 is compared token by token
with NAME-35 off, at each budget and k_chunk, when both are given.

    localllm quantize SRC -o m-awq-3 --bits 3 --method awq; localllm quantize SRC -o m-awq-35 --bits 3.5 --method awq
    python scripts/tuned_methods.py m-awq-3 m-awq-35 --k-chunks 8,16,32,64
"""
from __future__ import annotations

import argparse
import time

from localllm.errors import script_main
from localllm.evaluate import Reference, load_source, losses, paired_change, read_text, tokenize
from localllm.kernels import cuda
from localllm.runtime import load
from localllm.tuner.timing import setting
from localllm.tuner.tune import describe, table, tune


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--k-chunks", default="8", help="k_chunk on every layer, comma-separated")
    a = ap.parse_args()
    cuda.require_for("this script times the kernels on the GPU")  # (load's advice, --device cpu, is not this script's)
    ids = ref = None
    nlls = {}
    for d in a.models:
        t0 = time.perf_counter()
        lm = load(d, device="cuda", qdec="off")
        if ids is None:
            ids = tokenize(lm, read_text(None)[0], a.tokens + 1)
            ref = Reference(load_source(lm, "cuda"), lm)
        res = tune(lm, [0.025, 0.05], evaluate=False, write=False)
        print(table(res, d), flush=True)

        def score(q, lm=lm):
            lm.set_qdec(q)
            return losses(lm, ids, 512, reference=ref)[:3]
        p, k, n = score("off")
        nlls[d, "off"] = n
        print(f"{d} off: {p:.2f} / {k:.3f}", flush=True)
        for r in res.rows:
            c = r.choice
            if not c.compensates:
                print(f"{d} {100 * r.budget:g}%: nothing, as off", flush=True)
                continue
            where = describe(c, res.problem)
            p, k, n = score(setting(c))
            nlls[d, r.budget] = n
            print(f"{d} {100 * r.budget:g}%: {where}, measured {100 * r.slowdown:+.1f}%: {p:.2f} / {k:.3f}", flush=True)
        for kc in map(int, a.k_chunks.split(",")):
            p, k, n = score({"mode": "approx", "k_chunk": kc})
            nlls[d, f"k{kc}"] = n
            print(f"{d} k{kc} everywhere: {p:.2f} / {k:.3f}", flush=True)
        print(f"{d}: {time.perf_counter() - t0:.0f} s", flush=True)
    for (d, b), n in nlls.items():
        if d.rstrip("/").endswith("-3") and b != "off" and (d.rstrip("/") + "5", "off") in nlls:
            ch, ci = paired_change(n, nlls[d.rstrip("/") + "5", "off"], window=512)
            what = b if isinstance(b, str) else f"{100 * b:g}%"
            print(f"{d} {what} against {d.rstrip('/')}5 off, token by token: {ch:+.2f}% ± {ci:.2f}")


if __name__ == "__main__":
    script_main(main)
