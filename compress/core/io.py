"""Atomic file writes: a reader never sees a half-written file, an interrupted write leaves none."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp makes the file 0600; give it the mode open() would (0666 less the umask), as the
        # rest of the run folder has
        os.chmod(tmp, umask_mode())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def umask_mode() -> int:
    """The mode ``open()`` gives a new file: 0666 less the process's umask."""
    mask = os.umask(0o022)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write_text(path: Path, text: str) -> None:
    """Text form of :func:`atomic_write_bytes` (UTF-8)."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_torch_save(obj: object, path: Path) -> None:
    """``torch.save`` through a temporary file and a rename; a failed write (disk full) leaves no file."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except RuntimeError as exc:  # torch's zip writer reports a failed write (a full disk) as RuntimeError
        tmp.unlink(missing_ok=True)
        raise write_failure(path, exc) from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_failure(path: Path, exc: BaseException) -> OSError:
    """An OSError for a write that failed inside a library (torch, onnx): ENOSPC when the file
    system is (nearly) full, EIO otherwise; the CLI reports either as one line (exit 2)."""
    import errno
    import shutil

    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        free = None
    if free is not None and free < 4 << 20:
        return OSError(errno.ENOSPC, f"No space left on device ({free} bytes free)", str(path))
    return OSError(errno.EIO, f"write failed ({' '.join(str(exc).split())[:160]})", str(path))


def safe_torch_load(path: Path, *, where: str | None = None, hint: str | None = None, mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` with one-line RecipeErrors (exit 2) naming the file: a
    corrupt or truncated checkpoint, a file torch did not write, and a file that needs code to load (a
    pickled module), never with torch's advice to turn the check off. ``where`` prefixes the message
    (a recipe field and line, ``--resume``); ``hint`` ends it (what to do, e.g. for a run folder).
    ``mmap`` maps the tensors instead of reading them (a cheap check that a file loads)."""
    import pickle

    import torch

    from compress.core.errors import RecipeError

    at = f"{where}: " if where else ""
    then = f"; {hint}" if hint else ""
    head = _head(path)
    try:
        # mmap reads only torch's zip format; an older (pickle-stream) file loads as before
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and head == b"PK")
    except pickle.UnpicklingError as exc:
        # a global to import, or a bare pickle stream (pickle.dump) with opcodes torch's weights-only
        # reader refuses: code, not tensors; a broken zip or a stream that ends early: a damaged file
        cut = any(w in str(exc).lower() for w in ("truncated", "ran out of input", "eof"))
        if "Unsupported global" in str(exc) or (head is not None and head[:1] == b"\x80" and not cut):
            raise RecipeError(
                f"{at}{path}: holds pickled Python objects, not only tensors (e.g. a module saved with "
                "torch.save(model)); compress loads with weights_only=True and will not run code from a file: "
                f"save model.state_dict() instead{then}"
            ) from None
        why = _first_line(str(exc).split("WeightsUnpickler error:")[-1])
        raise RecipeError(_unreadable(path, head, why, at=at, then=then)) from None
    except Exception as exc:  # a truncated, corrupt or foreign file is the user's input
        if isinstance(exc, OSError) and exc.errno in (errno.ENOENT, errno.EISDIR, errno.EACCES, errno.EPERM):
            raise RecipeError(f"{at}{path}: cannot read checkpoint ({exc.strerror or exc}){then}") from None
        text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        why = f"{type(exc).__name__}: {_first_line(text)}".rstrip(": ")
        raise RecipeError(_unreadable(path, head, why, at=at, then=then)) from None


def _unreadable(path: Path, head: bytes | None, why: str, *, at: str, then: str) -> str:
    """The message for a checkpoint torch cannot read: corrupt or truncated when it starts like a
    file torch writes (or is empty), else not a checkpoint at all."""
    size = _size(path)
    if head is not None and (head in (b"PK", b"") or head[:1] == b"\x80"):
        return f"{at}checkpoint {path} is corrupt or truncated ({size} bytes; {why}){then}"
    return f"{at}{path}: not a readable checkpoint (not a file torch.save wrote; {why}){then}"


def _first_line(text: str) -> str:
    """The first non-empty line of an error message, without miniz's advice, at most 200 characters."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line.split(" This is an internal miniz error")[0][:200]


def _size(path: Path) -> str:
    try:
        return f"{os.path.getsize(path):,}"
    except OSError:
        return "?"


def _head(path: Path) -> bytes | None:
    """The first two bytes of the file (None when it cannot be read): b"PK" is torch's zip format,
    0x80 a pickle stream (protocol 2+)."""
    try:
        with open(path, "rb") as f:
            return f.read(2)
    except OSError:
        return None
