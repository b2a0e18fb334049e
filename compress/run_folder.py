"""The run folder: what ``compress apply`` may create, replace and delete.

A run folder carries a marker, ``.compress-run.json``, listing every file the run wrote. ``--overwrite``
and ``--resume`` delete only files on that list (and the run's own interrupted ``*.tmp`` writes), and
only in a folder that carries the marker; a file the run did not write is never removed: the run
is refused instead, naming it. The current folder, its parents, ``/``, the home folder and a
repository root are never cleared, marker or not.

The folder is a jail: every path read from it (the marker's list, checkpoints, the recipe) must
resolve inside it: no ``..``, no absolute path, no link that leads out. Anything else refuses the
whole ``--overwrite`` or ``--resume`` before a file is deleted or read. A run holds the folder's
lock (``.compress-run.lock``) from its first write to its end: a second run into the same folder is
refused, naming the holder; the lock of a killed run is released with its process and taken over.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

from compress.core.bounded import load_json_file
from compress.core.errors import RunFolderError
from compress.core.io import atomic_write_text
from compress.core.version import __version__

log = logging.getLogger(__name__)

MARKER = ".compress-run.json"
LOCK = ".compress-run.lock"
#: who holds the lock (pid, host, start, command): beside the lock file, which filelock truncates
OWNER = ".compress-run.owner.json"
#: the marker is a list of paths: a few MiB holds hundreds of thousands of them
MARKER_LIMIT = 16 * 2**20
_LOCKS = (LOCK, OWNER)


def is_temp(path: Path) -> bool:
    """Whether ``path`` (relative to the run folder) is an interrupted write of the run, safe to delete:
    ``.name.XXXX.tmp`` (core.io, export), ``name.pt.tmp`` (checkpoints), ``name.tmp.png`` (the plot),
    or a file in an LLM export's ``.llm_onnx.XXXX`` scratch folder or in a sharded checkpoint's folder being
    written or replaced (``name.dcp.tmp/``, ``name.dcp.old/``). A user's ``notes.tmp`` is none of these."""
    name = path.name
    if (name.startswith(".") and name.endswith(".tmp")) or name.endswith((".pt.tmp", ".tmp.png")):
        return True
    return any(part.startswith(".llm_onnx.") or part.endswith((".dcp.tmp", ".dcp.old")) for part in path.parts[:-1])


def _files(root: Path) -> set[str]:
    """Relative POSIX paths of the files under ``root`` (links are files here; never followed),
    the run lock's own two files left out."""
    out: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        base = Path(dirpath)
        out.update((base / f).relative_to(root).as_posix() for f in filenames)
        out.update((base / d).relative_to(root).as_posix() for d in dirnames if (base / d).is_symlink())
    return out - set(_LOCKS)


def _escapes(root: Path, rel: str) -> str | None:
    """Why the path ``rel``, read from the run folder ``root``, does not stay inside it, or None.
    The last part may itself be a link inside the folder (unlinking it removes the link alone)."""
    p = Path(rel)
    if p.is_absolute() or rel.startswith(("/", "\\")):
        return "is an absolute path"
    if not p.parts or any(part in ("..", "") for part in p.parts) or "\x00" in rel:
        return "leaves the folder through '..'" if ".." in p.parts else "is not a path inside the folder"
    real_root = root.resolve()
    if not (root / p).parent.resolve().is_relative_to(real_root):
        return f"leads out of the folder through a link (to {(root / p).parent.resolve()})"
    return None


def _legacy_name(rel: str) -> bool:
    """Whether ``rel`` is a name a run wrote before runs recorded their files."""
    top, _, rest = rel.partition("/")
    if not rest:
        return top in ("recipe.yaml", "report.json", "report.md", "accuracy_vs_size.png", "run.log")
    if top == "checkpoints":
        return "/" not in rest and rest.endswith(".pt")
    if top == "export":
        return rest.endswith((".onnx", ".onnx.data", ".json", ".txt", ".pbtxt", ".xml", ".bin", ".tokenizer.json"))
    return top == "artifacts"


def _holder(owner: Path) -> str:
    """``pid 123 on host since 12:00:00`` from the lock's owner file, as far as it can be read."""
    try:
        data = load_json_file(owner, limit=2**16, what="run lock owner")
        return f"pid {data['pid']} on {data['host']}, started {data['started']}: {data['command']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "owner unknown"


def _protected(out: Path) -> str | None:
    """Why ``out`` may never be cleared, or None."""
    real = out.resolve()
    if real == Path(real.anchor):
        return "it is the file-system root"
    if real == Path.home().resolve():
        return "it is the home folder"
    if Path.cwd().resolve().is_relative_to(real):
        return "it is the current folder or one of its parents"
    if (real / ".git").exists():
        return "it is a repository root (it holds .git)"
    return None


class RunFolder:
    """One run's folder. Every method is a no-op check or a write on rank 0 only (the caller decides)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.marker = self.path / MARKER
        # files found in the folder that the run did not write (a resumed run's folder may hold the
        # user's notes): never recorded as the run's unless the run itself rewrites them
        self._foreign: dict[str, int] = {}

    # ---- reading ---------------------------------------------------------------------------------
    def is_run(self) -> bool:
        """Whether the folder carries the marker of a compress run."""
        return self.marker.is_file()

    def is_legacy_run(self) -> bool:
        """A run folder written before the marker existed: recipe.yaml with run.log or report.json."""
        p = self.path
        return (not self.is_run() and (p / "recipe.yaml").is_file()
                and ((p / "run.log").is_file() or (p / "report.json").is_file()))

    def written(self) -> set[str]:
        """The files the run recorded as its own (for a pre-marker run folder: the files at the names
        such a run wrote)."""
        if self.is_legacy_run():
            return {f for f in _files(self.path) if _legacy_name(f)}
        if not self.is_run():
            return set()
        try:
            data = load_json_file(self.marker, limit=MARKER_LIMIT, what="run marker")
            files = data["files"]
            if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
                raise TypeError
        except (OSError, ValueError, KeyError, TypeError):
            raise RunFolderError(
                f"{self.marker}: the run marker is unreadable; cannot tell the run's files from others "
                "(move what you need out of the folder and delete it yourself, or choose another --out)"
            ) from None
        for f in files:
            why = _escapes(self.path, f)
            if why is not None:
                raise RunFolderError(
                    f"{self.marker}: lists {f!r}, which {why}; refusing to delete or read anything it names "
                    "(a run writes only inside its folder: this marker was not written by compress)"
                )
        return set(files)

    def foreign(self) -> list[str]:
        """Files in the folder the run did not write (sorted)."""
        ours = self.written() | {MARKER}
        return sorted(f for f in _files(self.path) if f not in ours and not is_temp(Path(f)))

    # ---- checks before anything is touched ----------------------------------------------------------
    def check(self, *, overwrite: bool, resume: bool) -> None:
        """Refuse, before any work, a folder this run must not write into or clear."""
        p = self.path
        if p.exists() and not p.is_dir():
            raise RunFolderError(f"--out {p}: exists and is not a folder")
        empty = not p.exists() or not any(e.name not in _LOCKS for e in p.iterdir())
        if resume:
            if not (p / "recipe.yaml").is_file():
                what = "does not exist" if not p.exists() else "is not a run folder (no recipe.yaml)"
                raise RunFolderError(f"--resume: {p} {what}; nothing to resume (drop --resume to start a run)")
            self._refuse_links_out("--resume")
            self._foreign = {f: (p / f).lstat().st_mtime_ns for f in self.foreign()}
            return
        if empty:
            return
        if not overwrite:
            raise RunFolderError(f"--out {p}: run folder exists and is not empty; pass --overwrite or --resume")
        why = _protected(p)
        if why:
            raise RunFolderError(f"--out {p} --overwrite: refusing to clear this folder, {why}; choose another --out")
        if not self.is_run() and not self.is_legacy_run():
            raise RunFolderError(
                f"--out {p} --overwrite: not a compress run folder (no {MARKER}); refusing to delete what "
                "it holds; choose another --out or empty it yourself"
            )
        self._refuse_links_out("--overwrite")
        self._refuse_foreign("--overwrite")

    def _refuse_links_out(self, flag: str) -> None:
        """A link in the folder that resolves outside it: the run would read or write through it."""
        real = self.path.resolve()
        for rel in sorted(_files(self.path)):
            link = self.path / rel
            if link.is_symlink() and not link.resolve().is_relative_to(real):
                raise RunFolderError(
                    f"--out {self.path} {flag}: {rel} is a link to {link.resolve()}, outside the run folder; "
                    "a run reads and writes only inside its folder: remove the link or choose another --out"
                )
        self.written()  # the marker's list, checked whole before anything is deleted

    def inside(self, rel: str) -> Path:
        """``rel`` under the folder, refused unless it resolves inside it (checkpoints, the recipe)."""
        why = _escapes(self.path, rel)
        target = self.path / rel
        if why is None and target.is_symlink() and not target.resolve().is_relative_to(self.path.resolve()):
            why = f"is a link to {target.resolve()}"
        if why is not None:
            raise RunFolderError(f"--out {self.path}: {rel} {why}, outside the run folder; refusing to read it")
        return target

    # ---- the lock --------------------------------------------------------------------------------
    @contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the folder's run lock for the block (the folder is created if need be); a second run
        is refused in one line naming the holder. The OS releases the lock of a killed process, so a
        stale lock is taken over, with a line saying whose it was."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunFolderError(f"--out {self.path}: cannot create the run folder ({exc.strerror or exc})") from None
        owner = self.path / OWNER
        held = FileLock(str(self.path / LOCK), timeout=0, is_singleton=False)
        try:
            held.acquire()
        except Timeout:
            raise RunFolderError(
                f"--out {self.path}: another compress run holds this folder ({_holder(owner)}); "
                "wait for it to finish or choose another --out"
            ) from None
        previous = _holder(owner) if owner.is_file() else None
        if previous is not None:
            log.warning("--out %s: took over the lock left by a run that ended without releasing it (%s)",
                        self.path, previous)
        atomic_write_text(owner, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                             "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                                             "command": " ".join(sys.argv)[:500]}) + "\n")
        try:
            yield
        finally:
            owner.unlink(missing_ok=True)
            held.release()

    def _refuse_foreign(self, flag: str) -> None:
        foreign = self.foreign()
        if foreign:
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            raise RunFolderError(
                f"--out {self.path} {flag}: {shown} {'was' if len(foreign) == 1 else 'were'} not written by the "
                "run; move them out of the folder or choose another --out"
            )

    # ---- writes ------------------------------------------------------------------------------------
    def clear(self) -> None:
        """Delete the previous run's files (for ``--overwrite``): only the recorded ones, then the
        folders they leave empty. The folder itself stays."""
        gone = [*self.written(), *self._remove_temps()]
        for rel in gone:
            (self.path / rel).unlink(missing_ok=True)
        self.marker.unlink(missing_ok=True)
        self._prune_empty_dirs(gone)

    def clear_unfinished(self, keep: tuple[str, ...] = ("recipe.yaml", "checkpoints/", "run.log")) -> None:
        """Before a resumed run: drop the interrupted writes of a killed attempt and the earlier
        attempt's outputs (reports, exports), so that report.json, written last, marks a complete run.
        Only files the run recorded are removed; anything else stays."""
        gone = [*self._remove_temps(), *(r for r in self.written() if not r.startswith(keep) and r != MARKER)]
        for rel in gone:
            (self.path / rel).unlink(missing_ok=True)
        self._prune_empty_dirs(gone)

    def _remove_temps(self) -> list[str]:
        """Delete the run's interrupted writes; their relative paths."""
        temps = sorted(rel for rel in _files(self.path) if is_temp(Path(rel)))
        for rel in temps:
            (self.path / rel).unlink(missing_ok=True)
        return temps

    def _prune_empty_dirs(self, removed: list[str]) -> None:
        """Remove the folders the removed files leave empty, deepest first; a folder of the user's
        that held none of them stays, empty or not."""
        dirs = {parent for rel in removed for parent in Path(rel).parents if parent != Path(".")}
        for rel_dir in sorted(dirs, key=lambda d: -len(d.parts)):
            d = self.path / rel_dir
            if d.is_dir() and not d.is_symlink() and not any(d.iterdir()):
                d.rmdir()

    def _still_foreign(self, rel: str) -> bool:
        mtime = self._foreign.get(rel)
        return mtime is not None and (self.path / rel).lstat().st_mtime_ns == mtime

    def record(self) -> None:
        """Add every file now in the folder to the run's list. Called at each point the run has
        written something (after setup, checkpoints, stages, export, at the end), so a run killed
        in between leaves at most its last few files unlisted."""
        files = (self.written() if self.is_run() else set()) | {
            f for f in _files(self.path)
            if not is_temp(Path(f)) and f != MARKER and not self._still_foreign(f)
        }
        payload = {"format": 1, "tool": "compress", "version": __version__, "files": sorted(files)}
        atomic_write_text(self.marker, json.dumps(payload, indent=1) + "\n")
