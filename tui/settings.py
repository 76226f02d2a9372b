"""The settings panel: system prompt, temperature, top-p, min-p, top-k, repetition penalty, max new tokens (for the
next reply); QDEC on/off and the tuning budget, with the k_chunk per layer type in force and where it comes from."""
from __future__ import annotations

from textual import events
from textual.containers import Horizontal, VerticalScroll
from textual.message import Message
from textual.validation import Function, ValidationResult, Validator
from textual.widgets import Input, Label, Static, Switch

from localllm.errors import LocalLLMError
from localllm.tuner.profile import parse_budget, percent

from . import facts
from .session import ChatSession, ReplySettings
from .transcript import pasted

# field: (label, what it must be: generate's rules, as ReplySettings.check applies them)
FIELDS = {"system": ("System prompt", "text"), "temperature": ("Temperature (0 = greedy)", "a number ≥ 0"),
          "top_p": ("Top-p", "a number > 0 and ≤ 1"), "min_p": ("Min-p (0 = off)", "a number ≥ 0 and ≤ 1"),
          "top_k": ("Top-k (0 = off)", "a whole number ≥ 0"),
          "repetition_penalty": ("Repetition penalty (1 = off)", "a number > 0"),
          "max_new_tokens": ("Max new tokens", "a whole number ≥ 1")}


class _Valid(Validator):
    """Valid when ReplySettings.updated accepts the text: the rules live in one place."""

    def __init__(self, panel: "SettingsPanel", name: str):
        super().__init__()
        self.panel, self.name = panel, name

    def validate(self, value: str) -> ValidationResult:
        try:
            self.panel.settings.updated(self.name, value)
        except ValueError:
            label, rule = FIELDS[self.name]
            return self.failure(f"{label} must be {rule}", value)
        return self.success()


class _SystemInput(Input):
    """The system prompt's one-line field: a paste keeps all its lines, joined by spaces (Input keeps the first)."""

    def _on_paste(self, event: events.Paste) -> None:
        event.stop()
        event.prevent_default()
        text = " ".join(line.strip() for line in pasted(event.text).split("\n") if line.strip())
        self.insert_text_at_cursor(text) if self.selection.is_empty else self.replace(text, *self.selection)


def budget_of(text: str) -> float | None:
    """The budget typed (percent, as `--budget` takes it) as a fraction, or None."""
    try:
        return parse_budget(text)
    except LocalLLMError:
        return None


class SettingsPanel(VerticalScroll):
    DEFAULT_CSS = """
    SettingsPanel { width: 40; max-width: 50%; padding: 0 1; border-left: tall $primary; background: $panel; }
    SettingsPanel .title { text-style: bold; margin: 1 0 0 0; }
    SettingsPanel Label { margin: 1 0 0 0; }
    SettingsPanel .why { color: $error; }
    SettingsPanel Horizontal { height: auto; }
    SettingsPanel Horizontal Label { margin: 1 1; }
    SettingsPanel .info, SettingsPanel .hint { color: $text-muted; }
    SettingsPanel .info { margin: 1 0 0 0; }
    """

    class Changed(Message):
        """The user changed a reply setting (to a valid value)."""

        def __init__(self, settings: ReplySettings):
            super().__init__()
            self.settings = settings

    class QdecChanged(Message):
        """The user turned QDEC on or off, or changed the tuning budget."""

        def __init__(self, on: bool, budget: float | None):
            super().__init__()
            self.on, self.budget = on, budget

    def __init__(self, settings: ReplySettings, **kw):
        super().__init__(**kw)
        self.settings = settings
        self._budget_text = ""  # the budget in force, as show_qdec last showed it
        self._entered: dict[str, object] = {}  # a field's value when it was entered (what a typo goes back to)

    def compose(self):
        yield Label("Settings", classes="title")
        for name, (label, _) in FIELDS.items():
            yield Label(label)
            yield (_SystemInput if name == "system" else Input)(
                str(getattr(self.settings, name)), id=name, validators=[_Valid(self, name)],
                        validate_on=["changed"], placeholder="none" if name == "system" else "", compact=True)
        yield Static("", classes="why", markup=False)
        yield Static("Changes apply to the next reply.", classes="hint")
        with Horizontal():
            yield Label("QDEC")
            yield Switch(False, id="qdec", disabled=True, animate=False)
        yield Label("Tuning budget, % of decode time")
        yield Input("", id="budget", disabled=True, compact=True,
                    validators=[Function(lambda t: budget_of(t) is not None, "a budget is a number in (0, 100]")])
        yield Static("loading…", classes="info", markup=False)

    def on_descendant_focus(self, event: events.DescendantFocus) -> None:
        if isinstance(event.widget, Input) and event.widget.id in FIELDS:
            self._entered[event.widget.id] = getattr(self.settings, event.widget.id)

    def on_input_changed(self, event: Input.Changed) -> None:
        """A valid value applies as it is typed; an invalid one puts back the value the field had when it was
        entered, so that a typo applies no prefix of it ("0,3" no greedy 0, "1e3" max new tokens no 1)."""
        event.stop()
        name = event.input.id
        if event.validation_result is not None and not event.validation_result.is_valid:
            if name in self._entered and getattr(self.settings, name) != self._entered[name]:
                self.settings = self.settings.updated(name, str(self._entered[name]))
                self.post_message(self.Changed(self.settings))
            self._show_problems()
            return
        self._show_problems()
        if name == "budget":
            self._qdec_changed()
            return
        self.settings = self.settings.updated(name, event.value)
        self.post_message(self.Changed(self.settings))

    def _show_problems(self) -> None:
        """Every field still invalid stays named (not only the one just edited), with the value in force: the one it
        had when it was entered."""
        problems = []
        for i in self.query(Input):
            failures = [] if i.disabled else getattr(i.validate(i.value), "failure_descriptions", [])
            if failures:
                kept = getattr(self.settings, i.id) if i.id in FIELDS and i.id != "system" else "the last valid one"
                problems.append(f"{'; '.join(failures)}: {kept} still applies")
        why = self.query_one(".why", Static)
        why.update("; ".join(problems))
        if problems:
            why.scroll_visible()  # (below a short screen it went unseen)

    def on_input_blurred(self, event: Input.Blurred) -> None:
        """A field left holding what is not valid shows the value in force again (its last valid one, or the budget
        in force), so that what the panel shows is what the next reply uses."""
        i = event.input
        if i.disabled or i.validate(i.value).is_valid:
            return
        with i.prevent(Input.Changed):  # (the value in force: nothing changes)
            i.value = self._budget_text if i.id == "budget" else str(getattr(self.settings, i.id))
        self._show_problems()

    def on_switch_changed(self, event: Switch.Changed) -> None:
        event.stop()
        self._qdec_changed()

    def _qdec_changed(self) -> None:
        self.post_message(self.QdecChanged(self.query_one(Switch).value,
                                           budget_of(self.query_one("#budget", Input).value)))

    def show_qdec(self, session: ChatSession, busy: bool = False) -> None:
        """Show the QDEC setting in force, or (busy) the one asked for while it is being applied."""
        lm = session.lm
        switch, budget = self.query_one(Switch), self.query_one("#budget", Input)
        self._budget_text = percent(session.want_budget)
        with switch.prevent(Switch.Changed), budget.prevent(Input.Changed):
            switch.value = session.want_qdec
            if not budget.has_focus:  # (not while the user is typing one)
                budget.value = self._budget_text
        switch.disabled, budget.disabled = not lm.has_residuals, not session.tunable
        if not lm.has_residuals:
            text = "This model has no QDEC residuals."
        elif busy:
            text = f"turning QDEC {'on' if session.want_qdec else 'off'}…"
        elif lm.settings.mode == "off":
            text = "QDEC off: no compensation."
        else:
            text = (f"k_chunk per layer type ({lm.settings.mode}):\n{facts.k_chunks(lm)}\n"
                    f"Source: {lm.qdec_source}\nOverhead per token: {facts.qdec_overhead(lm)}")
        self.query_one(".info", Static).update(text)
