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
    """Calibration data is missing, empty or non-finite."""

    exit_code = 1


class ExportError(CompressError):
    """ONNX export failed or produced a model that does not check."""

    exit_code = 1


class ValidationFailed(CompressError):
    """A validation threshold set in the recipe was missed."""

    exit_code = 3


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
