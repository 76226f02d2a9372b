"""The GPU decode path computes what the CPU reference computes, eagerly and as a replayed CUDA graph."""
import pytest
import torch

from localllm.decode import Decoder
from localllm.runtime import load

pytestmark = pytest.mark.gpu


def test_gpu_logits_match_cpu(tiny_quant):
    cpu, gpu = load(tiny_quant, qdec="off"), load(tiny_quant, device="cuda")
    toks = torch.randint(0, cpu.model.cfg.vocab_size, (1, 24))
    with torch.no_grad():
        want = cpu.model(toks)
        prompt = gpu.model(toks.cuda()).cpu()  # several tokens: dequantize + cuBLAS
        one = torch.cat([gpu.model(toks[:, :t + 1].cuda())[:, -1:] for t in range(4)], 1).cpu()  # GEMV kernel
    for got, ref in ((prompt, want), (one, want[:, :4])):
        rel = ((got - ref).norm() / ref.norm()).item()
        assert rel < 2e-2, rel


def test_graph_replay_equals_eager(tiny_quant):
    lm = load(tiny_quant, device="cuda")
    ids = torch.randint(0, lm.model.cfg.vocab_size, (12,)).tolist()
    eager, graph = Decoder(lm.model, 40, use_graph=False), Decoder(lm.model, 40, use_graph=True)
    with torch.no_grad():
        a, b = eager.prefill(ids), graph.prefill(ids)
        for pos in range(12, 30):
            tok = a.argmax()
            a, b = eager.step(tok, pos), graph.step(tok, pos)
            assert torch.allclose(a, b, atol=2e-2, rtol=1e-2), pos
