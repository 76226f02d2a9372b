"""The one way Python reaches CUDA code: compile the kernels of this folder's .cu files with CuPy (NVRTC) when first
launched (once per process and device, cached on disk), launch them on torch's current stream.

LOCALLLM_NO_CUDA_KERNELS=1 turns the kernels off (the GPU is then not used: the CPU path runs); LOCALLLM_LINEINFO=1
compiles them with source line information (for Nsight Compute's source view).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import sys
import threading
from pathlib import Path

import numpy as np
import torch

from localllm.errors import LocalLLMError

HERE = Path(__file__).parent


def unusable(kernels: bool = True) -> str | None:
    """Why the CUDA kernels (kernels=False: torch's CUDA) cannot run here (one line), or None when they can. (Without
    a GPU, no fix: what asks this, tune, bench or a report's GPU sections, has no CPU form.)"""
    if not (kernels and switched_off()) and not torch.cuda.is_available():
        return "no CUDA GPU is visible" + (" (an NVIDIA GPU with CuPy is needed)" if kernels else "")
    try:
        require(kernels)
    except LocalLLMError as e:
        return str(e)
    return None


def require_for(what: str) -> None:
    """Refuse, in one line, work that only runs on the GPU (timing its kernels: no CPU form, so no fix but a GPU):
    "`what` and needs one: why"."""
    if why := unusable():
        raise LocalLLMError(f"{what} and needs one: {why}")


def available() -> bool:
    """Whether the CUDA kernels can run here: a GPU, CuPy, and not switched off."""
    return unusable() is None


def switched_off() -> bool:
    return os.environ.get("LOCALLLM_NO_CUDA_KERNELS") == "1"


def require(kernels: bool = True) -> None:
    """Raise a one-line LocalLLMError saying what is missing for the GPU kernels (kernels=False: for torch's CUDA)."""
    if kernels and switched_off():  # (the GPU path has no torch fallback for the low-bit layers)
        raise LocalLLMError("the CUDA kernels are switched off (LOCALLLM_NO_CUDA_KERNELS=1): unset it, or use "
                            "--device cpu (device='cpu' in Python)")
    if not torch.cuda.is_available():
        raise LocalLLMError("no CUDA GPU is visible; " + ("the GPU kernels need an NVIDIA GPU: use --device cpu or "
                            "auto (device='cpu' or 'auto' in Python) to run on the CPU" if kernels else
                            "use --device cpu (or auto)"))
    if not kernels:
        return
    major, minor = torch.cuda.get_device_capability()
    if major < 8:  # cp.async and the m16n8k16 / m16n8k32 mma shapes
        raise LocalLLMError(f"{torch.cuda.get_device_name()} (compute capability {major}.{minor}) is older than the "
                            "GPU kernels need (8.0: RTX 30 series, A100 or newer); use --device cpu")
    try:
        import cupy  # noqa: F401
    except ImportError:
        raise LocalLLMError("CuPy is not installed; install cupy-cuda12x or cupy-cuda13x to match your CUDA "
                            "driver (pip install 'localllm[cuda12]')") from None


def source(name: str) -> str:
    """kernels/<name>.cu with the digest of the headers beside it: CuPy caches compiled modules on disk by source
    text and options, not by what the source includes, so an edited header (an upgrade) must change the text."""
    headers = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(HERE.glob("*.cuh")))).hexdigest()
    return (HERE / f"{name}.cu").read_text() + f"\n// headers {headers}\n"


def options(device: int) -> tuple[str, ...]:
    """NVRTC options of every kernel module for `device`: its architecture and the shared memory a block may opt in to
    (SHARED_LIMIT: shared_limit's, as the device reports it or LOCALLLM_SHARED_LIMIT lowers it, whatever a test's
    stand-in for shared_limit says; gemv.cu sizes an array by it as gemv.tiles_per_barrier does);
    LOCALLLM_LINEINFO=1 adds line info for profilers."""
    props = torch.cuda.get_device_properties(device)
    return ("-std=c++17", f"--gpu-architecture=sm_{props.major}{props.minor}", f"-I{HERE}",
            f"-DSHARED_LIMIT={_shared_limit(device)}") + (
        ("-lineinfo",) if os.environ.get("LOCALLLM_LINEINFO") == "1" else ())


# Measurement builds (scripts/gemv_bound.py, scripts/qdec_timeline.py): per module name, extra NVRTC options and code
# appended to its source, e.g. ("-DQDEC_MARKS",). Empty in the product.
BUILD: dict[str, tuple[tuple[str, ...], str]] = {}

# One module per template instance, compiled when first launched: NVRTC builds only the instances asked for (the .cu
# files instantiate every variant for nvcc's resource checks only), so a model's first decode compiles the few it
# runs in seconds, not a whole file's ~70 (~1 min cold). A file's plain (non-template) kernels compile into every
# module of it whatever is asked: their launchers ask for them together, once. CuPy caches each module on disk.
_modules: dict[tuple, object] = {}
_compiling = threading.Lock()
_told = threading.Event()


def module(name: str, device: int, names: tuple[str, ...], extra_options: tuple[str, ...] = (),
           extra_code: str = ""):
    """kernels/<name>.cu (+ extra_code) compiled for `device`, exporting the kernels `names` (template instances or
    plain kernels)."""
    key = (name, device, names, extra_options, extra_code)
    if key in _modules:
        return _modules[key]
    require()
    import cupy
    with _compiling:
        if key not in _modules:
            note = threading.Timer(1.0, _tell_compiling)  # a cache miss: say why the first reply waits
            note.start()
            try:
                with cupy.cuda.Device(device):
                    mod = cupy.RawModule(code=source(name) + extra_code, options=options(device) + extra_options,
                                         name_expressions=list(names))
                    mod.compile()
            finally:
                note.cancel()
            _modules[key] = mod
    return _modules[key]


def _tell_compiling() -> None:
    if not _told.is_set():
        _told.set()
        print("localllm: compiling GPU kernels for this GPU (once; CuPy caches them on disk) ...", file=sys.stderr)


def modules(name: str) -> list:
    """The modules of kernels/<name>.cu compiled so far in this process (measurement scripts read their globals)."""
    return [m for key, m in _modules.items() if key[0] == name]


def forget() -> None:
    """Compile afresh from now on, and read the shared-memory limit again (kernel_ab.py switches between kernel
    folders; a test sets LOCALLLM_SHARED_LIMIT)."""
    _modules.clear()
    _shared_limit.cache_clear()


def loaded(name: str, names: tuple[str, ...]):
    """The module of kernels/<name>.cu exporting `names`, for the current device, built as BUILD says."""
    return module(name, torch.cuda.current_device(), names, *BUILD.get(name, ((), "")))


def kernel(name: str, expr: str, together: tuple[str, ...] | None = None):
    """Kernel `expr` of kernels/<name>.cu; together: the names compiled with it in one module (a file's plain
    kernels), by default it alone."""
    return loaded(name, together or (expr,)).get_function(expr)


@functools.cache
def sm_count(device: int) -> int:
    """Streaming multiprocessors of GPU `device` (grid sizes that fill the GPU once, or must all be resident)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def shared_limit(device: int) -> int:
    """Shared memory (dynamic and static) a block of GPU `device` may opt in to: 227 KB on sm_90, 99 KB on the
    RTX 30/40 series (sm_86 / sm_89). LOCALLLM_SHARED_LIMIT=BYTES, where less, makes the kernels choose their variants
    and compile as on a GPU with that much (101376: an RTX 40's; the GPU tests' second pass)."""
    return _shared_limit(device)


@functools.cache
def _shared_limit(device: int) -> int:
    return lowered_limit(torch.cuda.get_device_properties(device).shared_memory_per_block_optin)


def lowered_limit(own: int) -> int:
    """A GPU's own shared memory a block, or LOCALLLM_SHARED_LIMIT's bytes where fewer; refused in one line where that
    is not a positive whole number."""
    text = os.environ.get("LOCALLLM_SHARED_LIMIT", "").strip()
    if not text:
        return own
    if not text.isdigit() or int(text) == 0:
        raise LocalLLMError(f"LOCALLLM_SHARED_LIMIT={text!r} is not a number of bytes: set it to a positive whole "
                            "number (101376: an RTX 40's 99 KB), or unset it")
    return min(own, int(text))


@functools.cache
def resident_blocks(device: int, threads: int, regs: int, smem: int) -> int:
    """Blocks of `threads` threads, `regs` registers each and `smem` bytes of shared memory in all (static, dynamic
    and the 1 KB the driver reserves per block) that one SM of `device` holds at once (at least 1)."""
    props = torch.cuda.get_device_properties(device)
    per_sm = getattr(props, "shared_memory_per_multiprocessor", props.shared_memory_per_block_optin + 1024)
    per_regs = getattr(props, "regs_per_multiprocessor", 65536) // (max(regs, 1) * threads)
    per_threads = getattr(props, "max_threads_per_multi_processor", 2048) // threads  # 1536 on sm_86 / sm_89
    return max(1, min(per_threads, per_regs, per_sm // smem))


def allow_shared(func, nbytes: int) -> None:
    """Let func launch with nbytes of dynamic shared memory. Its default limit is 48 KB minus its static arrays;
    past that it needs the opt-in, which only ever grows here, so launches already captured in CUDA graphs keep
    theirs."""
    if nbytes > func.max_dynamic_shared_size_bytes:
        func.max_dynamic_shared_size_bytes = nbytes


# Devices whose next launch is a plain one whatever it asks (launch's plain_next): a held GEMV after a compensating
# one (kernels.gemv). Its early launch made the 8B decode ~11 us a call slower (H200, W3, gate_up k_chunk 2 in every
# block: 2.19 ms a step against 1.86 with down launched plain, 1.71 without QDEC; kernels/NOTES.md, session 52).
_plain_next: set[int] = set()


def next_is_plain(device: int) -> bool:
    """Whether the next launch on `device` will be plain (no early start): its input is then ready when it starts."""
    return device in _plain_next or not early_launch(device)


def launch(func, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0, early: bool = False,
           plain_next: bool = False, cluster: tuple | None = None) -> None:
    """Launch a kernel of kernel() on torch's current stream. early=True: programmatic dependent launch (sm_90+),
    the kernel may start while the previous one in the stream still runs; it must execute griddepcontrol.wait
    before it reads or writes memory that earlier kernels touch (weights it may prefetch before). plain_next: the
    next launch on this device is a plain one (in stream order, as a graph captures it). cluster: the blocks of
    each thread-block cluster in x, y, z (sm_90+: clusters())."""
    dev = torch.cuda.current_device()
    early = early and not next_is_plain(dev)
    _plain_next.discard(dev)
    if plain_next:
        _plain_next.add(dev)
    if not early and cluster is None:
        func(grid, block, args, stream=stream(), shared_mem=shared_mem)
        return
    grid, block = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
    values = [_CTYPE[type(a)](a) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    attrs = (_LaunchAttribute * 2)()
    n = 0
    if early:
        attrs[n].id = _PROGRAMMATIC_STREAM_SERIALIZATION
        attrs[n].value[0] = 1  # programmaticStreamSerializationAllowed
        n += 1
    if cluster is not None:
        attrs[n].id = _CLUSTER_DIMENSION
        attrs[n].value[0], attrs[n].value[1], attrs[n].value[2] = cluster
        n += 1
    cfg = _LaunchConfig(*grid, *block, shared_mem, torch.cuda.current_stream().cuda_stream, attrs, n)
    err = _libcuda().cuLaunchKernelEx(ctypes.byref(cfg), ctypes.c_void_p(func.kernel.ptr), params, None)
    if err:
        raise LocalLLMError(f"kernel launch (cuLaunchKernelEx{', early' if early else ''}"
                            f"{', cluster' if cluster else ''}) failed with CUDA error {err}; set LOCALLLM_NO_PDL=1 "
                            "to launch kernels the plain way")


@functools.cache
def early_launch(device: int) -> bool:
    """Programmatic dependent launch: Hopper and newer with a driver that has cuLaunchKernelEx (CUDA 12), unless
    LOCALLLM_NO_PDL=1."""
    if torch.cuda.get_device_capability(device)[0] < 9 or os.environ.get("LOCALLLM_NO_PDL") == "1":
        return False
    try:
        _libcuda()
    except (OSError, AttributeError):
        return False
    return True


def clusters(device: int) -> bool:
    """Thread-block clusters (sm_90+, launched through cuLaunchKernelEx), unless LOCALLLM_NO_PDL=1, which keeps
    every launch plain."""
    return early_launch(device)


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID in cuda.h
_CLUSTER_DIMENSION = 4


def _ctypes():
    class LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, padding to 8, a 64-byte value union
        _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]

    class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
        _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                    ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                    ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                    ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]
    return LaunchAttribute, LaunchConfig


@functools.cache
def _libcuda():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.cuLaunchKernelEx.restype = ctypes.c_int
    return lib


_LaunchAttribute, _LaunchConfig = _ctypes()


def stream():
    """torch's current CUDA stream as a CuPy stream (so kernels join CUDA-graph captures)."""
    return _external_stream(torch.cuda.current_stream().cuda_stream, torch.cuda.current_device())


@functools.cache
def _external_stream(handle: int, device: int):
    import cupy
    if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy >= 14: the CUDA stream protocol
        with cupy.cuda.Device(device):
            return cupy.cuda.Stream.from_external(_StreamRef(handle))
    return cupy.cuda.ExternalStream(handle, device)


class _StreamRef:
    """A raw stream handle under the __cuda_stream__ protocol (version 0)."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self.handle


def ptr(t: torch.Tensor):
    return np.uint64(t.data_ptr())


_CTYPE = {np.uint64: ctypes.c_uint64, np.int32: ctypes.c_int32, np.uint32: ctypes.c_uint32,
          np.float32: ctypes.c_float}
