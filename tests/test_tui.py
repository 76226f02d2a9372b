"""The chat's logic without its widgets: conversation, cancellation, QDEC on/off, errors, status facts, history."""
import json
import threading

import pytest
import torch

from conftest import same_kv_cache
from localllm.errors import LocalLLMError
from localllm.generate import generate
from localllm.runtime import load
from localllm.tui import facts, history
from localllm.tui.session import ChatSession, ReplySettings, open_model, readable
from localllm.tui.transcript import printable


@pytest.fixture
def lm(tiny_quant):
    lm = load(tiny_quant)
    lm.eos_ids = []  # replies run to max_new_tokens: long enough to stream in pieces
    return lm


def reply_to(session, text, stop=None):
    reply = session.send(text)
    pieces = []
    reply.run(session, pieces.append, stop or threading.Event())
    session.finish(reply)
    return reply, pieces


def test_conversation_goes_to_generate_each_turn(lm):
    st = ReplySettings(system="Be brief.", temperature=0.8, top_p=0.95, max_new_tokens=12, seed=5)
    s = ChatSession(lm, st)
    kw = dict(max_new_tokens=12, temperature=0.8, top_p=0.95, seed=5, reuse_cache=True)  # each turn reads what is new
    with same_kv_cache(lm):
        first, pieces = reply_to(s, "Hello")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    want = generate(lm, msgs, **kw)
    assert first.text == "".join(pieces) == want and len(pieces) > 1 and first.error is None
    with same_kv_cache(lm):
        second, _ = reply_to(s, "And then?")
    msgs += [{"role": "assistant", "content": want}, {"role": "user", "content": "And then?"}]
    assert second.prompt == msgs
    assert second.text == generate(lm, msgs, **kw) and second.stats.cached_tokens > 0
    assert [t["role"] for t in s.turns] == ["user", "assistant"] * 2
    assert s.turns[-1]["settings"]["seed"] == 5 and s.turns[-1]["settings"]["qdec"]["mode"] == "approx"
    s.new_chat()
    assert s.turns == [] and s.send("Hi").prompt == [{"role": "system", "content": "Be brief."},
                                                      {"role": "user", "content": "Hi"}]


def test_a_stopped_reply_keeps_what_was_shown_and_the_model_goes_on(lm):
    s = ChatSession(lm, ReplySettings(max_new_tokens=40, seed=3))
    stop = threading.Event()
    shown = []

    def emit(piece):
        shown.append(piece)
        if len(shown) == 3:
            stop.set()  # as the UI does on Esc, while the next token decodes

    reply = s.send("Tell me")
    reply.run(s, emit, stop)
    s.finish(reply)
    assert reply.cancelled and reply.stats.finish_reason == "cancelled" and len(shown) == 3
    assert 3 <= reply.stats.new_tokens < 40 and reply.text == "".join(shown)
    assert s.turns[-1] == {**s.turns[-1], "content": reply.text, "cancelled": True}
    with same_kv_cache(lm):
        nxt, _ = reply_to(s, "Go on")  # the cancelled reply is part of the conversation
    want = generate(lm, [{"role": "user", "content": "Tell me"}, {"role": "assistant", "content": reply.text},
                         {"role": "user", "content": "Go on"}], max_new_tokens=40, seed=3, reuse_cache=True)
    assert nxt.text == want and not nxt.cancelled


def test_a_reply_cancelled_before_its_first_word_leaves_the_conversation_as_it_was(lm):
    s = ChatSession(lm, ReplySettings(max_new_tokens=8, seed=3))
    first, _ = reply_to(s, "One")
    stop = threading.Event()
    stop.set()  # Esc before the first token
    reply, shown = reply_to(s, "Two", stop)
    assert reply.cancelled and reply.text == "" and shown == []
    assert [t["content"] for t in s.turns] == ["One", first.text] and s.last_reply() == first.text


def test_a_qdec_change_asked_for_while_one_is_applied_is_not_lost(tiny_quant, monkeypatch):
    lm = load(tiny_quant)
    s = ChatSession(lm)
    set_qdec = lm.set_qdec

    def toggled_back_meanwhile(*a, **kw):  # the user turns QDEC on again while it is being turned off
        set_qdec(*a, **kw)
        s.want_qdec = True

    monkeypatch.setattr(lm, "set_qdec", toggled_back_meanwhile)
    s.want_qdec = False
    s.sync_qdec()
    assert lm.settings.mode == "off" and s.want_qdec  # the later request stands: its own sync applies it
    monkeypatch.setattr(lm, "set_qdec", set_qdec)
    s.sync_qdec()
    assert lm.settings.mode == "approx" and s.want_qdec


def test_a_failed_reply_is_a_message_and_leaves_the_conversation_as_it_was(lm, monkeypatch):
    s = ChatSession(lm, ReplySettings(max_new_tokens=4, seed=1))
    reply_to(s, "One")

    def out_of_memory(*a, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr("localllm.tui.session.generate", out_of_memory)
    failed, _ = reply_to(s, "Two")
    assert failed.error.startswith("out of GPU memory") and "new chat" in failed.error
    assert len(s.turns) == 2 and s.running is None
    with pytest.raises(LocalLLMError, match="still running"):
        s.send("a")
        s.send("b")


def test_readable_errors():
    assert readable(LocalLLMError("x is missing; do y")) == "x is missing; do y"
    assert readable(RuntimeError("CUDA error: an illegal memory access was encountered\nmore")).startswith(
        "the GPU failed (CUDA error: an illegal memory access was encountered); restart")
    assert readable(MemoryError()).startswith("out of memory")
    assert readable(ValueError("bad\ntrace")) == "unexpected error: ValueError: bad"


def test_qdec_off_and_back_on_restores_the_loaded_setting(tiny_quant):
    ks = {"qkv": 4, "o": 8, "gate_up": 16, "down": 2}
    qdec = {"mode": "approx", "k_chunk": ks}
    lm = load(tiny_quant, qdec=qdec)
    source = lm.qdec_source
    s = ChatSession(lm, qdec=qdec)
    assert s.want_qdec and not s.tunable  # a k_chunk given by hand: no tuning profile, the budget does not matter
    s.want_qdec = False
    s.sync_qdec()
    assert lm.settings.mode == "off" and facts.k_chunks(lm) == "off"
    s.want_qdec = True
    s.sync_qdec()
    assert lm.settings.mode == "approx" and lm.settings.k_chunk == ks and lm.qdec_source == source
    assert facts.k_chunks(lm) == "qkv 4 · o 8 · gate_up 16 · down 2"


def test_the_tuning_budget_goes_to_set_qdec(tiny_quant):
    lm = load(tiny_quant, budget=0.05)
    s = ChatSession(lm)  # loaded with qdec "on": the budget picks the tuning profile on a GPU
    assert not s.tunable and s.want_budget == 0.05  # on the CPU the panel's budget field is disabled
    s.want_budget = 0.1
    s.sync_qdec()
    assert lm.budget == 0.1 and lm.settings.mode == "approx"
    s.want_qdec, s.want_budget = False, 0.2
    s.sync_qdec()
    assert lm.settings.mode == "off"
    s.want_qdec = True
    s.sync_qdec()
    assert lm.budget == 0.2 and lm.settings.mode == "approx"


def test_status_facts_on_the_cpu(lm):
    line = facts.status_line(lm, None)
    kib = lm.sizes()["pinned_host_bytes"] / 1024
    # no GPU fields: no GPU memory, and QDEC's mode (nothing is tuned on the CPU) rather than its overhead
    assert line == f"CPU │ — tok/s │ TTFT — │ residuals {kib:.0f} KiB in RAM │ QDEC {lm.settings.mode}"
    assert lm.settings.mode != "off"
    s = generate(lm, "Hi", max_new_tokens=5, stream=True)
    s.text()
    assert f"{s.stats.tokens_per_second:.1f} tok/s │ TTFT {s.stats.time_to_first_token:.2f} s" in \
        facts.status_line(lm, s.stats)
    lm.set_qdec("off")
    assert facts.status_line(lm, None).endswith("QDEC off")


def test_status_facts_on_a_gpu(monkeypatch):
    """On a GPU the bar shows its memory and QDEC's overhead as tuning measured it (or that nothing measured it)."""
    from types import SimpleNamespace
    monkeypatch.setattr(facts, "device_name", lambda lm: "NVIDIA H200")
    monkeypatch.setattr(facts, "gpu_memory", lambda lm: "4.2 GiB")
    monkeypatch.setattr(facts, "residual_memory", lambda lm: "2.0 GiB pinned")
    lm = SimpleNamespace(model=SimpleNamespace(device=torch.device("cuda", 0)), settings=SimpleNamespace(mode="approx"),
                         qdec_overhead=None)
    assert facts.status_line(lm, None) == \
        "NVIDIA H200 │ — tok/s │ TTFT — │ GPU mem 4.2 GiB │ residuals 2.0 GiB pinned │ QDEC overhead not measured"
    lm.qdec_overhead = 0.048  # what a tuning profile measured
    assert facts.status_line(lm, None).endswith("QDEC overhead +4.8%")
    lm.settings.mode = "off"
    assert facts.status_line(lm, None).endswith("residuals 2.0 GiB pinned │ QDEC off")


def test_settings_are_checked_by_generates_rules():
    st = ReplySettings()
    assert st.updated("temperature", " 0 ").temperature == 0.0
    assert st.updated("max_new_tokens", "7").max_new_tokens == 7
    assert st.updated("min_p", "0.05").min_p == 0.05
    assert st.updated("top_k", "40").top_k == 40 and st.updated("repetition_penalty", "1.3").repetition_penalty == 1.3
    for name, text in [("temperature", "-1"), ("top_p", "0"), ("top_p", "1.5"), ("min_p", "-0.1"), ("min_p", "2"),
                       ("top_k", "-1"), ("top_k", "2.5"), ("repetition_penalty", "0"), ("repetition_penalty", "inf"),
                       ("max_new_tokens", "0"),
                       ("max_new_tokens", "2.5"), ("temperature", "warm"), ("temperature", "nan"),
                       ("max_new_tokens", "1_0"), ("temperature", "0_5")]:
        with pytest.raises(ValueError):
            st.updated(name, text)


def test_a_model_without_chat_template_cannot_chat(tiny_ckpt, tmp_path):
    import shutil
    folder = tmp_path / "plain"
    shutil.copytree(tiny_ckpt, folder)
    cfg = folder / "tokenizer_config.json"
    cfg.write_text(json.dumps({k: v for k, v in json.loads(cfg.read_text()).items() if k != "chat_template"}))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(LocalLLMError, match="no chat template"):
        open_model(str(folder))


def test_history_is_saved_to_a_new_file_and_never_replaces_one(lm, tmp_path, monkeypatch):
    s = ChatSession(lm, ReplySettings(system="Be kind.", max_new_tokens=5, seed=2))
    reply, _ = reply_to(s, "Hello")
    monkeypatch.setattr("localllm.tui.history.time.strftime", lambda fmt: "chat-fixed" if "chat" in fmt else "now")
    (tmp_path / "chat-fixed.json").write_text("mine")
    path = history.save(s, tmp_path)
    assert path == tmp_path / "chat-fixed-2.json" and (tmp_path / "chat-fixed.json").read_text() == "mine"
    d = json.loads(path.read_text())
    assert d["model"] == lm.path and d["device"] == "CPU"
    assert [m["role"] for m in d["messages"]] == ["system", "user", "assistant"]
    assert d["messages"][2]["content"] == reply.text and d["messages"][2]["settings"]["max_new_tokens"] == 5
    assert d["messages"][2]["stats"]["new_tokens"] == reply.stats.new_tokens
    assert history.save(s, tmp_path) == tmp_path / "chat-fixed-3.json"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat-fixed-2.json", "chat-fixed-3.json",
                                                          "chat-fixed.json"]  # no temp files left
    with pytest.raises(LocalLLMError, match="chat-fixed.json is a file, not a folder"):  # not "all names taken"
        history.save(s, tmp_path / "chat-fixed.json")


def test_control_characters_are_shown_not_sent_to_the_terminal():
    assert printable("a\x1b[31mb\tc\nd\x07\x7f\x9b") == "a␛[31mb\tc\nd␇␡\ufffd"


def test_a_resumed_chat_leaves_out_only_what_its_model_needs(lm):
    """A saved reply's left_out is where its own model's context made the next prompt start (to keep that KV cache):
    a chat resumed, on a model with a larger context or none of that cache, starts afresh; a reply made since counts."""
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "left_out": 0},
             {"role": "user", "content": "c"}, {"role": "assistant", "content": "d", "left_out": 1}]
    s = ChatSession(lm, ReplySettings(max_new_tokens=4, seed=1))
    s.go_on({"system": "", "turns": turns, "model": "/elsewhere", "saved": None})
    first = s.send("e")
    assert first.keep_out == 0
    s.running = None
    s.turns.append({"role": "user", "content": "e"})
    s.turns.append({"role": "assistant", "content": "f", "left_out": 1})
    assert s.send("g").keep_out == 1
