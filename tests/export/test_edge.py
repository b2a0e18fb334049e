"""Edge options: fp16 float parts, metadata props, Triton model repository, simplification kept QDQ."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from compress.export.pipeline import export_model

from compress.recipe import ExportSpec


def test_fp16_export(trained_resnet: Any, tmp_path: Path) -> None:
    from compress.export.onnx import export_onnx

    torch.manual_seed(2)
    x = torch.rand(5, 1, 8, 8) * 16
    path = export_onnx(trained_resnet, x, tmp_path / "m.fp16.onnx", fp16=True)
    m = onnx.load(str(path))
    floats = [t for t in m.graph.initializer if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)]
    assert floats and all(t.data_type == onnx.TensorProto.FLOAT16 for t in floats if len(t.dims) >= 2)
    assert m.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT  # callers keep feeding fp32
    out = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input": x.numpy()})[0]
    ref = trained_resnet(x).detach().numpy()
    assert np.abs(out - ref).max() < 0.05 * np.abs(ref).max()
    assert (out.argmax(1) == ref.argmax(1)).all()


def test_metadata_props(int8_path: Path, fp32_path: Path) -> None:
    import compress

    for path, role in ((int8_path, "final"), (fp32_path, "baseline")):
        props = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
        assert props["compress.version"] == compress.__version__
        assert props["recipe.hash"] == "abc123" and props["compress.role"] == role
    props = {p.key: p.value for p in onnx.load(str(int8_path)).metadata_props}
    assert props["compress.precision"] == "int8-qdq"


def test_triton_repository(trained_resnet: Any, digits: Any, tmp_path: Path) -> None:
    spec = ExportSpec(triton_repository=True, baseline=False)
    recs = export_model(trained_resnet, digits.example_inputs, spec, tmp_path, name="digits")
    model_dir = recs[0].triton_dir
    assert model_dir is not None and (model_dir / "1" / "model.onnx").is_file()
    config = (model_dir / "config.pbtxt").read_text()
    assert 'name: "digits_final"' in config and 'backend: "onnxruntime"' in config
    assert "max_batch_size: 32" in config and "dims: [ 1, 8, 8 ]" in config and "dims: [ 10 ]" in config
    assert (model_dir / "1" / "model.onnx").read_bytes() == recs[0].path.read_bytes()
