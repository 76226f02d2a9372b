"""The transcript: the user's messages, the model's replies streamed as Markdown, and notices."""
from __future__ import annotations

import time

from textual.containers import Vertical, VerticalScroll
from textual.widgets import Label, Markdown, Static

from .facts import NONE
from .loading import amount
from .session import Reply

# control characters as their visible symbols (ESC as ␛ ...): text from the model or a paste never reaches the
# terminal as control sequences
_VISIBLE = {c: 0x2400 + c for c in range(32) if chr(c) not in "\n\t"} | {0x7F: 0x2421} | \
    {c: 0xFFFD for c in range(0x80, 0xA0)}


def printable(text: str) -> str:
    return text.translate(_VISIBLE)


_CONTROLS = dict.fromkeys([*range(32), 127], None) | {9: 9, 10: 10}  # str.translate: C0 and DEL out, tab and newline kept


def pasted(text: str) -> str:
    """A paste as text to keep: lines end in newlines, and control characters but tab and newline (not text anyone
    means; raw ESC sequences in a field would reach the terminal) are dropped."""
    return text.replace("\r\n", "\n").replace("\r", "\n").translate(_CONTROLS)


GENERATING = "generating… (Esc cancels)"
READING = "reading the prompt… (Esc cancels)"  # until the first piece (a long prompt on the CPU: seconds)


class UserMessage(Vertical):
    """What the user sent; past SHOWN_CHARS only its beginning is shown (a pasted 500 KB file made every later
    re-layout of the transcript take seconds), the whole of it sent and saved."""
    SHOWN_CHARS = 20_000
    DEFAULT_CSS = """
    UserMessage { height: auto; margin: 1 1 0 1; padding: 0 1; border-left: thick $accent; }
    UserMessage .who { color: $accent; text-style: bold; }
    UserMessage .more { color: $text-muted; }
    """

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def compose(self):
        yield Label("You", classes="who")
        yield Static(printable(self.text[:self.SHOWN_CHARS]), markup=False)  # what the user typed, not markup
        if len(self.text) > self.SHOWN_CHARS:
            yield Static(f"… and {len(self.text) - self.SHOWN_CHARS:,} more characters, not shown", classes="more")


class ReplyMessage(Vertical):
    """A reply as it streams in. Pieces are buffered and appended to the Markdown at most UPDATES_PER_SECOND times,
    and at most a quarter of the time: Markdown.append re-parses and re-renders the last block, which grows (a long
    code block takes a while to highlight), and the UI must keep most of its time for the user."""

    UPDATES_PER_SECOND = 20
    DEFAULT_CSS = """
    ReplyMessage { height: auto; margin: 1 1 0 1; padding: 0 1; border-left: thick $primary; }
    ReplyMessage .who { color: $primary; text-style: bold; }
    ReplyMessage Markdown { margin: 0; padding: 0; }
    ReplyMessage .meta { color: $text-muted; }
    ReplyMessage .meta.-cancelled { color: $warning; }
    ReplyMessage .meta.-error { color: $error; }
    """

    def __init__(self, who: str, saved: tuple[str, str] | None = None):
        """saved: (text, note) of a reply of a chat read back (--resume): its whole text, and the note where the
        numbers would be."""
        super().__init__()
        self.who, self.saved = who, saved
        self.updates = 0  # Markdown appends so far
        self._pending = ""  # text not yet on screen
        self._timer = None  # the update scheduled, if any
        self._busy = False  # an update is under way, until the screen has been refreshed with it
        self._last = 0.0  # when the last update was on screen
        self._cost = 0.0  # seconds from its start to then

    def compose(self):
        yield Label(self.who, classes="who", markup=False)  # a model folder's name, not markup
        yield Markdown(printable(self.saved[0]) if self.saved else None)
        yield Static(self.saved[1] if self.saved else READING, classes="meta", markup=False)

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    def write(self, piece: str) -> None:
        if not self.updates and not self._pending:  # the first piece: the prompt has been read
            self.query_one(".meta", Static).update(GENERATING)
        self._pending += printable(piece)
        self._schedule()

    def _schedule(self) -> None:
        if self._timer is None and not self._busy and self._pending:
            gap = max(1 / self.UPDATES_PER_SECOND, 3 * self._cost)
            # (a Textual timer needs a delay above 0)
            self._timer = self.set_timer(max(0.001, self._last + gap - time.monotonic()), self._update)

    async def _update(self) -> None:
        self._timer, self._busy = None, True
        start = time.monotonic()
        await self._append()
        self.call_after_refresh(self._shown, start)

    def _shown(self, start: float) -> None:
        self._busy, self._last = False, time.monotonic()
        self._cost = self._last - start
        self._schedule()

    def reading(self, desc: str, n: float, total: float | None, unit: str) -> None:
        """How far the prompt has been read, where the numbers will be (a long prompt on the CPU takes seconds)."""
        done = total is not None and n >= total
        text = GENERATING if done else f"{desc}: {amount(n, total, unit)} (Esc cancels)"
        self.query_one(".meta", Static).update(text)

    async def _append(self) -> None:
        text, self._pending = self._pending, ""
        if text:
            self.updates += 1
            await self.markdown.append(text)

    async def finish(self, reply: Reply) -> None:
        """Show the rest of the text and how the reply ended: its numbers, cancelled, or the error."""
        if self._timer is not None:
            self._timer.stop()
            self._timer = None
        await self._append()
        meta = self.query_one(".meta", Static)
        st = reply.stats
        read = st.prompt_tokens - st.cached_tokens
        numbers = f"{st.counts(NONE, ' · ')} · first token " \
                  f"{st.time_to_first_token:.2f} s" + (f" ({read} new prompt tokens read, {st.cached_tokens} kept)"
                                                       if st.cached_tokens else f" ({read} prompt tokens read)")
        n, left_out = reply.left_out, ""
        if n:
            which = "the oldest exchange was" if n == 1 else f"the {n} oldest exchanges were"
            left_out = f" · {which} left out to fit the model's context"
        if reply.error is not None:
            meta.update(f"⚠ {reply.error} (this exchange is not kept in the conversation)")
            meta.add_class("-error")
        elif reply.dropped:  # cancelled before its first word (ChatSession.finish drops it; the box has it back)
            meta.update("cancelled before its first word (this exchange is not kept in the conversation)")
            meta.add_class("-cancelled")
        elif reply.cancelled:
            meta.update(f"cancelled · {numbers}{left_out}")
            meta.add_class("-cancelled")
        else:
            earlier = sum(m["role"] == "user" for m in reply.prompt) - 1  # exchanges before this one
            full = " · stopped: the context is full " + ("(Ctrl+N starts a new chat)" if n < earlier else
                                                         "(no earlier exchange is left in it: a shorter message "
                                                         "leaves the reply more room)")
            ended = {"length": " · stopped at max new tokens", "context": full}.get(st.finish_reason, "")
            meta.update(numbers + ended + left_out)


class Notice(Static):
    DEFAULT_CSS = """
    Notice { margin: 1 1 0 1; padding: 0 1; color: $text-muted; }
    """

    def __init__(self, text: str):
        super().__init__(text, markup=False)


class Transcript(VerticalScroll):
    DEFAULT_CSS = """
    Transcript { height: 1fr; }
    """

    def on_mount(self) -> None:
        self.anchor()  # follow the reply as it grows, until the user scrolls up

    async def add(self, widget):
        await self.mount(widget)
        return widget

    async def mount_all(self, widgets: list) -> None:
        if widgets:
            await self.mount(*widgets)

    def follow(self) -> None:
        """Back to the end, following what is added (as at the start, until the user scrolls up again)."""
        self.anchor()
        self.scroll_end(animate=False)

    async def clear(self) -> None:
        await self.remove_children()
