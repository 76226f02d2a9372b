"""The next-token kernels (kernels/sampling.cu) choose what the torch reference (sampling.next_token) chooses."""
import pytest
import torch

from localllm.sampling import SamplingParams, next_token, nucleus

pytestmark = pytest.mark.gpu

PARAMS = [SamplingParams(0.0, 1.0, 0, 1.0), SamplingParams(0.0, 1.0, 0, 1.3), SamplingParams(1.0, 1.0, 0, 1.0),
          SamplingParams(0.7, 0.9, 0, 1.0), SamplingParams(0.9, 0.95, 40, 1.1), SamplingParams(1.3, 0.5, 3, 0.8),
          SamplingParams(0.5, 1.0, 1, 1.0)]
# min-p cutting first (top-p off, or at 0.95), after top-p (1e-4 under 0.5), and under top-k
MIN_P = [SamplingParams(1.0, 1.0, 0, 1.0, 0.05), SamplingParams(1.5, 0.95, 0, 1.1, 0.02),
         SamplingParams(0.8, 0.5, 0, 1.0, 1e-4), SamplingParams(1.2, 0.9, 300, 1.0, 0.01)]


def kernel_choice(logits, seen, params, u, cap=None, max_blocks=None):
    from localllm.kernels import sampling
    tok, after = torch.zeros(1, 1, dtype=torch.long, device="cuda"), seen.clone()
    drawn = torch.zeros((), dtype=torch.long, device="cuda")
    draws = torch.tensor([0.5, u, 0.5], device="cuda")
    drawn.fill_(1)  # the draw is read at the counter
    sampling.choose(logits, after, params.tensor("cuda"), draws, drawn, tok, params.greedy,
                    sampling.CAP if cap is None else cap, max_blocks)
    t = int(tok)
    assert int(drawn) == 2 and bool(after[t])
    after[t] = seen[t]
    assert torch.equal(after, seen)  # only the chosen token is marked
    return t


def assert_reference_choice(logits, seen, params, u, got):
    """got is the reference's token, or, where the cumulative sums' rounding differs (the tail's tokens have intervals
    narrower than that, so on a large vocabulary a few draws in 12 land there), a token whose reference interval holds
    the draw to 1e-5."""
    want = int(next_token(logits, seen, params.tensor("cuda"), torch.tensor(u, device="cuda"), params.greedy))
    if got == want:
        return
    assert not params.greedy, (got, want)
    order, _, c, n = nucleus(logits, seen, params.tensor("cuda"))
    j = int((order == got).nonzero())
    cdf = (c[:int(n)] / c[int(n) - 1]).double().cpu()
    assert j < int(n) and (cdf[j - 1] if j else 0.0) - 1e-5 <= u <= cdf[j] + 1e-5, (j, u)


@pytest.mark.parametrize("cap", [None, 0], ids=["gathered", "whole-vocabulary"])
@pytest.mark.parametrize("V", [300, 49152, 128256])
@pytest.mark.parametrize("params", PARAMS + MIN_P)
def test_kernels_choose_the_reference_token(V, params, cap):
    """Random fp16-valued logits (ties included) and draws: greedy gives the same token, sampled the reference's (up
    to rounding), both when the sampled choice sorts the gathered bins and when it selects over the whole vocabulary
    (cap 0)."""
    if params.greedy and cap == 0:
        pytest.skip("greedy takes no cap")
    for _ in range(12):
        logits = (torch.randn(V, device="cuda") * 4).half().float()
        seen = torch.rand(V, device="cuda") < 0.05
        u = float(torch.rand(()))
        assert_reference_choice(logits, seen, params, u, kernel_choice(logits, seen, params, u, cap))


@pytest.mark.parametrize("cap", [None, 0], ids=["gathered", "whole-vocabulary"])
@pytest.mark.parametrize("params", [PARAMS[0], PARAMS[3], PARAMS[4], PARAMS[5], MIN_P[1]])
def test_kernels_choose_the_reference_token_with_few_blocks(params, cap):
    """3 blocks for 32 chunks of the vocabulary (a GPU with few SMs): each block takes several, in both paths."""
    V = 128256
    for _ in range(6):
        logits = (torch.randn(V, device="cuda") * 4).half().float()
        seen = torch.rand(V, device="cuda") < 0.05
        u = float(torch.rand(()))
        assert_reference_choice(logits, seen, params, u, kernel_choice(logits, seen, params, u, cap, max_blocks=3))


@pytest.mark.parametrize("kind", ["equal", "near-equal", "masked"])
@pytest.mark.parametrize("params", [SamplingParams(0.7, 0.9, 0, 1.0), SamplingParams(1.0, 1.0, 0, 1.0),
                                    SamplingParams(0.8, 0.95, 5000, 1.1), SamplingParams(1.0, 0.5, 3, 1.0),
                                    SamplingParams(1.0, 1.0, 0, 1.0, 0.99), SamplingParams(1.0, 0.9, 0, 1.0, 0.5)])
def test_kernels_choose_the_reference_token_on_flat_logits(kind, params):
    """Flat distributions, where the bins near the top hold more tokens than the gathered list takes (every logit
    equal: all in one bin, ties in index order), and logits at -inf (masked tokens: no mass, never drawn)."""
    V = 128256
    for _ in range(6):
        if kind == "equal":
            logits = torch.full((V,), 1.5, device="cuda")
        elif kind == "near-equal":
            logits = (torch.randn(V, device="cuda") * 0.01).half().float()
        else:
            logits = (torch.randn(V, device="cuda") * 2).half().float()
            logits[torch.rand(V, device="cuda") < 0.5] = float("-inf")
        seen = torch.rand(V, device="cuda") < 0.05
        u = float(torch.rand(()))
        got = kernel_choice(logits, seen, params, u)
        assert logits[got] > float("-inf")
        assert_reference_choice(logits, seen, params, u, got)


@pytest.mark.parametrize("cap", [None, 0], ids=["gathered", "whole-vocabulary"])
@pytest.mark.parametrize("V", [4, 300, 128256])
def test_kernels_cut_top_p_where_the_reference_does_at_an_exact_boundary(V, cap):
    """Equal logits and top_p 0.5: the mass before token V/2 is exactly top_p, so it goes (transformers' rule), and
    every draw picks one of the first V/2 tokens (ties in index order), the reference's."""
    logits, seen = torch.full((V,), 0.25, device="cuda"), torch.zeros(V, dtype=torch.bool, device="cuda")
    params = SamplingParams(1.0, 0.5)
    for u in (0.001, 0.3, 0.7, 0.999):
        got = kernel_choice(logits, seen, params, u, cap)
        assert got < V // 2
        assert_reference_choice(logits, seen, params, u, got)


@pytest.mark.parametrize("params", [SamplingParams(0.8, 0.9, 50, 1.0), SamplingParams(1.0, 0.95, 0, 1.0, 0.02)])
@pytest.mark.parametrize("cap", [None, 0], ids=["gathered", "whole-vocabulary"])
def test_sampled_kernel_draws_each_token_with_its_probability(cap, params):
    """Evenly spaced draws over one distribution pick each token as often as the reference's probabilities say."""
    V, M = 2000, 4000
    logits, seen = torch.randn(V, device="cuda") * 2, torch.zeros(V, dtype=torch.bool, device="cuda")
    order, e, _, n = nucleus(logits, seen, params.tensor("cuda"))
    p = torch.zeros(V, dtype=torch.float64)
    p[order[:n].cpu()] = (e[:n] / e[:n].sum()).double().cpu()
    counts = torch.zeros(V, dtype=torch.float64)
    for i in range(M):
        counts[kernel_choice(logits, seen, params, (i + 0.5) / M, cap)] += 1
    assert (counts - M * p).abs().max() <= 1.5
    assert counts[p == 0].sum() == 0
