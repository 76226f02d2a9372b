"""The tuner's search (tuner.search) on synthetic timing models: monotone, knee-shaped (the paper's Figure 17) and
noisy (fresh random each run, so only invariants are asserted), including the fallback. No GPU."""
import math
import os
import random
from types import SimpleNamespace

import pytest

from localllm.kernels import qdec
from localllm.tuner.search import (LEAST_SLACK, Layer, Memo, Problem, _coarse, _Cost, _uniform, carry_forward,
                                   largest_k, least, search)

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # Llama-3-8B
BUDGETS = (0.0, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5)


def search_budgets(p: Problem, time, budgets):
    """What tune.run's search does over several budgets, before its measurements: search() each (ascending) on one
    Memo, then carry_forward()."""
    memo = time if isinstance(time, Memo) else Memo(time)
    return carry_forward(p, [search(p, memo, b) for b in sorted(set(budgets))])


def problem(sms=132, kmax=256, layers=32, k_max=None, step=None) -> Problem:
    lays = []
    for kind, (N, K) in SHAPES.items():
        grid = min(N // 16, sms)
        lays.append(Layer(kind, N, K, layers, tuple(qdec.viable_n_tb(K, N, grid)),
                          kmax if k_max is None else k_max.get(kind, kmax)))
    p = Problem(tuple(lays), sms // 2)
    gemvs = sum(lay.count * base(lay) for lay in lays)
    return Problem(p.layers, p.n_tb_limit, step if step is not None else 1.6 * gemvs)


def base(lay: Layer) -> float:
    return 2e-6 + lay.N * lay.K * 3 / 8 / 2.4e12  # launch + W3 bytes at 2.4 TB/s


def fetch(lay: Layer, n_tb: int, k: int) -> float:
    """Zero-copy fetch of k rows per chunk: a round trip, then bytes at ~5 GB/s per compensating block (the H100's
    per-SM rate) up to PCIe's 50 GB/s."""
    rows = qdec.chunks(lay.K) * k
    return 1e-6 + rows * lay.N / 2 / min(50e9, 5e9 * n_tb)


def timing_model(layers, qdec_time):
    """oracle(kind, n_tb, k): base(layer) for k = 0, else qdec_time(layer, n_tb, k)."""
    by = {lay.kind: lay for lay in layers}
    return lambda kind, n_tb, k: qdec_time(by[kind], n_tb, k) if k else base(by[kind])


def monotone(layers):
    """Never hidden: grows with k from the start (and with n_tb: each compensating block leaves the weight stream)."""
    return timing_model(layers, lambda lay, n_tb, k: base(lay) * (1 + 0.0075 * n_tb) + 0.1 * fetch(lay, n_tb, k))


def knee(layers):
    """Flat while the fetch hides under the GEMV (which more blocks slow down), then linear in k."""
    return timing_model(layers, lambda lay, n_tb, k: max(base(lay) * (1 + 0.0075 * n_tb), fetch(lay, n_tb, k))
                        + 1e-9 * k)


def noisy(layers, seed):
    """The knee with 5% multiplicative noise per point (each point measured once, as the Memo does)."""
    rng = random.Random(seed)
    clean = knee(layers)
    return lambda kind, n_tb, k: clean(kind, n_tb, k) * (1 + 0.05 * rng.gauss(0, 1)) if k else \
        clean(kind, n_tb, k) * (1 + 0.02 * rng.gauss(0, 1))


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


ORACLES = {"monotone": lambda p, s: monotone(p.layers), "knee": lambda p, s: knee(p.layers),
           "noisy": lambda p, s: noisy(p.layers, s)}


def check_choice(p: Problem, memo: Memo, c, budget: float, msg=""):
    """What every choice must satisfy: viable n_tb from n_tb_max, bounded k, predicted slowdown within budget (and
    equal to the slowdown recomputed from the measured points)."""
    for lay in p.layers:
        n, k = c.n_tb[lay.kind], c.k_chunk[lay.kind]
        assert n in lay.n_tb, msg
        assert 0 <= k <= lay.k_max, msg
        if c.n_tb_max is not None:
            assert n == lay.n_tb_under(c.n_tb_max), msg
            assert c.n_tb_max <= max(p.n_tb_limit, min(lay.n_tb[0] for lay in p.layers)), msg
    assert c.predicted <= budget, msg
    added = sum(lay.count * (memo(lay.kind, c.n_tb[lay.kind], c.k_chunk[lay.kind]) - memo(lay.kind, 0, 0))
                for lay in p.layers)
    assert math.isclose(added / p.step_time, c.predicted, rel_tol=1e-9, abs_tol=1e-15), msg
    for kind in c.fallback:
        assert c.k_chunk[kind] == 0, msg


@pytest.mark.parametrize("name", ORACLES)
@pytest.mark.parametrize("sms", [132, 20])
def test_every_choice_is_viable_bounded_and_within_budget(name, sms):
    seed = fresh_seed()
    p = problem(sms=sms)
    memo = Memo(ORACLES[name](p, seed))
    for b in BUDGETS:
        c = search(p, memo, b)
        check_choice(p, memo, c, b, f"{name} sms={sms} budget={b} seed={seed}: {c}")


@pytest.mark.parametrize("name", ORACLES)
def test_larger_budget_never_compensates_less(name):
    seed = fresh_seed()
    p = problem()
    memo = Memo(ORACLES[name](p, seed))
    choices = search_budgets(p, memo, BUDGETS)
    assert [c.budget for c in choices] == sorted(BUDGETS)
    rows = [p.rows(c.k_chunk) for c in choices]
    assert rows == sorted(rows), (name, seed, rows)
    for c in choices:
        check_choice(p, memo, c, c.budget, f"{name} seed={seed}")
    assert rows[-1] > 0  # 50% compensates something
    if name != "noisy":  # (noise can make a point cheaper than the base GEMV: then even 0% compensates)
        assert rows[0] == 0


@pytest.mark.parametrize("name", ["monotone", "knee"])
def test_phase1_finds_what_a_step_by_step_walk_finds(name):
    """The gallop + bisection of the coarse search ends where the paper's walk (k = 1, 2, 3, ... until the budget
    breaks) ends, for times monotone in k; the n_tb_max chosen allows the most steps."""
    p = problem()
    memo = Memo(ORACLES[name](p, 0))
    for b in (0.01, 0.03, 0.05, 0.2):
        c = search(p, memo, b)
        fixed = set(c.fallback)
        cost = _Cost(p, memo, b)
        top = max((lay.k_max for lay in p.layers if lay.kind not in fixed), default=0)  # 0: all fell back
        for _, n_tb in p.n_tb_candidates():
            walk = 0
            while walk < top and cost.fits(n_tb, _uniform(p.layers, fixed, walk + 1)):
                walk += 1
            assert _coarse(cost, n_tb, fixed) == walk
        assert c.steps == max(_coarse(cost, n_tb, fixed) for _, n_tb in p.n_tb_candidates())
        assert c.steps > 0 or b < 0.2


@pytest.mark.parametrize("name", ["monotone", "knee"])
def test_phase2_leaves_no_step_that_fits(name):
    """For times monotone in k, Phase 2 ends where one more k_chunk on any kind would break the budget."""
    p = problem()
    memo = Memo(ORACLES[name](p, 0))
    for b in (0.01, 0.05, 0.2):
        c = search(p, memo, b)
        cost = _Cost(p, memo, b)
        for lay in p.layers:
            k = c.k_chunk[lay.kind]
            if k < lay.k_max and lay.kind not in c.fallback:
                assert not cost.fits(c.n_tb, {**c.k_chunk, lay.kind: k + 1}), (b, lay.kind, c)
        # Phase 2 only adds to Phase 1's uniform k
        assert all(c.k_chunk[lay.kind] >= min(c.steps, lay.k_max) for lay in p.layers if lay.kind not in c.fallback)


def test_phase2_raises_the_cheapest_layers_furthest():
    """Per-kind costs linear in k, gate_up cheapest, down dearest: each round of Phase 2 offers the cheap kinds
    their step first, so they end at least as high (one step per kind and round, as in the paper)."""
    p = problem()
    slope = {"gate_up": 0.01e-6, "qkv": 0.02e-6, "o": 0.04e-6, "down": 0.08e-6}
    memo = Memo(lambda kind, n_tb, k: 5e-6 + slope[kind] * k)
    c = search(p, memo, 0.05)
    k = c.k_chunk
    assert k["gate_up"] >= k["qkv"] >= k["o"] >= k["down"] >= c.steps > 0, c
    assert k["gate_up"] > k["down"], c


def expensive(p: Problem, kinds, cost=1e-3):
    """Any compensation of `kinds` adds `cost` s per layer; the others are cheap and linear."""
    cheap = monotone(p.layers)

    def t(kind, n_tb, k):
        if k and kind in kinds:
            return cheap(kind, 0, 0) + cost
        return cheap(kind, n_tb, k)
    return t


def test_fallback_fixes_the_smallest_layer_first():
    p = problem()
    memo = Memo(expensive(p, {"o"}))
    c = search(p, memo, 0.05)
    check_choice(p, memo, c, 0.05)
    assert c.fallback == ("o",) and c.k_chunk["o"] == 0
    assert all(c.k_chunk[k] > 0 for k in ("qkv", "gate_up", "down")) and c.steps > 0
    memo = Memo(expensive(p, {"o", "qkv"}))
    c = search(p, memo, 0.05)
    assert c.fallback == ("o", "qkv") and c.k_chunk["o"] == c.k_chunk["qkv"] == 0 and c.k_chunk["gate_up"] > 0


def test_fallback_to_nothing_when_no_layer_fits():
    p = problem()
    memo = Memo(expensive(p, set(SHAPES)))
    c = search(p, memo, 0.05)
    assert not c.compensates and c.n_tb_max is None and c.predicted == 0
    assert c.fallback == ("o", "qkv", "down", "gate_up")  # by weight size, smallest first
    check_choice(p, memo, c, 0.05)


def test_k_is_capped_by_each_layers_bound_and_zero_bound_is_not_a_fallback():
    p = problem(k_max={"qkv": 3, "o": 0, "gate_up": 40, "down": 7})
    memo = Memo(knee(p.layers))
    c = search(p, memo, 100.0)  # everything fits
    assert c.k_chunk == {"qkv": 3, "o": 0, "gate_up": 40, "down": 7} and c.fallback == ()
    check_choice(p, memo, c, 100.0)


def test_memo_asks_the_oracle_for_the_point_asked_for():
    asked = []

    def oracle(kind, n_tb, k):
        asked.append((kind, n_tb, k))
        return 1e-6 * (1 + n_tb + k)
    memo = Memo(oracle)
    t = [memo("o", 4, 2), memo("o", 8, 2), memo("o", 4, 2), memo("o", 3, 0)]
    assert asked == [("o", 4, 2), ("o", 8, 2), ("o", 0, 0)]  # k_chunk 0: the base GEMV, whatever n_tb
    assert t == [7e-6, 11e-6, 7e-6, 1e-6] and memo.points == {a: oracle(*a) for a in asked[:3]}


def test_every_point_is_measured_once_and_base_once_per_kind():
    p = problem()
    asked = []
    clean = knee(p.layers)

    def oracle(kind, n_tb, k):
        asked.append((kind, n_tb, k))
        return clean(kind, n_tb, k)
    search_budgets(p, oracle, BUDGETS)
    assert len(asked) == len(set(asked))
    assert sorted(a for a in asked if a[2] == 0) == sorted((k, 0, 0) for k in SHAPES)
    # an 8B-shaped model tunes on a few hundred GEMV timings for all budgets (~20-50 ms each on a GPU)
    assert len(asked) < 1500, len(asked)


def test_without_a_step_time_the_gemvs_alone_are_the_denominator():
    p = problem()
    q = Problem(p.layers, p.n_tb_limit, None)
    memo = Memo(knee(p.layers))
    loose, strict = search(p, memo, 0.05), search(q, memo, 0.05)
    assert q.rows(strict.k_chunk) <= p.rows(loose.k_chunk)


def test_n_tb_candidates_are_distinct_and_within_half_the_sms():
    p = problem(sms=132)
    cands = p.n_tb_candidates()
    assigned = [tuple(a.values()) for _, a in cands]
    assert len(assigned) == len(set(assigned))
    for v, a in cands:
        assert v <= 66
        for lay in p.layers:
            assert a[lay.kind] == lay.n_tb_under(v)
    # a GPU of 20 SMs: n_tb_max stops at 10, so down (14 chunks) never gets one compensating block per chunk
    small = problem(sms=20)
    assert all(a["down"] <= 10 for _, a in small.n_tb_candidates())


def test_viable_n_tb_follows_appendix_a():
    assert qdec.viable_groups(24) == [1, 2, 3, 4, 5, 6, 8, 12, 24]  # the paper's c_out = 6144 example
    # our kernel: up to one compensating block per chunk, each taking ceil(chunks / n_tb) whole chunks (one block
    # must stream); beyond, chunks x p blocks, each a part of ceil(segments / p) of its chunk's segments, p viable by
    # the same rule on the segments, while a quarter of the grid at most compensates
    assert qdec.viable_n_tb(14336, 4096, 132) == [1, 2, 3, 4, 5, 7, 14, 28]  # 16 segments: p = 2 only (28 <= 33)
    assert qdec.viable_n_tb(4096, 6144, 132) == [1, 2, 4] + [4 * p for p in (2, 3, 4, 5, 6, 8)]  # 24 segments
    assert qdec.viable_n_tb(4096, 64, 4) == [1, 2]
    # untuned: one chunk per block while a block's residual rows stay under FETCH_PER_BLOCK (k_chunk 8: 4 x 8 rows
    # of 3 KB in 4 blocks), more blocks where they would not (64 rows per chunk: 786 KB, 16 blocks of <= 48 KB)
    assert qdec.default_n_tb(4096, 6144, 132, 8) == 4
    assert qdec.default_n_tb(4096, 6144, 132, 64) == 16
    assert qdec.default_n_tb(4096, 28672, 132, 64) == 32  # 3.7 MB: the largest viable
    assert qdec.default_n_tb(4096, 28672, 20, 64) == 4  # a 20-SM GPU: a quarter of its grid at most


def test_largest_k_from_shared_memory():
    # the paper's A.2 example: 128 k + 2048 + 128 bytes within 48 KB -> 367
    assert largest_k(lambda k: 128 * k + 2048 + 128, 49152, 1024) == 367
    assert largest_k(lambda k: 10**9, 49152, 256) == 0
    assert largest_k(lambda k: 0, 49152, 256) == 256
    # the QDEC GEMV's own shared memory: the bound is the last k that fits
    for N, K in SHAPES.values():
        w = SimpleNamespace(in_features=K, out_features=N, bits=3, group_size=128)
        grid = min(N // 16, 132)
        need = lambda k: qdec.shared_bytes_total(w, k, grid)  # noqa: E731
        limit = need(100) + 5
        k = largest_k(need, limit, 1024)
        assert need(k) <= limit < need(k + 1)


def test_memo_refuses_nonsense_times():
    with pytest.raises(ValueError, match="oracle returned"):
        Memo(lambda *a: float("nan"))("o", 4, 1)
    with pytest.raises(ValueError, match="oracle returned"):
        Memo(lambda *a: 0.0)("o", 0, 0)


@pytest.mark.parametrize("model", ["monotone", "knee"])
def test_least_is_the_cheapest_compensating_setting(model):
    """least(): one kind compensated, the kind and n_tb whose k_chunk 1 adds the least time of all, at the largest
    k_chunk of 1, 2, 4, ... that adds at most LEAST_SLACK more; nothing when no kind may be compensated."""
    p = problem()
    t = Memo({"monotone": monotone, "knee": knee}[model](p.layers))
    c = least(p, t, 0.05)
    kinds = [k for k, v in c.k_chunk.items() if v]
    assert len(kinds) == 1
    (kind,), k = kinds, c.k_chunk[kinds[0]]
    lay = next(lay for lay in p.layers if lay.kind == kind)
    added = lambda la, n, kk: la.count * (t(la.kind, n, kk) - t(la.kind, 0, 0))  # noqa: E731
    one = added(lay, c.n_tb[kind], 1)
    assert all(added(la, n_tb[la.kind], 1) >= one for _, n_tb in p.n_tb_candidates() for la in p.layers)
    assert added(lay, c.n_tb[kind], k) <= one * (1 + LEAST_SLACK)
    kk = 2 * k  # the largest such k_chunk, not the last before the first one over (timings need not be monotone)
    while kk <= lay.k_max:
        assert added(lay, c.n_tb[kind], kk) > one * (1 + LEAST_SLACK)
        kk *= 2
    assert c.predicted == pytest.approx(added(lay, c.n_tb[kind], k) / p.step_time)
    assert not least(problem(k_max={kind: 0 for kind in SHAPES}), t, 0.05).compensates


# ------------------------------------------------------------------------------- allocate(): value per budget

def small_problem(rng, counts=(3, 2, 3, 2)):
    """Four kinds of a few blocks each with small n_tb sets, so every combination can be enumerated."""
    lays = tuple(Layer(kind, N, K, c, (1, 2, 4), rng.choice((2, 4, 8))) for (kind, (N, K)), c in
                 zip(SHAPES.items(), counts))
    gemvs = sum(lay.count * base(lay) for lay in lays)
    return Problem(lays, 4, 1.5 * gemvs)


def random_values(rng, p):
    """Per kind and block a gain that grows with k_chunk (concave, as a larger k_chunk adds smaller channels)."""
    w = {(lay.kind, b): rng.uniform(0.0, 1.0) for lay in p.layers for b in range(lay.count)}
    return lambda kind, k: {b: w[kind, b] * math.log1p(k) for b in range(p.layer(kind).count)}


def brute_force(p, oracle, budget, values):
    """The most value over every (k_chunk of LADDER, n_tb, block subset) per kind, by enumeration."""
    from itertools import combinations, product

    from localllm.tuner.search import LADDER
    step = p.step_time
    per_kind = []
    for lay in p.layers:
        opts = [(0.0, 0.0)]
        for k in (k for k in LADDER if k <= lay.k_max):
            # (any block subset takes the n_tb of least time per call: every other costs more for the same value)
            per_call = min(max(0.0, oracle(lay.kind, n, k) - oracle(lay.kind, 0, 0)) for n in lay.n_tb)
            v = values(lay.kind, k)
            for m in range(1, lay.count + 1):
                for bl in combinations(range(lay.count), m):
                    opts.append((m * per_call, sum(v[b] for b in bl)))
        per_kind.append(set(opts))
    return max(sum(o[1] for o in combo) for combo in product(*per_kind) if sum(o[0] for o in combo) <= budget * step)


@pytest.mark.parametrize("trial", range(6))
def test_allocate_finds_the_most_value_that_fits(trial):
    from localllm.tuner.search import allocate
    seed = f"{os.getpid()}-{trial}"  # in every message: a failure in CI can be rerun with it
    rng = random.Random(seed)
    p = small_problem(rng)
    oracle = Memo(noisy(p.layers, rng.random()))  # each point measured once, for both searches
    values = random_values(rng, p)
    for budget in (0.0, 0.02, 0.05, 0.1, 0.3, 1.0):
        c = allocate(p, oracle, budget, values)
        best = brute_force(p, oracle, budget, values)
        assert c.predicted <= budget + 1e-12, f"seed {seed!r} budget {budget}"
        assert (c.value or 0.0) == pytest.approx(best, rel=1e-9, abs=1e-12), f"seed {seed!r} budget {budget}"
        if c.compensates:  # the setting is what its value and predicted slowdown say
            on = {kind: c.blocks.get(kind, range(p.layer(kind).count)) for kind in c.kinds}
            v = sum(sum(values(kind, c.k_chunk[kind])[b] for b in on[kind]) for kind in c.kinds)
            added = sum(len(on[kind]) * max(0.0, oracle(kind, c.n_tb[kind], c.k_chunk[kind]) - oracle(kind, 0, 0))
                        for kind in c.kinds)  # a point below the base adds 0
            assert c.value == pytest.approx(v) and c.predicted == pytest.approx(added / p.step_time), \
                f"seed {seed!r} budget {budget}"
        else:
            assert best == 0.0 or budget == 0.0, f"seed {seed!r} budget {budget}"


@pytest.mark.parametrize("trial", range(4))
def test_single_is_the_one_call_of_most_value_that_fits(trial):
    from localllm.tuner.search import LADDER, single
    seed = f"{os.getpid()}-single-{trial}"
    rng = random.Random(seed)
    p = small_problem(rng)
    oracle = Memo(noisy(p.layers, rng.random()))
    values = random_values(rng, p)
    for budget in (0.0, 0.01, 0.05, 1.0):
        c = single(p, oracle, budget, values)
        # by enumeration: every kind, k_chunk of LADDER, n_tb and block, one call
        calls = [(max(0.0, oracle(lay.kind, n, k) - oracle(lay.kind, 0, 0)), values(lay.kind, k)[b])
                 for lay in p.layers for k in LADDER if k <= lay.k_max for n in lay.n_tb for b in range(lay.count)]
        best = max((v for t, v in calls if t <= budget * p.step_time), default=0.0)
        assert (c.value or 0.0) == pytest.approx(best) and c.predicted <= budget + 1e-12, \
            f"seed {seed!r} budget {budget}"
        if c.compensates:
            assert p.calls(c) == 1


def test_allocate_takes_a_larger_k_chunk_on_fewer_blocks_where_the_value_is_there():
    """A fixed cost per compensating call (the H200's ~4 us) and value in a few blocks: those blocks at a large
    k_chunk, not every block at a small one; and no value in a kind: that kind never."""
    from localllm.tuner.search import allocate
    p = problem(layers=8, k_max={"o": 0})
    per_call = 0.01 * p.step_time  # the fixed part
    oracle = lambda kind, n, k: base(p.layer(kind)) + (per_call + 1e-9 * k * n if k else 0)  # noqa: E731
    hot = {"gate_up": {1, 5}, "down": {2}}

    def values(kind, k):
        return {b: (1.0 if b in hot.get(kind, ()) else 0.01) * min(k, 16) if kind != "qkv" else 0.0
                for b in range(8)}
    c = allocate(p, oracle, 0.035, values)
    assert c.kinds == ("gate_up", "down") and c.blocks == {"gate_up": (1, 5), "down": (2,)}
    assert c.k_chunk["gate_up"] == c.k_chunk["down"] == 16 and c.n_tb["gate_up"] == 1
    assert c.value == pytest.approx(48.0) and c.predicted == pytest.approx(0.03, rel=1e-2)


def test_least_takes_the_largest_k_chunk_within_its_slack_over_noisy_timings():
    """Added time by k_chunk 1 / 2 / 4 / 8 of 4 / 6 / 4.5 / 4.6 us (k_chunk 2 a noisy outlier): k_chunk 8, the
    largest within LEAST_SLACK of k_chunk 1, not 1 (where the doubling stopped before); and where k_chunk 1 times
    below the plain GEMV (noise), the same cost at k_chunk 2 still counts as within."""
    p = problem(k_max={"qkv": 8, "o": 0, "gate_up": 0, "down": 0})
    extra = {0: 0.0, 1: 4e-6, 2: 6e-6, 4: 4.5e-6, 8: 4.6e-6}
    c = least(p, Memo(lambda kind, n_tb, k: 20e-6 + extra[k] + (n_tb - 1) * 1e-6), 0.05)
    assert c.k_chunk["qkv"] == 8 and c.n_tb["qkv"] == min(n["qkv"] for _, n in p.n_tb_candidates())
    faster = {0: 0.0, 1: -1e-6, 2: -1e-6, 4: 3e-6, 8: 3e-6}
    c = least(p, Memo(lambda kind, n_tb, k: 20e-6 + faster[k] + (n_tb - 1) * 1e-6), 0.05)
    assert c.k_chunk["qkv"] == 2
