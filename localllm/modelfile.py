"""The quantized model folder: safetensors files + a JSON manifest + the tokenizer.

    localllm.json            manifest: format version, source (+ sha256), config, method, bits (per block),
                             group size, residual and calibration info, size + sha256 of every file
    model.safetensors        fp16 embeddings / norms; the output head 8-bit (head.*; format 3) or fp16 (lm_head,
                             where not tied); packed low-bit weights (+ qkv bias), with
                             group scales + zeros (uniform) or per-channel tables (non-uniform); the
                             SmoothAttention factors folded into qkv (blocks.N.k_smooth, optional)
    residuals.safetensors    4-bit QDEC residuals, input-channel-major (optional)
    calibration.safetensors  activation statistics for QDEC bucket boundaries (optional)
    tokenizer files          incl. the chat template

Nothing is pickled. Loading checks version, sizes, hashes and shapes and refuses a mismatch in one line.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from . import __version__, atomic
from .config import ModelConfig
from .digest import sha256_files
from .errors import LocalLLMError, is_real, is_whole
from .loader import MANIFEST
from .model import KINDS, Block, QdecSettings, RMSNorm, Transformer, build_block
from .qdec import ActStats
from .quant import BASE_BITS, GROUP_SIZES, HEAD_BITS, QuantLUT, QuantResidual, QuantWeight

# Version 2: per-block bit widths (quant.block_bits) and the non-uniform layout. Version 3: the output head may be
# quantized (quant.head). Version 4: grouped tables. Version 1 files (uniform bits, WEIGHT_LAYOUT) still load.
FORMAT_VERSION = 4
WEIGHT_LAYOUT = "rtn-mma-v3"        # quant.pack_codes: 16x64 tiles in tensor-core operand order, group scale + zero
LUT_LAYOUT = "lut-mma-v3"           # the same packed codes, one fp16 table of 2^bits values per output channel
LUT_GROUP_LAYOUT = "lut-group-mma-v3"  # LUT_LAYOUT plus fp16 scales and offsets per group (quant.QuantLUT)
READABLE = {1: (WEIGHT_LAYOUT,), 2: (WEIGHT_LAYOUT, LUT_LAYOUT), 3: (WEIGHT_LAYOUT, LUT_LAYOUT),
            4: (WEIGHT_LAYOUT, LUT_LAYOUT, LUT_GROUP_LAYOUT)}  # format version -> weight layouts it may hold
RESIDUAL_LAYOUT = "sym4-inmajor-v1"  # quant.QuantResidual: [K, N/8] int32 of (q + 8) nibbles
FILES = ("model.safetensors", "residuals.safetensors", "calibration.safetensors")


def linear_shape(cfg: ModelConfig, kind: str) -> tuple[int, int]:
    """(out_features N, in_features K) of a fused projection."""
    return {"qkv": (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size), "o": (cfg.hidden_size, cfg.q_size),
            "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size),
            "down": (cfg.hidden_size, cfg.intermediate_size)}[kind]


# ---------------------------------------------------------------- writing

def block_state(i: int, blk: Block) -> tuple[dict, dict, dict]:
    """Tensors of one quantized block for (model, residuals, calibration) files."""
    p = f"blocks.{i}."
    model = {p + "attn_norm": blk.attn_norm.weight.half(), p + "mlp_norm": blk.mlp_norm.weight.half()}
    res, cal = {}, {}
    for kind in KINDS:
        lin = getattr(blk, kind)
        q = lin.quant
        model[p + kind + ".qweight"] = q.qweight
        if isinstance(q, QuantLUT):
            model[p + kind + ".lut"] = q.lut
            if q.scales is not None:
                model |= {p + kind + ".scales": q.scales, p + kind + ".offsets": q.offsets}
        else:
            model |= {p + kind + ".scales": q.scales, p + kind + ".zeros": q.zeros}
        if lin.bias is not None:
            model[p + kind + ".bias"] = lin.bias.half()
        if lin.residual is not None:
            res |= {p + kind + ".packed": lin.residual.packed, p + kind + ".scales": lin.residual.scales}
        if lin.stats is not None:
            cal |= {p + kind + "." + k: v for k, v in lin.stats.state().items()}
    return model, res, cal


def save(out: str | Path, manifest: dict, tensors: tuple[dict, dict, dict], tokenizer) -> Path:
    """Write a model folder atomically. `manifest` gets the format fields and file hashes added here."""
    out = Path(out)
    with atomic.new_folder(out) as tmp:
        files = {}
        for name, t in zip(FILES, tensors):
            if t:
                try:
                    save_file({k: v.contiguous() for k, v in t.items()}, str(tmp / name))
                except SafetensorError as e:  # e.g. a full disk or a file-size limit: as the OSError it wraps
                    raise OSError(f"cannot write {out / name}: {e}") from None
                files[name] = {"bytes": (tmp / name).stat().st_size, "sha256": sha256_files([tmp / name])[0]}
        try:
            tokenizer.save_pretrained(str(tmp))
        except OSError:
            raise
        except Exception as e:  # the tokenizers library's own errors (a full disk: "No space left on device") too
            raise OSError(f"cannot write the tokenizer into {out}: {e}") from None
        manifest = {"format": "localllm", "format_version": FORMAT_VERSION, "created_by": f"localllm {__version__}",
                    **manifest, "files": files,
                    "model_id": model_id(files)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return out.resolve()


def model_id(files: dict) -> str:
    """What identifies a model folder (its tuning profiles name it): a digest of its files' sizes and digests."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- reading

class NewerFormatError(LocalLLMError):
    """A model folder a newer localllm wrote (this one must not read it, nor replace it)."""


def read_manifest(path: Path) -> dict:
    f = path / MANIFEST
    if not f.exists():
        raise LocalLLMError(f"{path} is not a localllm model (no {MANIFEST}); create one with `localllm quantize`")
    try:
        m = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # a folder, not UTF-8, not JSON, nested past Python's stack
        raise LocalLLMError(f"{f} is corrupt ({type(e).__name__}: {str(e)[:100]}); re-run `localllm quantize`") \
            from None
    v = m.get("format_version") if isinstance(m, dict) else None
    if not isinstance(m, dict) or m.get("format") != "localllm" or not isinstance(v, int):
        raise LocalLLMError(f"{f} is not a localllm manifest; re-run `localllm quantize`")
    if v > FORMAT_VERSION:
        raise NewerFormatError(f"{path} was written by a newer localllm (format {v}, this one reads "
                               f"{FORMAT_VERSION}); upgrade localllm")
    # what every reader takes from it, of the right kinds (a hand-edited or damaged manifest: one line, not a traceback)
    files = m.get("files")
    bad = [k for k in ("config", "quant", "calibration", "files") if not isinstance(m.get(k), dict)] + \
        [f"files.{n}" for n, e in (files.items() if isinstance(files, dict) else [])
         if not isinstance(e, dict) or not isinstance(e.get("bytes"), int)]
    q = m.get("quant") if isinstance(m.get("quant"), dict) else {}
    if "group_size" in q and not (is_whole(q["group_size"]) and q["group_size"] in GROUP_SIZES):
        bad.append("quant.group_size")
    hq = q.get("head")
    if hq and not (isinstance(hq, dict) and is_whole(hq.get("bits")) and is_whole(hq.get("group_size"))
                   and hq["group_size"] in GROUP_SIZES):
        bad.append("quant.head")
    if not bad and "model_id" in m and m["model_id"] != model_id(files):  # a files table edited by hand
        bad.append("files (they are not the ones its model_id names)")
    _refuse_damaged(f, bad)
    layout = m["quant"].get("layout")
    if v < 1 or (v == 1 and layout != WEIGHT_LAYOUT):
        raise LocalLLMError(f"{path} uses an older format (version {v}); re-run `localllm quantize` on the source")
    if layout not in READABLE[v]:
        raise LocalLLMError(f"{path} holds weights in layout '{layout}', which this localllm cannot read (it reads "
                            f"{', '.join(READABLE[v])}); upgrade localllm or re-run `localllm quantize`")
    bad = _bad_quant(q) + _bad_calibration(m["calibration"])  # what info states, the runtime and the tuner read
    if bool(m.get("residual")) != (FILES[1] in files):  # (QDEC would run, or not, whatever it says)
        bad.append("residual (it says the opposite of files)")
    _refuse_damaged(f, bad)
    return m


def _refuse_damaged(f: Path, bad: list[str]) -> None:
    if bad:
        raise LocalLLMError(f"{f} is damaged ({', '.join(bad)} missing or not what localllm writes); re-run "
                            "`localllm quantize`")


def _bad_quant(q: dict) -> list[str]:
    """The manifest's quant entries that are not what quantize writes (what info states and the loader reads)."""
    bad = []
    bits, mix, method = q.get("bits"), q.get("block_bits"), q.get("method", "rtn")
    if not (is_real(bits) and (bits in BASE_BITS or bits - 0.5 in BASE_BITS and bits + 0.5 in BASE_BITS)):
        bad.append("quant.bits")
    elif mix is not None and not (isinstance(mix, list) and mix and set(mix) <= {math.floor(bits), math.ceil(bits)}):
        bad.append("quant.block_bits (not of quant.bits)")
    if method not in METHOD_NAMES or (method == "squeezellm") != (q.get("layout") in (LUT_LAYOUT, LUT_GROUP_LAYOUT)):
        bad.append("quant.method (not of its weight layout)")
    picks = q.get("awq_alpha")
    if picks is not None and not (isinstance(picks, list) and all(
            isinstance(b, dict) and all(isinstance(p, dict) and is_real(p.get("alpha")) and isinstance(p.get("duo"), bool)
                                        and is_real(p.get("error_vs_rtn", 0.0)) for p in b.values()) for b in picks)):
        bad.append("quant.awq_alpha")
    return bad


def _bad_calibration(c: dict | None) -> list[str]:
    """The calibration entries that the runtime (kmax) and the tuner and info (qdec_value) read, if not as written."""
    if not isinstance(c, dict):
        return []
    bad = [] if "kmax" not in c or is_whole(c["kmax"]) and 1 <= c["kmax"] <= 1024 else ["calibration.kmax"]
    v = c.get("qdec_value")
    if v is None:
        return bad
    ok = isinstance(v, dict) and is_whole(v.get("k_chunk")) and is_real(v.get("off")) and \
        isinstance(v.get("kl"), dict) and set(v["kl"]) == set(KINDS) and all(map(is_real, v["kl"].values()))
    fo = v.get("blocks") if ok else None
    if fo is not None:
        ks = fo.get("k_chunks") if isinstance(fo, dict) else None
        ok = isinstance(ks, list) and all(map(is_whole, ks)) and isinstance(fo.get("kl"), dict) and \
            set(fo["kl"]) == set(KINDS) and all(isinstance(b, list) and all(
                isinstance(r, list) and len(r) == len(ks) and all(map(is_real, r)) for r in b) for b in fo["kl"].values())
    return bad + ([] if ok else ["calibration.qdec_value"])


def block_bits(m: dict, num_layers: int) -> list[int]:
    """Bit width of each decoder block: the manifest's block_bits (format 2), else its one bit width."""
    q = m["quant"]
    bits = q.get("block_bits") or [q["bits"]] * num_layers
    if len(bits) != num_layers or any(b not in BASE_BITS for b in bits):
        raise LocalLLMError(f"the manifest's block bit widths {bits} do not fit {num_layers} blocks of "
                            f"{'/'.join(map(str, BASE_BITS))} bits; re-run `localllm quantize`")
    return bits


METHOD_NAMES = {"rtn": "", "awq": " AWQ", "squeezellm": " SqueezeLLM"}


def quant_label(q: dict) -> str:
    """The manifest's quantization in a few words: "3-bit, group 64", "3.5-bit AWQ (16 blocks 3-bit, 16 4-bit), group
    128", "4-bit SqueezeLLM". A mix names its blocks: with an odd count (or one block), --bits 3.5 is not 3.5 on
    average."""
    name = f"{q['bits']}-bit{METHOD_NAMES.get(q.get('method', 'rtn'), ' ' + str(q.get('method')))}"
    mix = q.get("block_bits") or []
    if len(set(mix)) > 1 or mix and mix[0] != q["bits"]:
        name += " (" + ", ".join(f"{mix.count(b)} block{'s' * (mix.count(b) > 1)} {b}-bit" for b in sorted(set(mix))) + ")"
    return name + (f", group {q['group_size']}" if q.get("group_size") else "")


def awq_summary(q: dict) -> dict | None:
    """AWQ's picks of the manifest per projection kind: how many blocks kept RTN (alpha 0, plain scales) and the mean
    output error over RTN's (None in files from before it was recorded); None for other methods."""
    picks = q.get("awq_alpha")
    if not picks:
        return None
    out = {}
    for kind in picks[0]:
        ps = [blk[kind] for blk in picks]
        err = [p["error_vs_rtn"] for p in ps if "error_vs_rtn" in p]
        out[kind] = {"rtn_blocks": sum(p["alpha"] == 0 and not p["duo"] for p in ps), "blocks": len(ps),
                     "mean_error_vs_rtn": sum(err) / len(err) if len(err) == len(ps) else None}
    return out


def _load_checked(path: Path, name: str, meta: dict, verify: bool) -> dict:
    f = path / name
    if not f.exists():
        raise LocalLLMError(f"{f} is missing; the model folder is incomplete, re-run `localllm quantize`")
    size = f.stat().st_size
    if size != meta["bytes"]:
        raise LocalLLMError(f"{f} has {size} bytes, the manifest says {meta['bytes']}: the file is truncated or "
                            "was replaced; re-run `localllm quantize`")
    if verify and sha256_files([f], f"verifying {name}")[0] != meta["sha256"]:
        raise LocalLLMError(f"{f} does not match its sha256 in the manifest: the file is corrupt; "
                            "re-run `localllm quantize`")
    try:
        return load_file(str(f))
    except (SafetensorError, OSError, ValueError) as e:
        raise LocalLLMError(f"{f} is corrupt ({e}); re-run `localllm quantize`") from None


def saved_block(cfg: ModelConfig, i: int, bits: int, quant: dict, files: tuple[dict, dict, dict],
                settings: QdecSettings, take=None, stats_error=None) -> Block:
    """Block i from the tensors block_state saved (files: the model's, the residuals' and the calibration's dicts;
    quant: the manifest's "quant"), on the device the tensors are on. take(d, name, shape, file name) checks each
    tensor (default: none)."""
    take = take or (lambda d, name, shape, fname: d[name])
    w, res, cal = files
    layout = quant["layout"]
    lut, grouped = layout in (LUT_LAYOUT, LUT_GROUP_LAYOUT), layout != LUT_LAYOUT
    g = quant["group_size"] if grouped else None
    D, p = cfg.hidden_size, f"blocks.{i}."
    t = {"attn_norm": take(w, p + "attn_norm", (D,), FILES[0]), "mlp_norm": take(w, p + "mlp_norm", (D,), FILES[0])}
    for kind in KINDS:
        N, K = linear_shape(cfg, kind)
        q = p + kind + "."
        qweight = take(w, q + "qweight", (N // 16, K * bits // 2), FILES[0])
        groups = (N, math.ceil(K / g)) if grouped else None
        if lut:
            scales, offsets = (take(w, q + n, groups, FILES[0]) if grouped else None for n in ("scales", "offsets"))
            qt = QuantLUT(qweight, take(w, q + "lut", (N, 2**bits), FILES[0]), bits, K, scales, offsets, g)
        else:
            qt = QuantWeight(qweight, take(w, q + "scales", groups, FILES[0]), take(w, q + "zeros", groups, FILES[0]),
                             bits, g, K)
        bias = take(w, q + "bias", (N,), FILES[0]) if kind == "qkv" and cfg.qkv_bias else None
        residual = None
        if res:
            residual = QuantResidual(take(res, q + "packed", (K, N // 8), FILES[1]),
                                     take(res, q + "scales", (N,), FILES[1]))
        stats = ActStats.from_state({k[len(q):]: v for k, v in cal.items() if k.startswith(q)}) if cal else None
        if stats is not None and stats.sq_mean.shape != (K,):
            raise LocalLLMError(stats_error(q[:-1]) if stats_error else f"statistics of {q[:-1]} do not match")
        t[kind] = {"quant": qt, "bias": bias, "residual": residual, "stats": stats}
    return build_block(cfg, i, t, settings)


def load(path: str | Path, verify: bool = True, settings: QdecSettings | None = None) -> tuple[Transformer, dict]:
    """Load a quantized model folder -> (model on CPU, manifest)."""
    path = Path(path).expanduser()
    m = read_manifest(path)
    cfg = ModelConfig.from_dict(m["config"])
    files = {n: _load_checked(path, n, meta, verify) for n, meta in m["files"].items()}
    w, res, cal = (files.get(n, {}) for n in FILES)
    bits_of = block_bits(m, cfg.num_layers)
    settings = settings or QdecSettings()

    def take(d: dict, name: str, shape: tuple, fname: str) -> torch.Tensor:
        t = d.get(name)
        if t is None or tuple(t.shape) != tuple(shape):
            got = "missing" if t is None else f"shape {tuple(t.shape)}"
            raise LocalLLMError(f"{path / fname}: tensor {name} is {got}, expected {tuple(shape)}; the files do not "
                                "match the manifest, re-run `localllm quantize`")
        return t

    D = cfg.hidden_size
    blocks = []
    for i in range(cfg.num_layers):
        if m.get("smooth_attention"):  # the factors folded into qkv: kept for the record, checked like the rest
            take(w, f"blocks.{i}.k_smooth", (cfg.kv_size,), FILES[0])
        blocks.append(saved_block(cfg, i, bits_of[i], m["quant"], (w, res, cal), settings, take,
                                  lambda q: f"{path / FILES[2]}: statistics of {q} do not match the model; re-run "
                                            "`localllm quantize`"))
    V = cfg.vocab_size
    embed = take(w, "embed", (V, D), FILES[0])
    if hq := m["quant"].get("head"):
        if hq.get("bits") != HEAD_BITS:
            raise LocalLLMError(f"{path}: the output head is {hq.get('bits')}-bit; this localllm reads {HEAD_BITS}-bit "
                                "heads: re-run `localllm quantize`")
        G = math.ceil(D / hq["group_size"])
        lm_head = QuantWeight(take(w, "head.qweight", (V // 16, D * HEAD_BITS // 2), FILES[0]),
                              take(w, "head.scales", (V, G), FILES[0]), take(w, "head.zeros", (V, G), FILES[0]),
                              HEAD_BITS, hq["group_size"], D)
    else:
        lm_head = None if cfg.tie_word_embeddings else take(w, "lm_head", (V, D), FILES[0])
    model = Transformer(cfg, embed, blocks, RMSNorm(take(w, "norm", (D,), FILES[0]), cfg.rms_norm_eps), lm_head,
                        settings)
    return model.eval(), m
