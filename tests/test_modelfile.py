"""Quantize -> folder on disk -> load: round trip, sizes, and refusal of bad files."""
import json
import shutil

import pytest
import torch

from localllm.errors import LocalLLMError
from localllm.modelfile import FILES, linear_shape
from localllm.runtime import load


def test_folder_contents_and_manifest(tiny_quant, tiny_ckpt):
    names = {p.name for p in tiny_quant.iterdir()}
    assert {"localllm.json", *FILES, "tokenizer.json"} <= names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pkl"))]  # nothing pickled
    m = json.loads((tiny_quant / "localllm.json").read_text())
    assert m["format_version"] == 4 and m["quant"]["bits"] == 3 and m["quant"]["block_bits"] == [3, 3] and m["quant"]["group_size"] == 64
    assert m["quant"]["head"] == {"bits": 8, "group_size": 128, "method": "rtn"}
    assert m["residual"]["bits"] == 4 and m["calibration"]["tokens"] >= 128
    assert len(m["source"]["sha256"]) == 64 and m["source"]["path"] == str(tiny_ckpt)
    # no stray temp folders left beside the output
    assert not [p for p in tiny_quant.parent.iterdir() if p.name.startswith(".")]


def test_loaded_weights_are_the_rtn_quantization_of_the_source(tiny_quant, tiny_ckpt):
    from safetensors.torch import load_file

    from localllm.quant import quantize_rtn
    from localllm.smooth_attention import fold
    q, src = load(tiny_quant, qdec="off").model, load(tiny_ckpt).model
    smooth = load_file(str(tiny_quant / "model.safetensors"))
    for i, (bq, bs) in enumerate(zip(q.blocks, src.blocks)):
        for kind in ("qkv", "o", "gate_up", "down"):
            lq, w = getattr(bq, kind), getattr(bs, kind).weight
            if kind == "qkv":  # with the SmoothAttention factors folded in, as quantize does
                w = fold({"qkv": {"weight": w}}, q.cfg, smooth[f"blocks.{i}.k_smooth"])["qkv"]["weight"]
            assert torch.equal(lq.dense(), quantize_rtn(w, 3, 64).dequantize())
            # residual reconstructs most of the quantization error
            r = w - lq.dense()
            assert ((r - lq.residual.dequantize()) ** 2).mean() < 0.05 * (r ** 2).mean()
    assert torch.equal(q.embed.float(), src.embed.half().float())
    assert q.head.quant.bits == 8 and torch.equal(q.head.dense(), quantize_rtn(src.head.weight, 8, 128).dequantize())


def test_head_kept_fp16_on_request(tiny_ckpt, tmp_path):
    """--head-bits 16 writes the source head in fp16; the 8-bit head is close to it (same logits within 8-bit
    rounding) and the folder is larger by the head's other half."""
    from localllm.quantize import quantize
    q8 = load(quantize(str(tiny_ckpt), str(tmp_path / "h8"), bits=4, residuals=False, calib_tokens=256, seq_len=64))
    q16 = load(quantize(str(tiny_ckpt), str(tmp_path / "h16"), bits=4, residuals=False, calib_tokens=256, seq_len=64,
                        head_bits=16))
    src = load(tiny_ckpt).model
    assert q16.manifest["quant"]["head"] is None and q16.model.head.quant is None
    assert torch.equal(q16.model.head.weight, src.head.weight.half().float())
    toks = torch.randint(0, src.cfg.vocab_size, (1, 16))
    with torch.no_grad():
        a, b = q8.model(toks), q16.model(toks)
    assert 0 < (a - b).abs().max() < 0.02 * b.abs().max()
    assert q16.sizes()["gpu_bytes"] - q8.sizes()["gpu_bytes"] > 0.9 * src.cfg.vocab_size * src.cfg.hidden_size
    # a format-2 folder (before the 8-bit head: an fp16 lm_head, no quant.head) still loads, with its fp16 head
    m = json.loads((tmp_path / "h16" / "localllm.json").read_text())
    m["format_version"] = 2
    del m["quant"]["head"]
    (tmp_path / "h16" / "localllm.json").write_text(json.dumps(m))
    old = load(tmp_path / "h16")
    assert old.model.head.quant is None and torch.equal(old.model.head.weight, q16.model.head.weight)


def test_sizes_match_bits(tiny_quant):
    lm = load(tiny_quant)
    cfg = lm.model.cfg
    s = lm.sizes()
    packed = sum(linear_shape(cfg, k)[0] * linear_shape(cfg, k)[1] for k in ("qkv", "o", "gate_up", "down"))
    packed *= cfg.num_layers
    assert s["pinned_host_bytes"] >= packed // 2  # 4-bit residuals
    assert s["pinned_embed_bytes"] == 2 * cfg.vocab_size * cfg.hidden_size  # on a GPU: the head has its own weights
    assert s["gpu_bytes"] < 2 * cfg.vocab_size * cfg.hidden_size * 2 + packed  # well under fp16


def test_full_compensation_recovers_the_source(tiny_quant, tiny_ckpt):
    """Compensating every channel (k_chunk = 1024) leaves only the 4-bit residual's own error."""
    lm, src = load(tiny_quant, qdec="off"), load(tiny_ckpt).model
    toks = torch.randint(0, src.cfg.vocab_size, (1, 32))
    with torch.no_grad():
        ref = src(toks)
        off = (lm.model(toks) - ref).norm() / ref.norm()
        lm.set_qdec({"mode": "exact", "k_chunk": 1024})
        full = (lm.model(toks) - ref).norm() / ref.norm()
        # k_chunk 128 (8 of the tiny model's 64 channels) sits ~0.7x off (0.55-0.82 over 160 draws); k_chunk 16, one
        # channel, sat at 0.85-1.03x and came out above off on some draws (seed 3558516542 in CI: 0.622 vs 0.615)
        lm.set_qdec({"mode": "exact", "k_chunk": 128})
        some = (lm.model(toks) - ref).norm() / ref.norm()
    assert full < 0.25 * off and full < some < off, (off, some, full)


def test_existing_output_is_never_overwritten(tiny_quant, tiny_ckpt):
    from localllm.quantize import quantize
    before = (tiny_quant / "localllm.json").read_bytes()
    with pytest.raises(LocalLLMError, match="already exists"):
        quantize(str(tiny_ckpt), str(tiny_quant), bits=4)
    assert (tiny_quant / "localllm.json").read_bytes() == before


@pytest.mark.parametrize("method,head_bits", [("rtn", 8), ("squeezellm", 8), ("rtn", 16)])
def test_a_disk_without_room_is_refused_before_any_block_is_quantized(tiny_ckpt, tmp_path, monkeypatch, method,
                                                                      head_bits):
    """The files' least size against the space free where the folder is made, before the work (an 8B model on the CPU
    once failed at its end, tens of minutes in); with room, the files are at least that size, and not much more
    (a run that passed the check once failed writing the tokenizer)."""
    import shutil

    from localllm import quantize as q
    real = shutil.disk_usage
    monkeypatch.setattr(q.shutil, "disk_usage", lambda p: real(p)._replace(free=10_000))
    monkeypatch.setattr(q, "block_tensors", lambda *a: pytest.fail("a block was quantized"))
    with pytest.raises(LocalLLMError, match=r"needs at least [\d.]+ [KMG]iB of disk and .* has [\d.]+ KiB free: free some "
                                            "space or choose another -o$"):
        q.quantize(str(tiny_ckpt), str(tmp_path / "m"), bits=3, method=method, head_bits=head_bits)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    monkeypatch.setattr(q.shutil, "disk_usage", lambda p: real(p)._replace(free=0))
    with pytest.raises(LocalLLMError) as e:
        q.quantize(str(tiny_ckpt), str(tmp_path / "m"), bits=3, method=method, head_bits=head_bits)
    value, unit = str(e.value).split("needs at least ")[1].split()[:2]
    least = float(value) * 1024 ** "KMG".index(unit[0]) * 1024
    monkeypatch.undo()
    out = q.quantize(str(tiny_ckpt), str(tmp_path / "m"), bits=3, method=method, head_bits=head_bits)
    written = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    assert written >= least > 0.8 * written, (written, least)


@pytest.fixture
def broken(tiny_quant, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(tiny_quant, dst)
    return dst


def test_truncated_file_is_refused(broken):
    f = broken / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(LocalLLMError, match="truncated"):
        load(broken)


def test_file_digests_cover_files_past_one_read(tmp_path):
    """The test models' files are smaller than one read of sha256_files: a real model's byte past it is checked too."""
    import hashlib

    from localllm.digest import sha256_files
    data = torch.randint(0, 256, (40 << 20,), dtype=torch.uint8).numpy().tobytes()
    (tmp_path / "big.bin").write_bytes(data)
    assert sha256_files([tmp_path / "big.bin"]) == [hashlib.sha256(data).hexdigest()]


def test_flipped_byte_is_refused(broken):
    f = broken / "residuals.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(LocalLLMError, match="sha256"):
        load(broken)


def test_a_model_folder_without_its_manifest_says_so(broken):
    (broken / "localllm.json").unlink()
    with pytest.raises(LocalLLMError, match="looks like a localllm model whose localllm.json is gone"):
        load(broken)


def test_missing_file_and_newer_format_are_refused(broken):
    (broken / "calibration.safetensors").unlink()
    with pytest.raises(LocalLLMError, match="missing"):
        load(broken)
    m = json.loads((broken / "localllm.json").read_text())
    m["format_version"] = 99
    (broken / "localllm.json").write_text(json.dumps(m))
    with pytest.raises(LocalLLMError, match="newer localllm"):
        load(broken)


def test_a_damaged_manifest_is_refused_in_one_line(broken):
    f = broken / "localllm.json"
    good = json.loads(f.read_text())
    damage = {"a list": lambda m: [1, 2], "no config": lambda m: {k: v for k, v in m.items() if k != "config"},
              "a file without its size": lambda m: {**m, "files": {n: {"sha256": "0"} for n in m["files"]}},
              "quant not a record": lambda m: {**m, "quant": "x"},
              "a config key from elsewhere": lambda m: {**m, "config": {**m["config"], "attention_dropout": 0.1}},
              "group size 0": lambda m: {**m, "quant": {**m["quant"], "group_size": 0}},
              "group size text": lambda m: {**m, "quant": {**m["quant"], "group_size": "64"}},
              "head a number": lambda m: {**m, "quant": {**m["quant"], "head": 8}},
              "head group size 0": lambda m: {**m, "quant": {**m["quant"], "head": {"bits": 8, "group_size": 0}}},
              "another model's file entry": lambda m: {**m, "files": {**m["files"], "residuals.safetensors": {
                  "bytes": 123, "sha256": "0" * 64}}},
              # what info states and the runtime and tuner read (hand edits gave tracebacks or false statements)
              "bits text": lambda m: {**m, "quant": {**m["quant"], "bits": "x"}},
              "bits 5": lambda m: {**m, "quant": {**m["quant"], "bits": 5}},
              "no bits": lambda m: {**m, "quant": {k: v for k, v in m["quant"].items() if k != "bits"}},
              "bits not the blocks'": lambda m: {**m, "quant": {**m["quant"], "bits": 3,
                                                                "block_bits": [4] * m["config"]["num_layers"]}},
              "a method without its layout": lambda m: {**m, "quant": {**m["quant"], "method": "squeezellm"}},
              "an unknown method": lambda m: {**m, "quant": {**m["quant"], "method": "gptq"}},
              "awq picks not records": lambda m: {**m, "quant": {**m["quant"], "awq_alpha": [{"qkv": 1}]}},
              "kmax text": lambda m: {**m, "calibration": {**m["calibration"], "kmax": "x"}},
              "kmax 0": lambda m: {**m, "calibration": {**m["calibration"], "kmax": 0}},
              "qdec_value a number": lambda m: {**m, "calibration": {**m["calibration"], "qdec_value": 5}},
              "qdec_value without kl": lambda m: {**m, "calibration": {**m["calibration"], "qdec_value": {"off": 1}}},
              "no residual but its file": lambda m: {**m, "residual": None}}
    for what, change in damage.items():
        f.write_text(json.dumps(change(json.loads(json.dumps(good)))))
        with pytest.raises(LocalLLMError, match="manifest|damaged|not one this localllm writes"):
            load(broken)
    for bad in (b"\xff\xfe{", b"[" * 100_000 + b"]" * 100_000):  # not UTF-8; nested past Python's stack
        f.write_bytes(bad)
        with pytest.raises(LocalLLMError, match="is corrupt"):
            load(broken)


def test_shape_mismatch_is_refused(broken):
    m = json.loads((broken / "localllm.json").read_text())
    m["config"]["intermediate_size"] += 32
    (broken / "localllm.json").write_text(json.dumps(m))
    with pytest.raises(LocalLLMError, match="expected"):
        load(broken)


def test_bad_sources_are_refused(tmp_path):
    with pytest.raises(LocalLLMError, match="no such file"):
        load(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(LocalLLMError, match="config.json"):
        load(str(tmp_path / "empty"))
    (tmp_path / "f.gguf").write_bytes(b"GGUF" + bytes(20))
    with pytest.raises(LocalLLMError, match="GGUF"):
        load(str(tmp_path / "f.gguf"))


def test_corrupt_source_safetensors_is_refused(tmp_path):
    from conftest import make_checkpoint
    p = make_checkpoint(tmp_path / "c")
    f = next(p.glob("*.safetensors"))
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(LocalLLMError, match="corrupt or truncated"):
        load(p)


def test_gpu_memory_check_names_sizes_and_a_bit_width_that_fits(tiny_quant, monkeypatch):
    from localllm.kvquant import bytes_per_token
    from localllm.runtime import check_gpu_memory
    lm = load(tiny_quant, qdec="off", kv_bits=4)  # the smallest KV cache: only the weights can shrink
    linear = sum(lin.in_features * lin.out_features for lin in lm.model.linears())
    kv = 256 * bytes_per_token(lm.model.cfg, 4)  # the model's whole context, 256 tokens
    need = lm.sizes()["gpu_bytes"] + kv + (256 << 20)  # weights + KV + slack
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (need - linear // 16, 1 << 40))
    with pytest.raises(LocalLLMError, match=r"[GMK]iB of GPU memory .* is free; quantize it to 2 bits"):
        check_gpu_memory(lm, torch.device("cuda"), context=4096)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (need + 1, 1 << 40))
    check_gpu_memory(lm, torch.device("cuda"), context=4096)  # fits: no error


def test_qdec_settings_and_budgets_the_api_cannot_run_are_refused(tiny_quant):
    """A layer kind misspelt would quietly leave it uncompensated; a budget of 5 meant as 5% would be 500%."""
    lm = load(tiny_quant, qdec="off")
    for bad in ({"k_chunk": {"qkv": 8, "gate": 8}}, {"k_chunk": "8"}, {"k_chunk": 8, "n_tb": {"up": 2}},
                {"blocks": {"qkv": 1}}):
        with pytest.raises(LocalLLMError, match="not understood|give layer kinds"):
            lm.set_qdec(bad)
    lm.set_qdec({"k_chunk": {"qkv": 8}})  # the kinds left out are off
    assert lm.settings.k_chunk == {"qkv": 8, "o": 0, "gate_up": 0, "down": 0}
    for budget in (5, -0.1, 0):
        with pytest.raises(LocalLLMError, match=r"fraction of the decode time in \(0, 1\], e.g. 0.05 for 5%"):
            load(tiny_quant, budget=budget)
