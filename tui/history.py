"""Save a chat to a new JSON file: the messages as generate() takes them, plus what each reply was generated with."""
from __future__ import annotations

import json
import time
from pathlib import Path

from localllm import atomic

from . import facts
from .session import ChatSession

FORMAT = "localllm-chat/1"


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
    for n in range(1, 1000):
        path = folder / (stem + (f"-{n}" if n > 1 else "") + ".json")
        try:
            atomic.write_new(path, data)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"{folder} already holds {stem}.json to {stem}-999.json")
