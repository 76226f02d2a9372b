"""`localllm tune`: search (tuner.search) over GEMV timings, then check each budget's setting end to end.

For each budget, ascending: the search picks a setting on the GEMV timings (search.allocate where the model's
quantize measured what each kind buys, calibration.qdec_value; else search.search, the paper's); the decode step is
then timed with it (a captured graph, as generation runs) and compared with the step without QDEC timed just before
(a pair, so clock drift over the tune does not enter the ratio). When the measured slowdown is over the budget (the
GEMV timings miss something: overlap, launch order, the QDEC variant's own cost; a setting whose first pair is
over is timed twice, and the two averaged), the search runs again with its target cut by the measured overshoot
(allocate: by SHRINK; its cost per compensating call that the GEMV timings miss is the mean over every setting
its searches measured so far (not the one-call fallback's), kept for the later budgets; the paper's search: from
the lower of its target and the setting's predicted cost), and the step is timed again, up to MAX_TRIES times.

Before a budget settles on no compensation (nothing predicted to fit, or still over after the tries), one more
setting is timed and kept if it measures within the budget. With the value search it is the single compensating
call of most value (search.single): on the H200, 2 of 6 demo models quantized at 3 / 3.5 bits ended their 2.5%
budget with nothing, where one call (~6 us) fits 2.5% of the 0.41 ms step; what those tunes tried was not kept, so
a row that ends with nothing now lists it (Row.over, table()). With the row-count search it is the cheapest setting
that compensates (search.least): the GEMV timings miss costs that do not grow with k_chunk (H100, 8B W3: the
compensating gate_up loses the plain GEMV's two blocks per SM), so a shrinking target can drop below the least
setting while that setting itself fits. When it is over the budget too, it is tried on fewer blocks of its kind,
those with the most to gain (tuner.blocks), as many as the measured cost per block allows, up to MAX_TRIES times
(H200, 8B W3: nothing else fits 2.5% and 5%, as a compensating GEMV costs ~4-5 us more than the plain one however few
channels it takes, against a ~1.7 ms step). allocate weighs fewer blocks itself.

So every reported setting was measured to fit its budget. Each setting's pair is timed once per tune (another budget
or try that lands on it reuses the pair). A larger budget then never ends with less compensation than a smaller one
(search.carry_forward, on measured settings).

run() is the procedure over a Bench (timing, quality and block-order functions), so it is tested on the CPU with
fakes; tune() is the GPU glue (tuner.timing) and writes the profiles.
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field, replace
from typing import Protocol

from localllm.model import KINDS

from . import profile as profiles
from .search import Choice, Memo, Problem, allocate, carry_forward, least, nothing, search, single, some_blocks

MAX_TRIES = 4
SHRINK = 0.9  # a retry aims this much under the target the overshoot suggests
NEAR = 0.004  # a setting's first pair this close under its budget (a fraction of the step) is timed again too


class Bench(Protocol):
    def gemv_time(self, kind: str, n_tb: int, k_chunk: int) -> float: ...

    def decode_time(self, choice: Choice | None) -> float: ...  # seconds per decode step; None: QDEC off

    def perplexity(self, choice: Choice | None) -> float: ...

    def block_order(self, kind: str, k_chunk: int) -> tuple[int, ...]: ...  # tuner.blocks.order of the kind

    # tuner.blocks.values of the kind; None: the model has no measured qdec_value (quantized before it was measured)
    def block_values(self, kind: str, k_chunk: int) -> dict[int, float] | None: ...


@dataclass
class Row:
    choice: Choice  # choice.budget is the budget asked for; choice.predicted is on the GEMV timings
    decode: float  # measured seconds per decode step at this setting
    decode_off: float  # the step without QDEC, timed just before it (so clock drift does not enter the ratio)
    slowdown: float  # measured: decode / decode_off - 1
    tries: int  # searches it took
    perplexity: float | None = None
    over: tuple[tuple[Choice, float], ...] = ()  # where nothing fits: each setting tried and its measured slowdown

    @property
    def budget(self) -> float:
        return self.choice.budget


@dataclass
class Result:
    problem: Problem  # step_time: the measured decode step without QDEC
    rows: list[Row]
    perplexity_off: float | None
    points: int  # GEMV timing points measured
    seconds: float
    paths: list = field(default_factory=list)  # profiles written (tune())


def run(problem: Problem, bench: Bench, budgets, evaluate: bool = True, bar=None) -> Result:
    """Tune every budget (fractions) on `bench`; `bar` (a tqdm-like object) counts the measurements."""
    t0 = time.perf_counter()
    tick = (lambda *_: bar.update(1)) if bar is not None else None  # noqa: E731
    say = (lambda s: bar.set_description(s)) if bar is not None else (lambda s: None)  # noqa: E731
    say("tuning: decode step without QDEC")
    base = bench.decode_time(None)
    problem = replace(problem, step_time=base)
    memo = Memo(bench.gemv_time, tick)

    def measure(c: Choice) -> tuple[float, float]:
        off, on = bench.decode_time(None), bench.decode_time(c)
        if tick:
            tick()
            tick()
        return on, off

    rows: list[Row] = []
    measured: dict[tuple, tuple[float, float]] = {}  # setting -> (decode, decode without QDEC), each timed once

    def timed(c: Choice) -> tuple[float, float]:
        """(decode with c, decode without QDEC just before), each setting's pair timed once per tune, or twice and
        averaged where the first pair is over c's budget or under it by less than NEAR: a pair's ratio varies by
        ~0.4% of the step from timing to timing (H200, demo shapes), as much as a setting near the budget is within
        it. (Timed again only when over, noise could only ever help a setting in: kept ones read low.)"""
        if c.key not in measured:
            say(f"tuning {profiles.percent(c.budget)}%: decode step")
            on, off = measure(c)
            if on / off - 1 > c.budget - NEAR:
                on2, off2 = measure(c)
                on, off = (on + on2) / 2, (off + off2) / 2
            measured[c.key] = on, off
        return measured[c.key]

    def on_fewer_blocks(c: Choice, slow: float, tries: int) -> Row | None:
        """c (one kind, measured at `slow` over the budget on all its blocks) on as many of the kind's blocks, those
        with the most to gain, as measure within the budget; None when not even one does."""
        (kind,) = c.kinds
        order = bench.block_order(kind, c.k_chunk[kind])
        m = problem.layer(kind).count
        for tries in range(tries + 1, tries + 1 + MAX_TRIES):
            m = min(m - 1, int(m * c.budget / slow * SHRINK))
            if m < 1:
                return None
            cm = some_blocks(problem, c, order, m)
            on, off = timed(cm)
            slow = on / off - 1
            if slow <= c.budget:
                return Row(cm, on, off, slow, tries)
        return None

    kinds = [lay.kind for lay in problem.layers if lay.k_max > 0]
    valued = bool(kinds) and bench.block_values(kinds[0], 1) is not None
    # allocate(): what each compensating call costs the decode step beyond its GEMV timing, the mean over every
    # setting allocate() chose and was measured so far (each pair is noisy: a bound learned from overshoots alone
    # only grows, and one noisy overshoot could leave a small budget with nothing)
    misses: dict[tuple, float] = {}  # per setting measured
    per_call = 0.0
    for budget in sorted(set(budgets)):
        target, row, none, tries, trail = budget, None, nothing(problem, budget), 0, []
        while row is None and tries < MAX_TRIES:
            tries += 1
            say(f"tuning {profiles.percent(budget)}%: search" + (f" (try {tries})" if tries > 1 else ""))
            c = allocate(problem, memo, target, bench.block_values, per_call) if valued else \
                search(problem, memo, target)
            c = replace(c, budget=budget)
            if not c.compensates:
                none = c
                break
            on, off = timed(c)
            slow = on / off - 1
            trail.append((c, slow))
            if valued:  # c.predicted counts per_call in each call
                misses.setdefault(c.key, (slow - c.predicted) * base / problem.calls(c) + per_call)
                per_call = max(0.0, sum(misses.values()) / len(misses))
            if slow <= budget:
                row = Row(c, on, off, slow, tries)
            else:
                # the paper's search: below what this setting was predicted to cost, or it may be chosen again
                target = target * SHRINK if valued else min(target, c.predicted) * budget / slow * SHRINK
        if row is None:  # nothing predicted to fit, or still over: the least setting (one call), measured
            c = replace(single(problem, memo, budget, bench.block_values) if valued else least(problem, memo, budget),
                        budget=budget)
            if c.compensates:
                on, off = timed(c)  # (a try may have measured it: timed() keeps each setting's pair)
                slow, tries = on / off - 1, tries + 1
                if all(t.key != c.key for t, _ in trail):
                    trail.append((c, slow))
                row = Row(c, on, off, slow, tries) if slow <= budget else \
                    None if valued else on_fewer_blocks(c, slow, tries)
        row = row or Row(none, base, base, 0.0, tries, over=tuple(trail))
        rows.append(row)
    by_budget = {r.budget: r for r in rows}
    final = []
    for c in carry_forward(problem, [r.choice for r in rows]):
        src = by_budget[c.budget if c.carried_from is None else c.carried_from]
        final.append(Row(c, src.decode, src.decode_off, src.slowdown, by_budget[c.budget].tries,
                         over=by_budget[c.budget].over if not c.compensates else ()))
    ppl_off = None
    if evaluate:
        say("tuning: perplexity without QDEC")
        ppl_off = bench.perplexity(None)
        seen: dict[tuple, float] = {}
        for r in final:
            if not r.choice.compensates:
                r.perplexity = ppl_off
                continue
            if r.choice.key not in seen:
                say(f"tuning {profiles.percent(r.budget)}%: perplexity")
                seen[r.choice.key] = bench.perplexity(r.choice)
            r.perplexity = seen[r.choice.key]
    return Result(problem, final, ppl_off, len(memo.points), time.perf_counter() - t0)


def profile_of(row: Row, result: Result, gpu: dict, model_id: str, bits: int | None, tokens: int | None) -> dict:
    """The JSON profile of one budget (tuner.profile describes the format and how the runtime uses it)."""
    from localllm import __version__
    c = row.choice
    return {
        "format": profiles.FORMAT,
        "gpu": gpu,
        "model_id": model_id,
        "bits": bits,
        "budget": c.budget,
        "n_tb_max": c.n_tb_max,
        "layers": {k: {"k_chunk": c.k_chunk[k], "n_tb": c.n_tb[k],
                       **({"blocks": list(c.blocks[k])} if k in c.blocks else {})} for k in KINDS},
        "slowdown": row.slowdown,
        "predicted_slowdown": c.predicted,
        "decode_ms": {"off": 1e3 * row.decode_off, "qdec": 1e3 * row.decode},
        "perplexity": None if row.perplexity is None else
        {"off": result.perplexity_off, "qdec": row.perplexity, "tokens": tokens},
        "search": {"objective": "rows" if c.value is None else "kl", "value": c.value,
                   "phase1_steps": c.steps, "fallback": list(c.fallback), "tries": row.tries,
                   "carried_from": c.carried_from, "points": result.points, "seconds": round(result.seconds, 1),
                   "over": [{"setting": describe(o, result.problem), "measured": s} for o, s in row.over]},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "localllm_version": __version__,
    }


def describe(c: Choice, problem: Problem) -> str:
    """A setting in a few words: "gate_up k8 in 2 of 30, down k16" (every block where no count is given)."""
    return ", ".join(f"{k} k{c.k_chunk[k]}" + (f" in {len(c.blocks[k])} of {problem.layer(k).count}"
                                               if k in c.blocks else "") for k in c.kinds) or "nothing"


def table(result: Result, title: str) -> str:
    """The paper's Table 3 for this GPU and model: budget -> n_tb_max / (k_qkv, k_o, k_gu, k_d) -> slowdown."""
    ev = result.perplexity_off is not None
    base = result.problem.step_time
    lines = [title,
             f"{'budget':>7}  {'n_tb_max / (k_qkv, k_o, k_gu, k_d)':<36} {'predicted':>9} {'measured':>9} "
             f"{'ms/token':>9}" + (f" {'perplexity':>10}" if ev else ""),
             f"{'off':>7}  {'-':<36} {'':>9} {'':>9} {1e3 * base:9.3f}"
             + (f" {result.perplexity_off:10.3f}" if ev else "")]
    for r in result.rows:
        c = r.choice
        ks = ", ".join(str(c.k_chunk[k]) for k in KINDS)
        setting = f"{c.n_tb_max if c.compensates else '-'} / ({ks})"
        note = f"  (= {profiles.percent(c.carried_from)}%'s)" if c.carried_from is not None else \
            "  (nothing fits" + "".join(f"; {describe(o, result.problem)} measured {100 * s:+.1f}%"
                                        for o, s in r.over) + ")" if not c.compensates else ""
        note += "".join(f"  ({k} in {len(b)} of {result.problem.layer(k).count} blocks)" for k, b in c.blocks.items())
        note += f"  (predicted KL taken away {c.value:.3f})" if c.value is not None else ""
        lines.append(f"{profiles.percent(r.budget) + '%':>7}  {setting:<36} {100 * c.predicted:+8.1f}% "
                     f"{100 * r.slowdown:+8.1f}% {1e3 * r.decode:9.3f}"
                     + (f" {r.perplexity:10.3f}" if ev and r.perplexity is not None else "") + note)
    lines.append(f"{result.points} GEMV timing points, {result.seconds:.0f} s")
    return "\n".join(lines)


def no_residuals(path) -> LocalLLMError:
    """The refusal of a model without QDEC residuals (cli.cmd_tune says it before it checks for a GPU)."""
    from localllm.errors import LocalLLMError
    return LocalLLMError(f"{path} has no QDEC residuals, so there is nothing to tune; quantize it with residuals "
                         "(localllm quantize, without --no-residuals)")


def tune(lm, budgets, evaluate: bool = True, tokens: int = 512, write: bool = True, force: bool = False,
         reps: int = 20) -> Result:
    """Tune a LocalModel on its GPU for each budget (fractions); write a profile per budget next to the model."""
    from localllm.errors import LocalLLMError
    from localllm.progress import progress

    from .timing import GpuBench, problem_of
    if lm.model.device.type != "cuda":
        raise LocalLLMError("localllm tune measures the GPU: load the model with device='cuda'")
    if not lm.manifest or not lm.has_residuals:
        raise no_residuals(lm.path)
    gpu = profiles.gpu_identity(lm.model.device)
    if write:  # refuse before minutes of measuring, not after
        for b in budgets:
            profiles.check_free(lm.path, gpu["name"], gpu["sm_count"], lm.manifest["model_id"], b, force)
    bench = GpuBench(lm, reps=reps, tokens=tokens if evaluate else 0)
    with progress(desc="tuning", unit="point") as bar:
        result = run(problem_of(lm), bench, budgets, evaluate=evaluate, bar=bar)
    lm.set_qdec("off")
    if write:
        for r in result.rows:
            p = profile_of(r, result, gpu, lm.manifest["model_id"], lm.manifest.get("quant", {}).get("bits"),
                           bench.tokens if evaluate else None)
            path, old = profiles.write(lm.path, p, force=force)
            result.paths.append((path, old))
        lm.profiles_changed()
    return result
