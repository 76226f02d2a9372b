"""What the transcript shows while the model loads: the step under way with its progress, or why loading failed."""
from __future__ import annotations

from textual.containers import Vertical
from textual.widgets import Label, ProgressBar, Static


def amount(n: float, total: float | None, unit: str) -> str:
    if unit == "B":
        mib = lambda v: f"{v / 2**20:.0f}"  # noqa: E731
        return f"{mib(n)} / {mib(total)} MiB" if total else f"{mib(n)} MiB"
    counted = unit in ("block", "layer", "step", "window") and (total or n) != 1
    plural = unit + "s" if counted else unit  # "1 / 30 layers"
    return f"{n:.0f} / {total:.0f} {plural}" if total else f"{n:.0f} {plural}"


class LoadingPanel(Vertical):
    DEFAULT_CSS = """
    LoadingPanel { height: auto; margin: 1 2; padding: 1 2; border: round $primary; }
    LoadingPanel ProgressBar { margin: 1 0 0 0; }
    LoadingPanel .step { color: $text-muted; }
    LoadingPanel .error { color: $error; text-style: bold; }
    LoadingPanel .said { color: $text-muted; }
    """

    def __init__(self, what: str):
        super().__init__()
        self.what = what

    def compose(self):
        yield Label(f"Loading {self.what} …", classes="title", markup=False)
        yield ProgressBar(total=None, show_eta=False)  # no total yet: an animated bar, until a step reports one
        yield Static("", classes="step", markup=False)
        yield Static("", classes="said", markup=False)

    def step(self, desc: str, n: float, total: float | None, unit: str) -> None:
        """A progress report of the loading (checking files, quantizing, pinning residuals)."""
        self.query_one(ProgressBar).update(total=total, progress=n)
        self.query_one(".step", Static).update(f"{desc}: {amount(n, total, unit)}")

    def say(self, line: str) -> None:
        """A line the library printed while loading (e.g. that it downloads the demo model)."""
        self.query_one(".said", Static).update(line)

    def failed(self, message: str) -> None:
        self.query_one(".title", Label).update(f"Could not load {self.what}")
        self.query_one(ProgressBar).display = False
        self.query_one(".step", Static).update(message)
        self.query_one(".step", Static).add_class("error")
        self.query_one(".said", Static).update("Fix it and start `localllm chat` again; ctrl+q quits.")
