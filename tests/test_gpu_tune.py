"""`localllm tune` on the GPU: the timing oracle gives sane times, a tune of the tiny model measures its slowdown
within each budget and writes profiles that load() then uses, and the CLI prints the table."""
import json
import shutil

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture
def model_copy(tiny_quant, tmp_path):
    return shutil.copytree(tiny_quant, tmp_path / "m")


def test_problem_of_the_model_on_this_gpu(tiny_quant):
    from localllm.kernels import qdec
    from localllm.kernels.gemv import grid_of
    from localllm.runtime import load
    from localllm.tuner.timing import problem_of
    lm = load(tiny_quant, device="cuda", qdec="off")
    p = problem_of(lm)
    props = torch.cuda.get_device_properties(0)
    assert p.n_tb_limit == props.multi_processor_count // 2
    assert [lay.kind for lay in p.layers] == ["qkv", "o", "gate_up", "down"]
    for lay in p.layers:
        lin = getattr(lm.model.blocks[0], lay.kind)
        grid = grid_of(lay.N, torch.device("cuda"))
        assert lay.count == lm.model.cfg.num_layers and list(lay.n_tb) == qdec.viable_n_tb(lay.K, lay.N, grid)
        assert lay.k_max == lm.manifest["calibration"]["kmax"]  # tiny shapes: the calibration bounds k, not smem
        assert qdec.shared_bytes_total(lin.packed, lay.k_max, grid) <= props.shared_memory_per_block_optin


def test_gemv_oracle_times_are_sane():
    """On 8B shapes (two layers each, random weights and residuals): positive, below a millisecond, QDEC not
    faster than the base GEMV (beyond noise), more channels not cheaper than fewer by much. Each time is the best of
    two: a stray slow median (the base of down once measured 29 us against its usual 14 without PDL) is noise, not
    the oracle."""
    from localllm.config import ModelConfig
    from localllm.synthetic import LLAMA3_8B_CONFIG, random_local_model
    from localllm.tuner.timing import GemvTimer, problem_of
    lm = random_local_model(ModelConfig(**{**LLAMA3_8B_CONFIG, "num_layers": 2}), 3, copies=2)
    p = problem_of(lm)
    timer = GemvTimer(lm, reps=10)
    t = lambda *a: min(timer(*a), timer(*a))  # noqa: E731
    for lay in p.layers:
        base = t(lay.kind, 0, 0)
        assert 1e-6 < base < 1e-3, (lay.kind, base)
        n_tb = lay.n_tb_under(p.n_tb_limit)
        k8, k64 = t(lay.kind, n_tb, 8), t(lay.kind, n_tb, 64)
        base = min(base, t(lay.kind, 0, 0))  # again after: down's base once measured 26 us twice before, then 14
        assert k8 > 0.9 * base and k64 > 0.9 * k8, (lay.kind, base, k8, k64)
        assert k64 < 1e-2


def test_tune_tiny_model_writes_profiles_that_load_uses(model_copy, capsys):
    from localllm.runtime import load
    from localllm.tuner import profile as P
    from localllm.tuner.tune import table, tune
    lm = load(model_copy, device="cuda", qdec="off")
    res = tune(lm, [0.2, 1.0], evaluate=True, tokens=64, reps=10)
    assert [r.budget for r in res.rows] == [0.2, 1.0]
    for r in res.rows:
        assert r.slowdown <= r.budget and r.decode > 0  # measured end to end, stepped back when over
        assert r.perplexity is not None and r.perplexity > 1
    assert res.problem.step_time > 0 and res.points > 0 and res.perplexity_off > 1
    print(table(res, "tiny"))
    name = torch.cuda.get_device_name()
    paths = [p for p, _ in res.paths]
    assert [p.name for p in paths] == [P.file_name(name, 0.2), P.file_name(name, 1.0)]
    d = json.loads(paths[0].read_text())
    assert P.problems(d) is None and d["model_id"] == lm.manifest["model_id"] and d["gpu"]["name"] == name
    assert d["decode_ms"]["off"] > 0 and d["perplexity"]["tokens"] == 64
    capsys.readouterr()
    lm2 = load(model_copy, device="cuda", budget=0.2)
    assert "warning" not in capsys.readouterr().err
    assert lm2.qdec_source.startswith(f"tuned on {name} for a 20% budget"), lm2.qdec_source
    assert lm2.qdec_overhead == d["slowdown"]
    want = {k: v["k_chunk"] for k, v in d["layers"].items()}
    if any(want.values()):
        assert lm2.settings.mode == "approx" and lm2.settings.k_chunk == want
        only = {k: set(v["blocks"]) for k, v in d["layers"].items() if "blocks" in v}  # kinds on some blocks
        for lin in lm2.model.linears():
            if want[lin.kind] and lin.block in only.get(lin.kind, {lin.block}):
                assert lin.comp.n_tb == d["layers"][lin.kind]["n_tb"] and lin.comp.k_chunk == want[lin.kind]
            else:
                assert lin.comp is None
    else:
        assert lm2.settings.mode == "off" and "no compensation fits" in lm2.qdec_source
    # generation runs with the tuned setting
    from localllm import generate
    assert isinstance(generate(lm2, "Once upon a time", max_new_tokens=4, seed=0), str)
    # re-tuning the same budget replaces its profile and says so
    res2 = tune(lm, [0.2], evaluate=False, reps=5)
    assert res2.paths[0][0] == paths[0] and res2.paths[0][1] is not None


def test_load_without_a_profile_says_so_or_tunes_once(model_copy, capsys):
    """No tuning profile for this GPU: load() runs the default k_chunk and says so in one line naming the fix (tune=False:
    silently); with tune=True it tunes once, saves the profile next to the model and uses it; the next load finds it,
    silently."""
    from localllm.runtime import DEFAULT_K_CHUNK, load
    from localllm.tuner import profile as P
    lm = load(model_copy, device="cuda", budget=0.2)
    err = capsys.readouterr().err
    assert lm.qdec_untuned and lm.settings.k_chunk["qkv"] == DEFAULT_K_CHUNK and err.count("\n") == 1
    assert err.startswith("localllm: no QDEC tuning profile for this GPU and model") and f"`localllm tune {model_copy}`" in err
    assert not (model_copy / P.DIR).exists() or not list((model_copy / P.DIR).glob("*.json"))
    lm = load(model_copy, device="cuda", budget=0.2, tune=False)  # as `localllm generate`, whose summary says it
    assert lm.qdec_untuned and capsys.readouterr().err == ""
    lm = load(model_copy, device="cuda", budget=0.2, tune=True)
    assert not lm.qdec_untuned and lm.qdec_source.startswith(f"tuned on {torch.cuda.get_device_name()} for a 20% budget")
    files = list((model_copy / P.DIR).glob("*.json"))
    assert len(files) == 1
    stamp = files[0].stat().st_mtime_ns
    capsys.readouterr()
    lm = load(model_copy, device="cuda", budget=0.2, tune=True)
    assert not lm.qdec_untuned and capsys.readouterr().err == "" and files[0].stat().st_mtime_ns == stamp


def test_profile_of_another_gpu_warns_and_falls_back(model_copy, capsys):
    from localllm.runtime import DEFAULT_K_CHUNK, load
    from localllm.tuner import profile as P
    d = {"format": P.FORMAT, "gpu": {"name": "Some Other GPU", "sm_count": 7}, "model_id": "x", "budget": 0.05,
         "layers": {k: {"k_chunk": 1, "n_tb": 1} for k in ("qkv", "o", "gate_up", "down")}, "slowdown": 0.01}
    P.write(model_copy, d)
    lm = load(model_copy, device="cuda")
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1
    assert "Some Other GPU" in warnings[0] and torch.cuda.get_device_name() in warnings[0]
    assert f"localllm tune {model_copy}" in warnings[0]
    assert lm.settings.k_chunk["qkv"] == DEFAULT_K_CHUNK and lm.qdec_source.startswith("default")


def test_cli_tune_prints_the_table(model_copy, capsys):
    from localllm.cli import main
    assert main(["tune", str(model_copy), "--budget", "50%", "--no-eval", "--reps", "5"]) == 0
    out = capsys.readouterr().out
    assert "n_tb_max / (k_qkv, k_o, k_gu, k_d)" in out and "50%" in out and "wrote " in out
    assert (model_copy / "profiles").is_dir() and "quantize it again" not in out
    # a model quantized before quantize measured QDEC's value per kind: the row-count search, and a note saying so
    m = json.loads((model_copy / "localllm.json").read_text())
    del m["calibration"]["qdec_value"]
    (model_copy / "localllm.json").write_text(json.dumps(m))
    assert main(["tune", str(model_copy), "--budget", "50%", "--no-eval", "--reps", "5"]) == 0
    out = capsys.readouterr().out
    assert "replaced " in out and "quantize it again" in out and "predicted KL taken away" not in out


def test_qdec_on_some_blocks_on_the_gpu(tiny_quant, monkeypatch):
    """A setting for some blocks (what a tune on a GPU whose compensating call costs more than a small budget gives):
    launches are placed for those layers only, graph replays equal eager steps, and the block order the tuner
    reads on the GPU is the CPU's."""
    from localllm.decode import Decoder
    from localllm.runtime import load
    from localllm.tuner import blocks
    cpu, gpu = load(tiny_quant, qdec="off"), load(tiny_quant, device="cuda", qdec="off")
    for kind in ("gate_up", "down", "qkv"):  # qkv: its v rows, a row range of the GPU's dequantized slices
        lins = lambda lm: [getattr(b, kind) for b in lm.model.blocks]  # noqa: E731
        rows = blocks.counted_rows(cpu.model.cfg, kind)
        assert blocks.order(lins(gpu), 8, rows) == blocks.order(lins(cpu), 8, rows)
        for a, b in zip(lins(gpu), lins(cpu)):
            assert blocks.gain(a, 8, rows) == pytest.approx(blocks.gain(b, 8, rows), rel=1e-2)
            want = b.weighted_energy(b.stats.sq_mean, rows)
            assert a.weighted_energy(a.stats.sq_mean.cuda(), rows) == pytest.approx(want, rel=1e-2)
            # the same from slices of 16 rows (as an 8B output head is dequantized), the row range cut across them
            monkeypatch.setattr("localllm.model.DEQUANT_ELEMS", 16 * a.in_features)
            assert a.weighted_energy(a.stats.sq_mean.cuda(), rows) == pytest.approx(want, rel=1e-2)
            monkeypatch.undo()
    ids = torch.randint(0, gpu.model.cfg.vocab_size, (8,)).tolist()

    def run(q, use_graph):
        gpu.set_qdec(q)
        dec = Decoder(gpu.model, 16, use_graph=use_graph)
        out = [dec.prefill(ids[:1]).float().cpu()]
        with torch.no_grad():
            for pos in range(1, len(ids)):
                out.append(dec.step(torch.tensor(ids[pos], device="cuda"), pos).float().cpu())
        return torch.stack(out)

    some = {"k_chunk": {"gate_up": 8, "down": 8}, "blocks": {"gate_up": [1], "down": [0]}}
    got = run(some, use_graph=False)
    assert {(lin.kind, lin.block) for lin in gpu.model.linears() if lin.comp is not None} == {("gate_up", 1),
                                                                                                ("down", 0)}
    assert torch.equal(run(some, use_graph=True), got)
    assert not torch.equal(got, run("off", use_graph=False))
    assert not torch.equal(got, run({"k_chunk": {"gate_up": 8, "down": 8}}, use_graph=False))
