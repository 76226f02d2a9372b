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
        assert md.count("Skipped: ") == 2 and "--sections kernel,pareto --update" in md
        assert set(rep["skipped"]) == {"kernel", "pareto"}
    run = rep["runs"][0]
    assert run["command"].startswith("localllm report ") and "--tokens 120" in run["command"]
    assert run["data"]["tokens"] == TOKENS and run["machine"]["cpu"] and run["settings"]["bits"] == [2, 3]
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
    # every channel compensated with the residual in fp16 is the source model, up to fp16 rounding of R
    (full,) = rows(rep, mode="exact", k_chunk=1024, residual_bits=16)
    assert full["ppl"] == pytest.approx(q["source_ppl"], rel=1e-3)
    assert all(math.isfinite(r["ppl"]) and r["ppl"] > 1 for r in q["rows"])


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


def test_an_existing_report_is_kept_unless_asked(report, tiny_ckpt, capsys):
    out, rep = report
    before = (out / "report.md").read_text()
    assert main(["report", str(tiny_ckpt), "--out", str(out), "--tokens", "20"]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--force" in err and len(err.strip().splitlines()) == 1
    assert (out / "report.md").read_text() == before
    # --update measures the sections asked for and keeps the others
    assert main(["report", str(tiny_ckpt), "--out", str(out), "--tokens", str(TOKENS), "--ctx", str(CTX),
                 "--bits", "2,3", "--k-chunk", "8,64", "--sections", "outliers", "--update"]) == 0
    new = json.loads((out / "report.json").read_text())
    assert new["sections"]["quality"] == rep["sections"]["quality"]
    assert new["sections"]["outliers"]["run"] == 1 and len(new["runs"]) == 2
    assert new["sections"]["outliers"]["per_kind"] == rep["sections"]["outliers"]["per_kind"], "same inputs"
    assert not list(out.parent.glob(".r.*")), "no temp folder left behind"


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
    assert all(0.5 < v < 100 for e in k.values() for r in e["ratio"].values() for v in r.values())
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
