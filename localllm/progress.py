"""Progress bars for long work (loading, quantizing, calibrating, tuning, evaluating).

Shown on a terminal, silent in pipes and CI unless LOCALLLM_PROGRESS=1; LOCALLLM_PROGRESS=0 hides them.
"""
from __future__ import annotations

import os

from tqdm.auto import tqdm


def progress(iterable=None, desc: str = "", total: int | None = None, unit: str = "it", **kw):
    env = os.environ.get("LOCALLLM_PROGRESS")
    disable = None if env is None else env == "0"  # None: tqdm shows bars only on a TTY
    return tqdm(iterable, desc=desc, total=total, unit=unit, disable=disable, dynamic_ncols=True,
                leave=False, **kw)
