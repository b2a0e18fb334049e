"""The int8 export carries no shape computation its fp32 export does not (issue 32).

Op counts of the raw exported files (before any runtime optimizer), fp32 against w8a8 QDQ int8 of
the same model, on a Swin-style windowed-attention model written the torchvision way
(benchmarks/pattern_models.py: F.pad, torch.roll, view/permute window partition, a relative-position
bias gathered from a table, a shift mask built by slice assignment) and on a transformers BERT.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from compress.export.onnx import export_onnx

import compress
from benchmarks.pattern_models import window_transformer

#: ops that compute shapes, indices or constants at run time
SHAPE_OPS = ("Shape", "Gather", "Slice", "Concat", "Unsqueeze", "Squeeze", "ConstantOfShape", "Range", "Where",
             "Equal", "Expand", "ScatterND")


def _counts(path: Path) -> collections.Counter[str]:
    """Op counts; a Gather from an initializer (an embedding table's rows, int8 codes and row scales
    alike) is a lookup, counted apart as ``TableGather``."""
    g = onnx.load(str(path)).graph
    tables = {i.name for i in g.initializer}
    return collections.Counter("TableGather" if n.op_type == "Gather" and n.input[0] in tables else n.op_type
                               for n in g.node)


def _export_pair(model: torch.nn.Module, example: object, calib: Sequence[Any], tmp: Path, *,
                 dynamic: bool = True) -> tuple[collections.Counter[str], collections.Counter[str], Path, Path]:
    fp, q8 = tmp / "fp32.onnx", tmp / "int8.onnx"
    export_onnx(copy.deepcopy(model), example, fp, dynamic_batch=dynamic)
    q = compress.quantize(model, "w8a8", calib)
    export_onnx(q, example, q8, dynamic_batch=dynamic)
    return _counts(fp), _counts(q8), fp, q8


@pytest.mark.slow  # 30 s in a full run: fp32 and int8 exports of a window transformer, run in ORT
def test_window_attention_int8_adds_no_shape_ops(tmp_path: Path) -> None:
    pm = window_transformer(0, size=32, batch=2, n=2, dim=16, heads=(2, 2))
    a, b, fp, q8 = _export_pair(pm.model, pm.example, pm.calibration, tmp_path)
    extra = {op: (a[op], b[op]) for op in SHAPE_OPS if b[op] > a[op]}
    assert not extra, f"int8 export adds shape computation (fp32, int8): {extra}"
    # each Linear on 3-D input becomes Reshape -> Gemm -> Reshape (so ORT fuses its bias into QGemm)
    assert b["Reshape"] <= a["Reshape"] + 2 * b["Gemm"]
    # and the int8 file computes what the fp32 file computes
    import onnxruntime as ort

    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(5)).numpy()
    outs = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0] for p in (fp, q8)]
    sqnr = 10 * np.log10((outs[0] ** 2).mean() / ((outs[0] - outs[1]) ** 2).mean())
    assert sqnr > 10, sqnr


def test_bert_int8_adds_no_shape_ops(tmp_path: Path) -> None:
    """Static shapes: batch and sequence fixed at export. (With a dynamic batch and sequence a
    Linear's output shape is not known at export; the Gemm form then reads it at run time.)"""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=32)
    model = transformers.BertModel(cfg).eval()
    g = torch.Generator().manual_seed(1)
    calib = [{"input_ids": torch.randint(0, 128, (2, 16), generator=g)} for _ in range(2)]
    a, b, _, _ = _export_pair(model, calib[0], calib, tmp_path, dynamic=False)
    extra = {op: (a[op], b[op]) for op in SHAPE_OPS if b[op] > a[op]}
    assert not extra, f"int8 export adds shape computation (fp32, int8): {extra}"
