"""What a user can get wrong, and interruptions: each a clear ExportError and never a partial file."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
import torch
from compress.export.onnx import export_onnx
from torch import nn

from compress.core.errors import ExportError, RecipeError
from compress.models import build_zoo_model


@torch.library.custom_op("compress_test::mystery", mutates_args=())
def _mystery(x: torch.Tensor) -> torch.Tensor:
    return x.sin()


@_mystery.register_fake
def _mystery_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class _Unsupported(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.compress_test.mystery(self.fc(x))


def _leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_unsupported_op(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"_Unsupported.*mystery"):
        export_onnx(_Unsupported(), torch.randn(2, 4), tmp_path / "m.onnx")
    assert _leftovers(tmp_path) == []


def test_wrong_example_shape(tmp_path: Path) -> None:
    model = build_zoo_model("resnet", {"width": 4})  # 1 input channel
    with pytest.raises(ExportError, match=r"example input \[\(2, 3, 8, 8\) float32\] does not fit ResNet"):
        export_onnx(model, torch.randn(2, 3, 8, 8), tmp_path / "m.onnx")
    assert _leftovers(tmp_path) == []


def test_unwritable_path(tmp_path: Path) -> None:
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a directory")
    with pytest.raises(ExportError, match="cannot create directory"):
        export_onnx(nn.Linear(4, 2), torch.randn(2, 4), blocker / "m.onnx")
    with pytest.raises(ExportError, match=r"must end in \.onnx"):
        export_onnx(nn.Linear(4, 2), torch.randn(2, 4), tmp_path / "m.txt")


def test_bad_example_type(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="example_inputs must be"):  # the caller's input: exit 2
        export_onnx(nn.Linear(4, 2), "not a tensor", tmp_path / "m.onnx")


def test_interrupted_export_leaves_no_partial_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    target = tmp_path / "m.onnx"
    export_onnx(model, torch.randn(2, 4), target)
    before = target.read_bytes()

    def interrupted_save(proto: onnx.ModelProto, f: str, *args: object, **kwargs: object) -> None:
        Path(f).write_bytes(proto.SerializeToString()[:100])  # half a file, then the process is stopped
        raise KeyboardInterrupt

    monkeypatch.setattr(onnx, "save_model", interrupted_save)
    with pytest.raises(KeyboardInterrupt):
        export_onnx(nn.Sequential(nn.Linear(4, 3)), torch.randn(2, 4), target)
    assert target.read_bytes() == before  # the previous good file is untouched
    assert _leftovers(tmp_path) == ["m.onnx"]  # and no temp file is left behind
    monkeypatch.undo()
    onnx.checker.check_model(str(target))


def test_large_model_goes_to_external_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import compress.export.files as eo
    import numpy as np
    import onnxruntime as ort

    monkeypatch.setattr(eo, "_SINGLE_FILE_LIMIT", 10_000)  # stands in for protobuf's 2 GB limit
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    x = torch.randn(3, 64)
    path = export_onnx(model, x, tmp_path / "big.onnx")
    assert _leftovers(tmp_path) == ["big.onnx", "big.onnx.data"]
    assert path.stat().st_size < 10_000
    out = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input": x.numpy()})[0]
    np.testing.assert_allclose(out, model(x).detach().numpy(), atol=1e-5, rtol=0)
