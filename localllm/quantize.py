"""`localllm quantize`: checkpoint -> low-bit weights + 4-bit residuals + calibration -> model folder.

Block by block, so only one block of the source is ever dense in memory: quantize its projections (RTN),
quantize the residuals W - W_hat, then run the calibration text through the quantized block (QDEC off,
as the runtime sees activations) to record the statistics QDEC's bucket boundaries come from.
"""
from __future__ import annotations

import hashlib
from importlib import resources
from pathlib import Path

import torch

from . import modelfile
from .errors import LocalLLMError
from .loader import Checkpoint, open_checkpoint
from .config import rope_inv_freq
from .model import KINDS, Linear, QdecSettings, attention_mask, build_block, rope_tables
from .progress import progress
from .qdec import ActStats
from .quant import BASE_BITS, GROUP_SIZES, TILE_K, TILE_N, quantize_residual, quantize_rtn

DEFAULT_CALIB = "calibration.txt"  # shipped in localllm/data


def calibration_tokens(tokenizer, text_file: str | None, n_tokens: int, seq_len: int) -> tuple[torch.Tensor, dict]:
    """Token ids [n_seq, seq_len] from the calibration text, and how to name that text in the manifest."""
    if text_file is None:
        text = resources.files("localllm").joinpath("data", DEFAULT_CALIB).read_text(encoding="utf-8")
        name = f"builtin:{DEFAULT_CALIB}"
    else:
        p = Path(text_file).expanduser()
        if not p.is_file():
            raise LocalLLMError(f"calibration text {p} does not exist; pass a UTF-8 text file with --calib-text")
        text, name = p.read_text(encoding="utf-8", errors="replace"), str(p)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    seq_len = min(seq_len, len(ids))
    n_seq = min(max(1, n_tokens // seq_len), len(ids) // seq_len)
    if n_seq < 1 or seq_len < 16:
        raise LocalLLMError(f"calibration text {name} is too short ({len(ids)} tokens); give at least a few "
                            "thousand tokens of text")
    toks = torch.tensor(ids[: n_seq * seq_len]).view(n_seq, seq_len)
    info = {"text": name, "sha256": hashlib.sha256(text.encode()).hexdigest(), "tokens": n_seq * seq_len,
            "seq_len": seq_len}
    return toks, info


def quantize_block(t: dict, bits: int, group_size: int, residuals: bool) -> dict:
    """Dense block tensors (Checkpoint.block_tensors) -> quantized ones (build_block's arguments)."""
    out = {"attn_norm": t["attn_norm"], "mlp_norm": t["mlp_norm"]}
    for kind in KINDS:
        w = t[kind]["weight"]
        q = quantize_rtn(w, bits, group_size)
        res = quantize_residual(w - q.dequantize()) if residuals else None
        out[kind] = {"quant": q, "bias": t[kind].get("bias"), "residual": res}
    return out


def quantize(src: str, out: str, bits: int = 4, group_size: int = 128, residuals: bool = True,
             calib_text: str | None = None, calib_tokens: int = 4096, seq_len: int = 512, kmax: int = 256,
             gguf_file: str | None = None, ckpt: Checkpoint | None = None) -> Path:
    if bits not in BASE_BITS:
        raise LocalLLMError(f"--bits {bits} is not supported; use one of {', '.join(map(str, BASE_BITS))}")
    if group_size not in GROUP_SIZES:
        raise LocalLLMError(f"--group-size {group_size} is not supported; use one of "
                            f"{', '.join(map(str, GROUP_SIZES))}")
    if Path(out).expanduser().exists():
        raise LocalLLMError(f"{out} already exists; choose another output path or remove it first")
    ckpt = ckpt or open_checkpoint(src, gguf_file)
    cfg = ckpt.config
    for kind in KINDS:
        N, K = modelfile.linear_shape(cfg, kind)
        if K % TILE_K or N % TILE_N:
            raise LocalLLMError(f"{kind} projection is {N}x{K}: localllm needs in_features % {TILE_K} == 0 and "
                                f"out_features % {TILE_N} == 0 (the GPU kernels' tiles)")
    toks, calib = calibration_tokens(ckpt.tokenizer, calib_text, calib_tokens, seq_len)
    fingerprint = ckpt.fingerprint()

    embed = ckpt.embed()
    h = embed[toks]  # [n_seq, seq_len, D]: calibration hidden states, pushed through block by block
    settings = QdecSettings()
    tensors = ({}, {}, {})
    pos = torch.arange(toks.shape[1])
    rope = rope_tables(rope_inv_freq(cfg), pos)
    mask = attention_mask(pos, None)
    for i in progress(range(cfg.num_layers), desc="quantizing blocks", unit="block"):
        qt = quantize_block(ckpt.block_tensors(i), bits, group_size, residuals)
        for kind in KINDS:
            qt[kind]["stats"] = ActStats(modelfile.linear_shape(cfg, kind)[1], kmax)
        blk = build_block(cfg, i, qt, settings)
        # the statistics are of what the weights multiply: the normed or gated input
        def observe(m, args, kw):
            m.stats.update(Linear.input_of(args[0], kw.get("norm"), kw.get("glu", False)))
        hooks = [lin.register_forward_pre_hook(observe, with_kwargs=True)
                 for lin in (blk.qkv, blk.o, blk.gate_up, blk.down)]
        with torch.no_grad():
            h = torch.cat([blk(hb, *rope, pos, None, mask) for hb in h.split(4)])
        for hk in hooks:
            hk.remove()
        for acc, part in zip(tensors, modelfile.block_state(i, blk)):
            acc.update(part)
        del blk, qt
    tensors[0]["embed"] = embed.half()
    tensors[0]["norm"] = ckpt.final_norm().half()
    if (lm_head := ckpt.lm_head()) is not None:
        tensors[0]["lm_head"] = lm_head.half()
    manifest = {
        "source": {**ckpt.source, "sha256": fingerprint},
        "config": cfg.to_dict(),
        "eos_token_ids": ckpt.eos_ids,
        "quant": {"method": "rtn", "bits": bits, "group_size": group_size, "layout": modelfile.WEIGHT_LAYOUT},
        "residual": {"bits": 4, "layout": modelfile.RESIDUAL_LAYOUT} if residuals else None,
        "calibration": {**calib, "kmax": kmax, "model_state": "quantized, QDEC off"},
    }
    return modelfile.save(out, manifest, tensors, ckpt.tokenizer)
