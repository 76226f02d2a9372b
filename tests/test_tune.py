"""`localllm tune` without a GPU: the end-to-end check and step-back over a fake bench, the profile files (format,
names, atomic writes, what is never overwritten), how the runtime picks a profile or warns, and the CLI."""
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from localllm.errors import LocalLLMError
from localllm.model import KINDS
from localllm.tuner import profile as P
from localllm.tuner.search import Memo, least
from localllm.tuner.tune import NEAR, profile_of, run, table

from test_tune_search import knee, problem

H100 = {"name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "sm_count": 132,
        "shared_memory_per_block": 232448}
BUDGETS = (0.025, 0.05, 0.1, 0.2)


class FakeBench:
    """GEMV times from the knee model; the decode step costs `factor` times the GEMV time a setting adds (the
    GEMV timings miss part of it) plus `extra` seconds whenever QDEC is on and `per_call` seconds per compensated
    layer. Blocks rank by gain in reverse order (the last block first)."""

    def __init__(self, p, factor=1.0, extra=0.0, per_call=0.0, values=None):
        self.p, self.factor, self.extra, self.per_call, self.values = p, factor, extra, per_call, values
        self.gemv_time = Memo(knee(p.layers))
        self.decodes, self.ppl, self.orders = [], [], []

    def decode_time(self, c):
        self.decodes.append(c)
        if c is None:
            return self.p.step_time
        added = 0.0
        for lay in self.p.layers:
            if c.k_chunk[lay.kind]:
                calls = len(c.blocks.get(lay.kind, range(lay.count)))
                added += calls * (self.factor * (self.gemv_time(lay.kind, c.n_tb[lay.kind], c.k_chunk[lay.kind])
                                                 - self.gemv_time(lay.kind, 0, 0)) + self.per_call)
        return self.p.step_time + added + self.extra

    def perplexity(self, c):
        self.ppl.append(c)
        return 20.0 if c is None else 20.0 - 0.01 * self.p.rows(c.k_chunk, c.blocks) / 1000

    def block_order(self, kind, k_chunk):
        self.orders.append((kind, k_chunk))
        return tuple(reversed(range(self.p.layer(kind).count)))

    def block_values(self, kind, k_chunk):
        return None if self.values is None else self.values(kind, k_chunk)


def concentrated(p):
    """Values as on the demo model: down and gate_up worth most, in a few blocks; o next to nothing."""
    w = {"qkv": 0.3, "o": 0.03, "gate_up": 0.7, "down": 0.9}
    return lambda kind, k: {b: w[kind] * (3.0 if b % 5 == 0 else 0.2) * k / (k + 4)
                            for b in range(p.layer(kind).count)}


def test_measured_slowdown_fits_every_budget_first_try_when_the_timings_are_right():
    p = problem()
    bench = FakeBench(p)
    res = run(p, bench, BUDGETS)
    assert [r.budget for r in res.rows] == list(BUDGETS)
    for r in res.rows:
        assert r.tries == 1 and r.slowdown <= r.budget
        assert r.slowdown == pytest.approx(r.choice.predicted)
    assert res.problem.step_time == p.step_time and res.points == len(bench.gemv_time.points)
    assert bench.ppl[0] is None and len(bench.ppl) <= 1 + len(BUDGETS)
    assert all(r.perplexity < res.perplexity_off for r in res.rows)


def test_each_retry_of_the_paper_search_tries_another_setting(monkeypatch):
    """Two kinds of 8 blocks whose GEMV timings miss 2 us a call: the step is slower than predicted, and each retry's
    target is cut below what the setting just measured was predicted to cost, so it is not chosen again (three tries
    went to one setting, measured once, before)."""
    import localllm.tuner.tune as tune
    from localllm.tuner.search import Layer, Problem
    p = Problem(tuple(Layer(kind, 1024, 1024, 8, (1, 2), 64) for kind in ("qkv", "o")), 4)

    class Bench:
        def gemv_time(self, kind, n_tb, k):
            return 1e-5 if k == 0 else 1e-5 + 1e-6 + k * 1e-8

        def decode_time(self, c):
            return 1e-3 + (0.0 if c is None else sum(
                len(c.blocks.get(lay.kind, range(lay.count))) * (1e-6 + c.k_chunk[lay.kind] * 1e-8 + 2e-6)
                for lay in p.layers if c.k_chunk[lay.kind]))

        def perplexity(self, c):
            return 1.0

        def block_order(self, kind, k):
            return tuple(range(p.layer(kind).count))

        def block_values(self, kind, k):
            return None

    chosen, real = [], tune.search
    monkeypatch.setattr(tune, "search", lambda *a, **kw: (chosen.append(real(*a, **kw)), chosen[-1])[1])
    row, = tune.run(p, Bench(), [0.05], evaluate=False).rows
    keys = [c.key for c in chosen if c.compensates]
    assert len(keys) > 1 and len(keys) == len(set(keys)), keys
    assert row.slowdown <= 0.05


def test_steps_back_when_the_decode_step_is_slower_than_predicted():
    p = problem()
    res = run(p, FakeBench(p, factor=2.0), BUDGETS)
    for r in res.rows:
        assert r.slowdown <= r.budget, r
        assert r.choice.predicted <= r.budget
    assert any(r.tries > 1 for r in res.rows)
    rows = [p.rows(r.choice.k_chunk) for r in res.rows]
    assert rows == sorted(rows) and rows[-1] > 0


@pytest.mark.parametrize("factor,per_call", [(1.0, 0.0), (2.0, 0.0), (1.0, 4e-6)])
def test_with_measured_values_the_budget_goes_where_it_buys_most(factor, per_call):
    """A model whose quantize measured what each kind buys: allocate() chooses, the decode step is measured and the
    setting stepped back where it is over, and a larger budget never ends with less value."""
    from localllm.tuner.search import allocate
    p = problem()
    values = concentrated(p)
    bench = FakeBench(p, factor=factor, per_call=per_call, values=values)
    res = run(p, bench, BUDGETS)
    assert not bench.orders  # the row-count search's fallback is not used
    for r in res.rows:
        c = r.choice
        assert r.slowdown <= r.budget and c.compensates and c.value > 0
        hot = set(range(0, 32, 5))
        assert all(hot <= set(b) or set(b) <= hot for b in c.blocks.values())  # the blocks worth most first
        assert c.value == pytest.approx(sum(sum(values(k, c.k_chunk[k])[b] for b in c.blocks.get(k, range(32)))
                                            for k in c.kinds))
    first = res.rows[0]
    if first.tries == 1:  # nothing measured yet: allocate() at the budget itself
        assert first.choice == replace(allocate(p, bench.gemv_time, first.budget, values), budget=first.budget)
    v = [r.choice.value for r in res.rows]
    assert v == sorted(v)
    assert (factor == 1.0 and per_call == 0) == all(r.tries == 1 for r in res.rows)
    d = profile_of(res.rows[0], res, H100, "abc", 3, None)
    assert d["search"]["value"] == pytest.approx(res.rows[0].choice.value)
    assert d["layers"][res.rows[0].choice.kinds[0]]["k_chunk"] > 0


class SpikyBench(FakeBench):
    """FakeBench whose first `n` timings with QDEC on are `spike` seconds slow, as a pair on the GPU now and then
    is."""

    def __init__(self, p, spike, n=1, **kw):
        super().__init__(p, **kw)
        self.spike, self.n = spike, n

    def decode_time(self, c):
        t = super().decode_time(c)
        if c is not None and self.n > 0:
            t, self.n = t + self.spike, self.n - 1
        return t


def test_one_slow_timing_does_not_cost_a_budget_its_setting():
    """A setting whose first pair measures over its budget is timed again and judged by the mean of the two: one
    noisy pair neither drops the setting nor leaves a cost per call behind for the later budgets."""
    p = problem()
    values = concentrated(p)
    clean = run(p, FakeBench(p, values=values), BUDGETS, evaluate=False).rows
    s0, b = clean[0].slowdown, clean[0].budget
    assert s0 < b
    bench = SpikyBench(p, spike=1.5 * (b - s0) * p.step_time, values=values)
    rows = run(p, bench, BUDGETS, evaluate=False).rows
    assert [r.choice.key for r in rows] == [r.choice.key for r in clean]
    assert rows[0].slowdown == pytest.approx(s0 + 0.75 * (b - s0)) and rows[0].tries == 1


def test_a_setting_first_timed_just_under_its_budget_is_timed_again():
    """Within NEAR of the budget a pair is noise-sized from it on either side: timed again and judged by the mean, as
    a setting first timed over it is (were only those timed again, noise could only help a setting in)."""
    p = problem()
    values = concentrated(p)
    clean = run(p, FakeBench(p, values=values), BUDGETS, evaluate=False).rows
    s0, b = clean[0].slowdown, clean[0].budget
    first = s0 - NEAR / 2  # the first pair, under the budget by less than NEAR
    assert 0 < b - first < NEAR
    bench = SpikyBench(p, spike=(first - s0) * p.step_time, values=values)
    rows = run(p, bench, BUDGETS, evaluate=False).rows
    assert [r.choice.key for r in rows] == [r.choice.key for r in clean]
    assert rows[0].slowdown == pytest.approx((first + s0) / 2)
    assert sum(c is not None and c.key == rows[0].choice.key for c in bench.decodes) == 2


def test_a_valued_budget_measures_its_single_best_call_before_settling_on_nothing():
    """Every setting the searches try measures over (here: slow pairs, as many as the tries take); before giving up,
    the one compensating call of most value is measured, and kept where it fits. Where nothing fits, the table says
    what was tried."""
    from localllm.tuner.search import single
    p = problem()
    values = concentrated(p)
    bench = SpikyBench(p, spike=p.step_time, n=100, values=values)
    rows = run(p, bench, [0.05], evaluate=False).rows
    assert not rows[0].choice.compensates and len(rows[0].over) >= 2
    out = table(run(p, SpikyBench(p, spike=p.step_time, n=100, values=values), [0.05], evaluate=False), "t")
    assert "nothing fits; " in out and "measured +" in out
    tries = len(rows[0].over) - 1  # the searches' settings, each timed twice (the first pair is over)
    r = run(p, SpikyBench(p, spike=p.step_time, n=2 * tries, values=values), [0.05], evaluate=False).rows[0]
    one = single(p, bench.gemv_time, 0.05, values)
    assert r.choice.key == one.key and r.slowdown <= 0.05 and p.calls(r.choice) == 1 and not r.over
    (kind,) = r.choice.kinds
    assert r.choice.value == max(values(kind, r.choice.k_chunk[kind]).values())
    # where a try already measured that call (over), it is not listed twice
    r = run(p, SpikyBench(p, spike=p.step_time, n=100, values=values), [0.2], evaluate=False).rows[0]
    keys = [c.key for c, _ in r.over]
    assert single(p, bench.gemv_time, 0.2, values).key in keys and len(set(keys)) == len(keys)


def test_no_compensation_when_nothing_measured_fits():
    p = problem()
    res = run(p, FakeBench(p, extra=p.step_time), BUDGETS, evaluate=False)  # QDEC on doubles the step
    for r in res.rows:
        assert not r.choice.compensates and r.slowdown == 0 and r.choice.n_tb_max is None
    assert res.perplexity_off is None and all(r.perplexity is None for r in res.rows)
    out = table(res, "title")
    assert "nothing fits" in out and "off" in out


def test_measures_the_least_setting_before_settling_on_nothing():
    """A cost the GEMV timings miss that does not grow with k_chunk (extra, whenever QDEC is on: on the H100 the
    compensating gate_up loses the plain GEMV's two blocks per SM) makes the searched settings overshoot and the
    shrinking target fall below the cheapest setting, which, measured, fits; where it does not, nothing."""
    p = problem()
    cheapest = least(p, knee(p.layers), 0.05)
    e, budget = cheapest.predicted, 2.05 * cheapest.predicted  # the least setting measures 2e
    r = run(p, FakeBench(p, extra=e * p.step_time), [budget], evaluate=False).rows[0]
    assert r.choice.k_chunk == cheapest.k_chunk and r.slowdown <= budget and r.tries > 1
    assert r.slowdown == pytest.approx(2 * e)
    assert not run(p, FakeBench(p, extra=2 * e * p.step_time), [budget], evaluate=False).rows[0].choice.compensates


def test_fewer_blocks_when_even_the_least_setting_is_over():
    """A fixed cost per compensating call (the H200: ~4 us a call against a 1.7 ms step) that puts even the least
    setting over the budget on every block: it runs on the blocks with the most to gain, as many as fit, measured."""
    p = problem()
    cheapest = least(p, knee(p.layers), 0.05)
    (kind,) = [k for k, v in cheapest.k_chunk.items() if v]
    n = p.layer(kind).count
    per_call = 0.05 * p.step_time / 10.5  # 10 calls fit 5%
    bench = FakeBench(p, per_call=per_call)
    res = run(p, bench, [0.05, 0.1], evaluate=True)
    for r, most in zip(res.rows, (10, 21)):
        c = r.choice
        assert c.k_chunk == cheapest.k_chunk and set(c.blocks) == {kind} and r.slowdown <= r.budget
        m = len(c.blocks[kind])
        assert most - 3 <= m <= most and c.blocks[kind] == tuple(range(n - m, n))  # the order's first m, sorted
        assert r.slowdown == pytest.approx(bench.decode_time(c) / p.step_time - 1)
        assert c.predicted == pytest.approx(cheapest.predicted * m / n)
        d = profile_of(r, res, H100, "abc", 3, None)
        assert P.problems(d) is None and d["layers"][kind]["blocks"] == list(c.blocks[kind])
        assert all("blocks" not in v for k, v in d["layers"].items() if k != kind)
        assert f"({kind} in {m} of {n} blocks)" in table(res, "t")
    assert res.rows[0].perplexity > res.rows[1].perplexity  # more blocks, more rows
    assert bench.orders and all(o == (kind, cheapest.k_chunk[kind]) for o in bench.orders)
    # not even one block fits: nothing
    r = run(p, FakeBench(p, per_call=0.06 * p.step_time), [0.05], evaluate=False).rows[0]
    assert not r.choice.compensates and r.slowdown == 0


def test_table_and_profiles():
    p = problem()
    res = run(p, FakeBench(p), BUDGETS)
    out = table(res, "QDEC tuning of m on GPU").splitlines()
    assert out[0] == "QDEC tuning of m on GPU" and "n_tb_max / (k_qkv, k_o, k_gu, k_d)" in out[1]
    assert [line.split()[0] for line in out[3:7]] == ["2.5%", "5%", "10%", "20%"]
    for r in res.rows:
        d = profile_of(r, res, H100, "abc", 3, 512)
        assert P.problems(d) is None
        assert d["layers"]["qkv"] == {"k_chunk": r.choice.k_chunk["qkv"], "n_tb": r.choice.n_tb["qkv"]}
        assert d["slowdown"] == r.slowdown <= d["budget"] and d["perplexity"]["tokens"] == 512
        assert d["decode_ms"]["off"] == pytest.approx(1e3 * p.step_time)
        assert d["slowdown"] == pytest.approx(d["decode_ms"]["qdec"] / d["decode_ms"]["off"] - 1)
        json.dumps(d)


def a_profile(budget=0.05, gpu=H100, model_id="abc", ks=(4, 2, 8, 6), slowdown=0.041):
    return {"format": P.FORMAT, "gpu": dict(gpu), "model_id": model_id, "bits": 3, "budget": budget,
            "n_tb_max": 24, "layers": {k: {"k_chunk": v, "n_tb": 4} for k, v in zip(KINDS, ks)},
            "slowdown": slowdown, "created": "2026-11-23T10:00:00+00:00"}


def test_budgets_and_file_names():
    assert P.parse_budgets("2.5,5,10,20") == [0.025, 0.05, 0.1, 0.2]
    assert P.parse_budgets("5%") == P.parse_budgets(" 5 ") == [0.05]
    for bad in ("0", "abc", "150", "", "-5"):
        with pytest.raises(LocalLLMError, match="budget"):
            P.parse_budgets(bad)
    assert P.file_name("NVIDIA H100 80GB HBM3", 0.05) == "nvidia-h100-80gb-hbm3__5pct.json"
    assert P.file_name("NVIDIA GeForce RTX 4090", 0.025) == "nvidia-geforce-rtx-4090__2.5pct.json"
    from localllm.runtime import _check_budget  # load(budget=): the same bounds as --budget (no bool, no "0pct")
    for bad in (True, 1e-12, 0, 1.5, float("nan"), "0.05"):
        with pytest.raises(LocalLLMError, match="tuning budget"):
            _check_budget(bad)
    _check_budget(0.05)


def test_profile_round_trip_and_replacing_the_same_target(tmp_path):
    d = a_profile()
    path, old = P.write(tmp_path, d)
    assert old is None and path == tmp_path / "profiles" / "nvidia-h100-80gb-hbm3__5pct.json"
    assert P.read(path) == d
    d2 = a_profile(ks=(5, 3, 9, 7))
    path2, old = P.write(tmp_path, d2)  # re-tuning the same GPU, model and budget replaces, and says so
    assert path2 == path and old == d and P.read(path) == d2
    assert [f.name for f in (tmp_path / "profiles").iterdir()] == [path.name]  # no temp files left
    # a budget is a fraction of the decode step, as load() takes it: 5 (meant as 5%) is not one, nor is 0
    for bad in (5, 0, -0.05, 1.01):
        assert "no budget" in P.problems(a_profile(budget=bad)), bad


def test_a_file_that_is_not_this_targets_profile_is_never_overwritten(tmp_path):
    path, _ = P.write(tmp_path, a_profile(model_id="other"))
    before = path.read_bytes()
    with pytest.raises(LocalLLMError, match="model other.*left as it is.*--force"):
        P.write(tmp_path, a_profile(model_id="abc"))
    assert path.read_bytes() == before
    with pytest.raises(LocalLLMError, match=r"\(132 SMs\) / model other, not NVIDIA H100 80GB HBM3 \(114 SMs\)"):
        P.write(tmp_path, a_profile(model_id="other", gpu={**H100, "sm_count": 114}))  # the same name: say the SMs
    assert path.read_bytes() == before
    path.write_text("{not json")
    with pytest.raises(LocalLLMError, match="not valid JSON.*left as it is"):
        P.write(tmp_path, a_profile())
    assert path.read_text() == "{not json"
    P.write(tmp_path, a_profile(), force=True)
    assert P.read(path)["model_id"] == "abc"


def test_a_failed_write_leaves_the_old_profile_whole(tmp_path, monkeypatch):
    path, _ = P.write(tmp_path, a_profile())
    before = path.read_bytes()

    def boom(*a):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        P.write(tmp_path, a_profile(ks=(1, 1, 1, 1)))
    assert path.read_bytes() == before
    assert [f.name for f in path.parent.iterdir()] == [path.name]


def test_select_takes_the_largest_budget_within_the_one_asked_for(tmp_path):
    for b in (0.025, 0.1, 0.2):
        P.write(tmp_path, a_profile(budget=b))
    pick = lambda b: P.select(tmp_path, H100["name"], 132, "abc", b)  # noqa: E731
    assert pick(0.05).profile["budget"] == 0.025 and not pick(0.05).warnings
    # the others in order, should the runtime find one not to fit: within the budget largest first, then above it
    assert [d["budget"] for _, d in pick(0.15).candidates] == [0.1, 0.025, 0.2]
    assert pick(0.1).profile["budget"] == 0.1
    assert pick(0.5).profile["budget"] == 0.2
    assert pick(0.01).profile["budget"] == 0.025  # none within: the smallest
    empty = P.select(tmp_path / "nothing", H100["name"], 132, "abc")
    assert empty.profile is None and not empty.warnings


def test_select_warns_about_other_gpus_models_and_broken_files(tmp_path):
    P.write(tmp_path, a_profile(gpu={**H100, "name": "NVIDIA GeForce RTX 4090", "sm_count": 128}))
    sel = P.select(tmp_path, H100["name"], 132, "abc")
    assert sel.profile is None and len(sel.warnings) == 1
    w = sel.warnings[0]
    assert "NVIDIA GeForce RTX 4090" in w and "NVIDIA H100 80GB HBM3" in w and "localllm tune" in w
    P.write(tmp_path, a_profile(model_id="old-model"))
    sel = P.select(tmp_path, H100["name"], 132, "abc")
    assert sel.profile is None and "old-model" in sel.warnings[0] and "abc" in sel.warnings[0]
    # the same name with another SM count (a MIG slice, another board) is another GPU
    sel = P.select(tmp_path, H100["name"], 114, "old-model")
    assert sel.profile is None and "132 SMs" in sel.warnings[0]
    (tmp_path / "profiles" / "broken.json").write_text("{")
    P.write(tmp_path, a_profile(budget=0.1))
    sel = P.select(tmp_path, H100["name"], 132, "abc")
    assert sel.profile["budget"] == 0.1
    assert len(sel.warnings) == 1 and "broken.json" in sel.warnings[0] and "not valid JSON" in sel.warnings[0]
    assert all("\n" not in w for w in sel.warnings)
    (tmp_path / "profiles" / "deep.json").write_text("[" * 100_000 + "]" * 100_000)  # past Python's stack
    sel = P.select(tmp_path, H100["name"], 132, "abc")
    assert sel.profile["budget"] == 0.1 and any("deep.json" in w and "not a profile" in w for w in sel.warnings)


@pytest.fixture
def model_copy(tiny_quant, tmp_path):
    return shutil.copytree(tiny_quant, tmp_path / "m")


@pytest.fixture
def fake_gpu(monkeypatch):
    """The runtime's GPU branch of set_qdec('on') on the CPU: device type cuda, an H100's properties, and the
    kernel launches not placed (nothing runs). Returns the (kind -> (k, n_tb)) the runtime asked to place."""
    from localllm.model import Transformer
    from localllm.runtime import LocalModel
    placed = {}

    class Props:
        name, multi_processor_count, shared_memory_per_block_optin = H100["name"], 132, 232448

    monkeypatch.setattr(Transformer, "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: Props())
    monkeypatch.setattr(LocalModel, "_check_qdec_shared_memory", lambda self, ks: None)
    monkeypatch.setattr(LocalModel, "_check_n_tb", lambda self, ks, nts: None)
    def place(self, ks, nts=None, blocks=None):
        placed.update({k: (ks[k], (nts or {}).get(k)) for k in ks})
        placed["blocks"] = blocks

    monkeypatch.setattr(LocalModel, "_place_qdec", place)
    return placed


def test_runtime_uses_the_profile_of_this_gpu_and_model(model_copy, fake_gpu, capsys):
    from localllm.runtime import load
    lm = load(model_copy, qdec="off")
    mid = lm.manifest["model_id"]
    P.write(model_copy, a_profile(model_id=mid, ks=(4, 2, 8, 6)))
    P.write(model_copy, a_profile(budget=0.2, model_id=mid, ks=(9, 9, 9, 9), slowdown=0.18))
    lm.set_qdec("on")
    assert lm.settings.mode == "approx" and lm.settings.k_chunk == {"qkv": 4, "o": 2, "gate_up": 8, "down": 6}
    assert fake_gpu["qkv"] == (4, 4)
    assert lm.qdec_source == "tuned on NVIDIA H100 80GB HBM3 for a 5% budget (measured +4.1%)"
    assert lm.qdec_overhead == 0.041
    lm.set_qdec("on", budget=0.2)
    assert lm.settings.k_chunk["qkv"] == 9 and lm.qdec_overhead == 0.18 and "20% budget" in lm.qdec_source
    lm.set_qdec(16)
    assert lm.qdec_source == "k_chunk 16 (set by hand)" and lm.qdec_overhead is None
    lm.set_qdec("off")
    assert lm.qdec_source == "QDEC off" and lm.settings.mode == "off"
    assert capsys.readouterr().err == ""
    P.write(model_copy, a_profile(budget=0.01, model_id=mid, ks=(0, 0, 0, 0), slowdown=0.0))
    lm.set_qdec("on", budget=0.01)
    assert lm.settings.mode == "off" and "no compensation fits" in lm.qdec_source and lm.qdec_overhead == 0.0
    # a profile that compensates some blocks of a kind (format 2), and one of format 1 (every block)
    d = a_profile(budget=0.03, model_id=mid, ks=(0, 0, 4, 0), slowdown=0.02)
    d["layers"]["gate_up"]["blocks"] = [1]
    P.write(model_copy, d)
    lm.set_qdec("on", budget=0.03)
    assert lm.settings.k_for("gate_up", 1) == 4 and lm.settings.k_for("gate_up", 0) == 0
    assert lm.qdec_source.endswith("(measured +2.0%, gate_up in 1 block)")
    assert fake_gpu["blocks"] == {"gate_up": frozenset({1})}
    d = {**a_profile(budget=0.04, model_id=mid, ks=(0, 0, 2, 0), slowdown=0.03), "format": 1}
    P.write(model_copy, d)
    lm.set_qdec("on", budget=0.04)
    assert lm.settings.k_for("gate_up", 0) == 2 and not lm.settings.blocks and fake_gpu["blocks"] == {}
    assert capsys.readouterr().err == ""


def test_qdec_on_some_blocks_only(model_copy):
    """set_qdec's blocks: a kind compensated in the blocks given only (the CPU path; the GPU places launches for the
    same layers); a block that does not exist is refused in one line."""
    from localllm.runtime import load
    lm = load(model_copy, qdec="off", device="cpu")
    seen = []
    lm.settings.observer = lambda lin, x, idx: seen.append((lin.kind, lin.block))
    ids = torch.tensor([[1, 5, 9, 3]])

    def logits(q):
        lm.set_qdec(q)
        seen.clear()
        with torch.inference_mode():
            return lm.model(ids).float()
    off, some = logits("off"), logits({"k_chunk": {"gate_up": 8}, "blocks": {"gate_up": [1]}})
    assert seen == [("gate_up", 1)] and "gate_up in blocks 1 only" in lm.qdec_source
    none = logits({"k_chunk": {"gate_up": 8}, "blocks": {"gate_up": []}})
    assert seen == [] and torch.equal(none, off) and "gate_up in no block" in lm.qdec_source
    every = logits({"k_chunk": {"gate_up": 8}})
    assert sorted(seen) == [("gate_up", b) for b in range(len(lm.model.blocks))]
    assert not torch.equal(some, off) and not torch.equal(some, every)
    with pytest.raises(LocalLLMError, match=r"block indices within 0\.\.") as e:
        lm.set_qdec({"k_chunk": 8, "blocks": {"gate_up": [len(lm.model.blocks)]}})
    assert "\n" not in str(e.value)


def test_without_a_profile_load_says_qdec_runs_untuned_once(model_copy, fake_gpu, capsys):
    """No profile at all for this GPU: load() says in one line that QDEC runs the default k_chunk and names the fix;
    tune=False (`localllm generate`, whose summary says it) is silent. (tune=True: tests/test_gpu_tune.py.)"""
    from localllm.runtime import DEFAULT_K_CHUNK, load
    lm = load(model_copy)
    err = capsys.readouterr().err
    assert lm.qdec_untuned and lm.settings.k_chunk == {k: DEFAULT_K_CHUNK for k in lm.settings.k_chunk}
    assert err.count("\n") == 1 and err.startswith("localllm: no QDEC tuning profile for this GPU and model, so every "
                                                    f"layer compensates at k_chunk {DEFAULT_K_CHUNK}")
    assert f"`localllm tune {model_copy}`" in err
    lm.set_qdec("off")
    lm.set_qdec("on")  # toggling says nothing again
    assert capsys.readouterr().err == ""
    lm = load(model_copy, tune=False)
    assert lm.qdec_untuned and capsys.readouterr().err == ""


def test_runtime_warns_and_uses_the_default_for_another_gpu_or_model(model_copy, fake_gpu, capsys):
    from localllm.runtime import DEFAULT_K_CHUNK, load
    P.write(model_copy, a_profile(gpu={**H100, "name": "NVIDIA GeForce RTX 4090", "sm_count": 128}))
    lm = load(model_copy)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("localllm: warning: ")
    assert "NVIDIA GeForce RTX 4090" in err and "NVIDIA H100 80GB HBM3" in err and f"localllm tune {model_copy}" in err
    assert lm.settings.k_chunk == {k: DEFAULT_K_CHUNK for k in lm.settings.k_chunk}
    assert lm.qdec_source.startswith(f"default k_chunk {DEFAULT_K_CHUNK}: no tuning profile")
    assert lm.qdec_overhead is None
    lm.set_qdec("off")
    lm.set_qdec("on")  # the same lookup: no second warning
    assert capsys.readouterr().err == ""
    shutil.rmtree(model_copy / "profiles")
    P.write(model_copy, a_profile(model_id="0123456789abcdef"))
    lm = load(model_copy)
    err = capsys.readouterr().err
    assert "0123456789abcdef" in err and lm.manifest["model_id"] in err and "localllm tune" in err
    assert lm.settings.k_chunk["qkv"] == DEFAULT_K_CHUNK


def test_runtime_survives_a_corrupt_or_unfitting_profile(model_copy, fake_gpu, capsys):
    from localllm.runtime import DEFAULT_K_CHUNK, describe, load
    (model_copy / "profiles").mkdir()
    (model_copy / "profiles" / "nvidia-h100-80gb-hbm3__5pct.json").write_text('{"format": 1, "gpu": ')
    lm = load(model_copy)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nvidia-h100-80gb-hbm3__5pct.json" in err and "not valid JSON" in err
    assert lm.settings.k_chunk["o"] == DEFAULT_K_CHUNK and "Traceback" not in err
    # a profile whose k_chunk this model's calibration cannot serve: a warning, then the default
    P.write(model_copy, a_profile(model_id=lm.manifest["model_id"], ks=(4, 4, 4, 999)), force=True)
    lm = load(model_copy)
    err = capsys.readouterr().err
    assert "does not fit this model" in err and err.count("\n") == 1 and "using the default k_chunk" in err
    assert lm.settings.k_chunk["down"] == DEFAULT_K_CHUNK
    assert lm.qdec_source.startswith(f"default k_chunk {DEFAULT_K_CHUNK}: this GPU's tuning profiles do not fit")
    # ... or the next profile, where one fits: a smaller budget's (the largest within the budget asked for first)
    P.write(model_copy, a_profile(model_id=lm.manifest["model_id"], budget=0.025, ks=(2, 2, 2, 2)))
    lm = load(model_copy)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not fit this model" in err and "using the next, " in err
    assert lm.settings.k_chunk == dict(zip(KINDS, (2, 2, 2, 2))) and "2.5% budget" in lm.qdec_source
    assert describe(lm)["tuning_profiles"]["nvidia-h100-80gb-hbm3__5pct.json"].startswith(
        "not usable: down k_chunk 999, past the")
    lm.set_qdec("off")
    lm.set_qdec("on")  # the lookup is kept: no second warning, the same profile
    assert capsys.readouterr().err == "" and lm.settings.k_chunk["down"] == 2


def test_cpu_ignores_profiles(model_copy, capsys):
    from localllm.runtime import DEFAULT_K_CHUNK, load
    P.write(model_copy, a_profile(gpu={**H100, "name": "Some GPU"}))
    lm = load(model_copy)
    assert capsys.readouterr().err == ""
    assert lm.settings.k_chunk["qkv"] == DEFAULT_K_CHUNK and "CPU" in lm.qdec_source


def test_info_lists_profiles(model_copy, capsys):
    from localllm.cli import main
    from localllm.runtime import describe, load
    mine = json.loads((model_copy / "localllm.json").read_text())["model_id"]
    P.write(model_copy, a_profile(model_id=mine))
    (model_copy / "profiles" / "broken__10pct.json").write_text("{not json")
    (model_copy / "profiles" / "other__20pct.json").write_text(json.dumps(a_profile(model_id="other")))
    (model_copy / "profiles" / "percent__5pct.json").write_text(json.dumps(a_profile(model_id=mine, budget=5)))
    d = describe(load(model_copy))
    fix = "; delete it or re-run `localllm tune`"
    assert d["tuning_profiles"] == {
        "broken__10pct.json": "unreadable: not valid JSON (Expecting property name enclosed in double quotes, line 1)"
                              + fix,
        "nvidia-h100-80gb-hbm3__5pct.json": "NVIDIA H100 80GB HBM3 (132 SMs), 5% budget",
        "other__20pct.json": "not usable: made for another model (other)",
        "percent__5pct.json": "not usable: no budget between 0.0001% and 100%, as a fraction" + fix}
    assert d["qdec"]["source"]
    assert main(["info", str(model_copy)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("tuning"))
    assert "nvidia-h100-80gb-hbm3__5pct.json (NVIDIA H100 80GB HBM3 (132 SMs), 5% budget)," in line
    assert "broken__10pct.json (unreadable" in line


def test_cli_tune_without_a_gpu_is_one_line(tiny_quant, tiny_ckpt, tmp_path):
    from localllm.cli import main
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    nores = tmp_path / "nores"
    assert main(["quantize", str(tiny_ckpt), "-o", str(nores), "--no-residuals", "--calib-tokens", "256"]) == 0
    r = subprocess.run([sys.executable, "-m", "localllm.cli", "tune", str(tiny_quant), "--budget", "5"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("localllm: error: localllm tune times the QDEC kernels")
    r = subprocess.run([sys.executable, "-m", "localllm.cli", "generate", "--budget", "abc", "hi"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "budget" in r.stderr and "Traceback" not in r.stderr
    # the arguments' own errors come first, so that a user meets them before renting a GPU
    for args, what in (([str(tiny_quant), "--budget", "abc"], "a budget is a percentage"),
                       (["/no/such/model"], "no such file or folder: /no/such/model; localllm tune takes a model"),
                       ([str(nores)], "has no QDEC residuals, so there is nothing to tune"),
                       ([str(tiny_quant.parent)], "is not a localllm model")):
        r = subprocess.run([sys.executable, "-m", "localllm.cli", "tune", *args], capture_output=True, text=True,
                           env=env)
        assert r.returncode == 2 and what in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_problem_of_a_model_with_this_gpus_numbers(tiny_quant):
    from localllm.kernels import qdec
    from localllm.runtime import load
    from localllm.tuner.timing import problem_of
    lm = load(tiny_quant, qdec="off")
    grid_of = lambda N: min(N // 16, 132)  # noqa: E731 - kernels.gemv.grid_of on an H100
    p = problem_of(lm, sm_count=132, smem=232448, grid_of=grid_of)
    assert p.n_tb_limit == 66 and [lay.kind for lay in p.layers] == list(KINDS)
    for lay in p.layers:
        assert lay.count == lm.model.cfg.num_layers and lay.k_max == lm.manifest["calibration"]["kmax"]
        assert list(lay.n_tb) == qdec.viable_n_tb(lay.K, lay.N, grid_of(lay.N))
    # a GPU with little shared memory per block bounds k_chunk by it
    lin = lm.model.blocks[0].down
    need = qdec.shared_bytes_total(lin.quant, 10, grid_of(lin.out_features), 99 * 1024)  # (a limit under 200 KB)
    small = problem_of(lm, sm_count=132, smem=need, grid_of=grid_of)
    assert {lay.kind: lay.k_max for lay in small.layers}["down"] == 10


def test_timing_inputs_have_the_calibration_spread_after_the_fused_transform(tiny_quant):
    """The GEMV timer's inputs, as the kernel transforms them (RMSNorm, SwiGLU gate), have the per-channel spread
    the calibration recorded (up to one scale for the RMSNorm kinds)."""
    from localllm import ops
    from localllm.runtime import load
    from localllm.tuner.timing import GemvTimer
    lm = load(tiny_quant, qdec="off")
    blk = lm.model.blocks[0]
    gen = torch.Generator().manual_seed(0)
    for kind in KINDS:
        lin = getattr(blk, kind)
        s = GemvTimer._inputs(kind, blk, lin, "cpu", gen)
        x = s["x"].float()
        assert torch.isfinite(x).all() and s["out"].shape == (lin.out_features,)
        f = ops.rmsnorm(x, s["norm"][0], s["norm"][1]) if s["norm"] else ops.silu_mul(x) if s["glu"] else x
        assert f.shape == (lin.in_features,)
        g = f / lin.stats.sq_mean.sqrt().clamp(min=1e-6)  # standard normal times one scale
        scale = g.square().mean().sqrt()
        assert torch.isfinite(g).all() and scale > 0
        if kind in ("o", "down"):  # no norm in front: the calibration's own scale
            assert 0.6 < scale < 1.6, (kind, scale)
        assert (s["residual"] is not None) == (kind in ("o", "down")) and s["glu"] == (kind == "down")


def test_tune_needs_the_model_on_a_gpu(tiny_quant):
    from localllm.runtime import load
    from localllm.tuner.tune import tune
    with pytest.raises(LocalLLMError, match="measures the GPU"):
        tune(load(tiny_quant, qdec="off"), [0.05])


def test_qdec_1_is_k_chunk_1_not_on(tiny_quant):
    from localllm.runtime import load
    lm = load(tiny_quant, qdec=1)
    assert lm.settings.k_chunk == {k: 1 for k in KINDS} and lm.qdec_source == "k_chunk 1 (set by hand)"
    lm.set_qdec(True)
    assert lm.settings.k_chunk["o"] == 8


def test_block_order_by_estimated_gain(model_copy):
    """tuner.blocks: each layer's share of output energy (qkv: of its v rows) that compensating its k_chunk most active
    channels per chunk adds back, against float64 from the dense W_hat and R_hat; blocks ranked by it."""
    from localllm.qdec import chunk_bounds, k_for_chunk
    from localllm.runtime import load
    from localllm.tuner import blocks
    lm = load(model_copy, qdec="off", device="cpu")
    cfg = lm.model.cfg
    assert blocks.counted_rows(cfg, "qkv") == slice(cfg.q_size + cfg.kv_size, cfg.q_size + 2 * cfg.kv_size)
    for kind, rows in [(kind, blocks.counted_rows(cfg, kind)) for kind in KINDS] + [("qkv", None)]:
        lins = [getattr(b, kind) for b in lm.model.blocks]
        # a few channels of the tiny inputs (a partial chunk takes k * size / 1024), then more, then one: gain()
        # keeps each layer's ranked channels and takes a smaller k_chunk's from the larger one's
        for k in (8, 300, 1):
            want = {}
            for lin in lins:
                sq = lin.stats.sq_mean.double()
                r = rows or slice(None)
                r2 = lin.residual.dequantize().double()[r].square().sum(0)
                top = torch.cat([sq[s:e].topk(k_for_chunk(k, e - s)).indices + s
                                 for s, e in chunk_bounds(lin.in_features)])
                den = (sq * lin.dense().double()[r].square().sum(0)).sum()
                want[lin.block] = float((sq[top] * r2[top]).sum() / den)
                assert lin.weighted_energy(lin.stats.sq_mean, rows) == pytest.approx(float(den), rel=1e-5)
                assert blocks.gain(lin, k, rows) == pytest.approx(want[lin.block], rel=1e-4)
            assert blocks.order(lins, k, rows) == tuple(sorted(want, key=lambda b: -want[b]))
    # what gain() keeps per layer follows statistics that grew, and a new residual
    lin = lm.model.blocks[0].down

    def fresh(lin):
        sq, r2 = lin.stats.sq_mean.double(), lin.residual.dequantize().double().square().sum(0)
        top = torch.cat([sq[s:e].topk(k_for_chunk(8, e - s)).indices + s for s, e in chunk_bounds(lin.in_features)])
        return float((sq[top] * r2[top]).sum() / (sq * lin.dense().double().square().sum(0)).sum())
    for change in ("stats", "residual"):
        before = blocks.gain(lin, 8)
        if change == "stats":
            # the two channels the calibration ranked lowest, far louder than any it saw: now they rank first, so
            # the gain must move (random loud inputs once moved it by 0.08% only, a flaky test)
            x = torch.zeros(256, lin.in_features)
            x[:, lin.stats.sq_mean.topk(2, largest=False).indices] = 1e3
            lin.stats.update(x)
        else:
            lin.residual = type(lin.residual)(lin.residual.packed.flip(0).contiguous(), lin.residual.scales)
        g = blocks.gain(lin, 8)
        assert g == pytest.approx(fresh(lin), rel=1e-4) and abs(g - before) > 1e-3 * before


def test_block_values_add_up_to_the_measured_kl_per_kind(tiny_quant):
    """tuner.blocks: a kind's measured KL taken away (quantize's qdec_value), split over its blocks by their gain, adds
    back up to the measurement at the measured k_chunk; at any other k_chunk each block's value is its gain there times
    the same weight."""
    from localllm.runtime import load
    from localllm.tuner.blocks import counted_rows, gain, kind_weight, values
    from localllm.tuner.timing import compensable
    lm = load(tiny_quant, qdec="off")
    measured = lm.manifest["calibration"]["qdec_value"]
    for kind in KINDS:
        lins, rows = compensable(lm, kind), counted_rows(lm.model.cfg, kind)
        assert [lin.block for lin in lins] == list(range(lm.model.cfg.num_layers))
        w = kind_weight(lins, measured, rows)
        v = values(lins, measured["k_chunk"], w, rows)
        assert sum(v.values()) == pytest.approx(max(measured["off"] - measured["kl"][kind], 0.0))
        for k in (1, 32):
            assert values(lins, k, w, rows) == pytest.approx({lin.block: w * gain(lin, k, rows) for lin in lins})


def test_first_order_values_stay_bounded_where_blocks_nearly_cancel():
    """Block values 0.2, -0.196 and 0 with 0.3 of KL measured taken away: scaled by the positive blocks' sum (block 0
    gets 0.3), not by the near-zero sum of all (block 0 got 15, ten times the model's whole KL)."""
    from localllm.tuner.blocks import first_order
    from types import SimpleNamespace
    lins = [SimpleNamespace(kind="down", block=b) for b in range(3)]
    measured = {"k_chunk": 8, "off": 1.5, "kl": {"down": 1.2},
                "blocks": {"k_chunks": [8], "kl": {"down": [[0.2], [-0.196], [0.0]]}}}
    assert first_order(lins, measured, 8) == pytest.approx({0: 0.3, 1: -0.294, 2: 0.0})


def test_first_order_block_values_scale_to_the_measured_kl_per_kind(tiny_quant):
    """tuner.blocks.first_order: quantize's per-block first-order values, scaled so that a kind's blocks add up to its
    measured KL taken away at the measured k_chunk; at another k_chunk the same scale; None for a model without them
    or at a k_chunk quantize did not record."""
    from localllm.runtime import load
    from localllm.tuner.blocks import first_order
    from localllm.tuner.timing import compensable
    lm = load(tiny_quant, qdec="off")
    measured = lm.manifest["calibration"]["qdec_value"]
    fo = measured["blocks"]
    for kind in KINDS:
        lins = compensable(lm, kind)
        whole = max(measured["off"] - measured["kl"][kind], 0.0)
        at = first_order(lins, measured, measured["k_chunk"])
        j0 = fo["k_chunks"].index(measured["k_chunk"])
        positive = sum(max(fo["kl"][kind][b][j0], 0.0) for b in range(len(lins)))  # (negative blocks left out)
        if positive <= 0:
            assert at is None
            continue
        assert sum(max(v, 0.0) for v in at.values()) == pytest.approx(whole)
        scale = whole / positive
        j = fo["k_chunks"].index(32)
        assert first_order(lins, measured, 32) == pytest.approx({b: scale * fo["kl"][kind][b][j] for b in at})
        assert first_order(lins, measured, 3) is None
        assert first_order(lins, {k: v for k, v in measured.items() if k != "blocks"}, 8) is None


def test_a_tuning_bench_lets_its_model_go(tiny_quant, monkeypatch):
    """GpuBench's caches are its own: a class-level cache kept every tuned model (on a GPU its weights and pinned
    residuals) alive for the process's life. And no reference cycle: the bench and its model go when the last
    reference does, not whenever the garbage collector runs (it once destroyed a bench's decode graph inside another
    capture). (GemvTimer, which needs a GPU, stubbed.)"""
    import weakref

    from localllm.graphs import gc_paused
    from localllm.runtime import load
    from localllm.tuner import timing
    monkeypatch.setattr(timing, "GemvTimer", lambda lm, reps: None)
    lm = load(tiny_quant)
    bench = timing.GpuBench(lm, tokens=0)
    assert bench.block_values("qkv", 1) is bench.block_values("qkv", 1)  # (cached)
    gone, bench_gone = weakref.ref(lm), weakref.ref(bench)
    with gc_paused():
        del lm, bench
        assert bench_gone() is None and gone() is None
