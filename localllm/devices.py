"""Where a model runs and whether it fits there: the device a name means, and the memory checks that refuse in one
line what would otherwise end in an out-of-memory error or the OOM killer."""
from __future__ import annotations

import functools
import sys

import torch

from . import kvquant
from .errors import LocalLLMError

WORKSPACE_BYTES = 256 << 20  # GPU memory kept free for activations and workspaces


def resolve_device(device: str | torch.device = "auto", kernels: bool = True) -> torch.device:
    """"auto": the GPU when the CUDA kernels can run (GPU + CuPy), else the CPU. kernels=False: what needs torch's
    CUDA alone (quantizing), which asks for a GPU only."""
    from .kernels import cuda
    if isinstance(device, str):
        device = device.strip().lower()  # "CUDA", "Auto"
    if device == "auto":
        if not kernels or cuda.available():
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        _say_why_not_the_gpu()
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):  # a name torch does not know ("gpu"), or not a name (None)
        dev = None
    if dev is None or dev.type not in ("cuda", "cpu"):
        raise LocalLLMError(f"device '{device}' is not supported; use auto, cpu or cuda")
    if dev.type == "cuda":
        cuda.require(kernels)
    return dev


@functools.cache
def _say_why_not_the_gpu() -> None:
    """Once: the one line saying why a visible GPU is not used (no CuPy, too old), as the CPU path is far slower."""
    from .kernels import cuda
    if torch.cuda.is_available() and not cuda.switched_off() and (why := cuda.unusable()):
        print(f"localllm: running on the CPU: {why}", file=sys.stderr)


def host_available() -> int | None:
    """Bytes of host memory available without swapping (Linux's MemAvailable); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def size(n: float) -> str:
    """Bytes as people read them: 1.5 GiB, 81.0 MiB, 12 KiB."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def check_kv_cache(cfg, tokens: int, bits: int, free: int, cpu: bool = False) -> None:
    """Refuse, in one line, a KV cache of `tokens` tokens at `bits` bits that needs more than `free` bytes of GPU
    memory (cpu: of host memory, for the CPU's cache, float32 at 16 bits), naming the kv-bits setting that would
    fit, or how many tokens fit at the smallest."""
    per_token = functools.partial(kvquant.bytes_per_token, cfg, cpu=cpu)
    memory = "host memory" if cpu else "GPU memory"
    need = per_token(bits) * tokens
    if need <= free:
        return
    fits = [b for b in kvquant.KV_BITS if b < bits and per_token(b) * tokens <= free]
    if fits:
        b = fits[0]
        hint = f"--kv-bits {b} (kv_bits={b}) fits it in {size(per_token(b) * tokens)}"
    else:
        b = min(kvquant.KV_BITS)
        hint = f"at most {max(free, 0) // per_token(b)} tokens fit even at --kv-bits {b}: " \
               "use a shorter prompt or fewer new tokens"
    raise LocalLLMError(f"a KV cache for {tokens} tokens at {bits} bits needs {size(need)} of {memory} but "
                        f"{size(max(free, 0))} is free; {hint}")


def gpu_free(dev: torch.device) -> int:
    """Bytes of GPU memory free to this process: the driver's free bytes and torch's cached, unused ones."""
    return torch.cuda.mem_get_info(dev)[0] + max(0, torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev))


def check_float32_fits(cfg, fix: str) -> None:
    """Refuse, in one line, a checkpoint whose float32 weights (how it runs, and how a GGUF's blocks are dequantized
    on load) would not fit the host's available memory: past it the OOM killer ends the process without a word."""
    need, free = 4 * cfg.parameters, host_available()
    if free is not None and need > free:
        raise LocalLLMError(f"the checkpoint takes {size(need)} as float32 weights, but {size(free)} of host memory "
                            f"is available; {fix}")
