"""`localllm report` on a tiny random-weight model (fast; never evidence of quality): its numbers are computed, as
independent computations and theory say they must be, and its output is a new folder of Markdown, JSON and valid
PNGs, written atomically."""
import json
import math
import re
import sys

import pytest
import torch

from localllm.cli import main
from localllm.errors import LocalLLMError
from localllm.evaluate import perplexity, read_text, tokenize
from localllm.modelfile import read_manifest
from localllm.report import Options, make_report
from localllm.runtime import load

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TOKENS, CTX = 120, 64


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    path = tmp_path_factory.mktemp("cache")
    mp.setenv("LOCALLLM_CACHE", str(path))  # the quantized variants go here, not into the user's cache
    yield path
    mp.undo()


@pytest.fixture(scope="module")
def report(tmp_path_factory, tiny_ckpt, cache):
    out = tmp_path_factory.mktemp("rep") / "r"
    argv = [str(tiny_ckpt), "--out", str(out), "--tokens", str(TOKENS), "--ctx", str(CTX), "--bits", "2,3",
            "--k-chunk", "8,64"]
    make_report(Options(model=str(tiny_ckpt), out=str(out), tokens=TOKENS, ctx=CTX, bits=(2, 3), k_chunks=(8, 64),
                        argv=argv))
    return out, json.loads((out / "report.json").read_text())


def rows(rep, **match):
    return [r for r in rep["sections"]["quality"]["rows"] if all(r[k] == v for k, v in match.items())]


def test_report_folder_holds_markdown_and_valid_pngs(report):
    import matplotlib.image
    out, rep = report
    md = (out / "report.md").read_text()
    images = re.findall(r"!\[[^]]*\]\(([^)]+)\)", md)
    assert len(images) == 5 and sorted(images) == sorted(p.name for p in out.glob("*.png"))
    for name in images:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
        h, w, _ = matplotlib.image.imread(out / name).shape
        assert h > 200 and w > 300
    for title in ("Fig. 12", "Fig. 15", "Fig. 16", "Table 1", "Fig. 5b", "Fig. 17", "Fig. 18", "Checks"):
        assert title in md
    if not torch.cuda.is_available():  # the GPU sections say why they are missing and how to add them
        assert md.count("Skipped: ") == 2  # the run's own command, its folder and sections swapped
        assert f"`localllm report {rep['runs'][0]['command'].split()[2]} --tokens {TOKENS} --ctx {CTX} --bits 2,3 " \
            "--k-chunk 8,64 -o DIR --sections kernel,pareto --update`" in md
        assert set(rep["skipped"]) == {"kernel", "pareto"}
    run = rep["runs"][0]
    assert run["command"].startswith("localllm report ") and "--tokens 120" in run["command"]
    assert run["data"]["tokens"] == TOKENS and run["machine"]["cpu"] and run["settings"]["bits"] == [2, 3]
    assert "W2, W3, output head fp16, 4-bit QDEC residuals" in md
    assert md.count(f"{rep['sections']['quality']['source_ppl']:.4g}") >= 2  # the numbers in the text are report.json's


def test_perplexities_are_those_of_the_models(report, tiny_ckpt, cache):
    _, rep = report
    q = rep["sections"]["quality"]
    src = load(tiny_ckpt)
    ids = tokenize(src, read_text(None)[0], TOKENS + 1)
    assert q["source_ppl"] == pytest.approx(perplexity(src, ids, CTX), rel=1e-6)
    for bits in (2, 3):
        (variant,) = (cache / "models").glob(f"*-w{bits}g128")
        lm = load(variant, qdec="off")
        assert rows(rep, bits=bits, mode="off")[0]["ppl"] == pytest.approx(perplexity(lm, ids, CTX), rel=1e-6)
        lm.set_qdec({"mode": "approx", "k_chunk": 64})
        assert rows(rep, bits=bits, mode="approx", k_chunk=64)[0]["ppl"] == \
            pytest.approx(perplexity(lm, ids, CTX), rel=1e-6)
    # every channel compensated with the residual in fp16 is the source model, up to fp16 rounding of R: the variants
    # keep the output head in fp16 (QDEC does not compensate it; an 8-bit head alone moved this tiny model's
    # perplexity by up to ~0.1%)
    assert all(read_manifest(v)["quant"]["head"] is None for v in (cache / "models").iterdir())
    (full,) = rows(rep, mode="exact", k_chunk=1024, residual_bits=16)
    assert full["ppl"] == pytest.approx(q["source_ppl"], rel=1e-3)
    assert all(math.isfinite(r["ppl"]) and r["ppl"] > 1 for r in q["rows"])


def test_table1_residuals_are_those_the_variant_keeps(report, tiny_ckpt, cache):
    """Table 1 requantizes each variant's true residual R = W - W_hat at other widths. W must be the weights the
    variant quantized (SmoothAttention rescales q and k rows): at 4 bits R requantized is the file's own residual.
    (Exact compensation with the fp16 R gives back the source whatever R is, so that check cannot tell.)"""
    from localllm.loader import open_checkpoint
    from localllm.quant import quantize_residual
    from localllm.report import true_residuals
    (variant,) = (cache / "models").glob("*-w3g128")
    assert read_manifest(variant).get("smooth_attention"), "the variants smooth the keys (the case that matters)"
    lm = load(variant, qdec="off")
    n = 0
    for lin, r in true_residuals(open_checkpoint(tiny_ckpt), variant, lm):
        want, got = lin.residual.dequantize().float(), quantize_residual(r, 4).dequantize().float()
        assert (got - want).abs().max() <= 1e-3 * want.abs().max(), lin
        n += 1
    assert n == 4 * lm.model.cfg.num_layers


def test_recall_is_measured_on_the_selections(report):
    _, rep = report
    for r in rows(rep, mode="exact"):
        assert all(v == 1.0 for v in r["recall"].values()), "exact top-k against itself"
    for k in (8, 64):
        (rnd,) = rows(rep, mode="random", k_chunk=k)
        (apx,) = rows(rep, mode="approx", k_chunk=k, residual_bits=4, bits=3)
        assert rnd["recall"]["all"] == pytest.approx(rnd["share"], abs=0.03), "random: the share it draws"
        assert 3 * rnd["recall"]["all"] < apx["recall"]["all"] <= 1
        assert set(apx["recall"]) == {"qkv", "o", "gate_up", "down", "all"}
    assert rows(rep, mode="off")[0]["recall"] is None


def test_residual_widths_read_equal_bytes(report, tiny_ckpt):
    _, rep = report
    scales = 2 * sum(n for n in (64 + 2 * 32, 64, 2 * 192, 64)) * 2  # 2 bytes per output channel, 2 layers
    for k4 in (8, 64):
        (base,) = rows(rep, bits=3, mode="approx", k_chunk=k4, residual_bits=4)
        for w, k in ((2, 2 * k4), (8, k4 // 2), (16, k4 // 4)):
            (r,) = rows(rep, bits=3, mode="approx", k_chunk=k, residual_bits=w)
            assert abs(r["pcie_bytes"] - base["pcie_bytes"]) <= scales, (k4, w)
    # more residual bits per channel, fewer channels: the rows differ, they are separate evaluations
    assert len({r["ppl"] for r in rows(rep, bits=3, mode="approx")}) > 4


def test_outlier_statistics(report):
    _, rep = report
    o = rep["sections"]["outliers"]
    for kind, row in o["per_kind"].items():
        assert 0 < row["share_1"] < row["share_5"] <= 1, kind
        assert 0 <= row["static_recall_1"] <= 1 and 0 <= row["static_recall_5"] <= 1
    s = o["series"]
    assert s["layer"] == 1 and s["kind"] == "down" and len(s["static_recall_5"]) == 100


def test_outlier_statistics_are_the_float64_ones(tiny_quant):
    """Fig. 5b's numbers on inputs with known outliers: each token's energy share of its top 1% / 5% channels and
    the recall of the calibration's top mean x^2 set, against a float64 computation of the same."""
    from localllm.outliers import OutlierStats, top_count
    lm = load(tiny_quant)
    stats = OutlierStats(lm.model, (0, "down"))
    lin = lm.model.blocks[0].down
    K = lin.in_features
    x = torch.randn(40, K)
    hot = lin.stats.sq_mean.topk(3).indices  # the calibration's loudest channels, loud here too in most tokens
    x[:30, hot] *= 20
    x[30:, torch.randperm(K)[:3]] *= 20  # elsewhere in the rest
    stats.update(lin, 0, "down", x)
    stats.remove()
    got = stats.result()["per_kind"]["down"]
    e = x.double().square()
    for f, pct in ((0.01, 1), (0.05, 5)):
        n = top_count(K, f)
        top = e.topk(n, dim=1).indices
        static = set(lin.stats.sq_mean.double().topk(n).indices.tolist())
        share = (e.gather(1, top).sum(1) / e.sum(1)).mean().item()
        rec = sum(len(static & set(r.tolist())) for r in top) / (n * len(top))
        assert got[f"share_{pct}"] == pytest.approx(share, rel=1e-5) and got[f"static_recall_{pct}"] == \
            pytest.approx(rec, rel=1e-5), pct
    assert got["share_1"] > 0.5 and got["static_recall_1"] > 0.3  # the planted outliers are what it measures


def test_an_existing_report_is_kept_unless_asked(report, tiny_ckpt, capsys):
    out, rep = report
    before = (out / "report.md").read_text()
    assert main(["report", str(tiny_ckpt), "-o", str(out), "--tokens", "20"]) == 2
    err = capsys.readouterr().err
    assert "already holds a report" in err and "--force" in err and len(err.strip().splitlines()) == 1
    assert (out / "report.md").read_text() == before
    # --update measures the sections asked for and keeps the others, and the user's own files beside them (dotfiles
    # and a .git folder too)
    (out / "notes.md").write_text("mine")
    (out / "data").mkdir()
    (out / "data" / "x.csv").write_text("1")
    (out / ".git").mkdir()
    (out / ".git" / "HEAD").write_text("ref")
    (out / ".notes").write_text("hidden")
    assert main(["report", str(tiny_ckpt), "--out", str(out), "--tokens", str(TOKENS), "--ctx", str(CTX),
                 "--bits", "2,3", "--k-chunk", "8,64", "--sections", "outliers", "--update"]) == 0
    assert (out / "notes.md").read_text() == "mine" and (out / "data" / "x.csv").read_text() == "1"
    assert (out / ".git" / "HEAD").read_text() == "ref" and (out / ".notes").read_text() == "hidden"
    new = json.loads((out / "report.json").read_text())
    assert new["sections"]["quality"] == rep["sections"]["quality"]
    assert new["sections"]["outliers"]["run"] == 1 and len(new["runs"]) == 2
    assert new["sections"]["outliers"]["per_kind"] == rep["sections"]["outliers"]["per_kind"], "same inputs"
    assert not list(out.parent.glob(".r.*")) and not list(out.glob(".render.*")), "no temp folder left behind"


def test_bad_input_is_one_line(tiny_ckpt, tiny_quant, tmp_path, capsys, monkeypatch):
    cases = [(["--bits", "5"], "--bits takes"), (["--k-chunk", "8,x"], "comma-separated integers"),
             (["--sections", "quality,bogus"], "--sections takes"), (["--residual-bits", "4"], "--residual-bits takes"),
             (["--force", "--update"], "exclude each other"),
             (["--update"], "--update needs the report.json")]
    for args, msg in cases:
        (tmp_path / "old").mkdir(exist_ok=True)
        assert main(["report", str(tiny_ckpt), "--out", str(tmp_path / "old"), *args]) == 2, args
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1, (args, err)
    # --update of a folder that is not there (mistyped): refused, not a new report
    assert main(["report", str(tiny_ckpt), "-o", str(tmp_path / "typo"), "--update", "--tokens", "20"]) == 2
    assert "there is no" in capsys.readouterr().err and not (tmp_path / "typo").exists()
    # the text is checked before the checkpoint opens (the model is missing too)
    assert main(["report", str(tmp_path / "no-model"), "--out", str(tmp_path / "t"), "--text",
                 str(tmp_path / "no.txt")]) == 2
    assert "no text file at" in capsys.readouterr().err
    assert main(["report", str(tiny_quant), "--out", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err
    assert "is a quantized localllm model" in err and "pass that checkpoint" in err
    if not torch.cuda.is_available():
        assert main(["report", str(tiny_ckpt), "--out", str(tmp_path / "g"), "--sections", "kernel"]) == 2
        assert "measures the GPU and needs one" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert main(["report", str(tiny_ckpt), "--out", str(tmp_path / "m")]) == 2
    assert "pip install 'localllm[report]'" in capsys.readouterr().err
    assert not (tmp_path / "m").exists() and not (tmp_path / "g").exists()


def test_require_matplotlib_names_the_install_command(monkeypatch):
    from localllm.report import require_matplotlib
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(LocalLLMError, match=r"pip install 'localllm\[report\]'"):
        require_matplotlib()


@pytest.mark.gpu
def test_gpu_sections_fill_the_report(tmp_path, tiny_ckpt, cache):
    out = tmp_path / "r"
    o = dict(model=str(tiny_ckpt), out=str(out), tokens=60, ctx=CTX, bits=(3,), k_chunks=(8,), budgets=(0.2,))
    make_report(Options(**o, sections=("outliers",)))
    make_report(Options(**o, sections=("kernel", "pareto"), update=True, shapes_8b=False))
    rep = json.loads((out / "report.json").read_text())
    k = rep["sections"]["kernel"]["model"]
    assert set(k) == {"qkv", "o", "gate_up", "down"}
    ratios = {(kind, n, kc): v for kind, e in k.items() for n, r in e["ratio"].items() for kc, v in r.items()}
    assert all(0.5 < v < 100 for v in ratios.values()), ratios
    (pts,) = rep["sections"]["pareto"]["bits"].values()
    assert pts["ms_off"] > 0 and math.isfinite(pts["ppl_off"])
    assert all(p["ms"] > 0 and math.isfinite(p["ppl"]) and p["slowdown"] <= 0.2 for p in pts["points"])
    md = (out / "report.md").read_text()
    assert "Skipped" not in md and (out / "fig18_pareto.png").read_bytes()[:8] == PNG_MAGIC
    assert (out / "fig17_kernel_model.png").exists() and not (out / "fig17_kernel_8b.png").exists()


def test_gpu_sections_render(report, tmp_path):
    """The GPU sections' pages from measurements shaped as measure_kernel / measure_pareto return them (made-up
    values: only the rendering is under test here; the GPU test above measures them)."""
    from localllm.report_render import render
    _, rep = report
    rep = json.loads(json.dumps(rep))
    gpu = {"name": "Some GPU", "compute_capability": "9.0", "sm_count": 132, "memory_bytes": 1, "driver": "CUDA 13.0",
           "torch_cuda": "13.0"}
    rep["runs"].append({**rep["runs"][0], "sections": ["kernel", "pareto"],
                        "machine": {**rep["runs"][0]["machine"], "gpu": gpu}})
    layer = {"N": 4096, "K": 4096, "base_us": 3.0, "ratio": {"1": {"2": 1.1, "8": 1.3}, "4": {"2": 1.05, "8": 1.2}}}
    rep["sections"]["kernel"] = {"bits": 3, "model": {k: layer for k in ("qkv", "o", "gate_up", "down")},
                                 "llama3_8b": {"qkv": layer}, "run": 1}
    point = {"budget": 0.05, "n_tb_max": 4, "k_chunk": {"qkv": 0, "o": 0, "gate_up": 8, "down": 2}, "predicted": 0.04,
             "slowdown": 0.03, "ms": 1.03, "ms_off": 1.0, "ppl": 50.0}
    rep["sections"]["pareto"] = {"budgets": [0.05], "bits": {"3": {"ms_off": 1.0, "ppl_off": 60.0, "points": [point]}},
                                 "run": 1}
    rep["skipped"] = {}
    render(rep, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "Skipped" not in md and "Some GPU" in md and "| W3 | 5% | 4 / (0, 0, 8, 2) | +3.0% | 1.030 | 50 |" in md
    assert "| qkv | 4096→4096 | 3.00 | 4 | 1.05 | 1.20 |" in md
    for name in ("fig17_kernel_model.png", "fig17_kernel_8b.png", "fig18_pareto.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC


def _measured(sections: dict) -> dict:
    """The sections' measurements, without the time they took."""
    return {s: {k: v for k, v in d.items() if k != "seconds"} for s, d in sections.items()}


def test_an_interrupted_report_resumes_without_measuring_again(report, tiny_ckpt, tmp_path, monkeypatch, capsys):
    """Every evaluation is saved as it is made: a run stopped in the quality section, then again in the outliers
    section, finishes on the third try with the numbers of an uninterrupted run, each evaluation made once."""
    import localllm.evaluate as evaluate
    _, whole = report
    out = tmp_path / "r"
    argv = [str(tiny_ckpt), "--out", str(out), "--tokens", str(TOKENS), "--ctx", str(CTX), "--bits", "2,3",
            "--k-chunk", "8,64"]
    real, calls, stop = evaluate.perplexity, [], []

    def counted(*a, **kw):
        calls.append(kw.get("desc"))
        if stop and len(calls) == stop[0]:
            raise KeyboardInterrupt  # what Ctrl+C does in the middle of an evaluation
        return real(*a, **kw)

    monkeypatch.setattr(evaluate, "perplexity", counted)
    total = len(whole["sections"]["quality"]["rows"]) + 2  # + the source model + the outlier statistics

    stop[:] = [7]
    assert main(["report", *argv]) == 130
    assert "rerun the same command" in capsys.readouterr().err
    saved = json.loads((out / "report.unfinished.json").read_text())
    assert len(saved["in_progress"]["done"]) == 6 and saved["sections"] == {} and not (out / "report.md").exists()
    assert saved["in_progress"]["done"]["quality/source"] == whole["sections"]["quality"]["source_ppl"]

    # another command (here: other --tokens) is refused in one line, and the saved work stays
    assert main(["report", *argv, "--tokens", "100"]) == 2
    err = capsys.readouterr().err
    assert "unfinished report" in err and "tokens" in err and len(err.strip().splitlines()) == 1
    assert json.loads((out / "report.unfinished.json").read_text()) == saved

    calls.clear()
    stop[:] = [total - 6]  # the quality section completes, the outlier statistics are interrupted
    assert main(["report", *argv]) == 130
    assert "resuming" in capsys.readouterr().err
    saved = json.loads((out / "report.unfinished.json").read_text())
    assert set(saved["sections"]) == {"quality"} and saved["in_progress"]["done"] == {}
    assert "eval source model" not in calls, "the saved evaluations are not made again"

    calls.clear()
    stop.clear()
    assert main(["report", *argv]) == 0
    assert calls == ["outlier statistics"], "the finished quality section is not measured again"
    rep = json.loads((out / "report.json").read_text())
    assert "in_progress" not in rep and not (out / "report.unfinished.json").exists()
    assert _measured(rep["sections"]) == _measured(whole["sections"]), "the numbers of an uninterrupted run"
    assert rep["runs"][0]["data"] == whole["runs"][0]["data"] and len(rep["runs"]) == 1
    sessions = rep["runs"][0]["sessions"]
    assert [len(s["measured"]) for s in sessions] == [6, total - 7, 0]
    assert [s["sections"] for s in sessions] == [[], ["quality"], ["outliers"]]
    md = (out / "report.md").read_text()
    assert "Interrupted and resumed" in md and "session 2: " in md and f"{total - 7} quality measurements" in md
    assert md.replace(re.search(r"- Interrupted and resumed.*?\n\n", md, re.S).group(0), "\n") \
        .split("## 1.")[1] == (report[0] / "report.md").read_text().split("## 1.")[1], "the same pages"


def test_a_run_renders_only_what_it_used(report, tmp_path):
    """A run that only timed kernels evaluated no text: no data line for it (and no "None" anywhere)."""
    from localllm.report_render import render
    _, rep = report
    rep = json.loads(json.dumps(rep))
    layer = {"N": 64, "K": 64, "count": 2, "base_us": 3.0, "ratio": {"1": {"1": 2.0, "8": 2.5}}}
    rep["runs"].append({**rep["runs"][0], "command": "localllm report --sections kernel --update",
                        "sections": ["kernel"], "data": {}})
    rep["sections"]["kernel"] = {"bits": 3, "model": {k: layer for k in ("qkv", "o", "gate_up", "down")},
                                 "llama3_8b": {}, "run": 1}
    render(rep, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "None" not in md
    run0, run1 = md.split("Run 0: ")[1].split("Run 1: ")
    run1 = run1.split("## 1.")[0]
    assert "- Data: the first 120 predicted tokens of eval.txt (shipped)" in run0 and "W2, W3," in run0
    assert "Data" not in run1 and "Quantized variants: RTN, group size 128, W3, " in run1, "only its W3 variant"


def test_no_residual_widths_asked_means_no_table_1(report, tmp_path):
    """--residual-bits "" measures no other width: section 4 says so instead of a table of 4-bit cells and dashes."""
    from localllm.report_render import render
    rep = json.loads(json.dumps(report[1]))
    rep["runs"][rep["sections"]["quality"]["run"]]["settings"]["residual_bits"] = []
    rep["sections"]["quality"]["rows"] = [r for r in rep["sections"]["quality"]["rows"] if r["residual_bits"] == 4]
    render(rep, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "Not measured (`--residual-bits` was empty)" in md and "| 2-bit |" not in md
    assert not (tmp_path / "table1_residual_bits.png").exists()


def test_a_report_from_before_the_widths_were_recorded_still_renders_table_1(report, tmp_path):
    """Reports before 2026-11-23 did not record --residual-bits (the defaults ran): their section 4 is a table."""
    from localllm.report_render import render
    rep = json.loads(json.dumps(report[1]))
    del rep["runs"][rep["sections"]["quality"]["run"]]["settings"]["residual_bits"]
    render(rep, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "Not measured" not in md and "| 2-bit |" in md and (tmp_path / "table1_residual_bits.png").exists()


def test_the_all_channels_check_is_optional(tiny_ckpt, tmp_path, cache):
    from localllm.config import ModelConfig
    from localllm.loader import open_checkpoint
    from localllm.report import CHEAP_CHECK_WEIGHTS, full_check
    cfg = open_checkpoint(str(tiny_ckpt)).config
    lm = load(tiny_ckpt)
    assert cfg.linear_weights == sum(lin.in_features * lin.out_features for lin in lm.model.linears())
    assert full_check(Options(), cfg)[0], "auto: on for a small model"
    qwen15 = ModelConfig(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
                         num_kv_heads=2, head_dim=128)
    assert qwen15.linear_weights > CHEAP_CHECK_WEIGHTS
    run, why = full_check(Options(), qwen15)
    assert not run and "--checks on" in why
    assert full_check(Options(checks="on"), qwen15)[0] and not full_check(Options(checks="off"), cfg)[0]
    assert not full_check(Options(checks="on", residual_bits=(2,)), cfg)[0], "it needs the fp16 residuals"
    from localllm.report import _check
    with pytest.raises(LocalLLMError, match=r"^--checks on needs the FP16 residuals of Table 1: add 16 to "
                                            r"--residual-bits \(got 2\)$"):
        _check(Options(checks="on", residual_bits=(2,)))  # refused before any work, where asked for
    assert full_check(Options(checks="off", residual_bits=(2,)), cfg) == (False, "--checks off")  # the user's reason

    out = tmp_path / "r"
    make_report(Options(model=str(tiny_ckpt), out=str(out), tokens=40, ctx=CTX, bits=(3,), k_chunks=(8,),
                        residual_bits=(16,), sections=("quality",), checks="off"))
    rep = json.loads((out / "report.json").read_text())
    q = rep["sections"]["quality"]
    assert not [r for r in q["rows"] if r["k_chunk"] == 1024] and [r for r in q["rows"] if r["residual_bits"] == 16]
    assert q["full_check"] == {"run": False, "why": "--checks off"}
    assert "- not run: every channel compensated with the FP16 residual gives the source model (--checks off)" \
        in (out / "report.md").read_text()


def test_the_pareto_section_explains_budgets_that_buy_nothing(report, tmp_path):
    """From the measured numbers: which budgets bought nothing, and the cheapest step's share of the decode step
    from section 6 (made-up values shaped as the measurements; only the text is under test)."""
    from localllm.cli import parser
    from localllm.report import BUDGETS
    from localllm.report_render import render
    from localllm.tuner.profile import parse_budgets
    assert parse_budgets(parser().parse_args(["report"]).budget) == list(BUDGETS) == list(Options().budgets)
    assert BUDGETS[-2:] == (0.5, 1.0)
    _, rep = report
    rep = json.loads(json.dumps(rep))
    gpu = {"name": "Some GPU", "compute_capability": "9.0", "sm_count": 132, "memory_bytes": 1, "driver": "x",
           "torch_cuda": "x"}
    rep["runs"].append({**rep["runs"][0], "sections": ["kernel", "pareto"], "data": {},
                        "machine": {**rep["runs"][0]["machine"], "gpu": gpu}})
    # per call: qkv +3 us (ratio 2.0 of 3 us), the others +1.5 us at best (n_tb 2, k 1: 1.5 of 3 us); 2 layers each
    ratios = {"1": {"1": 2.0, "2": 2.1}, "2": {"1": 1.5, "2": 1.6}}
    rep["sections"]["kernel"] = {"bits": 3, "llama3_8b": {}, "run": 1, "model": {
        k: {"N": 64, "K": 64, "count": 2, "base_us": 3.0, "ratio": {"1": {"1": 2.0}} if k == "qkv" else ratios}
        for k in ("qkv", "o", "gate_up", "down")}}
    nothing = {"qkv": 0, "o": 0, "gate_up": 0, "down": 0}
    pts = [{"budget": b, "n_tb_max": None, "k_chunk": nothing, "predicted": 0, "slowdown": 0, "ms": 0.1,
            "ms_off": 0.1, "ppl": 60.0} for b in (0.025, 0.05)]
    pts.append({"budget": 0.5, "n_tb_max": 2, "k_chunk": {**nothing, "o": 1}, "predicted": 0.03, "slowdown": 0.031,
                "ms": 0.1031, "ms_off": 0.1, "ppl": 55.0})
    rep["sections"]["pareto"] = {"budgets": [0.025, 0.05, 0.5], "run": 1,
                                 "bits": {"3": {"ms_off": 0.1, "ppl_off": 60.0, "points": pts},
                                          "2": {"ms_off": 0.1, "ppl_off": 900.0, "points": pts[:2]}}}
    rep["skipped"] = {}
    render(rep, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "for each budget (2.5/5/50% of the decode step" in md
    assert ("- W3: budgets 2.5% and 5% bought no compensation (k_chunk 0 on every layer: the plain model); the "
            "smallest budget that bought some, 50%, took (0, 1, 0, 0) at +3.1%, perplexity 60 → 55.") in md
    assert "- W2: no budget (2.5% and 5%) bought any compensation" in md
    # the cheapest step: o (first of the +1.5 us kinds) at k 1, n_tb 2: 2 x 1.5 us = 0.003 ms of 0.1 ms = 3.0%
    assert "costs 1.50–2.00× its plain GEMV, +1.5–3.0 µs per call on GEMVs of 3.0–3.0 µs" in md
    assert "o at k_chunk 1 (n_tb 2), adds 2 × 1.5 µs = 0.003 ms to the 0.100 ms decode step" in md
    assert "a budget below about 3.0% cannot compensate any layer" in md


def test_force_and_update_touch_only_a_report_folder(tiny_ckpt, tmp_path, capsys):
    """--force replaces, --update extends, a report's folder only: a folder of the user's files is refused whole."""
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("keep me")
    for flag in ("--force", "--update"):
        assert main(["report", str(tiny_ckpt), "--out", str(mine), flag, "--tokens", "20"]) == 2
        err = capsys.readouterr().err
        assert "holds no localllm report" in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt", "sub"]
    assert (mine / "notes.txt").read_text() == "keep me"
    f = tmp_path / "afile"
    f.write_text("x")
    assert main(["report", str(tiny_ckpt), "--out", str(f / "r")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    for foreign in ('{"t": 1}', "[1, 2]"):  # a report.json another program wrote is not a report's folder either
        (mine / "report.json").write_text(foreign)
        for flag in ("--force", "--update"):
            assert main(["report", str(tiny_ckpt), "--out", str(mine), flag, "--tokens", "20"]) == 2
            err = capsys.readouterr().err
            assert "holds no localllm report" in err and len(err.strip().splitlines()) == 1, err
        assert (mine / "report.json").read_text() == foreign and (mine / "notes.txt").read_text() == "keep me"


def test_force_keeps_the_old_report_until_the_new_one_is_done(report, tiny_ckpt, tmp_path, monkeypatch, capsys):
    """--force interrupted leaves the finished report as it was (its measurements go to report.unfinished.json);
    finished, it replaces the report's own files only: the old sections' plots go, the user's files stay."""
    import shutil
    import localllm.evaluate as evaluate
    out = tmp_path / "r"
    shutil.copytree(report[0], out)
    (out / "notes.md").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    argv = ["report", str(tiny_ckpt), "--out", str(out), "--tokens", str(TOKENS), "--ctx", str(CTX), "--bits", "2,3",
            "--k-chunk", "8,64", "--sections", "outliers", "--force"]

    def stop(*a, **kw):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(evaluate, "perplexity", stop)
        assert main(argv) == 130
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != "report.unfinished.json"} \
        == before
    assert main(argv) == 0
    rep = json.loads((out / "report.json").read_text())
    assert set(rep["sections"]) == {"outliers"} and len(rep["runs"]) == 1
    from localllm.report_render import FILES
    theirs = {name for name in before if name not in FILES and name != "report.json"}
    assert {p.name for p in out.iterdir() if p.is_file()} == {"fig5b_outliers.png", "report.json", "report.md"} | theirs
    assert (out / "notes.md").read_text() == "mine"


def test_a_folder_with_only_a_killed_runs_leftovers_is_reported_into(tiny_ckpt, tmp_path, capsys):
    """SIGKILL during the first save (or the rendering) leaves hidden temp files of ours only: the same command
    runs, removes them, and says so (it refused the folder as "holding no report")."""
    from localllm import atomic
    out = tmp_path / "r"
    out.mkdir()
    owner = atomic._OWNER
    dead = [out / f".report.unfinished.json.{owner}999999999.a.tmp", out / f".render.{owner}999999999.b.tmp"]
    dead[0].write_text("{")
    (dead[1] / "report.md").parent.mkdir()
    (dead[1] / "report.md").write_text("half")
    assert main(["report", str(tiny_ckpt), "-o", str(out), "--tokens", "20", "--sections", "outliers"]) == 0
    err = capsys.readouterr().err
    assert all(not d.exists() and str(d) in err for d in dead) and (out / "report.json").exists()
    assert not [f.name for f in out.iterdir() if f.name.startswith(".")], "no temp file of this run left either"
