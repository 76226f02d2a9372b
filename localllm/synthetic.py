"""Random-weight checkpoints for the tests and benchmarks: real shapes, a small trained tokenizer, no meaning (never
evidence of quality)."""
from __future__ import annotations

from pathlib import Path

import torch

from . import texts

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIALS = ["<s>", "</s>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]


def tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer of `vocab_size` tokens, trained on the shipped calibration text, with a chat
    template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    text = texts.shipped("calibration.txt")
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text.split("\n\n"), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|end|>",
                                   additional_special_tokens=SPECIALS[3:])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def checkpoint(path: Path, arch: str = "llama", seed: int = 0, std: float = 0.08, tokenizer_vocab: int | None = None,
               dtype: torch.dtype = torch.float32, **config) -> Path:
    """A Hugging Face checkpoint folder (safetensors, config, tokenizer) of model type `arch` with `config`; every
    matrix and bias drawn from N(0, std) (larger than the initializer's, so that layers matter), every norm weight
    from N(1, 0.1) (not all ones and zeros, so that one left out or misplaced shows). The tokenizer has
    min(vocab_size, tokenizer_vocab) tokens (default: vocab_size)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model(arch, **config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 or name.endswith(".bias"):
                p.normal_(0, std)
            else:
                p.normal_(1, 0.1)
    model.save_pretrained(str(path))
    tokenizer(min(cfg.vocab_size, tokenizer_vocab or cfg.vocab_size)).save_pretrained(str(path))
    return path
