"""The error taxonomy. Every error a user can cause is one of these, with a one-line message."""

from __future__ import annotations


class CompressError(Exception):
    """Base of all toolkit errors. ``exit_code`` is what the CLI exits with."""

    exit_code: int = 1


class RecipeError(CompressError):
    """A recipe, an override or an argument is invalid (names the field and the YAML line)."""

    exit_code = 2


class TargetMatchError(CompressError):
    """A target or ignore pattern matched no module."""

    exit_code = 2


class UnsupportedModelError(CompressError):
    """The model holds an op or structure a transform cannot handle correctly."""

    exit_code = 2


class CalibrationError(CompressError):
    """Calibration data is missing, empty, non-finite or not what the model takes."""

    exit_code = 2


class DataError(CompressError):
    """Data (a data source, a batch, a loss) is unusable: wrong shape, non-finite, labels the model
    cannot predict. Names the data source and, during training, the step."""

    exit_code = 2


class RunFolderError(RecipeError):
    """The run folder (``--out``) may not be written, cleared or resumed as asked (an argument
    error, hence a RecipeError)."""


class StorageError(CompressError):
    """A file could not be written: disk full, no permission, read-only file system."""

    exit_code = 2


class ExportError(CompressError):
    """ONNX export failed or produced a model that does not check."""

    exit_code = 1


class ValidationFailed(CompressError):
    """A validation threshold set in the recipe was missed."""

    exit_code = 3


# errno values that mean the user's disk or permissions, not a bug of ours
_STORAGE_ERRNOS = {"ENOSPC", "EDQUOT", "EACCES", "EPERM", "EROFS", "EFBIG", "EMFILE", "EIO"}


def storage_error(exc: BaseException) -> StorageError | None:
    """A StorageError (exit 2, one line naming the file) for an OSError the user's machine caused
    (disk full, no permission, read-only); None for anything else."""
    import errno

    if not isinstance(exc, OSError) or errno.errorcode.get(exc.errno or -1) not in _STORAGE_ERRNOS:
        return None
    where = f"'{exc.filename}'" if exc.filename else "a file"
    return StorageError(f"cannot write {where}: {exc.strerror or exc}")


def validation_message(exc: Exception) -> str:
    """A pydantic ValidationError as one line: ``field.path: what is wrong (got X)``, without the
    documentation URL and the multi-line layout."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return " ".join(str(exc).split())
    err = errors()[0]
    # union branches add tags such as 'constrained-float' or "literal['auto']": not field names
    loc = ".".join(str(p) for p in err.get("loc", ()) if not isinstance(p, str) or p.isidentifier())
    msg = str(err.get("msg", "")).removeprefix("Value error, ")
    if err.get("type") == "extra_forbidden":
        msg = "unknown field"
    got = err.get("input")
    shown = f" (got {got!r})" if err.get("type") not in ("missing",) and not isinstance(got, dict) else ""
    return f"{loc}: {msg}{shown}" if loc else f"{msg}{shown}"


def closest(name: str, choices: list[str] | tuple[str, ...] | set[str]) -> str | None:
    """The closest valid name to a typo, or None when nothing is close."""
    import difflib

    hits = difflib.get_close_matches(name, sorted(choices), n=1, cutoff=0.6)
    return hits[0] if hits else None


def did_you_mean(name: str, choices: list[str] | tuple[str, ...] | set[str]) -> str:
    """A ``valid: a, b, c (did you mean 'x'?)`` suffix for error messages."""
    valid = ", ".join(sorted(choices))
    hint = closest(name, choices)
    return f"valid: {valid}" + (f" (did you mean '{hint}'?)" if hint else "")
