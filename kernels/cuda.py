"""The one way Python reaches CUDA code: compile a .cu file of this folder with CuPy (NVRTC) once per
process and device, launch its kernels on torch's current stream.

LOCALLLM_NO_CUDA_KERNELS=1 turns the kernels off (the torch reference path runs instead).
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from localllm.errors import LocalLLMError

HERE = Path(__file__).parent


def available() -> bool:
    """Whether the CUDA kernels can run here: a GPU, CuPy, and not switched off."""
    if os.environ.get("LOCALLLM_NO_CUDA_KERNELS") == "1":
        return False
    try:
        require()
    except LocalLLMError:
        return False
    return True


def require() -> None:
    """Raise a one-line LocalLLMError saying what is missing for the GPU kernels."""
    if not torch.cuda.is_available():
        raise LocalLLMError("no CUDA GPU is visible; the GPU kernels need an NVIDIA GPU (the CPU path runs without)")
    try:
        import cupy  # noqa: F401
    except ImportError:
        raise LocalLLMError("CuPy is not installed; install cupy-cuda12x or cupy-cuda13x to match your CUDA "
                            "driver (pip install 'localllm[cuda12]')") from None


@functools.cache
def module(name: str, device: int, names: tuple[str, ...]):
    """Compile kernels/<name>.cu for `device`; `names` are the template instantiations to export."""
    require()
    import cupy
    with cupy.cuda.Device(device):
        major, minor = torch.cuda.get_device_capability(device)
        src = (HERE / f"{name}.cu").read_text()
        mod = cupy.RawModule(code=src, options=("-std=c++17", f"--gpu-architecture=sm_{major}{minor}"),
                             name_expressions=list(names))
        mod.compile()
        return mod


def kernel(name: str, expr: str, names: tuple[str, ...]):
    return module(name, torch.cuda.current_device(), names).get_function(expr)


def stream():
    """torch's current CUDA stream as a CuPy stream (so kernels join CUDA-graph captures)."""
    return _external_stream(torch.cuda.current_stream().cuda_stream, torch.cuda.current_device())


@functools.cache
def _external_stream(handle: int, device: int):
    import cupy
    return cupy.cuda.ExternalStream(handle, device)


def ptr(t: torch.Tensor):
    import numpy as np
    return np.uint64(t.data_ptr())
