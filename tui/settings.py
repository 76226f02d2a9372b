"""The settings panel: system prompt, temperature, top-p, max new tokens (for the next reply), QDEC on/off and the
k_chunk per layer type in force with where it comes from."""
from __future__ import annotations

from textual.containers import Horizontal, VerticalScroll
from textual.message import Message
from textual.validation import ValidationResult, Validator
from textual.widgets import Input, Label, Static, Switch

from localllm.runtime import LocalModel

from . import facts
from .session import ReplySettings

# field: (label, what it must be: generate's rules, as ReplySettings.check applies them)
FIELDS = {"system": ("System prompt", "text"), "temperature": ("Temperature (0 = greedy)", "a number ≥ 0"),
          "top_p": ("Top-p", "a number > 0 and ≤ 1"), "max_new_tokens": ("Max new tokens", "a whole number ≥ 1")}


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


class SettingsPanel(VerticalScroll):
    DEFAULT_CSS = """
    SettingsPanel { width: 40; padding: 0 1; border-left: tall $primary; background: $panel; }
    SettingsPanel .title { text-style: bold; margin: 1 0 0 0; }
    SettingsPanel Label { margin: 1 0 0 0; }
    SettingsPanel .why { color: $error; }
    SettingsPanel Horizontal { height: auto; }
    SettingsPanel Horizontal Label { margin: 1 1; }
    SettingsPanel .info, SettingsPanel .hint { color: $text-muted; }
    """

    class Changed(Message):
        """The user changed a reply setting (to a valid value)."""

        def __init__(self, settings: ReplySettings):
            super().__init__()
            self.settings = settings

    class QdecToggled(Message):
        def __init__(self, on: bool):
            super().__init__()
            self.on = on

    def __init__(self, settings: ReplySettings, **kw):
        super().__init__(**kw)
        self.settings = settings

    def compose(self):
        yield Label("Settings", classes="title")
        for name, (label, _) in FIELDS.items():
            yield Label(label)
            yield Input(str(getattr(self.settings, name)), id=name, validators=[_Valid(self, name)],
                        validate_on=["changed"], placeholder="none" if name == "system" else "", compact=True)
        yield Static("", classes="why", markup=False)
        yield Static("Changes apply to the next reply.", classes="hint")
        with Horizontal():
            yield Label("QDEC")
            yield Switch(False, id="qdec", disabled=True, animate=False)
        yield Static("loading…", classes="info", markup=False)

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        why = self.query_one(".why", Static)
        if event.validation_result is not None and not event.validation_result.is_valid:
            why.update("; ".join(event.validation_result.failure_descriptions))
            return
        why.update("")
        self.settings = self.settings.updated(event.input.id, event.value)
        self.post_message(self.Changed(self.settings))

    def on_switch_changed(self, event: Switch.Changed) -> None:
        event.stop()
        self.post_message(self.QdecToggled(event.value))

    def show_qdec(self, lm: LocalModel, want: bool, busy: bool = False) -> None:
        """Show the QDEC setting in force (`want`: what the switch asks, while it is being applied)."""
        switch = self.query_one(Switch)
        with switch.prevent(Switch.Changed):
            switch.value = want
        switch.disabled = not lm.has_residuals
        if not lm.has_residuals:
            text = "This model has no QDEC residuals."
        elif busy:
            text = f"turning QDEC {'on' if want else 'off'}…"
        elif lm.settings.mode == "off":
            text = "QDEC off: no compensation."
        else:
            text = (f"k_chunk per layer type ({lm.settings.mode}):\n{facts.k_chunks(lm)}\n"
                    f"Source: {facts.qdec_source(lm)}\nOverhead per token: {facts.qdec_overhead(lm)}")
            if lm.qdec_overhead is None:
                text += " (run `localllm tune`)"
        self.query_one(".info", Static).update(text)
