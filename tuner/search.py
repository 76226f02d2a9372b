"""The QDEC parameter search (paper sec. 4.4, Appendix A) as a pure function of a timing oracle.

Inputs: per layer kind its shape, how many such layers one decode step runs, its viable n_tb values (ascending) and
its largest usable k_chunk; the budget (a fraction of the decode step); and an oracle

    time(kind, n_tb, k_chunk) -> seconds of one GEMV of that kind (k_chunk 0: the base GEMV, n_tb ignored).

The predicted slowdown of a setting is the GEMV time it adds over the base GEMVs, summed over one decode step,
divided by the decode step time without QDEC (Problem.step_time: attention, norms and lm_head included, so "5%"
means 5% of a real token; without it, the base GEMVs alone, which is stricter).

Phase 1 replaces the per-kind n_tb by one limit n_tb_max, each kind taking its largest viable n_tb <= n_tb_max
(its smallest when none is). Every distinct per-kind assignment for n_tb_max up to Problem.n_tb_limit (half the
SM count) gets a coarse search: the largest k raised uniformly for every kind (each capped at its bound) that fits
the budget. The paper walks k up one step at a time; this gallops (1, 2, 4, ...) and then bisects, which finds the
same k for a time monotone in k in O(log k_max) measurements. The n_tb_max with the most steps wins (ties: the
one with the least added time there, then the smaller n_tb_max).
Fallback: when no n_tb_max allows a single step, k_chunk is fixed to 0 for the kind with the smallest weight matrix
(smaller matrices hide the least) and Phase 1 runs again; when every kind is fixed, nothing is compensated.
Phase 2 starts from the uniform k of Phase 1 and, round after round, offers every kind still open one more k_chunk
in order of the time that step adds (cheapest first); a step that would break the budget freezes that kind for
good. It ends when no kind is open.

allocate() is the search for models whose quantize measured what compensating each kind buys (the manifest's
calibration.qdec_value; tuner.blocks.values): it spends the budget where the predicted KL divergence taken away is
largest, per kind a k_chunk from LADDER, the n_tb that makes it cheapest, and the blocks with the most to gain, as
many as pay (an exact search over every kind's (k_chunk, blocks) on the GEMV timings). On the demo model (W3, on the
H200) it put each budget on gate_up and down at k_chunk 8-32 in a few of their best blocks, where the search above
gave gate_up alone k_chunk 16 in more: 2-4x the KL taken away at about the same measured cost (README).

least() is the cheapest setting that compensates at all: what tune.run measures before it settles on nothing, and
where even that is over the budget, on fewer blocks (some_blocks: those with the most to gain). single() is its
counterpart for allocate(): the one compensating call of most value.

Every oracle point is measured once (Memo); several budgets tuned together share the points (one Memo: tune.run), and
a larger budget never gets fewer compensated channels than a smaller one: a smaller budget's setting fits a larger
one too, so it is carried forward when the larger budget's own search found less.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from localllm.qdec import k_total

Oracle = Callable[[str, int, int], float]
Values = Callable[[str, int], dict[int, float]]  # (kind, k_chunk) -> per block, the KL divergence taken away
LADDER = (1, 2, 4, 8, 16, 32, 64)  # the k_chunks allocate() weighs (each within the kind's bound)


@dataclass(frozen=True)
class Layer:
    """One kind of linear layer of the decode step."""
    kind: str
    N: int  # out_features
    K: int  # in_features
    count: int  # layers of this kind per decode step
    n_tb: tuple[int, ...]  # viable n_tb values, ascending, not empty
    k_max: int  # the largest k_chunk usable (shared memory per block, calibration); 0: never compensated

    def __post_init__(self):
        if not self.n_tb or list(self.n_tb) != sorted(set(self.n_tb)) or self.n_tb[0] < 1:
            raise ValueError(f"{self.kind}: n_tb must be ascending distinct positive values, got {self.n_tb}")
        if self.k_max < 0 or self.count < 1:
            raise ValueError(f"{self.kind}: k_max must be >= 0 and count >= 1")

    @property
    def size(self) -> int:
        return self.N * self.K

    def n_tb_under(self, n_tb_max: int) -> int:
        """The largest viable n_tb <= n_tb_max, or the smallest viable one when none is."""
        ok = [n for n in self.n_tb if n <= n_tb_max]
        return ok[-1] if ok else self.n_tb[0]


@dataclass(frozen=True)
class Problem:
    layers: tuple[Layer, ...]
    n_tb_limit: int  # Phase 1 tries n_tb_max up to this: half the GPU's SM count
    step_time: float | None = None  # seconds of one decode step without QDEC; None: the base GEMVs alone

    def __post_init__(self):
        if len({lay.kind for lay in self.layers}) != len(self.layers) or not self.layers:
            raise ValueError("one Layer per kind, at least one")

    def n_tb_candidates(self) -> list[tuple[int, dict[str, int]]]:
        """(n_tb_max, per-kind n_tb) for every distinct assignment, each under its smallest n_tb_max."""
        values = sorted({n for lay in self.layers for n in lay.n_tb if n <= self.n_tb_limit})
        if not values:  # every kind needs more blocks than the limit: the smallest each can do
            values = [min(lay.n_tb[0] for lay in self.layers)]
        out, seen = [], set()
        for v in values:
            a = {lay.kind: lay.n_tb_under(v) for lay in self.layers}
            key = tuple(a.values())
            if key not in seen:
                seen.add(key)
                out.append((v, a))
        return out

    def rows(self, k_chunk: dict[str, int], blocks: dict[str, tuple[int, ...]] | None = None) -> int:
        """Residual rows fetched per decode step: the measure of how much a setting compensates (blocks: per kind,
        the blocks compensated where not all are)."""
        blocks = blocks or {}
        return sum(len(blocks.get(lay.kind, range(lay.count))) * k_total(k_chunk.get(lay.kind, 0), lay.K)
                   for lay in self.layers)

    def layer(self, kind: str) -> Layer:
        return next(lay for lay in self.layers if lay.kind == kind)

    def calls(self, choice: "Choice") -> int:
        """Compensating GEMV calls per decode step."""
        return sum(len(choice.blocks.get(kind, range(self.layer(kind).count))) for kind in choice.kinds)


@dataclass(frozen=True)
class Choice:
    budget: float
    n_tb_max: int | None  # None: nothing is compensated
    n_tb: dict[str, int]
    k_chunk: dict[str, int]
    predicted: float  # predicted slowdown (fraction of the decode step)
    steps: int  # Phase 1's uniform k
    fallback: tuple[str, ...] = ()  # kinds the fallback fixed at k_chunk 0, in order
    carried_from: float | None = None  # the smaller budget whose setting this is (carry_forward)
    blocks: dict[str, tuple[int, ...]] = field(default_factory=dict)  # per kind, its compensated blocks if not all
    value: float | None = None  # allocate(): the predicted KL divergence taken away (None: the row-count search)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds it compensates."""
        return tuple(k for k, v in self.k_chunk.items() if v)

    @property
    def compensates(self) -> bool:
        return bool(self.kinds)

    @property
    def key(self) -> tuple:
        """What the decode step runs: equal keys, equal settings."""
        return tuple(sorted(self.k_chunk.items())) + tuple(sorted(self.n_tb.items())) + \
            tuple(sorted(self.blocks.items()))


class Memo:
    """The oracle, asked once per point; on_measure(key, seconds) after each new measurement."""

    def __init__(self, oracle: Oracle, on_measure: Callable[[tuple, float], None] | None = None):
        self.oracle, self.on_measure = oracle, on_measure
        self.points: dict[tuple[str, int, int], float] = {}

    def __call__(self, kind: str, n_tb: int, k_chunk: int) -> float:
        key = (kind, 0, 0) if k_chunk == 0 else (kind, n_tb, k_chunk)
        if key not in self.points:
            t = float(self.oracle(*key))
            if not math.isfinite(t) or t <= 0:
                raise ValueError(f"the timing oracle returned {t} s for {key}")
            self.points[key] = t
            if self.on_measure:
                self.on_measure(key, t)
        return self.points[key]


@dataclass
class _Cost:
    problem: Problem
    time: Memo
    budget: float
    base: dict[str, float] = field(init=False)
    step: float = field(init=False)

    def __post_init__(self):
        self.base = {lay.kind: self.time(lay.kind, 0, 0) for lay in self.problem.layers}
        gemvs = sum(lay.count * self.base[lay.kind] for lay in self.problem.layers)
        self.step = self.problem.step_time or gemvs

    def added(self, n_tb: dict[str, int], k: dict[str, int]) -> float:
        return sum(lay.count * (self.time(lay.kind, n_tb[lay.kind], k[lay.kind]) - self.base[lay.kind])
                   for lay in self.problem.layers if k[lay.kind] > 0)

    def slowdown(self, n_tb: dict[str, int], k: dict[str, int]) -> float:
        return self.added(n_tb, k) / self.step

    def fits(self, n_tb: dict[str, int], k: dict[str, int]) -> bool:
        return self.slowdown(n_tb, k) <= self.budget


def _uniform(layers: Iterable[Layer], fixed: set[str], k: int) -> dict[str, int]:
    return {lay.kind: 0 if lay.kind in fixed else min(k, lay.k_max) for lay in layers}


def _coarse(cost: _Cost, n_tb: dict[str, int], fixed: set[str]) -> int:
    """Phase 1's coarse search: the largest uniform k that fits (0 if not even 1 does)."""
    layers = cost.problem.layers
    top = max((lay.k_max for lay in layers if lay.kind not in fixed), default=0)
    fits = lambda k: cost.fits(n_tb, _uniform(layers, fixed, k))  # noqa: E731
    lo, k = 0, 1  # lo fits (k 0 adds nothing)
    while k <= top and fits(k):
        lo, k = k, min(2 * k, top) if k < top else top + 1
    hi = k  # fails, or is past top
    if hi > top:
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _phase1(cost: _Cost, fixed: set[str]) -> tuple[int, int, dict[str, int]]:
    """(steps, n_tb_max, n_tb) of the best n_tb_max."""
    layers = cost.problem.layers
    best = None
    for v, n_tb in cost.problem.n_tb_candidates():
        steps = _coarse(cost, n_tb, fixed)
        key = (-steps, cost.added(n_tb, _uniform(layers, fixed, steps)), v)
        if best is None or key < best[0]:
            best = (key, steps, v, n_tb)
    return best[1], best[2], best[3]


def _phase2(cost: _Cost, n_tb: dict[str, int], k: dict[str, int], fixed: set[str]) -> dict[str, int]:
    """Phase 2's fine search from Phase 1's uniform k: one more k_chunk per open kind and round, cheapest first; a
    kind whose step does not fit is frozen."""
    t, k = cost.time, dict(k)
    open_ = [lay for lay in cost.problem.layers if lay.kind not in fixed and k[lay.kind] < lay.k_max]
    while open_:
        def extra(lay: Layer) -> float:
            return lay.count * (t(lay.kind, n_tb[lay.kind], k[lay.kind] + 1) - t(lay.kind, n_tb[lay.kind], k[lay.kind]))
        frozen = set()
        for lay in sorted(open_, key=extra):
            trial = {**k, lay.kind: k[lay.kind] + 1}
            if cost.fits(n_tb, trial):
                k = trial
            else:
                frozen.add(lay.kind)
        open_ = [lay for lay in open_ if lay.kind not in frozen and k[lay.kind] < lay.k_max]
    return k


def search(problem: Problem, time: Oracle, budget: float) -> Choice:
    """The setting for one budget (a fraction: 0.05 is 5%). `time` may be a Memo to share points."""
    if not budget >= 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    memo = time if isinstance(time, Memo) else Memo(time)
    cost = _Cost(problem, memo, budget)
    layers = problem.layers
    fixed = {lay.kind for lay in layers if lay.k_max == 0}
    fallback: list[str] = []
    while True:
        if len(fixed) == len(layers):  # nothing can be compensated within the budget
            return nothing(problem, budget, tuple(fallback))
        steps, v, n_tb = _phase1(cost, fixed)
        if steps > 0:
            break
        smallest = min((lay for lay in layers if lay.kind not in fixed), key=lambda lay: lay.size)
        fixed.add(smallest.kind)
        fallback.append(smallest.kind)
    k = _phase2(cost, n_tb, _uniform(layers, fixed, steps), fixed)
    return Choice(budget, v, n_tb, k, cost.slowdown(n_tb, k), steps, tuple(fallback))


def allocate(problem: Problem, time: Oracle, budget: float, values: Values, per_call: float = 0.0) -> Choice:
    """The setting of most value within the budget, on the GEMV timings (plus per_call seconds for each compensating
    call, what tune.run measured them to miss): per kind one k_chunk of LADDER at the n_tb where it adds the least
    time per call, on the blocks of most value at that k_chunk (values), as many as any; over all kinds, the
    combination of most value whose added time fits (each kind's options cut to those no other option beats in both
    time and value, then merged kind by kind the same way)."""
    if not budget >= 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    memo = time if isinstance(time, Memo) else Memo(time)
    cost = _Cost(problem, memo, budget)
    limit = budget * cost.step
    best: list[tuple[float, float, tuple]] = [(0.0, 0.0, ())]  # (added seconds, value, options taken)
    for lay in problem.layers:
        options = []
        for k, n_tb, call, v, order in _calls(problem, cost, lay, values):
            total = 0.0
            for m, b in enumerate(order, 1):
                total += v[b]
                options.append((m * (call + per_call), total, (lay.kind, k, n_tb, tuple(sorted(order[:m])))))
        options = _frontier(options)
        best = _frontier(best + [(c + oc, v + ov, taken + (o,)) for c, v, taken in best for oc, ov, o in options
                                 if c + oc <= limit])
    added, value, taken = best[-1]
    return _valued(problem, cost, budget, added, value, taken)


def single(problem: Problem, time: Oracle, budget: float, values: Values) -> Choice:
    """The one compensating call (a kind, at a k_chunk of LADDER, in its most valuable block) of most value that the
    GEMV timings put within the budget: what tune.run measures before a valued budget settles on nothing, when its
    searches' settings measured over (a noisy pair, or a cost per call learned from one)."""
    memo = time if isinstance(time, Memo) else Memo(time)
    cost = _Cost(problem, memo, budget)
    best = (0.0, 0.0, ())
    for lay in problem.layers:
        for k, n_tb, call, v, order in _calls(problem, cost, lay, values):
            if order and call <= budget * cost.step and v[order[0]] > best[1]:
                best = (call, v[order[0]], ((lay.kind, k, n_tb, (order[0],)),))
    return _valued(problem, cost, budget, *best)


def _calls(problem: Problem, cost: _Cost, lay: Layer, values: Values):
    """Per k_chunk of LADDER within the kind's bound: (k_chunk, the n_tb where a call adds the least time, that time
    on the GEMV timings, the blocks' values, the blocks by value, the most first)."""
    for k in (k for k in LADDER if k <= lay.k_max):
        n_tb = min([n for n in lay.n_tb if n <= problem.n_tb_limit] or [lay.n_tb[0]],
                   key=lambda n: (cost.time(lay.kind, n, k), n))  # noqa: B023
        v = values(lay.kind, k)
        yield k, n_tb, max(0.0, cost.time(lay.kind, n_tb, k) - cost.base[lay.kind]), v, \
            sorted(v, key=lambda b: (-v[b], b))  # noqa: B023


def _valued(problem: Problem, cost: _Cost, budget: float, added: float, value: float, taken: tuple) -> Choice:
    """The Choice of allocate() / single(): `taken` options (kind, k_chunk, n_tb, blocks) adding `added` seconds."""
    if value <= 0:
        return nothing(problem, budget)
    k = {lay.kind: 0 for lay in problem.layers}
    n_tb = {lay.kind: lay.n_tb_under(problem.n_tb_limit) for lay in problem.layers}
    blocks = {}
    for kind, kc, nt, bl in taken:
        k[kind], n_tb[kind] = kc, nt
        if len(bl) < problem.layer(kind).count:
            blocks[kind] = bl
    return Choice(budget, max(n_tb[kind] for kind, *_ in taken), n_tb, k, added / cost.step, 0, blocks=blocks,
                  value=value)


def _frontier(options: list[tuple[float, float, object]]) -> list[tuple[float, float, object]]:
    """The (time, value, ...) options that no other beats in both, by ascending time (so ascending value)."""
    out = []
    for o in sorted(options, key=lambda o: (o[0], -o[1])):
        if not out or o[1] > out[-1][1]:
            out.append(o)
    return out


LEAST_SLACK = 0.25  # least(): a larger k_chunk is taken while it adds at most this much more than k_chunk 1


def least(problem: Problem, time: Oracle, budget: float) -> Choice:
    """The cheapest setting that compensates, on the GEMV timings: the kind and n_tb whose k_chunk 1 adds the least
    time, at the largest k_chunk of 1, 2, 4, ... (up to the kind's bound) that adds at most LEAST_SLACK more than
    k_chunk 1 (a compensating GEMV's cost is mostly fixed at small k_chunk); nothing() when no kind can be
    compensated."""
    memo = time if isinstance(time, Memo) else Memo(time)
    cost = _Cost(problem, memo, budget)
    only = lambda kind, k: {lay.kind: k if lay.kind == kind else 0 for lay in problem.layers}  # noqa: E731
    best = None
    for v, n_tb in problem.n_tb_candidates():
        for lay in problem.layers:
            if lay.k_max > 0:
                added = cost.added(n_tb, only(lay.kind, 1))
                if best is None or added < best[0]:
                    best = (added, v, n_tb, lay)
    if best is None:
        return nothing(problem, budget)
    added, v, n_tb, lay = best
    ks = [1]
    while 2 * ks[-1] <= lay.k_max:
        ks.append(2 * ks[-1])
    limit = added + LEAST_SLACK * abs(added)  # (abs: timing noise can make k_chunk 1 cost less than the plain GEMV)
    k = max(k for k in ks if cost.added(n_tb, only(lay.kind, k)) <= limit)  # k_chunk 1 always qualifies
    return Choice(budget, v, n_tb, only(lay.kind, k), cost.slowdown(n_tb, only(lay.kind, k)), 0)


def some_blocks(problem: Problem, choice: Choice, order: tuple[int, ...], m: int) -> Choice:
    """`choice`, which compensates one kind, on the first m blocks of `order` (that kind's blocks, the most to gain
    first: tuner.blocks.order) only; its predicted slowdown scaled to them."""
    (kind,) = choice.kinds
    count = problem.layer(kind).count
    if not 1 <= m <= count or len(set(order)) != len(order) or len(order) != count:
        raise ValueError(f"{kind}: {m} of {count} blocks, order {order}")
    return replace(choice, blocks={kind: tuple(sorted(order[:m]))} if m < count else {},
                   predicted=choice.predicted * m / count)


def nothing(problem: Problem, budget: float, fallback: tuple[str, ...] = ()) -> Choice:
    """The setting that compensates nothing (k_chunk 0 everywhere)."""
    n_tb = {lay.kind: lay.n_tb_under(problem.n_tb_limit) for lay in problem.layers}
    return Choice(budget, None, n_tb, {lay.kind: 0 for lay in problem.layers}, 0.0, 0, fallback)


def carry_forward(problem: Problem, choices: Iterable[Choice]) -> list[Choice]:
    """By ascending budget: where a larger budget's setting compensates less than a smaller budget's (predicted
    value where allocate() chose, else rows), take the smaller budget's (it fits the larger budget too)."""
    choices = list(choices)
    valued = any(c.value is not None for c in choices)
    amount = lambda c: (c.value or 0.0) if valued else problem.rows(c.k_chunk, c.blocks)  # noqa: E731
    out: list[Choice] = []
    best: Choice | None = None
    for c in sorted(choices, key=lambda c: c.budget):
        if best is not None and amount(best) > amount(c):
            c = replace(best, budget=c.budget,
                        carried_from=best.budget if best.carried_from is None else best.carried_from)
        out.append(c)
        best = c
    return out


def largest_k(need: Callable[[int], int], limit: int, cap: int) -> int:
    """The largest k in 0..cap with need(k) <= limit, for need non-decreasing in k (shared memory per block as a
    function of k_chunk); 0 when even k = 1 does not fit."""
    lo, hi = 0, cap + 1  # need(lo) is taken to fit; hi does not or is past cap
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if need(mid) <= limit else (lo, mid)
    return lo
