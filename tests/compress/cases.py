"""What the fault tests share: the tiny recipe a run finishes in seconds, and the one-line check."""

from __future__ import annotations

from typing import Any

import yaml

#: an MLP on digits, one baseline epoch, PTQ, small validation: a whole run in a few seconds
TINY_YAML = """\
version: 1
name: tiny
model: {name: mlp, kwargs: {hidden: 16, depth: 1, num_classes: 10, in_features: 64}}
data: {source: digits, calibration_samples: 32, eval_samples: 64}
train: {epochs: 1, batch_size: 64, lr: 0.1, seed: 0}
stages: [{name: ptq, modifiers: [{type: ptq, scheme: w8a8}]}]
validate: {batch_sizes: [1], warmup: 0, runs: 2}
"""

#: the same recipe without export and validation (a run that is refused, or resumed, gets no further)
NO_EXPORT_YAML = TINY_YAML.replace("validate: {batch_sizes: [1], warmup: 0, runs: 2}", "export: {enabled: false}")


def tiny(**top: Any) -> dict[str, Any]:
    """The tiny recipe as data, top-level sections replaced by ``top`` (``export={"enabled": False}``)."""
    return {**yaml.safe_load(TINY_YAML), **top}


def one_error_line(err: str) -> str:
    """The one ``compress: error:`` line a bad input prints (INFO lines aside), with no traceback."""
    lines = [ln for ln in err.strip().splitlines() if ln.strip() and " INFO " not in ln]
    assert len(lines) == 1 and lines[0].startswith("compress: error:"), err
    assert "Traceback" not in err and "internal error" not in err
    return lines[0]
