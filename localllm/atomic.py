"""Atomic writes: a file or folder appears whole under its final name, or not at all."""
from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

from .errors import LocalLLMError


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` via a temp file + rename in the same folder (replaces an older version whole, keeping
    its permissions: a transcript the user made private stays private)."""
    with _temp_file(path, data) as tmp:
        with contextlib.suppress(FileNotFoundError):
            os.chmod(tmp, os.stat(path).st_mode & 0o7777)
        os.replace(tmp, path)
    _sync_folder(Path(path).parent)


def write_new(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path`, which must not exist: raises FileExistsError rather than replace anything, even a
    file that appears meanwhile (a hard link of the complete temp file takes the name, or fails)."""
    with _temp_file(path, data) as tmp:
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise
        except OSError:  # no hard links on this file system (FAT, some network shares): claim the name, then fill it
            open(path, "xb").close()
            os.replace(tmp, path)
    _sync_folder(Path(path).parent)


def _sync_folder(folder: Path) -> None:
    """Put a rename in `folder` on disk too (POSIX: a power cut could otherwise lose the new name); not where a
    folder cannot be opened for it (Windows), which orders its renames itself."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a folder
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def _temp_file(path: str | os.PathLike, data: bytes):
    """Yield the name of a temp file beside `path` holding `data` (on disk); it is removed afterwards."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_orphans(path)
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path), suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, _usual_mode(0o666))  # mkstemp's 0600 would make the user's file private
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        yield tmp
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def write_text(path: str | os.PathLike, text: str) -> None:
    write_bytes(path, text.encode())


def _read_umask() -> int:
    umask = os.umask(0)  # the only way to read it is to set it: done once, at import, before any thread writes
    os.umask(umask)
    return umask


_UMASK = _read_umask()


def _usual_mode(mode: int) -> int:
    """`mode` as the umask leaves it: what a plain open() or mkdir() would have given."""
    return mode & ~_UMASK


def check_writable(path: str | os.PathLike, fix: str = "choose an output path in a folder you can write") -> None:
    """A one-line error (ending in `fix`) now where `path` could not be written later (an ancestor is a file, a
    read-only or pseudo file system): long work checks its output before it starts. Leaves nothing behind."""
    path = Path(path).expanduser().resolve()
    folder = path.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise LocalLLMError(f"cannot write {path}: {folder} is a file, not a folder; {fix}")
    try:
        Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)).rmdir()
    except OSError as e:
        raise LocalLLMError(f"cannot write {path}: {folder} refuses new files ({e.strerror or type(e).__name__}); "
                            f"{fix}") from None


_OWNER = f"{socket.gethostname().replace('.', '-')}-"  # temp files' and folders' owner: this host, then a process id


def _temp_prefix(path: Path) -> str:
    """How a temp file or folder for `path` begins: hidden, then its name, this host and this process."""
    return f".{path.name}.{_OWNER}{os.getpid()}."


def remove_orphans(path: str | os.PathLike) -> None:
    """Remove the temp files and folders beside `path` (for it, or for another name: a killed quantize whose next
    run chose another -o) that a process of this host, no longer running, left (SIGKILL, a power cut: no cleanup
    ran)."""
    path = Path(path)
    for d in path.parent.glob(f".*.{glob.escape(_OWNER)}*.tmp"):
        owner = d.name.split(".")[-3]  # .NAME.OWNERPID.RANDOM.tmp (NAME may hold dots, the rest cannot)
        pid = owner[len(_OWNER):]
        if not owner.startswith(_OWNER) or not pid.isdigit() or _running(int(pid)):
            continue
        if d.is_dir():
            shutil.rmtree(d, ignore_errors=True)
        else:
            d.unlink(missing_ok=True)
        print(f"localllm: removed {d}, the unfinished copy an interrupted run left", file=sys.stderr)


@contextlib.contextmanager
def temp_folder(path: str | os.PathLike):
    """Yield a temp folder beside `path`, named for it (as remove_orphans finds it), removed afterwards."""
    path = Path(path)
    remove_orphans(path)
    tmp = tempfile.mkdtemp(prefix=_temp_prefix(path), suffix=".tmp", dir=path.parent)
    try:
        yield Path(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


@contextlib.contextmanager
def new_folder(path: str | os.PathLike):
    """Yield a temp folder beside `path`; on success it is renamed to `path`, on failure removed. Refuses an
    existing `path` (nothing the user saved is overwritten), before and after the work. The temp folder's name
    holds this host and process: one a killed run left (SIGKILL, a power cut: no cleanup ran) is removed by the
    next run that writes into the same folder, and said so."""
    path = Path(path).expanduser().resolve()
    if path.exists():
        raise LocalLLMError(f"{path} already exists; choose another output path or remove it first")
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_orphans(path)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(path), suffix=".tmp", dir=path.parent))
    os.chmod(tmp, _usual_mode(0o777))  # mkdtemp's 0700 would make the user's folder private
    try:
        yield tmp
        for f in tmp.iterdir():  # data on disk before the rename makes it visible
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
                os.chmod(f, _usual_mode(0o666))  # as open() makes files (safetensors writes 0600: private)
        if path.exists():
            raise LocalLLMError(f"{path} appeared while writing; the new copy was discarded, nothing was replaced")
        _sync_folder(tmp)
        os.rename(tmp, path)
        _sync_folder(path.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
