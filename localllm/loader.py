"""Open a source checkpoint: a folder of safetensors + config.json + tokenizer, a GGUF file, or a hub id.

A Checkpoint hands out the tensors of one decoder block at a time (q/k/v and gate/up fused), so quantizing
a large model never needs it whole in memory (except GGUF, which transformers dequantizes in one go).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import os
import re
import sys
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from .config import ModelConfig
from .digest import sha256_files
from .devices import check_float32_fits
from .errors import LocalLLMError
from .progress import follow_rule_in_transformers, progress

MANIFEST = "localllm.json"  # marks a quantized localllm model folder


def is_model_folder(path: Path) -> bool:
    """Whether path is a quantized localllm model folder (what `localllm quantize` writes), not a source checkpoint."""
    return path.is_dir() and (path / MANIFEST).exists()


def _expected(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor the config calls for in a Llama-family model -> its shape."""
    D, inter, V, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.q_size, cfg.kv_size
    layer = {"self_attn.q_proj.weight": (q, D), "self_attn.k_proj.weight": (kv, D),
             "self_attn.v_proj.weight": (kv, D), "self_attn.o_proj.weight": (D, q),
             "mlp.gate_proj.weight": (inter, D), "mlp.up_proj.weight": (inter, D), "mlp.down_proj.weight": (D, inter),
             "input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,)}
    if cfg.qkv_bias:
        layer |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
    out = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (V, D)
    out |= {f"model.layers.{i}.{n}": shape for i in range(cfg.num_layers) for n, shape in layer.items()}
    return out


@dataclass
class Checkpoint:
    config: ModelConfig
    tokenizer: object
    source: dict                       # where it came from: {"format", "path", ["gguf_file"], ["hub_id"]}
    files: list[Path]                  # weight files, for the fingerprint
    get: Callable[[str], torch.Tensor] # Hugging Face tensor name -> tensor
    names: set = field(default_factory=set)
    end_tokens: list[int] = field(default_factory=list)  # a GGUF's end-of-turn / end-of-message tokens
    # tensors as empty meta tensors of their config's shapes, none read: what a model built from it weighs
    # (`localllm info`), without the minutes and the float32 copy of reading it
    shapes_only: bool = False

    @property
    def eos_ids(self) -> list[int]:
        """Tokens that end a reply: the tokenizer's EOS plus generation_config.json's (Llama 3 has several), or
        config.json's where there is no generation_config.json (as transformers takes them); a GGUF's end_tokens."""
        ids = {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        ids |= set(self.end_tokens)
        if self.source["format"] == "safetensors":
            gen = Path(self.source["path"]) / "generation_config.json"
            f = gen if gen.exists() else gen.with_name("config.json")
            e = _read_json(f).get("eos_token_id")
            try:
                ids |= {int(i) for i in (e if isinstance(e, list) else [e] if e is not None else [])}
            except (TypeError, ValueError):
                raise LocalLLMError(f"{f} has eos_token_id {e!r}, not token ids; re-download the checkpoint") \
                    from None
        return sorted(ids)

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise LocalLLMError(f"checkpoint {self.source['path']} lacks tensor '{name}': the files are incomplete "
                                "or from another architecture; re-download the checkpoint")
        want = self.expected.get(name)
        if self.shapes_only:
            return torch.empty(want, device="meta")
        t = self.get(name)
        if want is not None and tuple(t.shape) != want:
            raise LocalLLMError(f"checkpoint {self.source['path']}: tensor '{name}' is {tuple(t.shape)}, but its "
                                f"config makes it {want}: the config and the weights are of different models; "
                                "re-download the checkpoint")
        t = t.float()
        if not torch.isfinite(t).all():  # else quantized into NaN scales, or a model whose every reply is empty
            raise LocalLLMError(f"checkpoint {self.source['path']}: tensor '{name}' holds NaN or inf values: the file "
                                "is damaged; re-download the checkpoint")
        return t

    def block_tensors(self, i: int) -> dict:
        """Fused weights of block i, as model.build_block takes them."""
        p = f"model.layers.{i}."
        t = lambda n: self.tensor(p + n)  # noqa: E731
        att, mlp = "self_attn.", "mlp."
        qkv_bias = None
        if self.config.qkv_bias:
            qkv_bias = torch.cat([t(att + f"{n}_proj.bias") for n in "qkv"])
        return {
            "attn_norm": t("input_layernorm.weight"),
            "mlp_norm": t("post_attention_layernorm.weight"),
            "qkv": {"weight": torch.cat([t(att + f"{n}_proj.weight") for n in "qkv"]), "bias": qkv_bias},
            "o": {"weight": t(att + "o_proj.weight")},
            "gate_up": {"weight": torch.cat([t(mlp + "gate_proj.weight"), t(mlp + "up_proj.weight")])},
            "down": {"weight": t(mlp + "down_proj.weight")},
        }

    def embed(self) -> torch.Tensor:
        return self.tensor("model.embed_tokens.weight")

    def final_norm(self) -> torch.Tensor:
        return self.tensor("model.norm.weight")

    def lm_head(self) -> torch.Tensor | None:
        """None when the output projection is tied to the embeddings."""
        if self.config.tie_word_embeddings:
            return None
        return self.tensor("lm_head.weight")  # an untied checkpoint without it is incomplete

    @functools.cached_property
    def expected(self) -> dict[str, tuple[int, ...]]:
        """The tensors its config calls for, and their shapes."""
        return _expected(self.config)

    def check_complete(self) -> None:
        """Refuse, in one line, a checkpoint that lacks a tensor its config calls for (before long work reads them
        block by block, not at its end)."""
        missing = [n for n in self.expected if n not in self.names]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise LocalLLMError(f"checkpoint {self.source['path']} lacks tensor '{missing[0]}'{more}: the files are "
                                "incomplete or from another architecture; re-download the checkpoint")

    def fingerprint(self) -> str:
        return fingerprint(self.files)


def fingerprint(files: list[Path]) -> str:
    """sha256 over a checkpoint's weight files (names + contents): names a source model in manifests and profiles."""
    digests = sha256_files(files, "hashing source")
    return hashlib.sha256("".join(f"{f.name}:{d}\n" for f, d in zip(files, digests)).encode()).hexdigest()


def open_checkpoint(src: str | os.PathLike, gguf_file: str | None = None, shapes_only: bool = False) -> Checkpoint:
    """Open `src`: a .gguf file, a folder (safetensors or GGUF), or a Hugging Face hub id. shapes_only: for its
    sizes alone (Checkpoint.shapes_only); a GGUF's weights then go undequantized, and its tensors are taken to be
    the ones its config calls for (transformers names them only as it dequantizes them)."""
    ckpt = _open(src, gguf_file, shapes_only)
    ckpt.shapes_only = shapes_only
    return ckpt


def _open(src: str | os.PathLike, gguf_file: str | None, shapes_only: bool) -> Checkpoint:
    check_path_text(src)
    path = Path(src).expanduser()
    if path.is_file():
        _check_kind(path)
        _check_gguf_name(path, gguf_file)
        return _open_gguf(path.parent, path.name, shapes_only)
    if path.is_dir():
        if is_model_folder(path):
            raise LocalLLMError(f"{path} is already a quantized localllm model; use it directly "
                                f"(e.g. `localllm generate {path} ...`)")
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if gguf_file or (ggufs and not list(path.glob("*.safetensors"))):
            if not gguf_file and len(ggufs) > 1:
                raise LocalLLMError(f"{path} holds several GGUF files ({', '.join(ggufs)}); pass one with --gguf-file, "
                                    "or the .gguf file's own path in place of the folder")
            return _open_gguf(path, gguf_file or ggufs[0], shapes_only)
        return _open_safetensors(path, {"format": "safetensors", "path": str(path.resolve())})
    if not _looks_like_hub_id(str(src)):
        raise _no_source(src)
    local = _download(str(src))
    return _open_safetensors(local, {"format": "safetensors", "path": str(local), "hub_id": str(src)})


def check_source(src: str | os.PathLike, kind: bool = False, gguf_file: str | None = None) -> None:
    """Raise the user's error now if `src` is neither a path here nor a hub id (so that a command taking two models
    fails before loading the first); kind: nor a path of a kind a model is (a .gguf file, a folder with a config,
    GGUF files or a localllm manifest), nor a .gguf file that --gguf-file names otherwise, as the chat checks before
    its app starts."""
    path = Path(src).expanduser()
    if not exists(path) and not _looks_like_hub_id(str(src)):
        raise _no_source(src)
    if kind and exists(path):
        _check_kind(path)
        if path.is_file():
            _check_gguf_name(path, gguf_file)


def _check_gguf_name(path: Path, gguf_file: str | None) -> None:
    if gguf_file and gguf_file != path.name:
        raise LocalLLMError(f"--gguf-file {gguf_file} names another file than {path}: pass the file, or its folder "
                            "with --gguf-file")


def _check_kind(path: Path) -> None:
    """Refuse a file that is not a .gguf, or a folder that holds no model, in one line."""
    if path.is_file() and path.suffix.lower() != ".gguf":
        raise LocalLLMError(f"{path} is a file but not a .gguf; pass a .gguf file or a checkpoint folder")
    if path.is_dir() and not any((path / n).exists() for n in (MANIFEST, "config.json")) and \
            not any(path.glob("*.gguf")):
        raise _no_config(path)


def _no_config(path: Path) -> LocalLLMError:
    if (path / "residuals.safetensors").exists() or (path / "calibration.safetensors").exists():
        return LocalLLMError(f"{path} looks like a localllm model whose {MANIFEST} is gone; re-run `localllm "
                             "quantize` on its source (the manifest holds its configuration and file digests)")
    return LocalLLMError(f"{path} has no config.json; pass a Hugging Face checkpoint folder or a .gguf file")


def check_path_text(path) -> None:
    """Refuse in one line a path whose name is not UTF-8 (bytes that decode to no character): safetensors and the
    tokenizers read files by UTF-8 names, and would call the files corrupt; or one with a name longer than file
    systems hold (the OS would say "File name too long" from deep inside a load)."""
    try:
        os.fsdecode(path).encode("utf-8")
    except UnicodeEncodeError:
        raise LocalLLMError(f"the path {os.fsdecode(path)!r} is not valid UTF-8 (a name in another encoding): rename "
                            "or move it") from None
    if any(len(os.fsencode(part)) > NAME_MAX for part in Path(path).parts):
        text = os.fsdecode(path)
        raise LocalLLMError(f"no such file or folder: {text[:60]!r}... (a name in it is longer than the "
                            f"{NAME_MAX} bytes file systems hold)")


NAME_MAX = 255  # bytes in one file or folder name (ext4, NTFS, APFS)


def exists(path) -> bool:
    """Whether `path` exists; False also for a name no file system holds (Path.exists raises there), e.g. a long
    prompt where a command's first argument may be a model path or the prompt."""
    try:
        return Path(path).expanduser().exists()
    except OSError:
        return False


def _no_source(src) -> LocalLLMError:
    return LocalLLMError(f"no such file or folder: {src}; pass a checkpoint folder, a .gguf file or a hub id "
                         "(org/name)")


def _looks_like_hub_id(s: str) -> bool:
    parts = s.split("/")
    return len(parts) == 2 and all(parts) and not s.startswith((".", "~")) and not s.lower().endswith(".gguf")


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
        # not consolidated*.safetensors: Mistral's repos hold the whole model again in its own format
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model",
                                                               "*.jinja"], ignore_patterns=["consolidated*"]))
    except Exception as e:  # offline, unknown repo, gated repo: all the same advice
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        first = first if len(first) <= 160 else first[:160].rsplit(" ", 1)[0] + " ..."  # (whole words)
        raise LocalLLMError(f"'{repo_id}' is not a local path and could not be fetched from the Hugging Face hub "
                            f"({first}); download the checkpoint and pass its folder") from None


def tokenizer_of(path: Path, vocab_size: int, **kw):
    """The tokenizer of a checkpoint or quantized model folder (or of a GGUF file in it: gguf_file=) whose model has
    vocab_size embeddings, or a one-line error where its files are missing, damaged or of another model."""
    from transformers import AutoTokenizer
    names = ("tokenizer.json", "tokenizer.model", "vocab.json")  # (tokenizer_config.json alone makes 3 tokens)
    folder = "gguf_file" not in kw and Path(path).is_dir()  # (a GGUF's tokenizer is in the file)
    if folder and not any((Path(path) / n).exists() for n in names):
        raise LocalLLMError(f"{path} holds no tokenizer vocabulary: copy the model's tokenizer.json (or "
                            "tokenizer.model) and tokenizer_config.json into it from its source")
    if folder and (Path(path) / "tokenizer.model").exists() and not (Path(path) / "tokenizer.json").exists() and \
            not _sentencepiece():
        raise LocalLLMError(f"{path}'s tokenizer is tokenizer.model (SentencePiece) alone, which transformers reads "
                            "only with `pip install sentencepiece protobuf`; install them, or put the model's "
                            "tokenizer.json beside it")
    try:
        # no "clean-up" of decoded text: it strips spaces before punctuation, which BPE tokens spell on purpose
        # (transformers skips it for BPE anyway, with a warning on every run)
        tok = AutoTokenizer.from_pretrained(str(path), clean_up_tokenization_spaces=False, **kw)
    except Exception as e:
        why = " ".join(str(e).split())[:160]  # one line
        raise LocalLLMError(f"cannot load the tokenizer from {path} ({type(e).__name__}: {why}); the folder needs "
                            "intact tokenizer files (tokenizer.json or tokenizer.model, tokenizer_config.json) and, "
                            "for a checkpoint, a valid config.json: copy them again from the source") from None
    if len(tok) < min(256, vocab_size // 2):  # (bytes alone are 256 tokens; tokenizer_config.json alone makes 3)
        raise LocalLLMError(f"the tokenizer in {path} knows {len(tok)} tokens, its model {vocab_size}: the tokenizer "
                            "files are damaged or of another model; copy the model's own from its source")
    return tok


def check_token_ids(ids, vocab_size: int) -> None:
    """One line where a tokenizer made an id past the model's embeddings (else an IndexError, or on a GPU a
    device-side assert)."""
    top = max(ids, default=-1) if isinstance(ids, list) else int(ids.max()) if ids.numel() else -1
    if top >= vocab_size:
        raise LocalLLMError(f"the tokenizer made token id {top}, past the model's vocabulary of {vocab_size}: the "
                            "tokenizer files are not this model's (or a token was added without resizing the "
                            "embeddings); use the model's own tokenizer files")


def _sentencepiece() -> bool:
    """Whether transformers can read a tokenizer.model (its SentencePiece conversion needs both)."""
    try:
        import google.protobuf  # noqa: F401
        import sentencepiece  # noqa: F401
    except ImportError:
        return False
    return True


def _open_safetensors(path: Path, source: dict) -> Checkpoint:
    from safetensors import SafetensorError, safe_open
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise _no_config(path)
    raw = _read_json(cfg_file)
    key = next((k for k in ("quantization_config", "quantization") if raw.get(k)), None)  # (MLX's: "quantization")
    if key:  # its weights are codes with scales beside them, which these layers would read as plain numbers
        qc = raw[key]
        how = qc.get("quant_method", "mlx" if key == "quantization" else "?") if isinstance(qc, dict) else "?"
        raise LocalLLMError(f"{path} is already quantized ({how}, its config.json's {key}): localllm "
                            "quantizes from the float checkpoint; pass the unquantized model (bf16/fp16/fp32)")
    config = ModelConfig.from_hf(raw)
    try:  # transformers' own checks of the config, before the tokenizer (which reads it too) reports them as its own
        from transformers import AutoConfig
        AutoConfig.from_pretrained(str(path))
    except Exception as e:
        first = (str(e).splitlines() or [""])[0][:160]
        raise LocalLLMError(f"{cfg_file} is not a config transformers accepts ({type(e).__name__}: {first}); fix it "
                            "or re-download the checkpoint") from None
    files = _weight_files(path)
    if not files:
        hint = " (pickled .bin weights are not loaded, for safety: convert them to safetensors)" \
            if list(path.glob("*.bin")) else " (Mistral's own consolidated.safetensors is not read: the Hugging " \
            "Face format's model*.safetensors is)" if (path / "consolidated.safetensors").exists() else ""
        raise LocalLLMError(f"{path} has no Hugging Face .safetensors weight files{hint}")
    where: dict[str, object] = {}
    file_of: dict[str, Path] = {}
    for f in files:
        try:
            h = safe_open(str(f), framework="pt")
        except (SafetensorError, OSError, ValueError) as e:
            raise LocalLLMError(f"corrupt or truncated weight file {f} ({e}); re-download it") from None
        for k in h.keys():
            if k in file_of:  # two copies (e.g. an old export beside the new): which one is the model's is not known
                raise LocalLLMError(f"{file_of[k].name} and {f.name} in {path} both hold {k}: two models' weights in "
                                    "one folder; move the one that is not this model's out of it")
            where[k], file_of[k] = h, f
    layers = {int(k.split(".")[2]) for k in where if k.startswith("model.layers.") and k.split(".")[2].isdigit()}
    if layers and max(layers) >= config.num_layers:
        raise LocalLLMError(f"{path}'s weights hold {max(layers) + 1} decoder layers, its config.json "
                            f"{config.num_layers} (num_hidden_layers): they are of different models; re-download the "
                            "checkpoint")

    def get(name: str) -> torch.Tensor:
        try:
            return where[name].get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise LocalLLMError(f"cannot read tensor {name} from {path} ({e}); the file is corrupt, re-download it") \
                from None

    if config.tie_word_embeddings and "lm_head.weight" in where and "model.embed_tokens.weight" in where \
            and not torch.equal(get("lm_head.weight"), get("model.embed_tokens.weight")):
        # as transformers does: a head that differs from the embeddings is the model's, whatever the config says
        print(f"localllm: warning: {path} says its output head is tied to the embeddings, but its lm_head.weight "
              "differs from them: using lm_head.weight", file=sys.stderr)
        config = replace(config, tie_word_embeddings=False)
    ckpt = Checkpoint(config, tokenizer_of(path, config.vocab_size), source, files, get, set(where))
    ckpt.check_complete()
    ckpt.eos_ids  # (a damaged generation_config.json: said now, not after the work)
    return ckpt


def _read_json(f: Path) -> dict:
    try:
        d = json.loads(f.read_text())
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested past Python's stack
        raise LocalLLMError(f"{f} is not valid JSON ({type(e).__name__}: {str(e)[:120]}); re-download the "
                            "checkpoint") from None
    if not isinstance(d, dict):
        raise LocalLLMError(f"{f} holds no JSON object; re-download the checkpoint")
    return d


def _weight_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files, as transformers picks them: model.safetensors, else the shards its index
    names, else every one but consolidated* (Mistral's repos hold the whole model again in its own format)."""
    index = path / "model.safetensors.index.json"
    if (path / "model.safetensors").exists():
        return [path / "model.safetensors"]
    if not index.exists():
        return sorted(f for f in path.glob("*.safetensors") if not f.name.startswith("consolidated"))
    wmap = _read_json(index).get("weight_map")
    if not (isinstance(wmap, dict) and wmap and all(isinstance(v, str) for v in wmap.values())):
        raise LocalLLMError(f"{index} has no weight_map of tensor names to file names: it is damaged; re-download "
                            "the checkpoint")
    files = sorted({path / name for name in wmap.values()})
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise LocalLLMError(f"{path} lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}, named by "
                            f"{index.name}: the download is incomplete; re-download the checkpoint")
    return files


def _gguf_rope_scaling(f: Path) -> dict:
    """llama.cpp's RoPE scaling, which transformers' GGUF import drops: Llama 3.1+'s per-frequency divisors (the
    rope_freqs tensor) or linear's rope.scaling keys, as ModelConfig's rope_scaling ({} for none). Their names are in
    the header: one look at its first bytes, and the (slow) parse only where they are."""
    if not _in_gguf_header(f, (b"rope_freqs.weight", b".rope.scaling.type")):
        return {}
    from gguf import GGUFReader
    try:
        r = GGUFReader(str(f))
        freqs = next((t for t in r.tensors if t.name == "rope_freqs.weight"), None)
        if freqs is not None:
            return {"rope_type": "factors", "factors": [float(v) for v in freqs.data]}
        field = lambda key: next(v.parts[v.data[0]] for k, v in r.fields.items() if k.endswith(key))  # noqa: E731
        kind = bytes(field(".rope.scaling.type")).decode()
        factor = float(field(".rope.scaling.factor")[0]) if kind == "linear" else None
    except Exception as e:  # noqa: BLE001 - whatever a damaged file raises
        raise _unreadable_gguf(f, e) from None
    if kind == "none":
        return {}
    if kind != "linear":
        raise LocalLLMError(f"{f} scales its RoPE by {kind}, which localllm does not run (default, linear and Llama "
                            "3.1+ RoPE); pick another file of the model")
    return {"rope_type": "linear", "factor": factor}


def _in_gguf_header(f: Path, keys: tuple[bytes, ...]) -> bool:
    """Whether any of the keys (metadata or tensor names) is in the file's header: one look at its first bytes, so
    that the (slow) parse runs only where they are."""
    import mmap
    if f.stat().st_size == 0:
        return False  # (nothing to map: transformers' reading refuses it)
    with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
        head = min(len(m), 64 << 20)  # the header (metadata, tokenizer, tensor names) is well inside this
        return any(m.find(key, 0, head) >= 0 for key in keys)


END_TOKEN_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def _gguf_end_tokens(f: Path) -> list[int]:
    """llama.cpp's end-of-turn and end-of-message tokens, which transformers' GGUF import drops: a chat model whose
    EOS is not its template's end of turn (early Llama 3 conversions: EOS 128001, end of turn 128009) would run on
    past its turn into invented ones."""
    if not _in_gguf_header(f, tuple(k.encode() for k in END_TOKEN_KEYS)):
        return []
    from gguf import GGUFReader
    try:
        fields = GGUFReader(str(f)).fields
        return sorted(int(fields[k].parts[fields[k].data[0]][0]) for k in END_TOKEN_KEYS if k in fields)
    except Exception as e:  # noqa: BLE001 - whatever a damaged file raises
        raise _unreadable_gguf(f, e) from None


def _unreadable_gguf(f: Path, e: Exception) -> LocalLLMError:
    return LocalLLMError(f"cannot read GGUF file {f} ({type(e).__name__}: {str(e)[:160]}); it is corrupt or truncated "
                         "(re-download it), or of an architecture transformers cannot import (localllm runs Llama, "
                         "Mistral and Qwen2 GGUFs)")


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers parses a GGUF file anew for its config, its tokenizer and its weights (the tokenizer's fields:
    seconds each), turns its metadata fields into a config and tokenizer dict for the first two, and builds gguf's
    tensor-name map once per submodule of the model. While this is open, one parse per file, one metadata dict (a
    copy to each caller) and one map per (architecture, layers) serve every call: the demo model's GGUF opens in ~7 s
    instead of ~17 on two cores. The parses and maps are only read. Process-wide while a GGUF loads (gguf's and
    transformers' own names are what transformers imports at each call)."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf
    with _GGUF_PATCH:  # (the originals read under it too)
        reader, name_map, hf_load = gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint
        parsed, metadata = {}, {}

        def parse(path, mode="r"):
            key = (str(path), mode)
            if key not in parsed:
                parsed[key] = reader(path, mode)
            return parsed[key]

        def load(path, return_tensors=False, **kw):  # the config's and the tokenizer's calls: ~1.5 s of fields each
            if return_tensors or kw:
                return hf_load(path, return_tensors, **kw)
            if str(path) not in metadata:
                metadata[str(path)] = hf_load(path, False)
            return copy.deepcopy(metadata[str(path)])  # (callers may change what they get)
        gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint = parse, functools.cache(name_map), load
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint = reader, name_map, hf_load


# one GGUF load patches at a time: a second one at once would take the first's patch for the original, and restore it
# for good (every later GGUF's parse kept, its file mapped, ~400 MB a demo load)
_GGUF_PATCH = threading.RLock()


def _open_gguf(folder: Path, name: str, shapes_only: bool = False) -> Checkpoint:
    # seconds pass before the weights' own bar (the demo's 135M: ~8 s on two cores): their stages, so something shows
    with _gguf_parsed_once(), progress(total=4, desc=f"reading {name} (metadata)", unit="step",
                                       bar_format="{desc}: {n_fmt}/{total_fmt} [{elapsed}]") as bar:
        def done(then: str) -> None:
            bar.update()
            bar.set_description_str(f"reading {name} ({then})")
        return _read_gguf(folder, name, done, shapes_only)


def _read_gguf(folder: Path, name: str, done: Callable[[str], None], shapes_only: bool = False) -> Checkpoint:
    """done(the next stage's name) after each stage."""
    f = folder / name
    if not f.exists():
        here = sorted(p.name for p in folder.glob("*.gguf"))
        raise LocalLLMError(f"no GGUF file {f}" + (f"; {folder} holds {', '.join(here)}" if here else ""))
    split = re.search(r"-(\d{5})-of-(\d{5})\.gguf$", name, re.IGNORECASE)
    if split and int(split[2]) > 1:
        raise LocalLLMError(f"{f} is part {int(split[1])} of a GGUF split into {int(split[2])} files: merge them "
                            "(llama.cpp's `llama-gguf-split --merge FIRST_PART merged.gguf`) and pass the merged file")
    scaling = _gguf_rope_scaling(f)
    done("config")
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
        hf_config = AutoConfig.from_pretrained(str(folder), gguf_file=name)
    except Exception as e:
        raise _unreadable_gguf(f, e) from None
    done("tokenizer")
    try:  # before the weights, which take minutes to dequantize on a large model
        tokenizer = tokenizer_of(folder, hf_config.vocab_size, gguf_file=name)
    except LocalLLMError:
        raise LocalLLMError(f"{f} holds no tokenizer transformers can read (its tokenizer.ggml.* keys): put the "
                            "model's tokenizer.json and tokenizer_config.json beside it") from None
    hf = hf_config.to_dict()
    if scaling:  # transformers' import leaves it out (its own model of this file runs without it)
        hf["rope_parameters"] = {**(hf.get("rope_parameters") or hf.get("rope_scaling") or {}), **scaling}
    config = ModelConfig.from_hf(hf)
    source = {"format": "gguf", "path": str(Path(folder).resolve()), "gguf_file": name}
    if shapes_only:
        return Checkpoint(config, tokenizer, source, [f], _unread, set(_expected(config)), _gguf_end_tokens(f))
    check_float32_fits(config, "free host memory, or use a smaller model: transformers dequantizes a GGUF's blocks "
                               "all at once")  # before it does
    done("weights")
    try:
        with follow_rule_in_transformers():  # transformers shows its own progress bars while it dequantizes
            # config= spares building the config again
            model, info = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=name, config=hf_config,
                                                               dtype=torch.float32, output_loading_info=True)
    except Exception as e:
        raise LocalLLMError(f"cannot load GGUF weights from {f} ({type(e).__name__}: {str(e)[:160]}); "
                            "the file is corrupt or truncated, re-download it") from None
    missing = sorted(info.get("missing_keys") or [])
    if missing:  # transformers fills them with random values
        raise LocalLLMError(f"{f} lacks {len(missing)} of the model's tensors (e.g. {missing[0]}): the file is "
                            "incomplete; re-download it")
    state = model.state_dict()
    done("weights read")
    return Checkpoint(config, tokenizer, source, [f], state.__getitem__, set(state), _gguf_end_tokens(f))


def _unread(name: str) -> torch.Tensor:
    raise AssertionError(f"{name}: a shapes_only checkpoint reads no weight")
