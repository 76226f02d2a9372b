"""Random-weight models for the tests and benchmarks: checkpoint folders (real shapes, a small trained tokenizer) and,
on a GPU, quantized decoders made in memory (random_model, random_local_model). No meaning: never evidence of
quality."""
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


# Random decoders made on the GPU (bench, the GPU tests, scripts/kernel_ab.py)

def random_codes(N: int, K: int, bits: int, dev) -> torch.Tensor:
    """Uniform random codes, packed: random words (quant.pack_codes writes each bit of a word once, so every word is
    some codes), without the unpacked int64 codes an 8 GB GPU has no room for beside an 8B model."""
    return torch.randint(-2**31, 2**31 - 1, (N // 16, K * bits // 2), dtype=torch.int32, device=dev)


def random_quant(N: int, K: int, bits: int, group_size: int, dev):
    """Random codes with scales that keep W x at about unit scale for unit x."""
    from .quant import QuantWeight
    G = -(-K // group_size)
    q = random_codes(N, K, bits, dev)
    scales = (torch.rand(N, G, device=dev) * 2 / (2**bits * K**0.5)).half()
    zeros = torch.full((N, G), 2 ** (bits - 1), device=dev, dtype=torch.uint8)
    return QuantWeight(q, scales, zeros, bits, group_size, K)


def random_lut(N: int, K: int, bits: int, dev):
    """A random table (SqueezeLLM-format, grouped as `quantize --method squeezellm` makes them) weight: random codes,
    each row's 2^bits entries sorted uniform draws in the groups' unit, group scales as random_quant's."""
    from .quant import TABLE_GROUP, QuantLUT
    G = -(-K // TABLE_GROUP)
    scales = (torch.rand(N, G, device=dev) * 2 / (2**bits * K**0.5)).half()
    return QuantLUT(random_codes(N, K, bits, dev),
                    (torch.rand(N, 2**bits, device=dev).sort(1).values * (2**bits - 1)).half(), bits, K,
                    scales, (-scales.float() * 2 ** (bits - 1)).half(), TABLE_GROUP)


LLAMA3_8B_CONFIG = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                        num_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position_embeddings=8192)


def random_model(cfg, bits: int | None, group_size: int = 128, head_bits: int | None = None, table: bool = False):
    """A decoder of cfg's shapes with random weights made on the GPU: packed `bits`-bit (table: SqueezeLLM-format
    tables, else group-wise uniform), or dense fp16 (None); the output head fp16 (head_bits 16) or 8-bit
    (quant.HEAD_BITS), by default as `localllm quantize` writes a model of those bits (8-bit; a dense one: fp16)."""
    from .model import KINDS, QdecSettings, RMSNorm, Transformer, build_block
    from .modelfile import linear_shape
    from .quant import HEAD_BITS, HEAD_GROUP
    if head_bits is None:
        head_bits = 16 if bits is None else HEAD_BITS
    dev, D = torch.device("cuda"), cfg.hidden_size
    settings = QdecSettings()
    blocks = []
    for i in range(cfg.num_layers):
        t = {"attn_norm": torch.ones(D, device=dev), "mlp_norm": torch.ones(D, device=dev)}
        for kind in KINDS:
            N, K = linear_shape(cfg, kind)
            if bits is None:
                t[kind] = {"weight": torch.randn(N, K, device=dev, dtype=torch.float16) * K ** -0.5}
            else:
                q = random_lut(N, K, bits, dev) if table else random_quant(N, K, bits, group_size, dev)
                t[kind] = {"quant": q}
        blk = build_block(cfg, i, t, settings)
        for lin in (blk.qkv, blk.o, blk.gate_up, blk.down):
            lin.place(dev, torch.float16)
        blocks.append(blk)
    embed = torch.randn(cfg.vocab_size, D, device=dev, dtype=torch.float16)
    lm_head = torch.randn(cfg.vocab_size, D, device=dev, dtype=torch.float16) * D ** -0.5 if head_bits == 16 else \
        random_quant(cfg.vocab_size, D, head_bits, HEAD_GROUP, dev)
    return Transformer(cfg, embed, blocks, RMSNorm(torch.ones(D, device=dev), cfg.rms_norm_eps), lm_head,
                       settings).place(dev).eval()


def random_qdec(model, copies: int = 1, kmax: int = 256) -> None:
    """Give every linear of a random_model random 4-bit residuals, pinned (`copies` distinct ones per kind, cycled
    over the layers: pinning one per layer of an 8B shape would take minutes), and calibration-like statistics
    (ActStats over random inputs with 2% outliers at 8x, as real activations have)."""
    from .kernels import qdec
    from .model import KINDS
    from .modelfile import linear_shape
    from .qdec import ActStats
    from .quant import QuantResidual
    cfg = model.cfg
    res, host, stats = {}, {}, {}
    for kind in KINDS:
        N, K = linear_shape(cfg, kind)
        res[kind] = [QuantResidual(torch.randint(-2**31, 2**31 - 1, (K, N // 8), dtype=torch.int32),
                                   (torch.rand(N) * 0.01).half()) for _ in range(copies)]
        host[kind] = [qdec.HostResidual.pin(r) for r in res[kind]]
        res[kind] = [QuantResidual(h.codes, h.scales) for h in host[kind]]  # one copy, pinned (qdec.pin)
        stats[kind] = ActStats(K, kmax)
        x = torch.randn(64, K)
        stats[kind].update(x * torch.where(torch.rand(64, K) < 0.02, 8.0, 1.0))
    for i, blk in enumerate(model.blocks):
        for kind in KINDS:
            lin = getattr(blk, kind)
            lin.residual, lin.host_residual, lin.stats = res[kind][i % copies], host[kind][i % copies], stats[kind]


def random_local_model(cfg, bits: int, copies: int = 4, table: bool = False):
    """A random_model with random_qdec, as a runtime.LocalModel (no tokenizer): what `bench tune` tunes. Its folder
    (where tuning writes profiles) is a temp folder, removed when the model goes."""
    import shutil
    import tempfile
    import weakref

    from .runtime import LocalModel
    m = random_model(cfg, bits, table=table)
    random_qdec(m, copies)
    manifest = {"model_id": f"random-{cfg.num_layers}x{cfg.hidden_size}-w{bits}", "quant": {"bits": bits},
                "calibration": {"kmax": 256}}
    lm = LocalModel(m, None, manifest, tempfile.mkdtemp(prefix="localllm-random-"), [])
    weakref.finalize(lm, shutil.rmtree, lm.path, True)
    lm.set_qdec("off")
    return lm
