"""GGUF files as llama.cpp writes them (tiny, float32, written here): what loads, and what is refused in one line."""
import json

import numpy as np
import pytest
import torch

from conftest import make_checkpoint
from localllm.errors import LocalLLMError
from localllm.loader import open_checkpoint
from localllm.progress import observe
from localllm.runtime import load

BLOCK = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}


def write_gguf(ckpt, out, drop=(), rope_freqs=None, linear=None, tokenizer=True, end_tokens=()):
    """A llama.cpp-style float32 GGUF of a tiny Llama checkpoint folder: its names, its Q/K row order, a BPE
    tokenizer; `drop` leaves tensors out (GGUF names), rope_freqs / linear write llama.cpp's RoPE scaling,
    end_tokens (token texts) its end-of-turn and end-of-message tokens."""
    import gguf
    from safetensors.torch import load_file
    cfg = json.loads((ckpt / "config.json").read_text())
    w = gguf.GGUFWriter(str(out), "llama")
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w.add_block_count(cfg["num_hidden_layers"]), w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"]), w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads), w.add_head_count_kv(kv), w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta") or 10000.0
    w.add_rope_freq_base(float(theta)), w.add_rope_dimension_count(cfg["hidden_size"] // heads)
    w.add_vocab_size(cfg["vocab_size"]), w.add_file_type(0)
    if tokenizer:
        tj = json.loads((ckpt / "tokenizer.json").read_text())
        vocab = {**tj["model"]["vocab"], **{t["content"]: t["id"] for t in tj["added_tokens"]}}
        toks = [f"[PAD{i}]" for i in range(cfg["vocab_size"])]
        for s, i in vocab.items():
            toks[i] = s
        special = {t["id"] for t in tj["added_tokens"]}
        w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("default"), w.add_token_list(toks)
        w.add_token_types([3 if i in special else 1 if toks[i] in vocab else 4 for i in range(len(toks))])
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
        w.add_bos_token_id(vocab["<s>"]), w.add_eos_token_id(vocab["<|end|>"]), w.add_add_bos_token(False)
        for add, t in zip((w.add_eot_token_id, w.add_eom_token_id), end_tokens):
            add(vocab[t])

    def permute(x, n):  # llama.cpp's order of q and k rows (transformers undoes it)
        return x.reshape(n, 2, x.shape[0] // n // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    for k, t in load_file(str(ckpt / "model.safetensors")).items():
        p = k.split(".")
        name = TOP.get(k) or f"blk.{p[2]}.{BLOCK['.'.join(p[3:-1])]}.{p[-1]}"
        x = t.float().numpy()
        if k.endswith(("q_proj.weight", "k_proj.weight")):
            x = permute(x, heads if "q_proj" in k else kv)
        if name not in drop:
            w.add_tensor(name, np.ascontiguousarray(x, dtype=np.float32))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    if linear is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR), w.add_rope_scaling_factor(linear)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("g") / "ck")


def test_a_llama_cpp_gguf_runs_as_its_source(ckpt, tmp_path):
    f = write_gguf(ckpt, tmp_path / "tiny-F32.gguf")
    ids = torch.tensor([[3, 17, 42, 99, 5]])
    with torch.no_grad():
        assert (load(f).model(ids) - load(ckpt).model(ids)).abs().max() < 1e-4


def test_info_of_a_gguf_dequantizes_nothing(ckpt, tmp_path, monkeypatch):
    """`localllm info` on a GGUF: the loaded model's facts (sizes, architecture), from its config alone."""
    from transformers import AutoModelForCausalLM

    from localllm.runtime import describe, info
    f = write_gguf(ckpt, tmp_path / "tiny-F32.gguf")
    want = describe(load(f))
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("weights dequantized"))
    assert info(f) == want

def test_a_gguf_is_parsed_once_while_it_loads(ckpt, tmp_path, monkeypatch):
    """transformers reads the file for the config, the tokenizer and the weights: one parse serves the three, one
    read of its metadata the first two, the stages show as progress, and gguf's and transformers' own functions are
    back in place afterwards, even after a refused file."""
    import gguf
    parses = []

    class Counting(gguf.GGUFReader):
        def __init__(self, path, mode="r"):
            parses.append(str(path))
            super().__init__(path, mode)
    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    cfg = json.loads((ckpt / "config.json").read_text())
    half = cfg["hidden_size"] // cfg["num_attention_heads"] // 2
    f = write_gguf(ckpt, tmp_path / "tiny-F32.gguf", rope_freqs=[1.0] * half)  # our own read of the factors too
    from transformers import AutoTokenizer
    from transformers import modeling_gguf_pytorch_utils as hf_gguf
    hf_load, metadata_reads, stages = hf_gguf.load_gguf_checkpoint, [], []

    def counting_load(path, return_tensors=False, **kw):
        metadata_reads.append(not return_tensors)
        return hf_load(path, return_tensors, **kw)
    monkeypatch.setattr(hf_gguf, "load_gguf_checkpoint", counting_load)
    with observe(lambda desc, n, total, unit: stages.append((desc.split("(")[-1].rstrip(")"), n, total))):
        c = open_checkpoint(f)
    # the config's and the tokenizer's metadata reads are one; the weights' read is its own
    assert parses == [str(f)] and gguf.GGUFReader is Counting and metadata_reads == [True, False]
    assert hf_gguf.load_gguf_checkpoint is counting_load
    assert [s for s in stages if s[1] == s[2]][-1] == ("weights read", 4, 4)  # the stages ended on the weights
    assert {"metadata", "config", "tokenizer", "weights"} <= {s[0] for s in stages}
    # the cached metadata gives the tokenizer and config transformers makes without it
    plain = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=f.name)
    text = "hello there, a test of 12 tokens"
    assert c.tokenizer(text)["input_ids"] == plain(text)["input_ids"] and c.tokenizer.eos_token == plain.eos_token
    assert c.config == open_checkpoint(f).config
    with pytest.raises(LocalLLMError):
        open_checkpoint(write_gguf(ckpt, tmp_path / "miss.gguf", drop={"blk.1.ffn_down.weight"}))
    assert gguf.GGUFReader is Counting and hf_gguf.load_gguf_checkpoint is counting_load


def test_a_ggufs_end_of_turn_tokens_end_a_reply(ckpt, tmp_path):
    """llama.cpp's eot / eom token ids (which transformers' import drops) end a reply beside the EOS, and quantize
    keeps them."""
    end = open_checkpoint(write_gguf(ckpt, tmp_path / "plain.gguf")).eos_ids
    ck = open_checkpoint(write_gguf(ckpt, tmp_path / "eot.gguf", end_tokens=("<|user|>", "<|system|>")))
    ids = ck.tokenizer.convert_tokens_to_ids(["<|end|>", "<|user|>", "<|system|>"])
    assert end == ids[:1] and ck.eos_ids == sorted(ids)
    from localllm.quantize import quantize
    quantize(str(tmp_path / "eot.gguf"), str(tmp_path / "q"), bits=4, residuals=False, calib_tokens=64, seq_len=32)
    assert load(tmp_path / "q").eos_ids == sorted(ids)


def llama3_factors(cfg: dict) -> list[float]:
    """What llama.cpp's converter writes as rope_freqs for a Llama-3.1-scaled checkpoint: each frequency's divisor."""
    import math
    rp = cfg.get("rope_parameters") or cfg["rope_scaling"]
    d = cfg["hidden_size"] // cfg["num_attention_heads"]
    f, lo, hi, old = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"], rp["original_max_position_embeddings"]
    out = []
    for i in range(0, d, 2):
        wavelen = 2 * math.pi * (rp.get("rope_theta") or cfg.get("rope_theta") or 10000.0) ** (i / d)
        smooth = (old / wavelen - lo) / (hi - lo)
        out.append(1.0 if wavelen < old / hi else f if wavelen > old / lo else 1 / ((1 - smooth) / f + smooth))
    return out


def test_rope_scaled_ggufs_run_with_their_scaling(tmp_path):
    """transformers' GGUF import drops llama.cpp's RoPE scaling; localllm reads it back and runs as the source."""
    ids = torch.tensor([[3, 17, 42, 99, 5, 7, 11]])
    for name, kw in [("l3", {"arch": "llama3"}), ("lin", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}})]:
        src = make_checkpoint(tmp_path / name, **kw)
        cfg = json.loads((src / "config.json").read_text())
        extra = {"rope_freqs": llama3_factors(cfg)} if name == "l3" else {"linear": 4.0}
        f = write_gguf(src, tmp_path / f"{name}.gguf", **extra)
        plain = write_gguf(src, tmp_path / f"{name}-plain.gguf")
        with torch.no_grad():
            want = load(src).model(ids)
            assert (load(f).model(ids) - want).abs().max() < 1e-4, name
            assert (load(plain).model(ids) - want).abs().max() > 1e-2, name  # the scaling matters here


def test_incomplete_and_split_ggufs_are_refused(ckpt, tmp_path):
    with pytest.raises(LocalLLMError, match="lacks 1 of the model's tensors .*down_proj.*re-download it"):
        open_checkpoint(write_gguf(ckpt, tmp_path / "miss.gguf", drop={"blk.1.ffn_down.weight"}))
    part = tmp_path / "m-00001-of-00002.gguf"
    part.write_bytes(b"GGUF")
    with pytest.raises(LocalLLMError, match="part 1 of a GGUF split into 2 files: merge them"):
        open_checkpoint(part)
    with pytest.raises(LocalLLMError, match="holds no tokenizer transformers can read .*put the model's tokenizer"):
        open_checkpoint(write_gguf(ckpt, tmp_path / "notok.gguf", tokenizer=False))
    with pytest.raises(LocalLLMError, match="no GGUF file .*nope.gguf; .* holds m-00001-of-00002.gguf, miss.gguf, "
                                            "notok.gguf"):
        open_checkpoint(tmp_path, gguf_file="nope.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(LocalLLMError, match="cannot read GGUF file .*empty.gguf.*re-download it"):
        open_checkpoint(tmp_path / "empty.gguf")
    with pytest.raises(LocalLLMError, match="--gguf-file other.gguf names another file than"):
        open_checkpoint(tmp_path / "miss.gguf", gguf_file="other.gguf")
    with pytest.raises(LocalLLMError, match="no such file or folder: nope/x.gguf"):
        open_checkpoint("nope/x.gguf")  # a mistyped path, not a hub id


def test_two_gguf_loads_at_once_leave_gguf_as_it_was():
    """The one-parse patch is process-wide: a second load at once waits for the first (it took the first's patch
    for the original and kept it for good: every later GGUF's parse, and its file's mapping, kept)."""
    import threading

    import gguf
    from localllm.loader import _gguf_parsed_once
    original, inside, release, entered = gguf.GGUFReader, threading.Event(), threading.Event(), []

    def first():
        with _gguf_parsed_once():
            inside.set()
            release.wait(10)

    def second():
        with _gguf_parsed_once():
            entered.append(gguf.GGUFReader)
    a = threading.Thread(target=first)
    a.start()
    assert inside.wait(10)
    b = threading.Thread(target=second)
    b.start()
    b.join(0.3)
    assert b.is_alive() and not entered  # waits while the first load runs
    release.set()
    a.join(10)
    b.join(10)
    assert entered and entered[0] is not original and gguf.GGUFReader is original
