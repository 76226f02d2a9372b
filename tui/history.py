"""Save a chat to a new JSON file: the messages as generate() takes them, plus what each reply was generated with; and
read one back to go on with it (`localllm chat --resume FILE`)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from localllm import atomic
from localllm.errors import LocalLLMError, is_whole

from . import facts
from .session import ChatSession

FORMAT = "localllm-chat/1"
MAX_BYTES = 256 << 20  # a saved chat is text: a long one is a few MB; a file past this is something else


def history(session: ChatSession) -> dict:
    system = session.settings.system
    return {
        "format": FORMAT,
        "model": session.lm.path,
        "device": facts.device_name(session.lm),
        "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        # each assistant message also carries its settings (system prompt, sampling, seed, QDEC) and stats
        "messages": ([{"role": "system", "content": system}] if system.strip() else []) + session.turns,
    }


def save(session: ChatSession, folder: str | Path) -> Path:
    """Write the chat to chat-<date>-<time>.json in `folder` (-2, -3, ... when taken) and return its path. Written
    whole or not at all; an existing file is never replaced."""
    folder = Path(folder).expanduser().resolve()
    data = (json.dumps(history(session), indent=2, ensure_ascii=False) + "\n").encode()
    stem = time.strftime("chat-%Y%m%d-%H%M%S")
    atomic.check_writable(folder / f"{stem}.json", "save it into a folder you can write")  # one line, no traceback
    for n in range(1, 1000):
        path = folder / (stem + (f"-{n}" if n > 1 else "") + ".json")
        try:
            atomic.write_new(path, data)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"{folder} already holds {stem}.json to {stem}-999.json")


def load(path: str | Path) -> dict:
    """A chat that save() wrote, to go on with: {"system": its system prompt ("" for none), "turns": the user and
    assistant messages as ChatSession.turns holds them, "model", "saved"}. Anything else is refused in one line."""
    path = Path(path).expanduser()
    fix = "pass a chat that Ctrl+S saved in `localllm chat`"
    try:
        with open(path, "rb") as f:  # sniffed first: a model file passed by mistake is not read whole into memory
            head = f.read(64).removeprefix(b"\xef\xbb\xbf").lstrip()  # (a BOM an editor added on saving it)
            size = os.fstat(f.fileno()).st_size
        if not head.startswith(b"{") or size > MAX_BYTES:
            what = f"{size / 2**20:.0f} MB, over {MAX_BYTES >> 20} MB" if head.startswith(b"{") else \
                "it does not begin as a JSON object"
            raise LocalLLMError(f"{path} is not a saved chat ({what}); {fix}")
        d = json.loads(path.read_text(encoding="utf-8-sig"))
    except FileNotFoundError:
        raise LocalLLMError(f"no such file: {path}; {fix}") from None
    except IsADirectoryError:
        raise LocalLLMError(f"{path} is a folder, not a saved chat; {fix}") from None
    except (OSError, ValueError, RecursionError) as e:  # ValueError: not UTF-8, not JSON, a number past its limits
        raise LocalLLMError(f"{path} is not a saved chat ({type(e).__name__}: {str(e)[:120]}); {fix}") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        got = d.get("format") if isinstance(d, dict) else None
        raise LocalLLMError(f"{path} is not a saved chat (format {got!r}, not {FORMAT!r}); {fix}")
    msgs = d.get("messages")
    ok = isinstance(msgs, list) and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in msgs)
    first = 1 if ok and msgs and msgs[0].get("role") == "system" else 0
    system, turns = (msgs[0]["content"] if first else ""), (msgs[first:] if ok else [])
    if not ok or len(turns) % 2 or any(m.get("role") != ("user", "assistant")[i % 2] for i, m in enumerate(turns)):
        raise LocalLLMError(f"{path}: its messages are not a system prompt then user and assistant turns in "
                            f"alternation, as a saved chat's are; {fix}")
    try:  # what save() could not write again (a lone surrogate from a \ud800 escape)
        json.dumps(msgs, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise LocalLLMError(f"{path}: its messages hold text that is not valid Unicode (a lone surrogate); {fix}") \
            from None
    for i, t in enumerate(turns):  # a reply's left_out only hints where the next prompt starts: a wrong one goes
        if "left_out" in t and not (is_whole(t["left_out"]) and 0 <= t["left_out"] <= i // 2):
            turns[i] = {k: v for k, v in t.items() if k != "left_out"}
    return {"system": system, "turns": turns, "model": d.get("model"), "saved": d.get("saved")}
