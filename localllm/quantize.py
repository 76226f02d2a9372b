"""`localllm quantize`: checkpoint -> low-bit weights + 4-bit residuals + calibration -> model folder.

Block by block, so only one block of the source is ever dense in memory: quantize its projections, quantize the
residuals W - W_hat, then run the calibration text through the quantized block (QDEC off, as the runtime sees
activations) to record the statistics QDEC's bucket boundaries come from. Beside it, the first calibration
sequences also run through the source block and through the quantized block with one kind compensated (one stream
per kind), so that at the end the KL divergence of each from the source says what QDEC on each kind is worth
(qdec_value; the tuner spends a budget by it).

Methods (the base quantizer; QDEC works on top of each):
    rtn         group-wise asymmetric round-to-nearest
    awq         rtn after AWQ's per-input-channel scaling, found on the block's calibration inputs and folded into
                the block (awq.py), so the runtime is unchanged; each group's range clipped where that lowers the
                error on those inputs
    squeezellm  non-uniform: per output channel, 2^bits fp16 values over the weights of each group of 128
                mapped onto [0, 2^bits - 1] by the group's min and max (quant.QuantLUT), by k-means weighted by
                each weight's sensitivity, the mean x^2 of its input channel on the block's calibration inputs
                times its group's scale squared (squeezellm.quantize_lut), then refit to the layer's output error on
                those inputs (refit_inputs)
Mixed bits (3.5): every block is quantized alone and scored by the KL divergence of the model's output from the
source model's (kl_sensitivity); the less sensitive half gets 3 bits, the rest 4.

The output head (the embeddings, where the source ties them) is quantized to 8 bits, group 128, RTN (head_bits=16
keeps it fp16): half the bytes a decode step reads there, which on an 8B model is a fifth of all it reads; 4 bits cost
the demo model 14% perplexity, 8 bits nothing measurable.

Where: the blocks are quantized and calibrated on the GPU where torch sees one (device "auto"; torch's CUDA alone, no
CuPy), else on the CPU; the same computation in the same precision, so the same result up to rounding, 4-60x faster
(docs/quantization.md, `localllm bench quantize`). Each block's tensors move to the device in turn, and what is saved
comes back.
A block that runs out of GPU memory is quantized again with smaller row blocks (GpuMemoryFit).

SmoothAttention (on unless smooth_attention=False): before a block is quantized, its key scaling factors are measured
on the calibration keys and folded into the q and k rows of qkv (smooth_attention.py): the same function, keys that
a 4-bit KV cache (--kv-bits 4) quantizes with less error.
"""
from __future__ import annotations

import gc
import hashlib
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from . import atomic, awq, modelfile, texts
from .devices import resolve_device, size
from .errors import LocalLLMError
from .loader import Checkpoint, check_path_text, check_token_ids, open_checkpoint
from .config import rope_inv_freq
from .model import KINDS, Linear, QdecSettings, RMSNorm, attention_mask, build_block, rope_tables, select_channels
from .progress import progress
from .qdec import ActStats, select_exact
from .smooth_attention import ALPHA as SMOOTH_ALPHA, factors as smooth_factors, fold as smooth_fold, key_max
from .quant import (BASE_BITS, GPU_BLOCKS, GROUP_SIZES, HEAD_BITS, HEAD_GROUP, HEAD_WIDTHS, TABLE_GROUP, TILE_K,
                    TILE_N, gpu_row_blocks_at, quantize_residual, quantize_rtn)
from .squeezellm import quantize_lut

DEFAULT_CALIB = "calibration.txt"  # shipped in localllm/data
METHODS = ("rtn", "awq", "squeezellm")
MIXED_BITS = (2.5, 3.5)  # half the blocks one bit below, half one bit above, by KL sensitivity
REFIT_TOKENS = 2048  # calibration inputs squeezellm's tables are refit on (refit_inputs)
REFIT_K_CHUNK = 8  # the channels per 1024 that refit_inputs leaves to QDEC
SENSITIVITY_TOKENS = 1024  # calibration tokens the KL sensitivity is measured on (each block costs a model pass)
VALUE_K_CHUNK = 8  # the k_chunk qdec_value compensates each kind at (on as many tokens as the sensitivity)
BLOCK_VALUE_K_CHUNKS = (1, 2, 4, 8, 16, 32, 64)  # first_order_values' k_chunks: the ones the tuner weighs


def calibration_text(text_file: str | None) -> tuple[str, str]:
    """The calibration text (the built-in one without a file), and how to name it in the manifest."""
    if text_file is None:
        return texts.shipped(DEFAULT_CALIB), f"builtin:{DEFAULT_CALIB}"
    return texts.read(text_file, "calibration text", "--calib-text"), str(Path(text_file).expanduser())


def calibration_tokens(tokenizer, text: str, name: str, n_tokens: int, seq_len: int) -> tuple[torch.Tensor, dict]:
    """Token ids [n_seq, seq_len] from the calibration text, and its record for the manifest."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    seq_len = min(seq_len, len(ids))
    n_seq = min(max(1, n_tokens // seq_len), len(ids) // seq_len) if seq_len else 0
    if n_seq < 1 or seq_len < 16:
        raise LocalLLMError(f"calibration text {name} is too short ({len(ids)} tokens); give at least a few "
                            "thousand tokens of text")
    if n_seq < max(1, n_tokens // seq_len):  # the text, not the request, set the count: statistics from fewer tokens
        print(f"localllm: warning: calibration text {name} gives {n_seq * seq_len} tokens in sequences of {seq_len}, "
              f"fewer than the {n_tokens} asked (--calib-tokens): the calibration is noisier; give a longer "
              "--calib-text", file=sys.stderr)
    toks = torch.tensor(ids[: n_seq * seq_len]).view(n_seq, seq_len)
    info = {"text": name, "sha256": hashlib.sha256(text.encode()).hexdigest(), "tokens": n_seq * seq_len,
            "seq_len": seq_len}
    return toks, info


def run_block(blk, h: torch.Tensor, rope: tuple, pos: torch.Tensor, mask: torch.Tensor,
              observe: Callable[[Linear, torch.Tensor], None] | None = None) -> torch.Tensor:
    """The block's output for calibration hidden states h [n_seq, T, D] (4 sequences at a time); observe(linear, x)
    sees what each projection's weights multiply (the normed or gated input)."""
    hooks = [lin.hook_input(observe) for lin in (blk.qkv, blk.o, blk.gate_up, blk.down)] if observe else []
    try:
        with torch.no_grad():
            return torch.cat([blk(hb, *rope, pos, None, mask) for hb in h.split(4)])
    finally:
        for hk in hooks:
            hk.remove()


def block_inputs(cfg, i: int, t: dict, h: torch.Tensor, rope: tuple, pos: torch.Tensor, mask: torch.Tensor
                 ) -> dict[str, torch.Tensor]:
    """The calibration inputs [tokens, K] of each projection of the source (dense) block i."""
    acc: dict[str, list] = {kind: [] for kind in KINDS}
    run_block(build_block(cfg, i, t, QdecSettings()), h, rope, pos, mask,
              lambda lin, x: acc[lin.kind].append(x.reshape(-1, x.shape[-1])))
    return {kind: torch.cat(v) for kind, v in acc.items()}


class GpuMemoryFit:
    """Runs quantize's steps on `device` with the largest GPU row blocks (quant.gpu_row_blocks_at) that fit: where a
    step runs out of GPU memory, it runs again with row blocks half as large, and later steps keep that size; where
    the CPU's size does not fit either, the one-line error that names the fix. On the CPU, steps just run."""

    def __init__(self, device: torch.device):
        self.device, self.factor = device, GPU_BLOCKS

    def __call__(self, what: str, step: Callable[[], object]):
        while True:
            try:
                with gpu_row_blocks_at(self.factor):
                    return step()
            except torch.OutOfMemoryError:
                if self.device.type != "cuda":
                    raise
                if self.factor == 1:
                    raise gpu_memory_error(self.device, what) from None
                self.factor //= 2
            # out of the handler, the failed step's tensors are garbage: give their memory back before trying again
            gc.collect()
            torch.cuda.empty_cache()
            tqdm.write(f"localllm: the GPU ran out of memory {what}; trying again with smaller row blocks "
                       f"({self.factor}x the CPU's)", file=sys.stderr)


def gpu_memory_error(device: torch.device, what: str) -> LocalLLMError:
    """The one-line error for a GPU that ran out of memory doing `what` with the smallest row blocks."""
    total = torch.cuda.get_device_properties(device).total_memory / 2**30
    return LocalLLMError(f"the GPU ({torch.cuda.get_device_name(device)}, {total:.0f} GiB) ran out of memory {what}; "
                         f"quantize on the CPU with --device cpu (slower), or pass fewer --calib-tokens")


def block_tensors(ckpt: Checkpoint, i: int, device: torch.device) -> dict:
    """Checkpoint.block_tensors(i) on `device`."""
    move = lambda v: None if v is None else v.to(device)  # noqa: E731
    return {k: {n: move(t) for n, t in v.items()} if isinstance(v, dict) else move(v)
            for k, v in ckpt.block_tensors(i).items()}


def quantize_block(t: dict, bits: int, group_size: int, residuals: bool, method: str = "rtn",
                   calib=None, cfg=None) -> tuple[dict, dict]:
    """Dense block tensors (Checkpoint.block_tensors) -> (build_block's arguments for the quantized block, what the
    method found: AWQ's alpha per kind). calib: for awq and squeezellm the block's calibration inputs per kind
    (block_inputs; awq also needs the model config)."""
    info, clips = {}, {}
    if method == "awq":
        t, info, clips = awq.awq_block(t, cfg, calib, bits, group_size)
    out = {"attn_norm": t["attn_norm"], "mlp_norm": t["mlp_norm"]}
    for kind in KINDS:
        w = t[kind]["weight"]
        if method == "squeezellm":
            x = calib[kind].float()
            q = quantize_lut(w.float(), bits, x.square().mean(0), refit_inputs(x), TABLE_GROUP)
        else:
            q = quantize_rtn(w, bits, group_size, clips.get(kind))
        res = quantize_residual(w - q.dequantize()) if residuals else None
        out[kind] = {"quant": q, "bias": t[kind].get("bias"), "residual": res}
    return out, info


def refit_inputs(x: torch.Tensor) -> torch.Tensor:
    """What squeezellm's tables are refit on (squeezellm.refit_table): REFIT_TOKENS of the calibration inputs x [T, K]
    (evenly spaced), once as they are and once with each token's REFIT_K_CHUNK largest |x| per 1024 channels zeroed,
    the channels that QDEC compensates at that k_chunk. Refit on the plain inputs alone, the tables spent their
    precision on those channels (demo model, 3 bits, QDEC off / k8 / k8 gate_up: 67.25 / 46.66 / 62.44 before any
    refit, 55.02 / 47.96 / 54.23 after); on the masked ones alone they neglected them (77.91 / 46.13 / 73.18); on both,
    55.49 / 45.99 / 54.32."""
    if x.shape[0] > REFIT_TOKENS:
        x = x[torch.linspace(0, x.shape[0] - 1, REFIT_TOKENS).long()]
    masked = x.clone().scatter_(1, select_exact(x, REFIT_K_CHUNK), 0.0)
    return torch.cat([x, masked])


def head_quant(w: torch.Tensor, head_bits: int) -> dict | None:
    """The manifest's record of the quantized output head, or None where it stays fp16 (asked for, or a shape the
    GPU tiles cannot hold: vocabulary % 16, hidden % 64)."""
    if head_bits == 16 or w.shape[0] % TILE_N or w.shape[1] % TILE_K:
        return None
    return {"bits": head_bits, "group_size": HEAD_GROUP, "method": "rtn"}


def parse_bits(bits) -> int | float:
    """--bits: one of BASE_BITS, or a MIXED_BITS value (half the blocks one bit below, half one above)."""
    try:
        b = float(bits)
    except (TypeError, ValueError):
        b = None
    if b in BASE_BITS:
        return int(b)
    if b in MIXED_BITS:
        return b
    raise LocalLLMError(f"--bits {bits} is not supported; use one of "
                        f"{', '.join(map(str, sorted((*BASE_BITS, *MIXED_BITS))))}")


class OutputHead:
    """The source model's final norm and output head on `device`, as log-probabilities of the next token."""

    def __init__(self, ckpt: Checkpoint, device: torch.device):
        self.norm = RMSNorm(ckpt.final_norm().to(device), ckpt.config.rms_norm_eps)
        head = ckpt.lm_head()
        self.head = (ckpt.embed() if head is None else head).to(device)

    def _log_probs(self, hb: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(F.linear(self.norm(hb), self.head).float(), dim=-1)

    def _kls(self, ref: list[torch.Tensor], h: torch.Tensor) -> list[torch.Tensor]:
        """Per sequence: the summed per-token KL divergence of h's next-token distribution from ref's."""
        return [F.kl_div(self._log_probs(hb), a, log_target=True, reduction="sum") for a, hb in zip(ref, h.split(1))]

    def log_probs(self, h: torch.Tensor) -> list[torch.Tensor]:
        """Per sequence of hidden states h [n_seq, T, D]: log-probabilities [1, T, vocab]."""
        with torch.no_grad():
            return [self._log_probs(hb) for hb in h.split(1)]

    def kl(self, ref: list[torch.Tensor], h: torch.Tensor) -> float:
        """The mean per-token KL divergence of h's next-token distribution from ref (log_probs of the reference)."""
        with torch.no_grad():
            return sum(kl.item() for kl in self._kls(ref, h)) / sum(a.shape[1] for a in ref)

    def kl_grad(self, ref: list[torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        """The gradient of kl(ref, h) with respect to h."""
        h = h.detach().requires_grad_()
        with torch.enable_grad():
            (sum(self._kls(ref, h)) / sum(a.shape[1] for a in ref)).backward()
        return h.grad


def kl_sensitivity(ckpt: Checkpoint, toks: torch.Tensor, quantize_one: Callable[[int, dict, torch.Tensor], dict],
                   device: torch.device = torch.device("cpu")) -> list[float]:
    """Per block i: the mean per-token KL divergence of the final next-token distribution of the source model from
    that of the source model with only block i quantized (quantize_one(i, block tensors, block input) -> build_block's
    arguments), on the calibration tokens [n_seq, T] (ZeroQ's sensitivity; the QDEC paper's 3.5-bit allocation).
    Only one block is dense in memory at a time; the source blocks run L(L+1)/2 times, on `device`."""
    cfg = ckpt.config
    settings = QdecSettings()
    pos = torch.arange(toks.shape[1], device=device)
    rope, mask = rope_tables(rope_inv_freq(cfg).to(device), pos), attention_mask(pos, None)
    out = OutputHead(ckpt, device)
    dense = lambda i, h: run_block(build_block(cfg, i, block_tensors(ckpt, i, device), settings), h, rope, pos,  # noqa
                                   mask)
    h = ckpt.embed()[toks].to(device)
    inputs = []
    for i in progress(range(cfg.num_layers), desc="sensitivity: source model", unit="block"):
        inputs.append(h)
        h = dense(i, h)
    ref = out.log_probs(h)
    kls = []
    for i in progress(range(cfg.num_layers), desc="sensitivity: KL per quantized block", unit="block"):
        h = run_block(build_block(cfg, i, quantize_one(i, block_tensors(ckpt, i, device), inputs[i]), settings),
                      inputs[i], rope, pos, mask)
        for j in range(i + 1, cfg.num_layers):
            h = dense(j, h)
        kls.append(out.kl(ref, h))
    return kls


def value_streams(cfg, i: int, t: dict, blk, streams: dict[str, torch.Tensor], rope: tuple, pos: torch.Tensor,
                  mask: torch.Tensor, k_chunk: int) -> dict[str, torch.Tensor]:
    """qdec_value's hidden states after block i: "source" through the source block (t, dense), each kind through the
    quantized block `blk` (calibrated) with that kind compensated at k_chunk (approx, as decode runs it)."""
    out = {"source": run_block(build_block(cfg, i, t, QdecSettings()), streams["source"], rope, pos, mask)}
    s = blk.qkv.settings  # the block's Linears share it; QDEC off again after
    try:
        for kind in KINDS:
            s.mode, s.k_chunk = "approx", {k: k_chunk if k == kind else 0 for k in KINDS}
            out[kind] = run_block(blk, streams[kind], rope, pos, mask)
    finally:
        s.mode, s.k_chunk = "off", {k: 0 for k in KINDS}
    return out


def qdec_value(head: OutputHead, ref: list[torch.Tensor], streams: dict[str, torch.Tensor], off: torch.Tensor,
               k_chunk: int) -> dict:
    """The manifest's calibration.qdec_value: the KL divergence of the quantized model's next-token distribution
    from the source model's with QDEC off, and with each kind compensated at k_chunk in every block (the others
    off), on the calibration tokens of `streams` (value_streams' final hidden states). What QDEC buys per kind differs
    ~10x (demo model, W3: o's layers take 2% of the divergence away, down's 18%), which tuner.blocks' per-layer
    estimate does not show across kinds; the tuner spends its budget by it (tuner.blocks.values). ref: the source's
    log-probabilities (head.log_probs of streams["source"])."""
    return {"metric": "kl", "tokens": off.shape[0] * off.shape[1], "mode": "approx", "k_chunk": k_chunk,
            "off": head.kl(ref, off), "kl": {kind: head.kl(ref, streams[kind]) for kind in KINDS}}


def first_order_values(cfg, block_of: Callable[[int], object], inputs: list[torch.Tensor], final: torch.Tensor,
                       head: OutputHead, ref: list[torch.Tensor], rope: tuple, pos: torch.Tensor, mask: torch.Tensor,
                       k_chunks=BLOCK_VALUE_K_CHUNKS) -> dict:
    """Per kind, block and k_chunk: the KL divergence from the source (ref) that compensating that one layer (approx)
    is predicted to take away, to first order: -sum over tokens of G . dy, G the gradient of the KL with respect to
    the layer's output (QDEC off) and dy = R_hat[:, S] x[S] its compensation; G . dy = (G R_hat) . x at S, so one
    product per layer serves every k_chunk. inputs[i]: block i's input on these tokens (QDEC off), final: the last
    block's output, block_of(i): block i as saved. The blocks run again in reverse, one at a time, with gradients.
    Demo model W3, these values (calibration text) against each block compensated alone on 1024 tokens of the
    evaluation text (CPU): rank correlation qkv 0.69, gate_up 0.65, down 0.17, where tuner.blocks' share reached 0.43
    (v rows), 0.21 and 0.50; the four blocks of most value by it took 0.120 / 0.158 / 0.073 of KL away, by the share
    0.092 / 0.095 / 0.125 (best 0.144 / 0.163 / 0.132). Its total is several times the measured one (qkv at k_chunk
    8: 0.88 against 0.19; tuner.blocks.first_order scales it to qdec_value's). Files before 2026-11-30 hold these
    values divided once more by the token count (1024): the tuner, which uses their ratios only, reads both alike."""
    g = head.kl_grad(ref, final)
    out = {kind: [None] * cfg.num_layers for kind in KINDS}
    for i in progress(range(cfg.num_layers - 1, -1, -1), desc="QDEC value per block", unit="block"):
        blk = block_of(i)
        lins = {kind: getattr(blk, kind) for kind in KINDS}
        rows = {kind: lin.residual.dequantize() for kind, lin in lins.items()}  # R_hat [N, K]
        acc = {kind: [0.0] * len(k_chunks) for kind in KINDS}
        grads = []
        for hb, gb in zip(inputs[i].split(4), g.split(4)):
            X, D = {}, {}
            hooks = [lin.hook_input(lambda lin, x: X.__setitem__(lin.kind, x.detach())) for lin in lins.values()]
            hooks += [lin.register_forward_hook(lambda m, a, kw, y: y + D.setdefault(m.kind, torch.zeros_like(
                y, requires_grad=True)), with_kwargs=True) for lin in lins.values()]
            x = hb.detach().requires_grad_()
            try:
                with torch.enable_grad():
                    (blk(x, *rope, pos, None, mask) * gb).sum().backward()
            finally:
                for hk in hooks:
                    hk.remove()
            grads.append(x.grad)
            s = blk.qkv.settings  # the block's Linears share it; select_channels reads its mode
            s.mode = "approx"
            try:
                for kind, lin in lins.items():
                    xk = X[kind].reshape(-1, X[kind].shape[-1])
                    p = xk.float() * (D[kind].grad.reshape(xk.shape[0], -1).float() @ rows[kind])
                    for j, k in enumerate(k_chunks):
                        acc[kind][j] -= float(p.gather(1, select_channels(lin, xk, k)).sum())
            finally:
                s.mode = "off"
        g = torch.cat(grads)
        for kind in KINDS:
            out[kind][i] = [float(f"{v:.6g}") for v in acc[kind]]  # (G is of the mean KL: per token already)
    return {"method": "first order: -G . R_hat[:, S] x[S] per layer, G the gradient of the KL at its output",
            "k_chunks": list(k_chunks), "kl": out}


def mixed_bits(kls: list[float], bits: float) -> list[int]:
    """Half the blocks (the least sensitive, the lower half rounded down) at floor(bits), the others at ceil."""
    lo = int(bits)
    order = sorted(range(len(kls)), key=lambda i: kls[i])
    low = set(order[: len(kls) // 2])
    return [lo if i in low else lo + 1 for i in range(len(kls))]


def check_disk(cfg, out: str, bits: float, group_size: int, residuals: bool, head_bits: int,
               method: str = "rtn") -> None:
    """Refuse in one line, before any block is quantized, an output the disk has no room for: the files' least size
    (packed weights with their group scales and zeros, or squeezellm's tables with their groups' scales and offsets,
    residuals, calibration statistics, fp16 embeddings, the head as it is written, the tokenizer at ~40 bytes a token)
    against the space free where the folder is made (an 8B model on the CPU would otherwise fail at its end, tens of
    minutes later)."""
    w, vd = cfg.linear_weights, cfg.vocab_size * cfg.hidden_size
    shapes = [modelfile.linear_shape(cfg, kind) for kind in KINDS]
    if method == "squeezellm":  # a table of 8-bit entries per row; an fp16 scale and offset per group
        groups = w / TABLE_GROUP * 4 + cfg.num_layers * sum(n for n, _ in shapes) * 2 ** int(bits)
    else:  # an fp16 scale and a uint8 zero per group
        groups = w / group_size * 3
    head = (vd * head_bits / 8 + vd / HEAD_GROUP * 3) if head_bits != 16 else 0 if cfg.tie_word_embeddings else 2 * vd
    calibration = cfg.num_layers * sum(4 * k + 4 * 256 + 8 for _, k in shapes)  # b0, kth, sq_sum per channel
    need = w * bits / 8 + groups + (w / 2 if residuals else 0) + calibration + 2 * vd + head + 40 * cfg.vocab_size
    folder = Path(out).expanduser().resolve().parent
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if need > free:
        raise LocalLLMError(f"{out} needs at least {size(need)} of disk and {folder} has {size(free)} free: free some "
                            "space or choose another -o")


def quantize(src: str, out: str, bits: int | float = 4, group_size: int = 128, residuals: bool = True,
             calib_text: str | None = None, calib_tokens: int = 4096, seq_len: int = 512, kmax: int = 256,
             gguf_file: str | None = None, ckpt: Checkpoint | None = None, method: str = "rtn",
             sensitivity_tokens: int = SENSITIVITY_TOKENS, smooth_attention: bool = True,
             head_bits: int = HEAD_BITS, device: str | torch.device = "cpu") -> Path:
    """The model folder `out` from the checkpoint `src` (see the module doc). device: where the blocks are quantized
    and calibrated, "cpu", "cuda" (torch's CUDA alone; the GPU kernels are not needed) or "auto"; the result is the
    same up to rounding, and the output head is quantized on the CPU (RTN: cheap, and an 8B model's head in float32
    is 2 GB)."""
    bits = parse_bits(bits)
    dev = resolve_device(device, kernels=False)
    if head_bits not in HEAD_WIDTHS:
        raise LocalLLMError(f"--head-bits {head_bits} is not supported; use {' or '.join(map(str, HEAD_WIDTHS))}")
    if method not in METHODS:
        raise LocalLLMError(f"--method {method} is not supported; use one of {', '.join(METHODS)}")
    if group_size not in GROUP_SIZES:
        raise LocalLLMError(f"--group-size {group_size} is not supported; use one of "
                            f"{', '.join(map(str, GROUP_SIZES))}")
    if method == "squeezellm" and group_size != TABLE_GROUP:
        raise LocalLLMError(f"--method squeezellm groups its tables by {TABLE_GROUP} input channels; drop --group-size "
                            f"{group_size} or use --method rtn or awq")
    if not str(out).strip():
        raise LocalLLMError("the output folder's name is empty: give -o a new folder, e.g. -o my-model-w4")
    check_path_text(out)
    if Path(out).expanduser().exists():
        raise LocalLLMError(f"{out} already exists; choose another output path or remove it first")
    atomic.check_writable(out)
    if calib_tokens < 1:
        raise LocalLLMError(f"--calib-tokens must be at least 1 (a few thousand is typical), got {calib_tokens}")
    text, text_name = calibration_text(calib_text)  # before the checkpoint loads
    ckpt = ckpt or open_checkpoint(src, gguf_file)
    cfg = ckpt.config
    for kind in KINDS:
        N, K = modelfile.linear_shape(cfg, kind)
        if K % TILE_K or N % TILE_N:
            raise LocalLLMError(f"{kind} projection is {N}x{K}: localllm needs in_features % {TILE_K} == 0 and "
                                f"out_features % {TILE_N} == 0 (the GPU kernels' tiles)")
    check_disk(cfg, out, bits, group_size, residuals, head_bits, method)
    start = time.perf_counter()
    fit = GpuMemoryFit(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    # sequences no longer than the model's context: the statistics are of attention as the model runs it
    toks, calib = calibration_tokens(ckpt.tokenizer, text, text_name, calib_tokens,
                                     min(seq_len, cfg.max_position_embeddings))
    fingerprint = ckpt.fingerprint()
    pos = torch.arange(toks.shape[1], device=dev)
    rope = rope_tables(rope_inv_freq(cfg).to(dev), pos)
    mask = attention_mask(pos, None)

    def calib_of(i, t, h):  # what the method needs of block i besides its weights (h: the block's input)
        return None if method == "rtn" else block_inputs(cfg, i, t, h, rope, pos, mask)

    quant = {"method": method, "bits": bits, "group_size": group_size,
             "layout": modelfile.LUT_GROUP_LAYOUT if method == "squeezellm" else modelfile.WEIGHT_LAYOUT}
    if isinstance(bits, float):
        n_seq = max(1, min(toks.shape[0], sensitivity_tokens // toks.shape[1]))
        sens = toks[:n_seq]
        kls = fit("measuring each block's KL sensitivity", lambda: kl_sensitivity(ckpt, sens, lambda i, t, h: (
            quantize_block(t, int(bits), group_size, False, method, calib_of(i, t, h), cfg)[0]), dev))
        block_bits = mixed_bits(kls, bits)
        quant["sensitivity"] = {"metric": "kl", "tokens": sens.numel(), "kl": kls}
    else:
        block_bits = [bits] * cfg.num_layers
    quant["block_bits"] = block_bits
    if method == "squeezellm":
        quant["weight_sensitivity"] = "mean x^2 of the weight's input channel on the calibration inputs, times its " \
                                      "group's scale squared"
        quant["table_groups"] = f"fp16 scale and offset per {TABLE_GROUP} input channels: the group's min and max " \
                                f"onto 0 and 2^bits - 1, the tables fitted in that unit"
        quant["table_refit"] = f"least squares on the output error over {REFIT_TOKENS} calibration inputs, and the " \
                               f"same with their {REFIT_K_CHUNK} largest |x| per 1024 channels zeroed"

    embed = ckpt.embed()
    check_token_ids(toks, embed.shape[0])
    # [n_seq, seq_len, D]: calibration hidden states, pushed through block by block; from the embeddings rounded as
    # the model file keeps them (fp16), what the quantized model's first block will see
    h_src = embed[toks].to(dev)
    h = h_src.half().to(h_src.dtype)
    settings = QdecSettings()
    # QDEC's value per kind (qdec_value): the first sequences through the source blocks and through the quantized
    # blocks with one kind compensated, beside the calibration's own (QDEC off)
    n_value, value_k = max(1, min(toks.shape[0], sensitivity_tokens // toks.shape[1])), min(VALUE_K_CHUNK, kmax)
    streams = {"source": h_src[:n_value], **{kind: h[:n_value] for kind in KINDS}} if residuals else None
    tensors = ({}, {}, {})
    value_inputs = []  # each block's input on the value tokens, QDEC off (first_order_values)
    found = []
    block_s = []  # each block's quantize and calibration time
    for i in progress(range(cfg.num_layers), desc=f"quantizing blocks ({method}, {dev.type})", unit="block"):
        t0 = time.perf_counter()

        def one_block():  # -> (the next block's input, what is saved of this one, what the method found)
            t = block_tensors(ckpt, i, dev)
            saved = ({}, {}, {})
            if smooth_attention:  # on this block's calibration keys, before anything else sees its weights
                lam = smooth_factors(key_max(cfg, t, h, *rope), cfg.head_dim)
                t = smooth_fold(t, cfg, lam)
                saved[0][f"blocks.{i}.k_smooth"] = lam.cpu()
            qt, info = quantize_block(t, block_bits[i], group_size, residuals, method, calib_of(i, t, h), cfg)
            for kind in KINDS:
                qt[kind]["stats"] = ActStats(modelfile.linear_shape(cfg, kind)[1], kmax, dev)
            blk = build_block(cfg, i, qt, settings)
            # the statistics are of what the weights multiply (after AWQ's folding: the GEMV's actual input)
            out = run_block(blk, h, rope, pos, mask, lambda lin, x: lin.stats.update(x))
            for acc, part in zip(saved, modelfile.block_state(i, blk)):
                acc.update({name: v.cpu() for name, v in part.items()})
            return out, saved, info, None if streams is None else value_streams(cfg, i, t, blk, streams, rope, pos,
                                                                                  mask, value_k)

        if streams is not None:
            value_inputs.append(h[:n_value])
        h, saved, info, streams = fit(f"quantizing block {i}", one_block)
        found.append(info)
        for acc, part in zip(tensors, saved):
            acc.update(part)
        block_s.append(round(time.perf_counter() - t0, 3))
    if method == "awq":
        quant["awq_alpha"] = found
        quant["awq_clip"] = f"per row and group, the range shrunk by {1 - awq.CLIPS[-1]:.0%} at most where that " \
                            "lowers the group's output error on the calibration inputs"
    tensors[0]["embed"] = embed.half()
    tensors[0]["norm"] = ckpt.final_norm().half()
    lm_head = ckpt.lm_head()
    head = embed if lm_head is None else lm_head
    quant["head"] = head_quant(head, head_bits)
    if quant["head"]:
        q = quantize_rtn(head.float(), head_bits, HEAD_GROUP)
        tensors[0].update({"head.qweight": q.qweight, "head.scales": q.scales, "head.zeros": q.zeros})
    elif lm_head is not None:
        tensors[0]["lm_head"] = lm_head.half()
    calibration = {**calib, "kmax": kmax, "model_state": "quantized, QDEC off"}
    if streams is not None:
        head_src = OutputHead(ckpt, dev)
        ref = head_src.log_probs(streams["source"])
        calibration["qdec_value"] = qdec_value(head_src, ref, streams, h[:n_value], value_k)

        def block_of(i):  # block i as saved, on the device
            p = f"blocks.{i}."
            files = tuple({k: v.to(dev) for k, v in d.items() if k.startswith(p)} for d in tensors)
            return modelfile.saved_block(cfg, i, block_bits[i], quant, files, QdecSettings())
        # (with qdec_value's own k_chunk, which tuner.blocks.first_order scales by, even below the ladder's)
        ks = tuple(sorted({k for k in BLOCK_VALUE_K_CHUNKS if k <= kmax} | {value_k}))
        try:
            calibration["qdec_value"]["blocks"] = first_order_values(cfg, block_of, value_inputs, h[:n_value], head_src,
                                                                     ref, rope, pos, mask, ks)
        except torch.OutOfMemoryError:  # an improvement for the tuner, not a reason to lose the quantized model
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            tqdm.write("localllm: the GPU ran out of memory measuring QDEC's value per block; the model is saved "
                       "without it (localllm tune then splits each kind's value by an estimate)", file=sys.stderr)
    manifest = {
        "source": {**ckpt.source, "sha256": fingerprint},
        "config": cfg.to_dict(),
        "eos_token_ids": ckpt.eos_ids,
        "quant": quant,
        "residual": {"bits": 4, "layout": modelfile.RESIDUAL_LAYOUT} if residuals else None,
        "calibration": calibration,
        "quantized_on": {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                         "block_seconds": block_s, "seconds": round(time.perf_counter() - start, 3),
                         "peak_gpu_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
                         "gpu_row_blocks": fit.factor if dev.type == "cuda" else None},
        "smooth_attention": {"alpha": SMOOTH_ALPHA, "tensors": "blocks.N.k_smooth",
                             "folded": "q rows of qkv times the factor, k rows divided by it"}
        if smooth_attention else None,
    }
    return modelfile.save(out, manifest, tensors, ckpt.tokenizer)
