"""Atomic file writes: a reader never sees a half-written file, an interrupted write leaves none."""

from __future__ import annotations

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


def safe_torch_load(path: Path, *, where: str | None = None) -> Any:
    """``torch.load(path, weights_only=True)`` with one-line RecipeErrors: a file that needs code to
    load (a pickled module) is refused, and never with torch's advice to turn the check off; a
    truncated or foreign file is named. ``where`` prefixes the message (a recipe field and line)."""
    import pickle

    import torch

    from compress.core.errors import RecipeError

    at = f"{where}: " if where else ""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "Unsupported global" not in str(exc) and not _looks_pickled(path):  # a foreign or broken file
            why = str(exc).split("WeightsUnpickler error:")[-1].strip().splitlines()
            raise RecipeError(f"{at}{path}: not a readable checkpoint ({(why or [''])[0][:200]})") from None
        raise RecipeError(
            f"{at}{path}: holds pickled Python objects, not only tensors (e.g. a module saved with "
            "torch.save(model)); compress loads with weights_only=True and will not run code from a file: "
            "save model.state_dict() instead"
        ) from None
    except Exception as exc:  # a truncated or foreign file is the user's input
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise RecipeError(f"{at}{path}: not a readable checkpoint ({type(exc).__name__}: {first})") from None


def _looks_pickled(path: Path) -> bool:
    """Whether the file starts like a pickle (protocol 2+) or torch's zip format."""
    try:
        with open(path, "rb") as f:
            head = f.read(2)
    except OSError:
        return False
    return head[:1] == b"\x80" or head == b"PK"
