"""fp32 export: parity with PyTorch in onnxruntime (atol 1e-4), named IO, dynamic and static batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from compress.export.onnx import export_onnx

from compress.models import build_zoo_model


def _ort(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_resnet_fp32_parity_dynamic_batch(trained_resnet: torch.nn.Module, fp32_path: Path) -> None:
    sess = _ort(fp32_path)
    assert [i.name for i in sess.get_inputs()] == ["input"]
    assert [o.name for o in sess.get_outputs()] == ["output"]
    torch.manual_seed(1)
    for n in (1, 5):  # dynamic batch: a size other than the example's works
        x = torch.randn(n, 1, 8, 8)
        out = sess.run(None, {"input": x.numpy()})[0]
        np.testing.assert_allclose(out, trained_resnet(x).detach().numpy(), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("name", "kwargs", "shape"),
    [
        ("mobilenetv2", {"width_mult": 0.25}, (3, 1, 8, 8)),
        ("vit", {}, (3, 1, 8, 8)),
        ("mlp", {}, (3, 1, 8, 8)),
    ],
)
def test_zoo_models_fp32_parity(name: str, kwargs: dict[str, Any], shape: tuple[int, ...], tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build_zoo_model(name, kwargs).eval()
    x = torch.randn(*shape)
    path = export_onnx(model, x, tmp_path / f"{name}.onnx")
    out = _ort(path).run(None, {"input": x.numpy()})[0]
    np.testing.assert_allclose(out, model(x).detach().numpy(), atol=1e-4, rtol=0)


def test_static_shapes_and_opset(trained_resnet: torch.nn.Module, tmp_path: Path) -> None:
    x = torch.randn(4, 1, 8, 8)
    path = export_onnx(trained_resnet, x, tmp_path / "static.onnx", dynamic_batch=False, opset=18, simplify=False)
    m = onnx.load(str(path))
    dims = [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [4, 1, 8, 8]
    assert next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx")) == 18
    out = _ort(path).run(None, {"input": x.numpy()})[0]
    np.testing.assert_allclose(out, trained_resnet(x).detach().numpy(), atol=1e-4, rtol=0)


def test_bert_fp32_parity_dynamic_sequence(tiny_bert: Any, text_batch: Any, tmp_path: Path) -> None:
    model = tiny_bert()
    path = export_onnx(model, text_batch(2, 12, seed=0), tmp_path / "bert.onnx")
    sess = _ort(path)
    assert [o.name for o in sess.get_outputs()] == ["last_hidden_state", "pooler_output"]
    batch = text_batch(3, 9, seed=1)  # other batch and sequence length than the example
    feeds = {i.name: batch[i.name].numpy() for i in sess.get_inputs()}
    out = sess.run(None, feeds)
    ref = model(**batch)
    np.testing.assert_allclose(out[0], ref.last_hidden_state.detach().numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(out[1], ref.pooler_output.detach().numpy(), atol=1e-4, rtol=0)


def test_export_leaves_the_model_as_it_was(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 2)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    path = export_onnx(model, torch.randn(2, 4), tmp_path / "m.onnx")
    assert model.training  # restored after the eval-mode export
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    x = torch.randn(3, 4)
    out = _ort(path).run(None, {"input": x.numpy()})[0]
    np.testing.assert_allclose(out, model.eval()(x).detach().numpy(), atol=1e-5, rtol=0)  # exported in eval mode


def test_batch_one_example_still_exports_a_dynamic_batch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)).eval()
    path = export_onnx(model, torch.randn(1, 6), tmp_path / "m.onnx")  # torch.export specializes size-1 dims
    dim0 = onnx.load(str(path)).graph.input[0].type.tensor_type.shape.dim[0]
    assert not dim0.HasField("dim_value")
    x = torch.randn(3, 6)
    np.testing.assert_allclose(_ort(path).run(None, {"input": x.numpy()})[0], model(x).detach().numpy(), atol=1e-5)
