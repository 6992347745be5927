"""Index caches beside the data, as Megatron's GPTDataset keeps its indices: .npy files named by a hash of what they
were built from, so that a start that finds them reads them instead of scanning the .bin or rebuilding the indices.

An entry is `{md5 of description}-{kind}-{array}.npy` for each array plus `{md5}-{kind}-description.txt`, the
description itself (the JSON that was hashed): the dataset's config and the identity of the files it was built from,
so a changed config or a rewritten .bin/.idx misses. The directory is --data-cache-path when given, else
cache/{kind} in the data's own folder (data/c.bin -> data/cache/GPTDataset/): Megatron's default, PREFIX/cache/,
would make a folder named like the dataset beside its .bin and .idx, which reads as a third part of it. The
descriptions name their files, so the prefixes of one folder share its cache without colliding.

Written atomically by one process (the launcher's data check, or global rank 0): each file goes to a temporary name
and is renamed, the description last, so an entry whose description exists is complete; a reader checks the
description's text, not only its name. The others read, or build in memory when nothing is there yet. A directory
that cannot be written (read-only data) is not an error: the index is built in memory, as it always was, and the
process says so once.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

DESCRIPTION = "description.txt"
_warned: set[Path] = set()  # the directory this process said it cannot write (it says so once)


def file_identity(path: str | os.PathLike) -> dict[str, Any]:
    """What says a file is the one an entry was built from: size, modification time and inode (a file rewritten by
    tmp + rename, as preprocess and Megatron's tools write, gets a new inode even within one timestamp tick)."""
    st = os.stat(path)
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


@dataclass(frozen=True)
class IndexCache:
    directory: Path
    kind: str  # "GPTDataset", "IndexedDataset", "BlendedDataset": part of every file name
    write: bool  # this process may write entries (one process does; the others read)

    @classmethod
    def beside(cls, prefix: str, kind: str, cache_path: str | None, write: bool) -> "IndexCache":
        directory = Path(cache_path) if cache_path else Path(prefix).parent / "cache" / kind
        return cls(directory, kind, write)

    def _path(self, digest: str, name: str) -> Path:
        return self.directory / f"{digest}-{self.kind}-{name}"

    def load(self, description: dict[str, Any], names: tuple[str, ...]) -> dict[str, np.ndarray] | None:
        """The entry's arrays (memory-mapped), or None when it is missing, stale or unreadable."""
        text, digest = _describe(description)
        try:
            if self._path(digest, DESCRIPTION).read_text() != text:
                return None
            return {name: np.load(self._path(digest, f"{name}.npy"), mmap_mode="r", allow_pickle=False)
                    for name in names}
        except (OSError, ValueError):
            return None

    def save(self, description: dict[str, Any], arrays: dict[str, np.ndarray]) -> bool:
        """Write the entry if this process writes; False when the directory refuses (said once per process)."""
        if not self.write:
            return False
        text, digest = _describe(description)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            for name, array in arrays.items():
                _replace(self._path(digest, f"{name}.npy"), lambda f, a=array: np.save(f, a, allow_pickle=False))
            _replace(self._path(digest, DESCRIPTION), lambda f: f.write(text.encode()))
        except OSError as exc:
            if not _warned:  # once per process: every later entry would fail for the same reason
                _warned.add(self.directory)
                print(f"data cache: cannot write {self.directory} ({exc.strerror or exc}); the dataset's indices are "
                      "built in memory at every start (--data-cache-path DIR puts them elsewhere)", file=sys.stderr)
            return False
        return True


def _describe(description: dict[str, Any]) -> tuple[str, str]:
    text = json.dumps(description, sort_keys=True, indent=1)
    return text, hashlib.md5(text.encode(), usedforsecurity=False).hexdigest()


def _replace(path: Path, write) -> None:
    """Write through a temporary name of this process and rename: readers see the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
