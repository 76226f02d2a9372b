"""sha256 of files, with a progress bar for big ones."""
from __future__ import annotations

import hashlib
from pathlib import Path

from .progress import progress


def sha256_files(paths: list[Path], desc: str = "hashing") -> list[str]:
    """The hex sha256 of each file, one progress bar over all their bytes."""
    out = []
    with progress(total=sum(p.stat().st_size for p in paths), desc=desc, unit="B", unit_scale=True) as bar:
        for p in paths:
            h = hashlib.sha256()
            with open(p, "rb") as f:
                while buf := f.read(1 << 24):
                    h.update(buf)
                    bar.update(len(buf))
            out.append(h.hexdigest())
    return out
