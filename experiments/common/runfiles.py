"""The files of a run folder: atomic writes, strict JSON, the folder lock and its checks.

Every file is written to a temporary file of a unique name beside it and moved into place
with ``os.replace``, so a reader (or a run killed at any instant) sees the old file or the
new one, never a part. A run holds an advisory lock (``fcntl.flock``) on ``.lock`` in its
folder for its whole life; the operating system releases it when the process ends, however
it ends, so a killed run leaves no stale lock.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import pickle
import re
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch

LOCK = ".lock"
_TEMPORARY = re.compile(r"\..+\.[0-9]+\.[0-9a-f]{8}\.tmp")


class RunError(Exception):
    """A run that cannot start or go on; the message is the one line the user sees."""


class FolderInUseError(RunError):
    """Another process holds the run folder's lock."""


class CorruptFileError(RunError):
    """A run file that cannot be read back."""


def _temporary(path: Path) -> Path:
    """A fresh name beside ``path``: ``.NAME.PID.RANDOM.tmp`` (two writers never share one)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def _is_temporary(name: str) -> bool:
    return _TEMPORARY.fullmatch(name) is not None


def write_atomic(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Call ``write`` on a new temporary file, flush it to disk, then move it onto ``path``."""
    tmp = _temporary(path)
    try:
        with tmp.open("xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: Path, text: str) -> None:
    write_atomic(path, lambda f: f.write(text.encode()))


def write_json(path: Path, obj: Any) -> None:
    """Strict JSON (a non-finite float is a ``ValueError``, never a bare ``NaN``), atomically."""
    write_text(path, json.dumps(obj, indent=2, allow_nan=False) + "\n")


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """One strict JSON object per line, atomically."""
    write_text(path, "".join(json.dumps(r, allow_nan=False) + "\n" for r in rows))


def save_torch(path: Path, state: dict[str, Any]) -> None:
    write_atomic(path, lambda f: torch.save(state, f))


def read_json(path: Path) -> Any:
    """A JSON file, or :class:`CorruptFileError` naming it."""
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CorruptFileError(f"{path} is not valid JSON ({err})") from None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file (none if it is missing), or :class:`CorruptFileError`."""
    if not path.exists():
        return []
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CorruptFileError(f"{path} is not valid JSON lines ({err})") from None


def load_torch(path: Path) -> Any:
    """A checkpoint (``weights_only``), or :class:`CorruptFileError` naming it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as err:
        if isinstance(err, (FileNotFoundError, PermissionError)):
            raise
        raise CorruptFileError(
            f"checkpoint {path} is corrupt or truncated (torch.load: {type(err).__name__}); "
            "restore it, or move it away and train into a new folder"
        ) from None


def nonfinite(obj: Any, where: str = "") -> list[str]:
    """The keys (``a.b.c``) of every NaN or infinite float in nested dicts and lists."""
    if isinstance(obj, float):
        return [] if math.isfinite(obj) else [where or "value"]
    if isinstance(obj, dict):
        items = list(obj.items())
    elif isinstance(obj, list):
        items = list(enumerate(obj))
    else:
        return []
    return [k for key, v in items for k in nonfinite(v, f"{where}.{key}" if where else str(key))]


def all_finite(tensors: Iterator[torch.Tensor] | list[torch.Tensor]) -> bool:
    """Whether every entry of every floating-point tensor is finite (one sync per device)."""
    flags = [torch.isfinite(t).all() for t in tensors if t.is_floating_point()]
    devices = {f.device for f in flags}
    return all(bool(torch.stack([f for f in flags if f.device == d]).all()) for d in devices)


@contextmanager
def locked(folder: Path) -> Iterator[Path]:
    """Create ``folder`` and hold its lock until the block ends; refuse if another holds it.

    The lock file records the holder's process id, which the refusal names. A block that
    fails leaving the folder with nothing but its lock (a failed start) takes back what this
    call made: the lock file, then the folders it created; a folder that held anything
    before is left as it was.
    """
    if folder.exists() and not folder.is_dir():
        raise RunError(f"{folder} is a file, not a folder; choose another --out")
    made = [p for p in (folder, *folder.parents) if not p.exists()]  # innermost first
    folder.mkdir(parents=True, exist_ok=True)
    fd, created = _open_lock(folder / LOCK)
    try:
        _hold(fd, folder)
        try:
            yield folder
        except BaseException:
            if not contents(folder):
                _take_back(folder / LOCK if created else None, made)
            raise
    finally:
        os.close(fd)  # releases the lock


def _open_lock(path: Path) -> tuple[int, bool]:
    """A descriptor of the lock file ``path``, and whether this call created it."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
    except FileExistsError:
        return os.open(path, os.O_RDWR), False


def _hold(fd: int, folder: Path) -> None:
    """Lock ``fd``, the lock file of ``folder``, and write this process's id into it; refuse
    if another process holds it, or took the file back since it was opened (its start
    failed: the file locked would no longer be the folder's)."""
    path = folder / LOCK
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        raise FolderInUseError(
            f"{folder} is in use by another run (process {holder} holds {path}); "
            "wait for it to end or choose another --out"
        ) from None
    if not (path.exists() and os.path.samestat(os.fstat(fd), path.stat())):
        raise FolderInUseError(f"another run was starting in {folder}; try again")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)


def _take_back(lock: Path | None, made: list[Path]) -> None:
    """Delete ``lock`` (None: keep the folder's) and the empty folders of ``made``,
    innermost first, stopping at one that holds anything (another run's start)."""
    if lock is not None:
        lock.unlink(missing_ok=True)
    for folder in made:
        try:
            folder.rmdir()
        except OSError:
            return


def contents(folder: Path) -> list[str]:
    """What a run folder holds besides its lock and the leftovers of interrupted writes."""
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.name != LOCK and not _is_temporary(p.name))


def remove_leftovers(folder: Path) -> None:
    """Delete temporary files of writes that a kill interrupted (call with the lock held)."""
    for path in folder.iterdir():
        if _is_temporary(path.name):
            path.unlink(missing_ok=True)
