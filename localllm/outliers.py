"""Measurements on a model's real activations, behind the report's paper figures 5b and 15.

- How concentrated a token's input is: the share of sum(x^2) held by its largest 1% / 5% of channels.
- How well a static channel set (calibration's highest mean x^2, what QDEC's "static" mode compensates) covers each
  token's own largest channels (paper Fig. 5b: recall of the static top 1% / 5%).
- The recall of a QDEC selection (approx, static, random, exact) against exact per-chunk top-k of the same input
  (paper Fig. 15), observed during evaluation through QdecSettings.observer.
All are averaged over tokens and layers, per layer type.
"""
from __future__ import annotations

import math
from collections import defaultdict

import torch

from .model import KINDS, Linear
from .qdec import select_exact

FRACTIONS = (0.01, 0.05)  # top 1% and top 5% of a layer's input channels


def recall(idx: torch.Tensor, ref: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, the share of ref's channels that idx also holds: idx [T, a], ref [T, b] of distinct channels in
    [0, k) -> float [T]."""
    hit = torch.zeros(ref.shape[0], k, dtype=torch.bool, device=ref.device).scatter_(1, ref, True)
    return hit.gather(1, idx).sum(1).float() / ref.shape[1]


def top_count(k: int, frac: float) -> int:
    """Channels in the top `frac` of k channels (at least one)."""
    return max(1, math.ceil(frac * k))


class _Mean:
    """Running means of named values, per layer type."""

    def __init__(self):
        self.sum: dict = defaultdict(float)
        self.n: dict = defaultdict(int)

    def add(self, kind: str, name: str, values: torch.Tensor) -> None:
        self.sum[kind, name] += float(values.double().sum())
        self.n[kind, name] += values.numel()

    def table(self) -> dict:
        """{kind: {name: mean}} plus "all": the token-weighted mean over every layer."""
        out: dict = {}
        names = sorted({name for _, name in self.sum})
        for kind in KINDS + ("all",):
            keys = [(k, n) for k, n in self.sum if (kind == "all" or k == kind)]
            row = {}
            for name in names:
                s = sum(self.sum[k] for k in keys if k[1] == name)
                n = sum(self.n[k] for k in keys if k[1] == name)
                if n:
                    row[name] = s / n
            if row:
                out[kind] = row
        return out


class SelectionRecall:
    """QdecSettings.observer that measures the recall of each compensation's selected channels against exact top-k
    of the same input at the same k_chunk (1.0 for mode "exact" by construction)."""

    def __init__(self):
        self.means = _Mean()

    def __call__(self, lin: Linear, x: torch.Tensor, idx: torch.Tensor) -> None:
        exact = select_exact(x, lin.settings.k_for(lin.kind))
        self.means.add(lin.kind, "recall", recall(idx, exact, x.shape[1]))

    def table(self) -> dict:
        """{kind or "all": mean recall}."""
        return {kind: row["recall"] for kind, row in self.means.table().items()}


class OutlierStats:
    """Forward pre-hooks on every Linear of a model (QDEC off): per token, the energy share of its top 1% / 5%
    channels and the recall of the static top 1% / 5% set (the layer's calibration mean x^2); and, for one
    layer, the per-token series of the first `series_tokens` tokens."""

    def __init__(self, model, series_layer: tuple[int, str], series_tokens: int = 100):
        self.means = _Mean()
        self.series_layer, self.series_tokens = series_layer, series_tokens
        self.series: dict = defaultdict(list)
        self._static = {}
        self._hooks = []
        for blk in model.blocks:
            for kind in KINDS:
                lin = getattr(blk, kind)
                if lin.stats is None:
                    raise ValueError("outlier statistics need the model's calibration (a quantized model folder)")
                imp = lin.stats.sq_mean
                self._static[lin] = {f: imp.topk(top_count(imp.numel(), f)).indices for f in FRACTIONS}
                self._hooks.append(lin.hook_input(lambda m, x, layer=blk.layer, kind=kind: self.update(
                    m, layer, kind, x.reshape(-1, x.shape[-1]).float())))

    def update(self, lin: Linear, layer: int, kind: str, x: torch.Tensor) -> None:
        k = x.shape[1]
        e = x.square()
        total = e.sum(1).clamp_min(1e-30)
        order = e.argsort(dim=1, descending=True)
        keep = (layer, kind) == self.series_layer and len(self.series["share_5"]) < self.series_tokens
        for f in FRACTIONS:
            n = top_count(k, f)
            top = order[:, :n]
            pct = round(100 * f)
            share = e.gather(1, top).sum(1) / total
            rec = recall(self._static[lin][f].expand(x.shape[0], -1), top, k)
            self.means.add(kind, f"share_{pct}", share)
            self.means.add(kind, f"static_recall_{pct}", rec)
            if keep:
                room = self.series_tokens - len(self.series[f"share_{pct}"])
                self.series[f"share_{pct}"] += share[:room].tolist()
                self.series[f"static_recall_{pct}"] += rec[:room].tolist()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()

    def result(self) -> dict:
        layer, kind = self.series_layer
        return {"per_kind": self.means.table(), "series": {"layer": layer, "kind": kind, **self.series}}
