"""The GPU decode path computes what the CPU reference computes, eagerly and as a replayed CUDA graph."""
import pytest
import torch

from localllm.decode import SHORT_SPAN, Decoder
from localllm.runtime import load

pytestmark = pytest.mark.gpu


def test_gpu_logits_match_cpu(tiny_quant):
    cpu, gpu = load(tiny_quant, qdec="off"), load(tiny_quant, device="cuda", qdec="off")
    # the 8-bit head does not share the embeddings: they stay in pinned host memory, read by the embedding kernel
    assert gpu.model.embed.device.type == "cpu" and gpu.model.embed.is_pinned()
    assert gpu.sizes()["pinned_embed_bytes"] == 2 * gpu.model.embed.numel()
    toks = torch.randint(0, cpu.model.cfg.vocab_size, (1, 24))
    with torch.no_grad():
        want = cpu.model(toks)
        prompt = gpu.model(toks.cuda()).cpu()  # several tokens: dequantize + cuBLAS
        one = torch.cat([gpu.model(toks[:, :t + 1].cuda())[:, -1:] for t in range(4)], 1).cpu()  # GEMV kernel
    for got, ref in ((prompt, want), (one, want[:, :4])):
        rel = ((got - ref).norm() / ref.norm()).item()
        assert rel < 2e-2, rel


def test_prompt_matmul_in_slices_of_rows(tiny_quant, monkeypatch):
    """A prompt's GPU matmul dequantizes big weights (an 8B model's 8-bit head) a slice of rows at a time: the same
    logits as in one piece (up to cuBLAS's summation order), and the head is 8-bit there."""
    from localllm import model as model_mod
    lm = load(tiny_quant, device="cuda", qdec="off")
    assert lm.model.head.packed is not None and lm.model.head.packed.bits == 8
    toks = torch.randint(0, lm.model.cfg.vocab_size, (1, 24), device="cuda")
    with torch.no_grad():
        whole = lm.model(toks)
        monkeypatch.setattr(model_mod, "DEQUANT_ELEMS", 16 * lm.model.cfg.hidden_size * 5)  # 80 rows at a time
        sliced = lm.model(toks)
        last = lm.model(toks, last=True)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(sliced, whole) < 1e-3 and rel(last, whole[:, -1:]) < 1e-2  # last: one token, the GEMV kernel


def test_reuse_cache_reads_the_rest_of_a_prompt_on_the_gpu(tiny_quant):
    """A next turn on the GPU is read from where the KV cache stops holding it, by a masked pass at an offset (several
    tokens) or by the fused decode attention (one): the logits of reading the whole prompt, up to fp16 rounding (the
    cache's entries of the reply were made by decode steps)."""
    from localllm.generate import encode_prompt, generate
    lm = load(tiny_quant, device="cuda", qdec="off")
    lm.eos_ids = []
    msgs = [{"role": "user", "content": "Hello"}]
    s = generate(lm, msgs, max_new_tokens=12, temperature=1.0, seed=2, stream=True, reuse_cache=True)
    s.text()
    dec, first = lm._decoder, encode_prompt(lm, msgs)
    held = dec.cached()
    assert len(held) == len(first) + 11 and held[:len(first)] == first
    ids = held + first[-5:]
    with torch.no_grad():
        want = Decoder(lm.model, dec.max_len).prefill(ids).float()
        several = dec.prefill(ids, reuse=True).float()
        assert dec.reused == len(held)
        one = dec.prefill(ids, reuse=True).float()  # all but the last token held now
        assert dec.reused == len(ids) - 1
    for got in (several, one):
        assert (got - want).abs().max() <= 1e-2 * want.abs().max()


@pytest.mark.parametrize("kv_bits", [16, 4])
def test_a_cache_outgrown_on_the_gpu_is_kept(tiny_quant, kv_bits):
    """A reply longer than the GPU's KV cache gets a larger cache holding the old one's entries (a 4-bit cache's codes
    and scales too): the next prompt reads only what is new, with the logits of reading it whole, up to rounding."""
    lm = load(tiny_quant, device="cuda", qdec="off", kv_bits=kv_bits)
    V = lm.model.cfg.vocab_size
    ids = torch.randint(0, V, (40,)).tolist()
    lm._decoder = dec = Decoder(lm.model, 64, kv_bits=kv_bits)
    with torch.no_grad():
        dec.prefill(ids)
        new = lm.decoder(100, keep=True)
        assert new is not dec and new.max_len >= 100 and new.cached() == ids
        more = ids + torch.randint(0, V, (30,)).tolist()
        got = new.prefill(more, reuse=True).float()
        assert new.reused == len(ids)
        want = Decoder(lm.model, new.max_len, kv_bits=kv_bits).prefill(more).float()
    assert (got - want).abs().max() <= 1e-2 * want.abs().max()


def test_graph_replay_equals_eager(tiny_quant):
    lm = load(tiny_quant, device="cuda", qdec="off")
    ids = torch.randint(0, lm.model.cfg.vocab_size, (12,)).tolist()
    eager, graph = Decoder(lm.model, 40, use_graph=False), Decoder(lm.model, 40, use_graph=True)
    with torch.no_grad():
        a, b = eager.prefill(ids), graph.prefill(ids)
        for pos in range(12, 30):
            tok = a.argmax()
            a, b = eager.step(tok, pos), graph.step(tok, pos)
            assert torch.allclose(a, b, atol=2e-2, rtol=1e-2), pos


def test_a_collection_during_a_capture_does_not_end_it():
    """The garbage collector may run at any allocation, a capture's too; a dead object's graph destroyed then would
    end the capture (CUDA error 901 at the next launch: `bench tune`, whose previous tune left a cycle holding its
    decode graph). Here a dead cycle holds a graph, and the captured code allocates with the collector's threshold
    at 1."""
    import gc

    from localllm.graphs import capture
    x = torch.zeros(64, device="cuda")
    thresholds = gc.get_threshold()
    gc.collect()
    gc.set_threshold(1 << 30)  # nothing collected until the capture's allocations below

    def run():
        if torch.cuda.is_current_stream_capturing():
            gc.set_threshold(1)
            junk = [[i] for i in range(100)]  # would start a collection of the dead cycle
            gc.set_threshold(1 << 30)
            del junk
        x.add_(1)
        return x * 2

    try:
        dead = [capture(lambda: x.mul_(1))[0]]
        dead.append(dead)  # only the collector frees it
        del dead
        g, y = capture(run)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, torch.full_like(x, 4.0))  # x: 1 after the warm-up, 2 after the replay
    finally:
        gc.set_threshold(*thresholds)
        gc.collect()


@pytest.mark.parametrize("greedy", [True, False])
def test_generation_graph_chooses_what_step_by_step_sampling_gives(tiny_quant, greedy):
    """advance() as a CUDA graph (the model and the choice of the next token, which stays on the GPU; the host reads
    each token while the next step runs) gives the tokens of step()'s graph followed by next_token, twice in a row
    (the capture's warm-up leaves no trace in the sampling state), across the short graphs' span into the long ones."""
    from localllm.sampling import SamplingParams, next_token
    lm = load(tiny_quant, device="cuda", qdec="off")
    V, n = lm.model.cfg.vocab_size, 20
    ids = torch.randint(0, V, (SHORT_SPAN - 10,)).tolist()  # positions SHORT_SPAN - 10 to SHORT_SPAN + 9
    params = SamplingParams(0.0, 1.0, 0, 1.3) if greedy else SamplingParams(0.9, 0.95, 50, 1.1)
    draws = torch.rand(n)
    seen = torch.zeros(V, dtype=torch.bool, device="cuda")
    seen[torch.tensor(ids)] = True
    dec = Decoder(lm.model, SHORT_SPAN + 32)
    runs = []
    with torch.inference_mode():
        for _ in range(2):
            dec.start(dec.prefill(ids), len(ids), seen, params, draws)
            reads = [dec.read()]
            for _ in range(n - 1):
                dec.advance()
                reads.append(dec.read())
            runs.append([r() for r in reads])
        assert set(dec._advance_graphs) == {(greedy, SHORT_SPAN), (greedy, SHORT_SPAN + 32)}
        logits, want, mask, u = dec.prefill(ids), [], seen.clone(), draws.cuda()
        for i in range(n):
            t = next_token(logits, mask, params.tensor("cuda"), u[i], params.greedy)
            want.append(int(t))
            mask[t] = True
            logits = dec.step(t, len(ids) + i)
    assert runs[0] == runs[1] == want


@pytest.mark.parametrize("rows,D", [(1, 4096), (7, 576), (3, 5120)])
def test_fused_kernels_match_torch_reference(rows, D):
    from localllm import ops
    from localllm.kernels import fused
    x = torch.randn(rows, D, device="cuda").half()
    w = torch.rand(D, device="cuda") + 0.5
    ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5) * w).half()
    assert torch.allclose(fused.rmsnorm(x, w, 1e-5).float(), ref.float(), rtol=2e-3, atol=2e-3)
    gu = torch.randn(rows, 2 * D, device="cuda").half()
    ref = (torch.nn.functional.silu(gu[:, :D].float()) * gu[:, D:].float()).half()
    assert torch.allclose(fused.silu_mul(gu).float(), ref.float(), rtol=2e-3, atol=2e-3)
    heads, hd = 6, 128
    qkv = torch.randn(rows, heads * hd + 256, device="cuda").half()
    ang = torch.rand(rows, hd // 2, device="cuda") * 6
    want = qkv.clone().cpu().float()
    ops.rope_(want, ang.cos().cpu(), ang.sin().cpu(), heads, hd)  # the torch reference, on the CPU
    fused.rope_(qkv, ang.cos(), ang.sin(), heads, hd)
    assert torch.allclose(qkv.float().cpu(), want, rtol=2e-3, atol=2e-3)


def test_too_big_for_the_gpu_is_refused_with_sizes(tiny_quant, monkeypatch):
    from localllm.errors import LocalLLMError
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (1 << 20, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: 0)  # (torch's cache counts as free too)
    with pytest.raises(LocalLLMError, match=r"needs .* [GMK]iB of GPU memory .* but 1.0 MiB is free"):
        load(tiny_quant, device="cuda")


def rotated_qkv(heads: int, kv_heads: int, D: int, p: int):
    """A random fp16 qkv row on the GPU, RoPE frequencies (a random base between 1e4 and 1e6, so angles up to ~p
    radians) and the torch reference on the CPU at position p: q and the new key rotated then rounded to fp16, the
    new value; float32 [heads, D], [kv_heads, D], [kv_heads, D] (fp16 values, exact)."""
    from localllm import ops
    from localllm.model import rope_tables
    qkv = torch.randn((heads + 2 * kv_heads) * D, device="cuda").half()
    inv_freq = (10 ** (4 + 2 * torch.rand(()))) ** -(torch.arange(0, D, 2, dtype=torch.float64) / D)
    inv_freq = inv_freq.float()
    cos, sin = rope_tables(inv_freq, torch.tensor([p]))
    rot = qkv.cpu().float().view(1, -1).clone()
    ops.rope_(rot, cos, sin, heads + kv_heads, D)
    rot = rot.half().float().view(-1)
    return (qkv, inv_freq.cuda(), rot[: heads * D].view(heads, D),
            rot[heads * D: (heads + kv_heads) * D].view(kv_heads, D),
            qkv[(heads + kv_heads) * D:].cpu().float().view(kv_heads, D))


def random_cache(kv_heads: int, max_len: int, D: int, bits: int) -> list[torch.Tensor]:
    """One layer's random cache on the GPU as the fused attention takes it: [k, v] in fp16, or at 8 / 4 bits the codes
    and their (scale, zero)s, [k, v, k_sz, v_sz] (kvquant)."""
    from localllm import kvquant
    k, v = (torch.randn(kv_heads, max_len, D, device="cuda") for _ in range(2))
    if bits == 16:
        return [k.half(), v.half()]
    (k, ksz), (v, vsz) = kvquant.quantize(k, bits), kvquant.quantize(v, bits)
    return [k, v, ksz, vsz]


@pytest.mark.parametrize("heads,kv_heads,D", [(9, 3, 64), (32, 8, 128), (4, 4, 128), (16, 2, 64)])
@pytest.mark.parametrize("splits", [None, 1, 3, 8])  # the default, then runs of 12, 4, 2 chunks (merged in a cluster
# on sm_90 where 8 or fewer)
def test_fused_decode_attention_matches_float64_reference(heads, kv_heads, D, splits):
    from localllm.kernels import attention
    max_len, gq = 1500, heads // kv_heads
    kc = torch.randn(kv_heads, max_len, D, device="cuda").half()
    vc = torch.randn(kv_heads, max_len, D, device="cuda").half()
    # chunk boundaries of 128 positions; 1100 and 1499: 9 and 12 runs for attend_combine to merge
    for p in (0, 127, 128, 255, 256, 300, 399, 1100, 1499):
        qkv, inv_freq, q, k_new, v_new = rotated_qkv(heads, kv_heads, D, p)
        q, k_new, v_new = q.double(), k_new.double(), v_new.double()
        keys, vals = kc.cpu().double(), vc.cpu().double()
        keys[:, p], vals[:, p] = k_new, v_new
        out = attention.attend(qkv, inv_freq, kc, vc, torch.tensor([p], device="cuda"),
                               heads, kv_heads, D ** -0.5, splits=splits)
        torch.cuda.synchronize()
        kvh = torch.arange(heads) // gq
        scores = torch.einsum("hd,hpd->hp", q, keys[kvh, : p + 1]) * D ** -0.5
        want = torch.einsum("hp,hpd->hd", scores.softmax(-1), vals[kvh, : p + 1]).reshape(-1)
        rel = ((out.cpu().double() - want).norm() / want.norm()).item()
        assert rel < 2e-3, (p, rel)
        assert torch.allclose(kc[:, p].cpu().double(), k_new, atol=2e-3), "rotated key appended at pos"
        assert torch.equal(vc[:, p].cpu().double(), v_new), "value appended at pos"


@pytest.mark.parametrize("heads,kv_heads,D,bits", [(9, 3, 64, 16), (32, 8, 128, 16), (16, 2, 64, 16),
                                                   (28, 4, 128, 8), (28, 4, 128, 4)])
def test_runs_merged_in_a_cluster_equal_attend_combine(heads, kv_heads, D, bits):
    """Where the GPU has thread-block clusters, up to 8 runs of a kv head merge in their cluster instead of in
    attend_combine: the same bits, for every count of runs from 1 to 8 (and for 3 runs of up to 3 chunks each). With
    7 query heads of 128 channels a kv head and a quantized cache's 256 threads a block, two runs merge 896 outputs."""
    from localllm.kernels import attention, cuda
    if not cuda.clusters(torch.cuda.current_device()):
        pytest.skip("no thread-block clusters here (a GPU before sm_90, or LOCALLLM_NO_PDL=1)")
    max_len = attention.CLUSTER_SPAN
    kc, vc, *sz = random_cache(kv_heads, max_len, D, bits)
    for splits in (8, 3):
        for p in (5, 130, 300, 500, 640, 700, 900, max_len - 1):
            qkv, inv_freq = rotated_qkv(heads, kv_heads, D, p)[:2]
            pos = torch.tensor([p], device="cuda")
            merged = attention.attend(qkv, inv_freq, kc, vc, pos, heads, kv_heads, D ** -0.5, *sz, splits=splits)
            combined = attention.attend(qkv, inv_freq, kc, vc, pos, heads, kv_heads, D ** -0.5, *sz, splits=splits,
                                        cluster=False)
            assert torch.equal(merged, combined), (splits, p)


@pytest.mark.parametrize("heads,kv_heads,D,bits", [(32, 8, 128, 16), (9, 3, 64, 16), (28, 4, 128, 8),
                                                   (28, 4, 128, 4), (16, 2, 64, 8)])
def test_a_block_a_query_head_equals_a_block_a_kv_head(heads, kv_heads, D, bits):
    """Where the span is at most PER_HEAD_CHUNKS chunks, each a run (the short decode graphs), attend_part runs a block
    per query head, of which one per kv head appends the new key and value: the same output bits, and the same cache,
    as a block per kv head; runs merged in a cluster or by attend_combine."""
    from localllm.kernels import attention
    assert attention.PER_HEAD_CHUNKS == 2
    for chunks, cluster in ((1, True), (2, True), (2, False)):
        max_len = chunks * attention.CHUNK
        for p in sorted({0, 1, 17, 100, max_len // 2 + 3, max_len - 1}):
            cache = random_cache(kv_heads, max_len, D, bits)
            qkv, inv_freq = rotated_qkv(heads, kv_heads, D, p)[:2]
            pos = torch.tensor([p], device="cuda")
            got = {}
            for per_head in (True, False):
                c = [t.clone() for t in cache]
                out = attention.attend(qkv, inv_freq, c[0], c[1], pos, heads, kv_heads, D ** -0.5, *c[2:],
                                       cluster=cluster, per_head=per_head)
                got[per_head] = (out, c)
            where = (chunks, cluster, p)
            assert torch.equal(got[True][0], got[False][0]), where
            assert all(torch.equal(a, b) for a, b in zip(got[True][1], got[False][1])), where
            assert not all(torch.equal(a, b) for a, b in zip(got[True][1], cache)), where  # the new row was appended


@pytest.mark.parametrize("heads,kv_heads,D,bits", [(32, 8, 128, 16), (9, 3, 64, 16), (28, 4, 128, 8),
                                                   (16, 2, 64, 4)])
def test_runs_merged_by_the_o_gemv_equal_the_merged_output(heads, kv_heads, D, bits, monkeypatch):
    """The attention leaves its runs to o's GEMV, which merges them: two (the pair graph's) while it stages x, up to 8
    (small models' middle graph) before: the same output bits as that GEMV of the merged attention output (cluster
    merge, or attend_combine), on the fp16 and int8 paths, with QDEC and for table weights; the same cache;
    Runs.merged (torch) agrees up to rounding."""
    from test_gpu_gemv import random_quant
    from test_gpu_gemv_lut import on_gpu, random_lut
    from test_gpu_qdec import setup
    from localllm.kernels import attention
    from localllm.kernels import gemv as G
    K, N = heads * D, 1024
    int8 = {"on": False}
    monkeypatch.setattr(G, "uses_int8", lambda w, qdec, dev: int8["on"])
    weights = [("fp16", G.Packed.from_quant(random_quant(N, K, 3, 128)), None),
               ("int8", G.Packed.from_quant(random_quant(N, K, 4, 128)), None),
               ("table", on_gpu(random_lut(N, K, 3, grouped=True)), None)]
    cases = [(splits, p) for splits in (2, 4, 8) if attention.leaves_runs(splits, heads, D, False)
             for p in sorted({0, 100, 128, 200, 300, splits * attention.CHUNK - 1}) if p < splits * attention.CHUNK]
    for splits, p in cases:  # (MR 2: two runs merged in the staging; MR 8: more, merged first)
        max_len = splits * attention.CHUNK
        cache = random_cache(kv_heads, max_len, D, bits)
        qkv, inv_freq = rotated_qkv(heads, kv_heads, D, p)[:2]
        pos = torch.tensor([p], device="cuda")
        c1, c2 = [t.clone() for t in cache], [t.clone() for t in cache]
        out = attention.attend(qkv, inv_freq, c1[0], c1[1], pos, heads, kv_heads, D ** -0.5, *c1[2:], splits=splits)
        runs = attention.attend(qkv, inv_freq, c2[0], c2[1], pos, heads, kv_heads, D ** -0.5, *c2[2:],
                                splits=splits, cluster=False, leave_runs=True)  # MR 8 as without clusters
        assert isinstance(runs, attention.Runs) and all(torch.equal(a, b) for a, b in zip(c1, c2)), (splits, p)
        assert torch.allclose(runs.merged().float(), out.float(), atol=2e-3, rtol=2e-3), (splits, p)
        if len(weights) == 3:  # a QDEC launch for this x (its boundaries follow x)
            weights.append(("qdec", *setup(N, K, 4, 8, x=out.cpu())[2:5:2]))
        res = torch.randn(N, device="cuda").half()
        for name, w, comp in weights:
            int8["on"] = name == "int8"
            want = G.gemv(out, w, residual=res, comp=comp)
            got = G.gemv(runs, w, residual=res, comp=comp)
            assert torch.equal(got, want), (splits, p, name)


@pytest.mark.parametrize("heads,kv_heads,D", [(9, 3, 64), (32, 8, 128)])
def test_attend_combine_merges_more_runs_than_it_prefetches(heads, kv_heads, D):
    """attend_combine holds the first 32 runs' outputs in registers and reads the rest afterwards: 32 and 36 runs."""
    from localllm.kernels import attention
    max_len, gq = 36 * attention.CHUNK, heads // kv_heads
    kc = torch.randn(kv_heads, max_len, D, device="cuda").half()
    vc = torch.randn(kv_heads, max_len, D, device="cuda").half()
    for p in (32 * attention.CHUNK - 1, max_len - 1):
        qkv, inv_freq, q, k_new, v_new = rotated_qkv(heads, kv_heads, D, p)
        keys, vals = kc.cpu().double(), vc.cpu().double()
        keys[:, p], vals[:, p] = k_new.double(), v_new.double()
        out = attention.attend(qkv, inv_freq, kc, vc, torch.tensor([p], device="cuda"),
                               heads, kv_heads, D ** -0.5, splits=40)  # one chunk per run
        kvh = torch.arange(heads) // gq
        scores = torch.einsum("hd,hpd->hp", q.double(), keys[kvh, : p + 1]) * D ** -0.5
        want = torch.einsum("hp,hpd->hd", scores.softmax(-1), vals[kvh, : p + 1]).reshape(-1)
        rel = ((out.cpu().double() - want).norm() / want.norm()).item()
        assert rel < 2e-3, (p, rel)


def test_decode_with_fused_attention_matches_full_forward():
    # head_dim 64 with grouped queries: decode steps take the fused attention kernels, the full forward SDPA
    from localllm.synthetic import random_model
    from localllm.config import ModelConfig
    cfg = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=64)
    m = random_model(cfg, 4)
    ids = torch.randint(0, 512, (1, 150), device="cuda")
    with torch.no_grad():
        full = m(ids)[0].float()
        for use_graph in (False, True):
            dec = Decoder(m, 160, use_graph=use_graph)
            got = [dec.prefill(ids[0, :120].tolist())]
            # crosses the 128-position chunk boundary; a replayed graph reuses its output buffer, so copy each step
            got += [dec.step(ids[0, t], t).clone() for t in range(120, 150)]
            got = torch.stack(got).float()
            rel = ((got - full[119:]).norm() / full[119:].norm()).item()
            assert rel < 2e-2, (use_graph, rel)


def test_warm_up_captures_what_the_first_reply_replays(tiny_quant):
    """warm_up makes the Decoder and both choices' graphs that a first reply then uses without capturing, and the
    reply is what it is without the warm-up (the warm-up's cache rows are overwritten)."""
    from localllm.generate import generate
    cold = load(tiny_quant, device="cuda", qdec="off")
    cold.eos_ids = []
    want = {t: generate(cold, "hello there", max_new_tokens=24, temperature=t, seed=3) for t in (0.0, 0.8)}
    lm = load(tiny_quant, device="cuda", qdec="off")
    lm.eos_ids = []
    lm.warm_up(64)
    dec = lm.decoder(1)
    assert {greedy for greedy, _ in dec._advance_graphs} == {True, False} and dec.max_len >= 64
    graphs = dict(dec._advance_graphs)
    for t, text in want.items():
        assert generate(lm, "hello there", max_new_tokens=24, temperature=t, seed=3) == text
    assert lm.decoder(1) is dec and dec._advance_graphs == graphs  # nothing captured again


@pytest.mark.parametrize("arch,tied,bits,head_bits,kv_bits,int8", [("llama3", False, 3.5, 8, 16, False),
                                                                    ("qwen2", True, 3, 16, 8, False),
                                                                    ("qwen2", False, 2.5, 8, 4, False),
                                                                    ("llama3", False, 3.5, 8, 16, True)])
def test_fused_decode_of_real_shaped_models_matches_cpu(tmp_path, monkeypatch, arch, tied, bits, head_bits, kv_bits,
                                                         int8):
    """Models whose heads the fused decode attention takes (head_dim 64; the tiny model's 16 falls back to torch):
    Llama 3's RoPE scaling, Qwen2's qkv bias, tied embeddings, mixed 3.5 / 2.5-bit blocks, an fp16 or 8-bit head,
    16 / 8 / 4-bit caches, and (int8) every 3- and 4-bit projection on the int8 tensor cores (kernels.gemv.uses_int8 takes
    only larger layers). Decoder steps teacher-forced past the short graphs' span give the CPU's logits, up to fp16
    rounding (the 4-bit cache's codes round apart where fp16 and float32 keys differ)."""
    from conftest import make_checkpoint
    from localllm import ops
    from localllm.kernels import gemv as kg
    from localllm.quantize import quantize
    if int8:
        used = []
        monkeypatch.setattr(kg, "uses_int8", lambda w, qdec, dev: used.append(w.bits in (3, 4)) or (
            w.bits in (3, 4) and w.group_size == 128 and not qdec))
    src = make_checkpoint(tmp_path / "src", arch, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                          num_key_value_heads=2, tie_word_embeddings=tied, max_position_embeddings=512)
    q = quantize(str(src), str(tmp_path / "q"), bits=bits, group_size=128 if int8 else 64, calib_tokens=1024,
                 seq_len=128, head_bits=head_bits)
    cpu, gpu = load(q, qdec="off", kv_bits=kv_bits), load(q, device="cuda", qdec="off", kv_bits=kv_bits)
    assert gpu.model.cfg.qkv_bias == (arch == "qwen2") and gpu.model.tied == (tied and head_bits == 16)
    fused = []
    real = ops.attend_decode
    monkeypatch.setattr(ops, "attend_decode", lambda *a, **k: fused.append(1) or real(*a, **k))
    n, steps = 100, 50  # steps cross SHORT_SPAN: both graphs' spans (the second of two chunks)
    assert n < SHORT_SPAN < n + steps
    toks = torch.randint(0, cpu.model.cfg.vocab_size, (n + steps,))
    rels = []
    with torch.inference_mode():
        decs = [Decoder(lm.model, n + steps, kv_bits=kv_bits) for lm in (cpu, gpu)]
        outs = [d.prefill(toks[:n].tolist()).float().cpu() for d in decs]
        rels.append(((outs[1] - outs[0]).norm() / outs[0].norm()).item())
        for pos in range(n, n + steps - 1):
            want = decs[0].step(toks[pos], pos).float()
            got = decs[1].step(toks[pos].cuda(), pos).float().cpu()
            rels.append(((got - want).norm() / want.norm()).item())
    assert fused, "the fused decode attention did not run"
    assert not int8 or any(used), "no 3- or 4-bit GEMV took the int8 path"
    # (random weights at 2-3 bits: fp16 rounding moves these logits 1-2%, and the 4-bit cache's codes 5-9% (up to
    # 16% on a step), as much in the prompt's pass, rels[0], as in the steps; a wrong position or span would be far
    # off, and grow; the prompt's pass, 100 tokens through fp16 GEMMs, once measured 3.8% at 3 bits)
    most, mean = (0.3, 0.12) if kv_bits == 4 else (3e-2, 3e-2)
    assert rels[0] < 2 * most and max(rels[1:]) < most and sum(rels) / len(rels) < mean, rels
    assert sum(rels[-10:]) < 2 * sum(rels[1:11]), rels


def steps_against_eager(tmp_path, n: int, steps: int, max_len: int) -> Decoder:
    """A small quantized model whose attention the fused kernel serves (head dim 64), stepped from position n for
    `steps` steps through the decode graphs and eagerly (whose attention splits the whole cache and merges in
    attend_combine): the same logits up to the runs' rounding. Returns the graphs' Decoder."""
    from conftest import make_checkpoint
    from localllm.quantize import quantize
    src = make_checkpoint(tmp_path / "src", "llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=2048)
    lm = load(quantize(str(src), str(tmp_path / "q"), bits=4, group_size=64, calib_tokens=256, seq_len=64),
              device="cuda", qdec="off")
    ids = torch.randint(0, lm.model.cfg.vocab_size, (n + steps,)).tolist()
    eager, graph = Decoder(lm.model, max_len, use_graph=False), Decoder(lm.model, max_len)
    with torch.no_grad():
        a, b = eager.prefill(ids[:n]), graph.prefill(ids[:n])
        for pos in range(n, n + steps):
            tok = torch.tensor(ids[pos], device="cuda")
            a, b = eager.step(tok, pos), graph.step(tok, pos)
            assert torch.allclose(a, b, atol=2e-2, rtol=1e-2), pos
    return graph


def test_decode_graphs_across_the_cluster_span_match_eager_steps(tmp_path, monkeypatch):
    """Steps from CLUSTER_SPAN - 24 on cross from the middle graph (8 runs a kv head, merged in their clusters where
    the GPU has them, else, for this small model, by o's GEMV: an MR 8 instance) to the long one (attend_combine);
    eager steps split the whole cache and merge in attend_combine. The same logits up to the runs' rounding."""
    from test_gpu_qdec import kernels_asked
    from localllm.decode import CLUSTER_SPAN, PAIR_SPAN
    from localllm.kernels import attention, cuda
    asked = kernels_asked(monkeypatch)
    n, steps = CLUSTER_SPAN - 24, 48
    graph = steps_against_eager(tmp_path, n, steps, n + steps)
    clusters = cuda.clusters(torch.cuda.current_device())
    assert attention.leaves_runs(8, 4, 64, False)  # the model's o merges 8 runs where no cluster does
    assert graph.spans == [SHORT_SPAN, PAIR_SPAN, CLUSTER_SPAN, n + steps]
    assert set(graph._step_graphs) == {CLUSTER_SPAN, n + steps}
    mr8 = [e for e in asked if e.startswith("gemv<") and e.count(",") == 8 and e.endswith(",8>")]
    assert bool(mr8) != clusters, asked


def test_pair_span_steps_leave_the_runs_to_o_and_match_eager_steps(tmp_path, monkeypatch):
    """Steps from position 120 on cross from the short graph into the pair graph (PAIR_SPAN: two runs), whose
    attention leaves its runs to o's GEMV (an MR 2 instance: gemv<..., 2> of nine parameters); eager steps split the
    whole cache and merge in attend_combine. The same logits up to the runs' rounding."""
    from test_gpu_qdec import kernels_asked
    from localllm.decode import PAIR_SPAN
    asked = kernels_asked(monkeypatch)
    graph = steps_against_eager(tmp_path, 120, 24, 2 * PAIR_SPAN)
    assert set(graph._step_graphs) == {SHORT_SPAN, PAIR_SPAN}
    merging = [e for e in asked if e.startswith("gemv<") and e.count(",") == 8 and e.endswith(",2>")]
    assert merging, asked  # o's GEMV merged the pair graph's runs


def test_gpu_decode_steps_match_cpu_with_a_16_bit_cache(tiny_quant):
    """The GEMV kernels (uniform weights, 16-bit cache) over many positions, step by step, against the CPU: a prompt's
    pass (dequantize + cuBLAS) is another path."""
    cpu, gpu = load(tiny_quant, qdec="off"), load(tiny_quant, device="cuda", qdec="off")
    toks = torch.randint(0, cpu.model.cfg.vocab_size, (40,))
    with torch.inference_mode():
        decs = [Decoder(lm.model, 64) for lm in (cpu, gpu)]
        for d in decs:
            d.prefill(toks[:4].tolist())
        for pos in range(4, 40):
            want = decs[0].step(toks[pos], pos).float()
            got = decs[1].step(toks[pos].cuda(), pos).float().cpu()
            rel = ((got - want).norm() / want.norm()).item()
            assert rel < 2e-2, (pos, rel)
