"""Checked, atomic ONNX files: the path checks before an export, onnx.checker, and saves through a
temp file beside the target then ``os.replace`` (weights as external data past protobuf's 2 GiB), so
an interrupted export never leaves a partial file."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import onnx

from compress.core.errors import ExportError
from compress.core.io import umask_mode

#: protobuf's hard limit is 2 GiB; stay clear of it (the serialized size grows a little on save)
_SINGLE_FILE_LIMIT = 2**31 - 64 * 2**20


def check_model(proto: onnx.ModelProto, path: Path) -> None:
    """onnx.checker with full shape inference (a file past the single-file limit is checked on disk by
    :func:`atomic_save`); ExportError naming the file and the first line of what failed."""
    if proto.ByteSize() >= _SINGLE_FILE_LIMIT:
        return  # checked on disk after saving with external data
    try:
        onnx.checker.check_model(proto, full_check=True)
    except Exception as exc:
        raise ExportError(f"exported model for {path.name} does not pass onnx.checker: {str(exc).splitlines()[0]}") from exc


def check_writable(path: Path) -> None:
    """Refuse, before any tracing, a path the export could not write: ExportError saying why."""
    if path.suffix != ".onnx":
        raise ExportError(f"export path '{path}' must end in .onnx")
    parent = path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ExportError(f"cannot create directory '{parent}' for '{path.name}': {exc.strerror}") from None
    if path.is_dir():
        raise ExportError(f"export path '{path}' is a directory")
    if not os.access(parent, os.W_OK):
        raise ExportError(f"directory '{parent}' is not writable; cannot write '{path.name}'")


def atomic_save(proto: onnx.ModelProto, path: Path) -> None:
    """Write to temp files beside ``path`` then ``os.replace``: never a half-written model. Above
    2 GB the weights go to ``<name>.data`` beside the model (protobuf cannot hold them)."""
    external = proto.ByteSize() >= _SINGLE_FILE_LIMIT
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    data_name = path.name + ".data"
    tmp_data = path.parent / f".{data_name}.tmp"
    try:
        if external:
            onnx.save_model(proto, tmp, save_as_external_data=True, all_tensors_to_one_file=True,
                            location=tmp_data.name, size_threshold=1024)
            onnx.checker.check_model(tmp)
            _relocate_external(tmp, tmp_data.name, data_name)
            os.replace(tmp_data, path.parent / data_name)
        else:
            onnx.save_model(proto, tmp)
        os.chmod(tmp, umask_mode())  # mkstemp makes it 0600; the file gets the mode open() would give
        if external:
            os.chmod(path.parent / data_name, umask_mode())
        os.replace(tmp, path)
    except OSError as exc:
        raise ExportError(f"cannot write '{path}': {exc.strerror or exc}") from None
    except onnx.checker.ValidationError as exc:
        raise ExportError(f"exported model for {path.name} does not pass onnx.checker: {str(exc).splitlines()[0]}") from exc
    finally:
        for leftover in (Path(tmp), tmp_data):
            if leftover.exists():
                leftover.unlink()


def _relocate_external(model_path: str, old: str, new: str) -> None:
    """Point external-data references at the final data file name before the rename."""
    m = onnx.load(model_path, load_external_data=False)
    for t in m.graph.initializer:
        for entry in t.external_data:
            if entry.key == "location" and entry.value == old:
                entry.value = new
    onnx.save_model(m, model_path)
