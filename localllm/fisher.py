"""SqueezeLLM's weight sensitivity: the diagonal of the Fisher information of the next-token loss on the
calibration text, F[n, c] = sum_t (dL/dy_n(t) * x_c(t))^2 for every projection y = W x (x: what W multiplies).

Why not the layer-local diagonal of X^T X (mean x_c^2 per input channel, no gradients): on real models a few
tokens carry massive activations in a few channels; they dominate sum_t x_c(t)^2 but the loss barely depends on
them, so k-means weighted by them spends the table on those weights. On the demo model (SmolLM2-135M, 3 bits) that
made every layer's output error smaller than RTN's and the perplexity much worse (191 vs 122); the gradient factor
weighs each token by how much the loss cares. The price: the source model whole in memory (float32) and one
backward pass per calibration sequence, so `--method squeezellm` needs about 4 bytes per parameter of RAM more than
the other methods, plus as much again for the result.

quantize.py weighs k-means by the square root of F: the per-token sums are heavy-tailed (a few tokens with large
gradients), and on the demo model (2048 tokens of the shipped text, QDEC off) sqrt(F) did best of the weightings
tried: 3 bits: RTN 117.3, F 100.4, sqrt(F) 91.0, F^(1/4) 202.4; 4 bits: RTN 35.6, F 41.5, sqrt(F) 35.2, unweighted
119.7 (the tables chase a few outlier weights).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .loader import Checkpoint
from .model import KINDS, Linear
from .progress import progress


def fisher_diagonal(ckpt: Checkpoint, toks: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Per block, per projection kind: F [N, K] float32, summed over the calibration sequences toks [n_seq, T]."""
    from .runtime import dense_model
    model = dense_model(ckpt)
    out = [{kind: torch.zeros(lin.out_features, lin.in_features) for kind, lin in
            zip(KINDS, (blk.qkv, blk.o, blk.gate_up, blk.down))} for blk in model.blocks]

    def hook(i: int, kind: str):
        def forward(m: Linear, args, kw, y):
            x2 = Linear.input_of(args[0], kw.get("norm"), kw.get("glu", False)).detach().square()
            x2 = x2.reshape(-1, x2.shape[-1])

            def backward(g):
                out[i][kind].addmm_(g.reshape(-1, g.shape[-1]).square().T, x2)
            y.register_hook(backward)
        return forward

    hooks = [lin.register_forward_hook(hook(i, kind), with_kwargs=True)
             for i, blk in enumerate(model.blocks) for kind, lin in zip(KINDS, (blk.qkv, blk.o, blk.gate_up, blk.down))]
    try:
        for seq in progress(toks, desc="sensitivity: Fisher (squared gradients)", unit="sequence"):
            model.embed.requires_grad_(True)  # so autograd runs through the blocks (their weights stay frozen)
            logits = model(seq[None, :-1])[0]
            F.cross_entropy(logits, seq[1:], reduction="sum").backward()
            model.embed.grad = None
    finally:
        for h in hooks:
            h.remove()
    return out
