"""Text files: the ones a user names (a calibration or evaluation text) and the ones shipped in localllm/data."""
from __future__ import annotations

from importlib import resources
from pathlib import Path

from .errors import LocalLLMError


def shipped(name: str) -> str:
    return resources.files("localllm").joinpath("data", name).read_text(encoding="utf-8")


def read(path: str | Path, what: str, option: str) -> str:
    """A UTF-8 text file's text (a byte-order mark dropped: it is not text), refused in one line where it is missing,
    not UTF-8 or only whitespace. what: what the text is for ("calibration text"); option: the flag that names it."""
    p = Path(path).expanduser()
    if p.is_dir() or not p.exists():  # (a pipe, e.g. <(...) or /dev/stdin, is read like a file)
        why = "is a folder, not a text file" if p.is_dir() else "does not exist (no text file at that path)"
        raise LocalLLMError(f"{what} {p} {why}: give {option} a UTF-8 text file")
    try:
        text = p.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise LocalLLMError(f"{what} {p} is not UTF-8 text: convert it (e.g. iconv -t UTF-8) or pick another file") \
            from None
    if not text.strip():
        raise LocalLLMError(f"{what} {p} holds no text (only whitespace): give {option} a text")
    return text
