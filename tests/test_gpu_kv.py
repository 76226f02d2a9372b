"""The GPU decode attention over an 8- / 4-bit KV cache computes what the CPU reference (kvquant, model.KVCache)
computes: the kernel's append quantizes as kvquant.quantize does, its attention equals float64 attention over the
dequantized cache, and whole decodes agree with the torch path and the CPU."""
import pytest
import torch

from localllm import kvquant
from localllm.decode import Decoder
from localllm.runtime import load

from test_gpu_model import rotated_qkv

pytestmark = pytest.mark.gpu


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("heads,kv_heads,D", [(9, 3, 64), (32, 8, 128), (4, 4, 128), (16, 2, 64)])
@pytest.mark.parametrize("splits", [None, 1, 3])  # the default, then runs of 4 and 2 chunks
def test_quantized_decode_attention_matches_float64_reference(heads, kv_heads, D, splits, bits):
    from localllm.kernels import attention
    max_len, gq = 400, heads // kv_heads
    # a cache already holding quantized random keys (with outlier channels) and values
    outliers = torch.where(torch.rand(D, device="cuda") < 0.05, 10.0, 1.0)
    kc, ksz = kvquant.quantize(torch.randn(kv_heads, max_len, D, device="cuda") * outliers, bits)
    vc, vsz = kvquant.quantize(torch.randn(kv_heads, max_len, D, device="cuda"), bits)
    for p in (0, 127, 128, 255, 256, 300, 399):  # chunk boundaries of 128 positions
        qkv, inv_freq, q, k_new, v_new = rotated_qkv(heads, kv_heads, D, p)
        q = q.double()
        out = attention.attend(qkv, inv_freq, kc, vc, torch.tensor([p], device="cuda"),
                               heads, kv_heads, D ** -0.5, ksz, vsz, splits=splits)
        torch.cuda.synchronize()
        # the append: kvquant.quantize of the fp16-rounded rotated key and of the value (exact). RoPE may round a
        # key one way or the other by an ulp; where that moves the head's minimum or maximum, its scale moves and
        # with it every code near a rounding boundary (a few % of the head's codes), so each key code must be the
        # level nearest the key under the scale and zero the kernel stored, within that ulp
        for codes, sz, new, exact in ((kc, ksz, k_new, False), (vc, vsz, v_new, True)):
            want_c, want_sz = kvquant.quantize(new, bits)
            got_c, got_sz = codes[:, p].cpu(), sz[:, p].cpu()
            if exact:
                assert torch.equal(got_c, want_c) and torch.equal(got_sz, want_sz), "value appended at pos"
            else:
                a, b = (kvquant.dequantize(c, torch.tensor([1.0, 0.0]).half().expand_as(want_sz), bits)
                        for c in (got_c, want_c))
                assert (a - b).abs().max() <= 1, "key appended at pos"
                assert torch.allclose(got_sz.float(), want_sz.float(), rtol=2e-3, atol=1e-4)
                err = (kvquant.dequantize(got_c, got_sz, bits) - new).abs()
                assert (err <= 0.5 * got_sz[:, :1].float() + 2e-3 * new.abs() + 1e-6).all(), "key code not nearest"
        # the output: float64 attention over the cache as the kernel left it, dequantized
        keys, vals = (kvquant.dequantize(c[:, : p + 1].cpu(), s[:, : p + 1].cpu(), bits, torch.float64)
                      for c, s in ((kc, ksz), (vc, vsz)))
        kvh = torch.arange(heads) // gq
        scores = torch.einsum("hd,hpd->hp", q, keys[kvh]) * D ** -0.5
        want = torch.einsum("hp,hpd->hd", scores.softmax(-1), vals[kvh]).reshape(-1)
        assert rel(out.cpu(), want) < 2e-3, (p, rel(out.cpu(), want))


@pytest.mark.parametrize("bits", [8, 4])
def test_decode_with_a_quantized_cache_matches_the_prompt_path(bits):
    # head_dim 64 with grouped queries: decode steps take the fused kernels, the prompt the torch path (SDPA over the
    # dequantized cache); both read the same quantized cache, so they compute the same function
    from localllm.synthetic import random_model
    from localllm.config import ModelConfig
    from localllm.model import KVCache
    cfg = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=64)
    m = random_model(cfg, 4)
    ids = torch.randint(0, 512, (1, 150), device="cuda")
    with torch.no_grad():
        full = m(ids, 0, KVCache(cfg, 160, dtype=torch.float16, device="cuda", bits=bits))[0].float()
        for use_graph in (False, True):
            dec = Decoder(m, 160, use_graph=use_graph, kv_bits=bits)
            got = [dec.prefill(ids[0, :120].tolist())]
            # crosses the 128-position chunk boundary; a replayed graph reuses its output buffer, so copy each step
            got += [dec.step(ids[0, t], t).clone() for t in range(120, 150)]
            got = torch.stack(got).float()
            assert rel(got, full[119:]) < 2e-2, (use_graph, rel(got, full[119:]))


@pytest.mark.parametrize("bits", [8, 4])
def test_gpu_decode_matches_the_cpu_reference(tiny_quant, bits):
    cpu = load(tiny_quant, qdec="off", kv_bits=bits)
    gpu = load(tiny_quant, qdec="off", kv_bits=bits, device="cuda")
    ids = torch.randint(0, cpu.model.cfg.vocab_size, (40,)).tolist()
    got, want = [], []
    with torch.no_grad():
        for lm, out in ((cpu, want), (gpu, got)):
            dec = lm.decoder(64)
            out.append(dec.prefill(ids[:20]).float().cpu())
            out += [dec.step(torch.tensor(ids[t], device=lm.model.device), t).float().cpu() for t in range(20, 40)]
    # The two paths round differently by an ulp here and there before the cache quantizes, and at 4 bits one flipped
    # code moves a value by a fifteenth of its row's range. Over 40 fresh tiny models on the H100 (2026-11-27)
    # rel was 0.0035 median / 0.0053 max at 8 bits and 0.016 / 0.041 at 4 bits (4 of 40 above the 0.03 this test had).
    # The append and the attention are held to float64 and kvquant by the tests above; this bound catches a path that
    # goes wrong end to end.
    assert rel(torch.stack(got), torch.stack(want)) < {8: 1.5e-2, 4: 0.1}[bits]


def test_a_decoder_cache_that_does_not_fit_names_the_kv_bits(tiny_quant, monkeypatch):
    from localllm.errors import LocalLLMError
    lm = load(tiny_quant, qdec="off", device="cuda")
    from localllm.devices import WORKSPACE_BYTES
    per16 = kvquant.bytes_per_token(lm.model.cfg, 16)
    reserve = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    free = WORKSPACE_BYTES + 256 * per16 * 3 // 4 - reserve  # 256 tokens fit at 8 bits, not at 16
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (free, 80 << 30))
    with pytest.raises(LocalLLMError, match="256 tokens at 16 bits .* --kv-bits 8"):
        lm.decoder(200)
    lm.set_kv_bits(8)
    assert lm.decoder(200).cache.bits == 8
