"""What the status bar and the settings panel say about the model and the machine, as text (no widgets here)."""
from __future__ import annotations

from pathlib import Path

import torch

from localllm.devices import size
from localllm.generate import Stats
from localllm.model import KINDS
from localllm.modelfile import quant_label
from localllm.runtime import LocalModel

NONE = "—"


def model_name(lm: LocalModel) -> str:
    return Path(lm.path).name


def summary(lm: LocalModel) -> str:
    """The model in one line: name, bits, device, QDEC, and the KV cache width when it is quantized."""
    q = lm.manifest["quant"] if lm.manifest else None
    bits = quant_label(q) if q else "dense as loaded"  # (a GGUF's low-bit blocks are dequantized on load)
    qdec = "QDEC off" if lm.settings.mode == "off" else f"QDEC {lm.settings.mode}"
    kv = f", {lm.kv_bits}-bit KV cache" if lm.kv_bits < 16 else ""
    return f"{model_name(lm)} ({bits}) on {device_name(lm)}, {qdec}{kv}"


def device_name(lm: LocalModel) -> str:
    dev = lm.model.device
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"


def gpu_memory(lm: LocalModel) -> str:
    return size(torch.cuda.memory_allocated(lm.model.device))


def residual_memory(lm: LocalModel) -> str:
    """Host memory of the QDEC residuals: pinned on a GPU (only once QDEC has been on), plain RAM on the CPU."""
    if not lm.has_residuals:
        return "none"
    if lm.model.device.type != "cuda":
        return f"{size(lm.sizes()['pinned_host_bytes'])} in RAM"
    pinned = sum(lin.residual.nbytes for lin in lm.model.linears() if lin.host_residual is not None)
    return f"{size(pinned)} pinned"


def k_chunks(lm: LocalModel) -> str:
    """The k_chunk in force per layer type (channels compensated per 1024 inputs)."""
    s = lm.settings
    if s.mode == "off":
        return "off"
    return " · ".join(f"{kind} {s.k_for(kind)}" for kind in KINDS)


def qdec_overhead(lm: LocalModel) -> str:
    """The decode slowdown QDEC costs, as `localllm tune` measured it on this GPU (the profile in force)."""
    return "not measured" if lm.qdec_overhead is None else f"{lm.qdec_overhead:+.1%}"


def status_line(lm: LocalModel, last: Stats | None) -> str:
    """The status bar: device, speed and time to first token of the last reply, memory, QDEC (on a GPU its overhead,
    as tuning measured it; on the CPU, where nothing is tuned, its mode)."""
    speed = f"{last.tokens_per_second:.1f} tok/s" if last and last.tokens_per_second else f"{NONE} tok/s"
    ttft = f"{last.time_to_first_token:.2f} s" if last and last.time_to_first_token else NONE
    gpu = lm.model.device.type == "cuda"
    qdec = "QDEC off" if lm.settings.mode == "off" else \
        f"QDEC overhead {qdec_overhead(lm)}" if gpu else f"QDEC {lm.settings.mode}"
    return " │ ".join([device_name(lm), speed, f"TTFT {ttft}"] + ([f"GPU mem {gpu_memory(lm)}"] if gpu else [])
                      + [f"residuals {residual_memory(lm)}", qdec])
