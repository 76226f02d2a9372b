"""Progress bars for long work (loading, quantizing, calibrating, tuning, evaluating).

Shown on a terminal, silent in pipes and CI unless LOCALLLM_PROGRESS=1; LOCALLLM_PROGRESS=0 hides them.
A UI that owns the terminal (the chat app) takes the progress of the work it runs with observe() instead.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
from contextvars import ContextVar
from typing import Callable

from tqdm.auto import tqdm
from tqdm.std import tqdm as tqdm_std

# callback(desc, n, total, unit) of the current thread's observer; None: bars go to the terminal
_observer: ContextVar[Callable[[str, float, float | None, str], None] | None] = ContextVar("observer", default=None)


def progress(iterable=None, desc: str = "", total: int | None = None, unit: str = "it", **kw):
    callback = _observer.get()
    if callback is not None:
        return _Observed(iterable, desc=desc, total=total, unit=unit, callback=callback, **kw)
    return tqdm(iterable, desc=desc, total=total, unit=unit, disable=_disabled(), dynamic_ncols=True,
                leave=False, **kw)


def _disabled() -> bool | None:
    """The rule: LOCALLLM_PROGRESS=0 hides bars, =1 shows them; unset, None (shown on a terminal only)."""
    env = os.environ.get("LOCALLLM_PROGRESS")
    return None if env is None else env == "0"


_patching = threading.Lock()
_patched = 0  # loads inside follow_rule_in_transformers now (threads may load at once)
_gguf_tqdm = None  # the GGUF conversion's own tqdm, while it is replaced


@contextlib.contextmanager
def follow_rule_in_transformers():
    """Within this block, transformers' own bars (loading weights, a GGUF's conversion) are shown by the same rule as
    ours, and reported to this thread's observer; after it, transformers' switch is as it was."""
    global _patched, _gguf_tqdm
    from transformers.utils import logging
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        gguf_utils = None
    disabled = _disabled()
    show = _observer.get() is None and (sys.stderr.isatty() if disabled is None else not disabled)
    was_shown = logging.is_progress_bar_enabled()
    (logging.enable_progress_bar if show else logging.disable_progress_bar)()
    with _patching:  # the GGUF conversion calls tqdm itself, past transformers' switch: it gets our bar meanwhile
        if _patched == 0 and getattr(gguf_utils, "tqdm", None) is not None:
            _gguf_tqdm, gguf_utils.tqdm = gguf_utils.tqdm, progress
        _patched += 1
    try:
        yield
    finally:
        with _patching:
            _patched -= 1
            if _patched == 0 and _gguf_tqdm is not None:
                gguf_utils.tqdm, _gguf_tqdm = _gguf_tqdm, None
        (logging.enable_progress_bar if was_shown else logging.disable_progress_bar)()


@contextlib.contextmanager
def observe(callback: Callable[[str, float, float | None, str], None]):
    """Within this block, in this thread, progress bars call callback(desc, n, total, unit) (at most ~10 times a
    second, and once when done) and print nothing."""
    token = _observer.set(callback)
    try:
        yield
    finally:
        _observer.reset(token)


class _Observed(tqdm_std):
    """A bar that reports to a callback; tqdm still decides when (its rate limit) and counts."""

    def __init__(self, *args, callback, **kw):
        self._callback = callback
        super().__init__(*args, file=io.StringIO(), disable=False, leave=False, **kw)

    def display(self, msg=None, pos=None) -> bool:
        self._callback(self.desc, self.n, self.total, self.unit)
        return False  # nothing was written to clear

    def refresh(self, nolock=False, lock_args=None):
        # without tqdm's lock: it is every bar's, and tqdm keeps it when display() raises (a callback that stops the
        # work, as the chat's does when it closes), so that every later bar in the process would wait forever; these
        # bars draw on nothing shared
        return super().refresh(nolock=True)
