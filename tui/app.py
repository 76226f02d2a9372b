"""`localllm chat`: the Textual app. Layout and keys here; the model work (loading, replies, QDEC on/off) runs in
Textual worker threads and reports to the UI thread with messages, so the UI never waits on the model."""
from __future__ import annotations

import contextlib
import re
import threading
import time
from pathlib import Path

from textual import events, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import Footer, Header, Input, Static, TextArea
from textual.worker import Worker, get_current_worker

from localllm.errors import LocalLLMError
from localllm.progress import observe
from localllm.runtime import LocalModel

from . import facts, history
from .loading import LoadingPanel, amount
from .session import ChatSession, Reply, ReplySettings, open_model, readable
from .settings import SettingsPanel
from .transcript import Notice, ReplyMessage, Transcript, UserMessage, pasted

DISCARD_SECONDS = 5  # Ctrl+N / Ctrl+Q on a chat with unsaved exchanges: how long the second press may wait


class Loaded(Message):
    def __init__(self, lm: LocalModel):
        super().__init__()
        self.lm = lm


class LoadFailed(Message):
    def __init__(self, error: str):
        super().__init__()
        self.error = error


class WorkProgress(Message):
    """A progress report of model work on a worker thread (localllm.progress)."""

    def __init__(self, desc: str, n: float, total: float | None, unit: str):
        super().__init__()
        self.desc, self.n, self.total, self.unit = desc, n, total, unit


class ReplyPiece(Message):
    def __init__(self, reply: Reply, piece: str):
        super().__init__()
        self.reply, self.piece = reply, piece


class ReplyProgress(Message):
    """How far a reply's prompt has been read (localllm.progress, from the worker)."""

    def __init__(self, reply: Reply, desc: str, n: float, total: float | None, unit: str):
        super().__init__()
        self.reply, self.desc, self.n, self.total, self.unit = reply, desc, n, total, unit


class ReplyDone(Message):
    def __init__(self, reply: Reply):
        super().__init__()
        self.reply = reply


class QdecDone(Message):
    def __init__(self, error: str | None):
        super().__init__()
        self.error = error


class _Closing(BaseException):
    """Raised from a progress report when the app is closing: stops a long load between steps (a BaseException, so
    that no `except Exception` on the way turns it into an error)."""


class PromptInput(TextArea):
    """The message being typed: Enter sends it, ctrl+j (or shift+enter where the terminal tells it apart) starts a new
    line, and a paste keeps all its lines. PageUp / PageDown scroll the transcript (the app's), not this box."""
    BINDINGS = [Binding("enter", "submit", "Send"), Binding("ctrl+j,shift+enter", "newline", "New line", show=False),
                Binding("ctrl+shift+z", "redo", show=False)]  # (ctrl+y copies the last reply)

    class Submitted(Message):
        pass

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":  # not TextArea's new line (its handler runs after this one unless prevented)
            event.stop()
            event.prevent_default()
            self.action_submit()

    async def _on_paste(self, event: events.Paste) -> None:
        event.stop()
        event.prevent_default()  # TextArea's own handler would insert the control characters `pasted` drops
        text = pasted(event.text)
        if text and not self.read_only:
            self.move_cursor(self.replace(text, *self.selection).end_location)

    def action_submit(self) -> None:
        self.post_message(self.Submitted())

    def action_newline(self) -> None:
        self.move_cursor(self.replace("\n", *self.selection).end_location)


class ChatApp(App):
    TITLE = "localllm chat"
    ENABLE_COMMAND_PALETTE = False
    CSS = """
    #chat { width: 1fr; }
    #prompt { margin: 0 1; height: auto; max-height: 40%; min-height: 3; }
    #status { height: auto; max-height: 2; padding: 0 1; background: $panel; color: $text-muted; }
    """
    BINDINGS = [
        Binding("escape", "cancel", "Cancel reply"),
        Binding("escape", "close_settings", "Close settings"),  # (when no reply runs: check_action)
        Binding("ctrl+c", "cancel", "Cancel reply", show=False, priority=True),  # only while a reply runs
        Binding("ctrl+n", "new_chat", "New chat"),
        # (in the keys panel, not the footer: the footer's keys fit 80 columns)
        Binding("ctrl+y", "copy_reply", "Copy reply", show=False, priority=True),  # before the message box's redo
        Binding("ctrl+s", "save", "Save chat"),
        Binding("f2", "toggle_settings", "Settings"),
        Binding("f1", "toggle_keys", "Keys"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
        # the transcript's, wherever the focus is (the message box and the settings panel would take them)
        Binding("pageup", "scroll_transcript(-1)", "Scroll up", show=False, priority=True),
        Binding("pagedown", "scroll_transcript(1)", "Scroll down", show=False, priority=True),
    ]

    def __init__(self, model: str | None = None, *, gguf_file: str | None = None, device: str = "cpu",
                 qdec: str | int = "on", budget: float | None = None, settings: ReplySettings | None = None,
                 save_dir: str | Path = ".", kv_bits: int = 16, prefill_int8: bool = False, tune: bool = True,
                 resume: dict | None = None):
        """resume: a saved chat to go on with (history.load; its system prompt is the caller's to put in settings)."""
        super().__init__()
        self.model_src, self.gguf_file, self.device, self.qdec, self.budget = model, gguf_file, device, qdec, budget
        self.kv_bits, self.prefill_int8, self.tune = kv_bits, prefill_int8, tune
        self.settings = settings or ReplySettings()
        self.save_dir = save_dir
        self.resume = resume
        self.session: ChatSession | None = None
        self.load_error: str | None = None  # why the model did not load (the command's exit status says so too)
        self._current: tuple[Reply, ReplyMessage] | None = None  # the reply running and its view
        self._reply_worker: Worker | None = None
        self._last_stats = None  # of the last reply that did not fail: the status bar's speed
        self._printed = ""  # the library's stderr lines, until their newline
        self.working: set[int] = set()  # the worker threads doing model work now (they outlive the app by a step)
        self._armed, self._armed_until = None, 0.0  # a discarding key pressed once: its action, until when

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal():
            with Vertical(id="chat"):
                yield Transcript(id="transcript")
                yield PromptInput(placeholder="Type a message: Enter sends, ctrl+j new line, F1 keys", id="prompt",
                                  disabled=True)
            yield SettingsPanel(self.settings, id="settings")
        yield Static("loading…", id="status", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = Path(self.model_src).name if self.model_src else "the demo model"
        self.query_one(SettingsPanel).display = False
        self.query_one(Transcript).mount(LoadingPanel(f"{self.sub_title} on {self.device.upper()}"))
        self.begin_capture_print(self)  # the library says some things on stderr ("localllm: ..."): show them
        self._load()

    # --- model work, on worker threads -------------------------------------------------------------------------

    def _report(self, desc: str, n: float, total: float | None, unit: str) -> None:
        if get_current_worker().is_cancelled:
            raise _Closing()
        self.post_message(WorkProgress(desc, n, total, unit))

    @contextlib.contextmanager
    def _work(self):
        self.working.add(threading.get_ident())
        try:
            yield
        finally:
            self.working.discard(threading.get_ident())

    @work(thread=True, exit_on_error=False, group="model")
    def _load(self) -> None:
        try:
            with self._work(), observe(self._report):
                # tune: once per GPU and model where no profile applies (it is saved next to the model)
                lm = open_model(self.model_src, self.gguf_file, qdec=self.qdec, device=self.device,
                                budget=self.budget, kv_bits=self.kv_bits, prefill_int8=self.prefill_int8,
                                tune=self.tune)
                # the first reply then runs as fast as later ones (a short first prompt and the default length)
                lm.warm_up(self.settings.max_new_tokens + 512)
        except _Closing:
            return
        except Exception as e:  # noqa: BLE001 - a missing model, a full GPU...: a message in the app
            self.post_message(LoadFailed(readable(e)))
            return
        self.post_message(Loaded(lm))

    @work(thread=True, exit_on_error=False, group="model")
    def _generate(self, reply: Reply) -> None:
        # cancelling this worker (Esc, or the app closing) sets cancelled_event: the reply stops after this token
        try:
            with self._work(), observe(lambda *a: self.post_message(ReplyProgress(reply, *a))):  # a long CPU prompt
                reply.run(self.session, lambda piece: self.post_message(ReplyPiece(reply, piece)),
                          get_current_worker().cancelled_event)
        finally:
            self.post_message(ReplyDone(reply))

    @work(thread=True, exit_on_error=False, group="model")
    def _sync_qdec(self) -> None:
        error = None
        try:
            with self._work(), observe(self._report):
                self.session.sync_qdec()  # waits for a running reply to end
        except _Closing:
            return
        except Exception as e:  # noqa: BLE001
            error = readable(e)
        self.post_message(QdecDone(error))

    # --- reports from the workers ------------------------------------------------------------------------------

    async def on_loaded(self, m: Loaded) -> None:
        session = ChatSession(m.lm, self.settings, self.qdec)
        self.sub_title = facts.model_name(m.lm)
        transcript = self.query_one(Transcript)
        await transcript.query(LoadingPanel).remove()
        await transcript.add(Notice(f"{facts.summary(m.lm)}. Type a message and press Enter; F2 opens the settings."))
        if self.resume is not None:
            await self._show_saved(session, self.resume)
        self.query_one(SettingsPanel).show_qdec(session)
        self.session = session  # last: the chat's actions are enabled once its screen is ready
        self._show_status()
        prompt = self.query_one(PromptInput)
        prompt.disabled = False
        if not self.query_one(SettingsPanel).display:  # not away from a settings field being typed in
            prompt.focus()
        self.refresh_bindings()

    def on_load_failed(self, m: LoadFailed) -> None:
        self.load_error = m.error
        self.query_one(LoadingPanel).failed(m.error)
        self.query_one("#status", Static).update("no model loaded")

    def on_work_progress(self, m: WorkProgress) -> None:
        panels = self.query(LoadingPanel)
        if panels:
            panels.first().step(m.desc, m.n, m.total, m.unit)
        else:
            self.query_one("#status", Static).update(f"{m.desc}: {amount(m.n, m.total, m.unit)}")

    def on_reply_piece(self, m: ReplyPiece) -> None:
        if self._current and self._current[0] is m.reply:
            self._current[1].write(m.piece)

    def on_reply_progress(self, m: ReplyProgress) -> None:
        if self._current and self._current[0] is m.reply:
            self._current[1].reading(m.desc, m.n, m.total, m.unit)

    async def on_reply_done(self, m: ReplyDone) -> None:
        self.session.finish(m.reply)
        prompt = self.query_one(PromptInput)
        if m.reply.dropped and m.reply.chat == self.session.chat and not prompt.text.strip():
            prompt.text = m.reply.user_text  # dropped with its reply: back in the box to edit and send again
            prompt.move_cursor(prompt.document.end)
        if self._current and self._current[0] is m.reply:
            await self._current[1].finish(m.reply)
            self._current = None
        self._show_status(m.reply)
        self.query_one(SettingsPanel).show_qdec(self.session)
        self.refresh_bindings()

    def on_qdec_done(self, m: QdecDone) -> None:
        if m.error:
            self.notify(m.error, title="QDEC", severity="error", markup=False)
        self.query_one(SettingsPanel).show_qdec(self.session)
        self._show_status()

    def on_print(self, event: events.Print) -> None:
        self._printed += event.text
        *lines, self._printed = self._printed.split("\n")
        for line in (ln.strip() for ln in lines):
            if not line.startswith("localllm:"):
                continue  # other libraries' output (and progress bars) stay off the screen
            panels = self.query(LoadingPanel)
            if panels:
                panels.first().say(line)
            else:
                self.notify(line.removeprefix("localllm:").strip(), severity="warning", markup=False)

    # --- the user's actions ------------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        """None: shown disabled in the footer, and the key goes on to the focused widget (ctrl+c copies)."""
        running = self.session is not None and self.session.running is not None
        if action == "cancel":  # (hidden while Esc closes the settings instead)
            return True if running else False if self._settings_open() else None
        if action == "close_settings":
            return not running and self._settings_open()
        if action in ("new_chat", "copy_reply", "save"):
            return True if self.session is not None else None
        return True

    async def on_prompt_input_submitted(self) -> None:
        await self.action_send()

    def on_input_submitted(self) -> None:  # Enter in a settings field: back to the message
        self.query_one(PromptInput).focus()

    def action_scroll_transcript(self, pages: int) -> None:
        t = self.query_one(Transcript)
        t.scroll_page_down() if pages > 0 else t.scroll_page_up()

    async def action_send(self) -> None:
        prompt = self.query_one(PromptInput)
        # as typed, but for blank lines around it: a first line's indentation is the text's (pasted code)
        text = re.sub(r"^(?:[ \t]*\n)+", "", prompt.text.rstrip())
        if self.session is None or not text:
            return
        if self.session.running is not None:
            self.notify("A reply is still running: Esc cancels it.", severity="warning")
            return
        prompt.clear()
        transcript = self.query_one(Transcript)
        await transcript.add(UserMessage(text))
        view = await transcript.add(ReplyMessage(facts.model_name(self.session.lm)))
        transcript.follow()  # the new message, and the reply as it grows, even if the user had scrolled up
        reply = self.session.send(text)  # from here to the worker's start nothing awaits: Esc finds the worker
        self._current = (reply, view)
        self._reply_worker = self._generate(reply)
        self.refresh_bindings()

    def action_toggle_keys(self) -> None:
        """Textual's keys panel: every key of the focused widget and the app, the ones the footer leaves out too."""
        if self.screen.query("HelpPanel"):
            self.action_hide_help_panel()
        else:
            self.action_show_help_panel()

    def action_cancel(self) -> None:
        if self.session is not None and self.session.running is not None and self._reply_worker is not None:
            self._reply_worker.cancel()

    def _discard_ok(self, action: str, key: str) -> bool:
        """Whether `action` may drop the conversation now: at once where nothing is unsaved, else at the key's
        second press within a few seconds (the first says so)."""
        s = self.session
        if s is None or not (s.unsaved or s.running is not None) or self._armed == action \
                and time.monotonic() < self._armed_until:  # (the second press acts, though a reply ended between)
            return True
        self._armed, self._armed_until = action, time.monotonic() + DISCARD_SECONDS
        what = {"new_chat": "start a new chat", "quit": "quit"}[action]
        if s.unsaved:
            self.notify(f"This chat has exchanges that are not saved: press {key} again to {what} without them, or "
                        "Ctrl+S to save first.", severity="warning", timeout=DISCARD_SECONDS)
        else:
            self.notify(f"A reply is still coming: press {key} again to {what} without it.", severity="warning",
                        timeout=DISCARD_SECONDS)
        return False

    async def action_quit(self) -> None:
        if self._discard_ok("quit", "Ctrl+Q"):
            self.exit()

    async def action_new_chat(self) -> None:
        if not self._discard_ok("new_chat", "Ctrl+N"):
            return
        self.action_cancel()  # a reply still running belongs to the old chat: it ends unseen
        self._current = None
        self.session.new_chat()
        transcript = self.query_one(Transcript)
        await transcript.clear()
        await transcript.add(Notice("New chat."))
        self.query_one(PromptInput).focus()

    def action_copy_reply(self) -> None:
        text = self.session.last_reply()
        if text is None:
            self.notify("No reply to copy yet.", severity="warning")
            return
        self.copy_to_clipboard(text)
        self.notify(f"Copied the last reply ({len(text)} characters) to the clipboard.")

    def action_save(self) -> None:
        if not self.session.turns:
            self.notify("Nothing to save yet.", severity="warning")
            return
        try:
            path = history.save(self.session, self.save_dir)
        except (OSError, LocalLLMError) as e:
            self.notify(f"Could not save the chat: {e}", severity="error", markup=False)
            return
        self.session.saved = len(self.session.turns)
        self.notify(f"Saved the chat to {path}", title="Saved", timeout=10, markup=False)

    def _settings_open(self) -> bool:
        panels = self.query(SettingsPanel)  # (none yet while the app composes)
        return bool(panels) and panels.first().display

    def action_close_settings(self) -> None:
        self.action_toggle_settings()

    def action_toggle_settings(self) -> None:
        panel = self.query_one(SettingsPanel)
        panel.display = not panel.display
        if panel.display:
            panel.query_one(Input).focus()
        else:
            self.query_one(PromptInput).focus()

    def on_settings_panel_changed(self, m: SettingsPanel.Changed) -> None:
        self.settings = m.settings
        if self.session is not None:
            self.session.settings = m.settings

    def on_settings_panel_qdec_changed(self, m: SettingsPanel.QdecChanged) -> None:
        self.session.want_qdec = m.on
        if m.budget is not None:  # (None: the budget field holds no valid number just now)
            self.session.want_budget = m.budget
        self.query_one(SettingsPanel).show_qdec(self.session, busy=True)
        self._sync_qdec()

    # --- helpers -----------------------------------------------------------------------------------------------

    async def _show_saved(self, session: ChatSession, saved: dict) -> None:
        """A chat read back: its turns go on in this session (the next reply gets them) and are shown as they were."""
        session.go_on(saved)
        who, transcript = facts.model_name(session.lm), self.query_one(Transcript)
        note = lambda t: "from the saved chat" + (" · cancelled" if t.get("cancelled") is True else "")  # noqa: E731
        # mounted together: one layout for the whole chat (one mount per turn re-laid out the transcript each time)
        await transcript.mount_all([UserMessage(t["content"]) if t["role"] == "user" else
                                    ReplyMessage(who, saved=(t["content"], note(t))) for t in session.turns])
        when = f" of {saved['saved']}" if saved.get("saved") else ""
        model = f", made with {saved['model']}" if saved.get("model") and saved["model"] != session.lm.path else ""
        exchanges = len(session.turns) // 2
        await transcript.add(Notice(f"Going on with the saved chat{when} ({exchanges} exchanges{model})."))

    def _show_status(self, reply: Reply | None = None) -> None:
        if reply is not None and reply.error is None and not reply.dropped:  # (cancelled before any text: no numbers)
            self._last_stats = reply.stats
        self.query_one("#status", Static).update(facts.status_line(self.session.lm, self._last_stats))
