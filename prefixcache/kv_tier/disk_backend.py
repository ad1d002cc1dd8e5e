"""A tier in a local directory: one file per block, for one machine that restarts.

Files are written to a temporary name in the same directory and renamed into place
(``os.replace``), so a reader never sees half a value, even if the writer dies; a value
damaged some other way fails the tier's checksum. With ``max_bytes`` the oldest files
(by modification time, refreshed on every read, so least recently used first) are
deleted once the directory holds more, down to nine tenths of it.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from prefixcache.kv_tier.backend import KVTierBackend

_TEMP_SUFFIX = ".tmp"


class DiskBackend(KVTierBackend):
    """Values as files under ``root`` (created); see the module docstring."""

    def __init__(self, root: str | Path, max_bytes: int | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.description = f"disk:{self.root}"
        self._lock = threading.Lock()  # guards _num_bytes and the pruning
        self._num_bytes = sum(size for _, size, _ in self._scan())

    def _path(self, key: str) -> Path:
        # Keys are "<namespace>:<fingerprint>:<hash>": a folder per fingerprint, and a
        # level of 256 sub-folders so no folder grows past a few thousand files.
        namespace, fingerprint, block = key.split(":", 2)
        return self.root / f"{namespace}-{fingerprint}" / block[:2] / block

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [self._path(key).is_file() for key in keys]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        values: list[bytes | None] = []
        for key in keys:
            path = self._path(key)
            try:
                values.append(path.read_bytes())
                os.utime(path)  # recently used: pruned last
            except FileNotFoundError:
                values.append(None)
        return values

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> int:
        num_written = 0
        for key, value in items:
            path = self._path(key)
            if path.is_file():
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, temp_name = tempfile.mkstemp(dir=path.parent, suffix=_TEMP_SUFFIX)
            try:
                with os.fdopen(fd, "wb") as file:
                    file.write(value)
                os.replace(temp_name, path)
            except BaseException:
                Path(temp_name).unlink(missing_ok=True)
                raise
            num_written += 1
            with self._lock:
                self._num_bytes += len(value)
        if self.max_bytes is not None and self._num_bytes > self.max_bytes:
            self._prune()
        return num_written

    def _scan(self) -> list[tuple[float, int, Path]]:
        """(modification time, size, path) of every value file."""
        entries = []
        for path in self.root.glob("*/*/*"):
            if path.name.endswith(_TEMP_SUFFIX):
                continue
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            entries.append((stat.st_mtime, stat.st_size, path))
        return entries

    def _prune(self) -> None:
        with self._lock:
            entries = sorted(self._scan())
            self._num_bytes = total = sum(size for _, size, _ in entries)
            target = self.max_bytes * 9 // 10
            for _, size, path in entries:
                if total <= target:
                    break
                path.unlink(missing_ok=True)
                total -= size
            self._num_bytes = total

    @property
    def num_bytes(self) -> int:
        """Bytes of values this directory holds (as this process counted them)."""
        return self._num_bytes

    def clear(self, key_prefix: str) -> int:
        namespace, fingerprint = key_prefix.rstrip(":").split(":", 1)
        folder = self.root / f"{namespace}-{fingerprint}"
        num_deleted = 0
        with self._lock:
            for path in folder.glob("*/*"):
                try:
                    size = path.stat().st_size
                    path.unlink()
                except FileNotFoundError:
                    continue
                num_deleted += 1
                self._num_bytes -= size
        return num_deleted
