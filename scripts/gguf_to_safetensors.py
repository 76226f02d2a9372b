"""A GGUF model as a float32 safetensors checkpoint folder (config.json, tokenizer, weights in a few shards).

localllm reads a GGUF through transformers, which dequantizes the whole model into memory and keeps it there while
it quantizes or evaluates; a safetensors folder is read a block at a time. On a machine with little RAM, convert a
large GGUF once (this holds it in memory once), then pass the folder to `localllm quantize` or `localllm report`.

    python scripts/gguf_to_safetensors.py MODEL.gguf OUT_FOLDER
"""
import sys
from pathlib import Path

from safetensors.torch import save_file
from transformers import AutoConfig, AutoTokenizer

from localllm import atomic
from localllm.errors import LocalLLMError, script_main
from localllm.loader import open_checkpoint

LAYERS_PER_SHARD = 7


def main(src: Path, out: Path) -> None:
    atomic.check_writable(out)
    if out.exists():
        raise LocalLLMError(f"{out} already exists; choose another output folder")
    ckpt = open_checkpoint(str(src))
    cfg = AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name)
    with atomic.new_folder(out) as tmp:  # whole or not at all: an interrupted run leaves nothing to refuse later
        write(ckpt, cfg, src, tmp)


def write(ckpt, cfg, src: Path, out: Path) -> None:
    cfg.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name).save_pretrained(str(out))
    shards: dict[str, list[str]] = {}
    for name in sorted(ckpt.names):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # the same tensor as the embeddings
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        shards.setdefault("rest" if layer is None else f"layers{int(layer) // LAYERS_PER_SHARD}", []).append(name)
    for shard, names in shards.items():
        save_file({n: ckpt.get(n).float().contiguous() for n in names}, str(out / f"model-{shard}.safetensors"))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    script_main(main, Path(sys.argv[1]), Path(sys.argv[2]))
