"""The `localllm` command as a user runs it."""
import io
import json
import re
import subprocess
import sys

import pytest
import torch
from localllm.cli import main


def run(*args):
    """The command's exit code and output, decoded as UTF-8 without newline translation (text=True would turn a
    generated "\r" into "\n")."""
    r = subprocess.run([sys.executable, "-m", "localllm.cli", *map(str, args)], capture_output=True)
    return subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode(), r.stderr.decode())


def test_generate_streams_text(tiny_quant):
    """`generate` prints the reply generate() gives for the same settings, then a summary line. (The reply may be
    empty: a random tiny model's first greedy token is its end of sequence in about one run in 400.)"""
    from localllm.generate import generate
    from localllm.runtime import load
    r = run("generate", tiny_quant, "Once upon a time", "--raw", "--max-new-tokens", "8", "--seed", "1",
            "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout == generate(load(tiny_quant), "Once upon a time", max_new_tokens=8, temperature=0, seed=1) + "\n"
    m = re.search(r"\[(\d+) tokens?, ([\d.]+|-) tok/s, .* finished by (\w+)", r.stderr)
    assert m and (int(m[1]) == 8) == (m[3] == "length") and (m[2] == "-") == (int(m[1]) < 2), r.stderr


def test_options_anywhere_and_an_unknown_one_is_refused_in_one_line(tiny_quant, capsys):
    """An option between MODEL and PROMPT (argparse splits the positionals there) changes nothing; a mistyped
    option is refused in one line that names the option meant, where one is close, and the command's own --help
    (which lists its options, not the top level's)."""
    args = ["--max-new-tokens", "2", "--raw", "--temperature", "0"]
    assert main(["generate", str(tiny_quant), *args, "hi"]) == 0
    between = capsys.readouterr().out
    assert main(["generate", str(tiny_quant), "hi", *args]) == 0
    assert capsys.readouterr().out == between
    for argv, msg in ((["eval", "--tokens", "5"], "unrecognized arguments: --tokens (did you mean --max-tokens?)"),
                      (["generate", str(tiny_quant), "hi", "--max-tokens", "1"],
                       "unrecognized arguments: --max-tokens 1 (did you mean --max-new-tokens?)"),
                      (["generate", str(tiny_quant), "hi", "--qdec", "-5"], "a k_chunk is channels per 1024"),
                      (["quantize", str(tiny_quant), "-o", "x", "--bits", "5"], "argument --bits: invalid choice")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and err.startswith(f"localllm {argv[0]}: error: "), err
        assert msg in err and err.endswith(f"; `localllm {argv[0]} --help` lists its options\n"), err
    with pytest.raises(SystemExit):
        main(["bogus"])
    assert capsys.readouterr().err.endswith("; `localllm --help` lists its commands\n")


def test_a_closed_standard_output_is_refused_where_the_result_goes_there(tiny_quant, capsys, monkeypatch):
    """`localllm info M >&-`: print() would drop the result without a word and exit 0."""
    monkeypatch.setattr("sys.stdout", None)
    for argv, what in ((["info", str(tiny_quant)], "the model's description"),
                       (["generate", str(tiny_quant), "hi"], "the reply")):
        assert main(argv) == 2
        assert capsys.readouterr().err == f"localllm: error: standard output is closed: {what} is written there " \
            "(redirect it to a file)\n"


def test_chat_refuses_a_path_of_no_model_before_its_app_starts(tmp_path, capsys, monkeypatch):
    """A text file or an empty folder: the loader's one-line error in the terminal, not inside a chat UI."""
    monkeypatch.setattr("localllm.tui.app.ChatApp.run", lambda self: pytest.fail("the app started"))
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    for args, why in (([str(tmp_path / "notes.txt")], "is a file but not a .gguf"),
                      ([str(tmp_path / "empty")], "has no config.json"),
                      ([str(tmp_path / "m.gguf"), "--gguf-file", "x.gguf"], "--gguf-file x.gguf names another file")):
        assert main(["chat", *args]) == 2
        err = capsys.readouterr().err
        assert why in err and len(err.strip().splitlines()) == 1, err


def test_info_reports_sizes(tiny_quant, tiny_ckpt, capsys):
    assert main(["info", str(tiny_quant), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["bits"] == 3 and d["head"]["bits"] == 8 and d["pinned_host_bytes"] > 0 and d["gpu_bytes"] > 0 and d["calibration"]["kmax"] == 256
    from localllm.runtime import load
    src = load(tiny_ckpt).model
    assert d["parameters"] == sum(p.numel() for p in src.parameters())  # the source's, norms included
    assert main(["info", str(tiny_quant)]) == 0
    out = capsys.readouterr().out
    assert "pinned host" in out and "GPU memory" in out and "no profiles" in out and "output head 8-bit" in out
    cpu = load(tiny_quant).model  # the CPU path: every weight float32 once run, the packed ones kept too
    cpu(torch.tensor([[1, 2, 3]]))
    lins = (*cpu.linears(), cpu.head)
    assert not cpu.tied and cpu.embed.dtype == torch.float16  # as the file holds it: the head does not multiply by it
    assert d["cpu_bytes"] == 4 * sum(lin.dense().numel() + (lin.bias is not None) * lin.out_features for lin in lins) \
        + 2 * cpu.embed.numel() + sum(lin.nbytes for lin in lins) + d["pinned_host_bytes"]  # and the residuals
    assert d["cpu_unpacked_bytes"] < d["cpu_bytes"] and "CPU memory   " in out and " where that does not fit" in out
    assert f"quantized on {d['quantized_on']['device']} in " in out
    v = d["calibration"]["qdec_value"]  # what each kind's QDEC took away, as quantize measured it
    assert f"QDEC value   KL from the source {v['off']:.3f}" in out
    assert f"gate_up {v['kl']['gate_up'] - v['off']:+.3f}" in out
    j = v["blocks"]["k_chunks"].index(v["k_chunk"])
    down = v["blocks"]["kl"]["down"]
    assert "per block to first order" in out and f"down {max(range(len(down)), key=lambda b: down[b][j])}" in out


def test_info_of_a_source_checkpoint_reads_no_weight(tiny_ckpt, tmp_path, monkeypatch, capsys):
    """`localllm info` on a safetensors checkpoint describes it from its config and tensor names, on the meta device:
    the same facts as from the loaded float32 model, no weight read, and a missing tensor still refused."""
    import shutil

    from localllm import runtime
    from localllm.runtime import describe, load
    want = describe(load(tiny_ckpt))
    opened = runtime.open_checkpoint

    def unreadable(*args, **kwargs):
        ckpt = opened(*args, **kwargs)
        ckpt.get = lambda name: pytest.fail(f"{name} was read")
        return ckpt
    monkeypatch.setattr(runtime, "open_checkpoint", unreadable)
    assert main(["info", str(tiny_ckpt), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got == json.loads(json.dumps(want)) and got["cpu_bytes"] > 0 and got["quantization"].startswith("16 (dense")
    monkeypatch.undo()
    from safetensors.torch import load_file, save_file
    bad = tmp_path / "bad"
    shutil.copytree(tiny_ckpt, bad)
    (f,) = bad.glob("*.safetensors")
    t = load_file(f)
    del t["model.layers.1.mlp.down_proj.weight"]
    save_file(t, f, metadata={"format": "pt"})
    assert main(["info", str(bad)]) == 2
    assert "lacks tensor 'model.layers.1.mlp.down_proj.weight'" in capsys.readouterr().err

def test_quantize_then_generate(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "m2"
    assert main(["quantize", str(tiny_ckpt), "-o", str(out), "--bits", "2", "--group-size", "64",
                 "--calib-tokens", "512"]) == 0
    manifest = json.loads((out / "localllm.json").read_text())
    assert manifest["quant"]["bits"] == 2
    # --device auto: the GPU where torch sees one
    assert manifest["quantized_on"]["device"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    assert len(manifest["quantized_on"]["block_seconds"]) == 2
    assert main(["generate", str(out), "hi", "--max-new-tokens", "3", "--qdec", "off"]) == 0


def test_errors_are_one_line(tmp_path):
    r = run("generate", tmp_path / "missing", "hello")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("localllm: error: no such file")
    r = run("quantize", tmp_path / "missing", "-o", tmp_path / "o")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    # a missing calibration text is found before the checkpoint (here missing too) would load
    r = run("quantize", tmp_path / "missing", "-o", tmp_path / "o", "--calib-text", tmp_path / "no.txt")
    assert r.returncode == 2 and r.stderr.startswith("localllm: error: calibration text")
    assert "does not exist" in r.stderr


def test_chat_starts_the_app_with_the_options(tiny_quant, monkeypatch):
    from localllm.tui.app import ChatApp
    started = []
    monkeypatch.setattr(ChatApp, "run", lambda self: started.append(self))
    assert main(["chat", str(tiny_quant), "--device", "cpu", "--system", "Be brief.", "--temperature", "0",
                 "--max-new-tokens", "9", "--seed", "3", "--qdec", "off", "--budget", "10", "--kv-bits", "4"]) == 0
    app = started[0]
    assert (app.model_src, app.device, app.qdec, app.budget, app.kv_bits) == (str(tiny_quant), "cpu", "off", 0.1, 4)
    assert (app.settings.system, app.settings.temperature, app.settings.max_new_tokens, app.settings.seed) == \
        ("Be brief.", 0.0, 9, 3)
    assert app.tune  # tunes QDEC once where no profile applies, unless --no-tune
    assert main(["chat", str(tiny_quant), "--device", "cpu", "--no-tune"]) == 0 and not started[1].tune


def test_chat_errors_before_the_app_are_one_line(capsys, tmp_path):
    assert main(["chat", "--top-p", "0"]) == 2
    assert "top_p" in capsys.readouterr().err
    assert main(["chat", "--min-p", "1.5"]) == 2
    assert "min_p" in capsys.readouterr().err
    assert main(["chat", "--save-dir", str(tmp_path / "no-such-folder")]) == 2
    assert "--save-dir" in capsys.readouterr().err and not (tmp_path / "no-such-folder").exists()
    with pytest.MonkeyPatch.context() as m:  # a read-only folder (root writes through file modes: refused by hand)
        import errno
        import localllm.atomic

        def refused(*a, **kw):
            raise OSError(errno.EROFS, "Read-only file system")
        m.setattr(localllm.atomic.tempfile, "mkdtemp", refused)
        assert main(["chat", "--save-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert "Read-only file system" in err and "pass a --save-dir you can write" in err
    assert main(["chat", str(tmp_path / "no-model")]) == 2
    assert capsys.readouterr().err.startswith("localllm: error: no such file or folder")
    if not torch.cuda.is_available():
        assert main(["chat", "--device", "cuda"]) == 2
        assert capsys.readouterr().err.startswith("localllm: error: no CUDA GPU is visible")
        assert main(["quantize", str(tmp_path / "no-model"), "-o", str(tmp_path / "q"), "--device", "cuda"]) == 2
        assert capsys.readouterr().err.startswith("localllm: error: no CUDA GPU is visible")


def test_bad_input_is_refused_before_the_work(tiny_ckpt, tiny_quant, tmp_path, capsys):
    """Each a one-line error, before any quantizing or evaluating: an output under a file, a calibration of no
    tokens or of binary text, a device torch does not know, an empty prompt, a GGUF file named for a quantized
    folder, too few tokens, no k_chunk."""
    f = tmp_path / "afile"
    f.write_text("x")
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00abc" * 100)
    q = tmp_path / "q"
    cases = [(["quantize", tiny_ckpt, "-o", f / "m"], "is a file, not a folder"),
             (["quantize", tiny_ckpt, "-o", q, "--calib-tokens", "0"], "--calib-tokens must be at least 1"),
             (["quantize", tiny_ckpt, "-o", q, "--calib-text", binary], "is not UTF-8 text"),
             (["generate", tiny_quant, "hi", "--device", "gpu"], "device 'gpu' is not supported"),
             (["generate", tiny_quant, "", "--raw"], "the prompt is empty"),
             (["generate", tiny_quant, "two", "words"], "generate takes [MODEL] PROMPT, got 3 arguments"),
             (["info", tiny_quant, "--gguf-file", "m.gguf"], "holds no GGUF: drop --gguf-file m.gguf"),
             (["eval", tiny_quant, "--max-tokens", "-3"], "--max-tokens must be at least 2"),
             (["eval", tiny_quant, "--k-chunk", ""], "--k-chunk is empty"),
             (["eval", tiny_quant, "--k-chunk", "8,0"], "--k-chunk values are channels per 1024, at least 1")]
    for args, msg in cases:
        assert main([str(a) for a in args]) == 2, args
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1, (args, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "bin.txt"]  # nothing written, nothing left


def test_a_full_disk_is_one_line_and_leaves_nothing(tiny_ckpt, tmp_path, capsys, monkeypatch):
    """A write that fails (here: safetensors' error for a file over the size limit, as `ulimit -f` gives) is one line
    naming the file and the fix, and no folder, finished or not, is left."""
    import errno
    from safetensors import SafetensorError
    from transformers import PreTrainedTokenizerBase
    import localllm.modelfile as modelfile

    def refused(owner, name: str, error: Exception) -> str:
        """quantize's stderr where owner.name raises `error`: one line, and nothing left in tmp_path."""
        def fail(*a, **kw):
            raise error
        monkeypatch.setattr(owner, name, fail)
        assert main(["quantize", str(tiny_ckpt), "-o", str(tmp_path / "q"), "--calib-tokens", "64"]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and list(tmp_path.iterdir()) == []
        return err

    err = refused(modelfile, "save_file",
                  SafetensorError("Error while serializing: IoError(Os { code: 27, kind: FileTooLarge })"))
    assert "FileTooLarge" in err and "q/model.safetensors" in err and "check the disk" in err
    err = refused(modelfile, "save_file", OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x")))
    assert err.startswith("localllm: error: No space left on device: ")
    # the tokenizer's writer (the tokenizers library) raises a plain Exception for a full disk
    monkeypatch.undo()
    err = refused(PreTrainedTokenizerBase, "save_pretrained", Exception("No space left on device (os error 28)"))
    assert "cannot write the tokenizer into" in err and "No space left" in err and "check the disk" in err


def test_sigterm_while_writing_leaves_nothing(tiny_ckpt, tmp_path, capsys, monkeypatch):
    """SIGTERM (`timeout`, kill) unwinds like Ctrl+C: the half-written folder is removed, the exit status is 143
    (128 + 15, as a shell reports a process SIGTERM ended), and the handlers are put back afterwards."""
    import os
    import signal
    import localllm.modelfile as modelfile
    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(modelfile, "save_file", lambda *a, **kw: os.kill(os.getpid(), signal.SIGTERM))
    assert main(["quantize", str(tiny_ckpt), "-o", str(tmp_path / "q"), "--calib-tokens", "64"]) == 143
    assert "interrupted" in capsys.readouterr().err and list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) == before


def test_eval_of_a_model_without_residuals_runs_qdec_off(tiny_ckpt, capsys):
    """The default modes (off, approx) shrink to what the model can run, the default windows to its context (256
    here); asked for explicitly, approx is refused."""
    assert main(["eval", str(tiny_ckpt), "--max-tokens", "40"]) == 0
    out, err = capsys.readouterr()
    assert "is not quantized (a dense checkpoint); evaluating with QDEC off only" in err and "windows of 256" in out
    rows = [line.split()[0] for line in out.splitlines()[2:] if line.strip() and not line.startswith("(")]  # (notes)
    assert rows == ["off"], out
    assert main(["eval", str(tiny_ckpt), "--max-tokens", "40", "--ctx", "16", "--qdec", "off,approx"]) == 2
    err = capsys.readouterr().err
    assert "no QDEC residuals" in err and "--qdec off" in err
    if not torch.cuda.is_available():  # --device auto is the CPU here, where --prefill-int8 evaluates
        assert main(["eval", str(tiny_ckpt), "--max-tokens", "40", "--prefill-int8"]) == 0


def test_a_damaged_tokenizer_is_one_line(tiny_quant, tmp_path, capsys):
    import shutil
    copy = tmp_path / "m"
    shutil.copytree(tiny_quant, copy)
    (copy / "tokenizer.json").write_text("")
    assert main(["generate", str(copy), "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "cannot load the tokenizer" in err and "tokenizer.json" in err and len(err.strip().splitlines()) == 1
    (copy / "tokenizer.json").unlink()  # tokenizer_config.json alone (transformers makes 3 tokens of it: "" replies)
    assert main(["generate", str(copy), "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert f"{copy} holds no tokenizer vocabulary" in err and len(err.strip().splitlines()) == 1
    for f in copy.glob("tokenizer*"):  # none at all: said plainly
        f.unlink()
    assert main(["generate", str(copy), "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert f"{copy} holds no tokenizer vocabulary" in err and len(err.strip().splitlines()) == 1
    # a vocabulary of another (tiny) tokenizer: fewer tokens than bytes
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast
    words = Tokenizer(WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(str(copy))
    assert main(["generate", str(copy), "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "knows" in err and "of another model" in err and len(err.strip().splitlines()) == 1


def test_the_source_is_recorded_by_its_absolute_path(tiny_ckpt, tmp_path, monkeypatch):
    """A model quantized from a relative path finds its source from any folder (eval --reference)."""
    monkeypatch.chdir(tiny_ckpt.parent)
    out = tmp_path / "m"
    assert main(["quantize", tiny_ckpt.name, "-o", str(out), "--no-residuals", "--calib-tokens", "256"]) == 0
    assert json.loads((out / "localllm.json").read_text())["source"]["path"] == str(tiny_ckpt.resolve())


def test_a_name_longer_than_file_systems_hold_is_no_path(capsys):
    """A long one-word prompt (generate's first argument may be a model path) is not a path, and a model argument
    that long is refused in one line, not reported as a disk problem ("File name too long")."""
    from localllm.loader import exists
    long = "x" * 300
    assert not exists(long) and not exists(f"org/{long}")
    for args in (["info", long], ["info", f"org/{long}"], ["generate", long, "hi"], ["tune", long]):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "no such file or folder" in err and "disk" not in err and len(err.strip().splitlines()) == 1, args


def test_small_things_a_user_meets(tiny_quant, tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("localllm ")
    # one argument that names a model folder: the prompt is missing (not a prompt for the demo model)
    assert main(["generate", str(tiny_quant)]) == 2
    assert "which is a path: give the prompt too" in capsys.readouterr().err
    # --system without a chat template is said to be unused; QDEC off is said once
    assert main(["generate", str(tiny_quant), "hi", "--raw", "--system", "Be brief.", "--max-new-tokens", "2",
                 "--qdec", "off"]) == 0
    err = capsys.readouterr().err
    assert "--system needs the model's chat template" in err and "; QDEC off;" in err
    # a model without a chat template continues the prompt, and says so
    import shutil
    plain = tmp_path / "plain"
    shutil.copytree(tiny_quant, plain)
    cfg = plain / "tokenizer_config.json"
    cfg.write_text(json.dumps({k: v for k, v in json.loads(cfg.read_text()).items() if k != "chat_template"}))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    assert main(["generate", str(plain), "hi", "--system", "Be brief.", "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert f"{plain} has no chat template: the prompt is continued as plain text" in err and "--system is not" in err
    # "-": the prompt from standard input, as given on the command line
    stdin = lambda data: monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data)))  # noqa: E731
    stdin(b"hi\n")  # (echo's newline is not part of the prompt: --raw would continue after it)
    assert main(["generate", str(tiny_quant), "-", "--raw", "--max-new-tokens", "4", "--seed", "3"]) == 0
    piped = capsys.readouterr().out
    assert main(["generate", str(tiny_quant), "hi", "--raw", "--max-new-tokens", "4", "--seed", "3"]) == 0
    assert capsys.readouterr().out == piped
    stdin(b" \n")
    assert main(["generate", str(tiny_quant), "-"]) == 2
    assert "the prompt from standard input (-) is empty" in capsys.readouterr().err
    stdin(b"caf\xe9\n")  # not UTF-8, whatever the locale's decoding (a strict one raised at the read)
    assert main(["generate", str(tiny_quant), "-", "--max-new-tokens", "2"]) == 2
    assert capsys.readouterr().err.strip().startswith("localllm: error: the prompt is not UTF-8 text")
    assert main(["generate", str(tiny_quant), ""]) == 2  # an empty argument (an unset "$PROMPT")
    assert "the prompt is empty" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", None)
    assert main(["generate", str(tiny_quant), "-"]) == 2 and "standard input is closed" in capsys.readouterr().err
    # bytes that are not UTF-8 (Python reads them as lone surrogates), a seed beyond 64 bits: one line each
    assert main(["generate", str(tiny_quant), "caf\udce9", "--max-new-tokens", "2"]) == 2
    assert capsys.readouterr().err.strip().startswith("localllm: error: the prompt is not UTF-8 text")
    with pytest.raises(SystemExit):
        main(["generate", str(tiny_quant), "hi", "--seed", str(2**64)])
    assert "--seed takes a whole number from 0 to" in capsys.readouterr().err


def test_summary_says_why_qdec_is_off():
    """generate's summary line (and bench's) names what turned QDEC off: a tuning profile where nothing fits the
    budget, the user."""
    from types import SimpleNamespace

    from localllm.runtime import LocalModel
    from localllm.tuner.profile import source_of
    summary = LocalModel.qdec_summary
    profile = {"gpu": {"name": "NVIDIA H200"}, "budget": 0.05, "layers": {"qkv": {"k_chunk": 0}, "o": {"k_chunk": 0}}}
    lm = SimpleNamespace(settings=SimpleNamespace(mode="off"), qdec_source=source_of(profile))
    assert summary(lm) == "QDEC off: tuned on NVIDIA H200 for a 5% budget: no compensation fits it"
    lm.qdec_source = "QDEC off"  # --qdec off
    assert summary(lm) == "QDEC off"
    lm.settings.mode, lm.qdec_source = "approx", "k_chunk 16 (set by hand)"
    assert summary(lm) == "QDEC approx: k_chunk 16 (set by hand)"


def test_a_gpu_the_kernels_cannot_use_is_named_once(monkeypatch, capsys):
    """A visible GPU that the kernels cannot use (older than sm_80, or no CuPy): --device cuda is a one-line error
    naming it; auto runs on the CPU and says why, once."""
    from localllm import devices
    from localllm.errors import LocalLLMError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    monkeypatch.delenv("LOCALLLM_NO_CUDA_KERNELS", raising=False)
    with pytest.raises(LocalLLMError, match=r"^Tesla T4 \(compute capability 7.5\) is older than the GPU kernels need "
                                            r"\(8.0: RTX 30 series, A100 or newer\); use --device cpu$"):
        devices.resolve_device("cuda")
    devices._say_why_not_the_gpu.cache_clear()
    capsys.readouterr()
    assert devices.resolve_device("auto").type == "cpu" and devices.resolve_device("auto").type == "cpu"
    assert capsys.readouterr().err == "localllm: running on the CPU: Tesla T4 (compute capability 7.5) is older " \
                                      "than the GPU kernels need (8.0: RTX 30 series, A100 or newer); use --device cpu\n"
    assert devices.resolve_device("auto", kernels=False).type == "cuda"  # quantizing needs torch's CUDA alone
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 9))
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy fails
    devices._say_why_not_the_gpu.cache_clear()
    assert devices.resolve_device("auto").type == "cpu"
    assert capsys.readouterr().err.startswith("localllm: running on the CPU: CuPy is not installed; install")
    devices._say_why_not_the_gpu.cache_clear()
    monkeypatch.setitem(sys.modules, "cupy", torch)  # (any module: the kernels could run)
    monkeypatch.setenv("LOCALLLM_NO_CUDA_KERNELS", "1")  # switched off: the GPU is not used, and says so if asked
    with pytest.raises(LocalLLMError, match=r"^the CUDA kernels are switched off \(LOCALLLM_NO_CUDA_KERNELS=1\): unset"):
        devices.resolve_device("cuda")
    assert devices.resolve_device("auto").type == "cpu" and capsys.readouterr().err == ""
    with pytest.raises(LocalLLMError, match="^device 'None' is not supported; use auto, cpu or cuda$"):
        devices.resolve_device(None)
    devices._say_why_not_the_gpu.cache_clear()


def test_out_of_gpu_memory_past_the_load_checks_is_one_line(monkeypatch, capsys):
    """A torch out-of-memory error that the checks at load could not foresee (a long prompt, a benchmark's baseline)
    ends the command with one line saying what would need less, not a traceback."""
    import localllm.cli as cli

    def oom(a):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 5.8 GiB total)\nmore")
    monkeypatch.setattr(cli, "cmd_info", oom)
    assert main(["info"]) == 2
    err = capsys.readouterr().err
    assert err == "localllm: error: out of GPU memory (CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 5.8 GiB " \
                  "total)); a shorter prompt, fewer new tokens, --kv-bits 8 or 4, or a smaller model needs less\n"


@pytest.mark.parametrize("argv0", ["/usr/bin/localllm", "python"])
def test_ctrl_c_while_the_command_starts_is_one_line(argv0):
    """Ctrl+C during torch's import (the `localllm` command's first seconds) ends the command with its usual line and
    status 130, not an import traceback; a program importing localllm gets its KeyboardInterrupt as usual."""
    code = ("import builtins, sys\n"
            f"sys.argv = [{argv0!r}]\n"
            "real = builtins.__import__\n"
            "def ctrl_c(name, *a, **k):\n"
            "    if name == 'torch':\n"
            "        raise KeyboardInterrupt\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = ctrl_c\n"
            "import localllm\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if argv0 == "python":
        assert r.returncode != 130 and r.stderr.rstrip().endswith("KeyboardInterrupt")
    else:
        assert (r.returncode, r.stderr) == (130, "\nlocalllm: interrupted\n")


def test_generate_refuses_its_options_before_loading_and_ends_an_interrupted_reply(tiny_quant, capsys, monkeypatch):
    """Bad sampling options are refused before the model loads (an 8B model's load and dequantization take minutes);
    Ctrl+C mid-reply ends the reply's line and still prints the numbers, finished by cancelled."""
    from localllm import runtime
    gen_mod = sys.modules["localllm.generate"]  # (localllm.generate is also the function)
    real_load = runtime.load
    monkeypatch.setattr(runtime, "load", lambda *a, **k: pytest.fail("loaded before refusing"))
    for args, what in ((["--top-p", "0"], "top_p=0.0"), (["--temperature", "-1"], "temperature=-1.0"),
                       (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1")):
        assert main(["generate", str(tiny_quant), "hi", *args]) == 2
        assert what in capsys.readouterr().err
    monkeypatch.setattr(runtime, "load", real_load)
    real_generate = gen_mod.generate
    shown = []

    def interrupted(*a, **k):  # the user presses Ctrl+C after the first piece
        s = real_generate(*a, **k)
        pieces = iter(s.pieces)

        def gen():
            shown.append(next(pieces))
            yield shown[-1]
            raise KeyboardInterrupt
        s.pieces = gen()
        return s

    monkeypatch.setattr(gen_mod, "generate", interrupted)
    lm = real_load(tiny_quant)
    lm.eos_ids = []
    monkeypatch.setattr(runtime, "load", lambda *a, **k: lm)
    assert main(["generate", str(tiny_quant), "hi", "--max-new-tokens", "8"]) == 130
    out, err = capsys.readouterr()
    # (the random model's first piece may be a newline or a space: the line is ended after it all the same)
    assert out == shown[0] + "\n" and "finished by cancelled" in err and err.endswith("interrupted\n")


def test_chat_resume_takes_the_saved_system_prompt(tiny_quant, tmp_path, monkeypatch):
    """`chat --resume FILE` without --system goes on with the saved chat's system prompt (with --system, that one)."""
    import localllm.tui.app as app_mod
    seen = {}

    class Fake:  # what cmd_chat hands the app
        working, load_error = False, None

        def __init__(self, *a, **kw):
            seen.clear()
            seen.update(kw)

        def run(self):
            pass
    monkeypatch.setattr(app_mod, "ChatApp", Fake)
    f = tmp_path / "chat.json"
    f.write_text(json.dumps({"format": "localllm-chat/1", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"}]}))
    assert main(["chat", str(tiny_quant), "--resume", str(f), "--save-dir", str(tmp_path)]) in (0, None)
    assert seen["settings"].system == "Be brief." and seen["resume"]["system"] == "Be brief."
    assert main(["chat", str(tiny_quant), "--resume", str(f), "--system", "Be long.", "--top-k", "5"]) in (0, None)
    assert seen["settings"].system == "Be long." and seen["settings"].top_k == 5


def test_a_hangup_nohup_ignores_stays_ignored(tiny_ckpt, tmp_path, monkeypatch):
    """Under nohup (SIGHUP ignored) a closed terminal does not stop the run: the handler is not installed over it."""
    import os
    import signal
    import localllm.modelfile as modelfile
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        save = modelfile.save_file

        def hangup_then_save(*a, **kw):
            os.kill(os.getpid(), signal.SIGHUP)
            return save(*a, **kw)
        monkeypatch.setattr(modelfile, "save_file", hangup_then_save)
        assert main(["quantize", str(tiny_ckpt), "-o", str(tmp_path / "q"), "--calib-tokens", "64"]) == 0
        assert (tmp_path / "q" / "localllm.json").exists() and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)
