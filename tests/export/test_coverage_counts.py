"""ort_coverage's float ops left: float work ORT has an integer kernel for, counted by op type."""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

from export.runtimes import ort_coverage


def test_float_ops_left_count_float_work_not_index_arithmetic(tmp_path: Path) -> None:
    f, i64, b = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
    nodes = [
        helper.make_node("Mul", ["x", "x"], ["m"]),
        helper.make_node("Where", ["c", "m", "x"], ["w"]),  # a boolean condition, float values
        helper.make_node("Softmax", ["w"], ["y"], axis=-1),
        helper.make_node("Add", ["n", "n"], ["k"]),  # index arithmetic on int64
    ]
    g = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", f, [2, 3]), helper.make_tensor_value_info("c", b, [2, 3]),
         helper.make_tensor_value_info("n", i64, [2])],
        [helper.make_tensor_value_info("y", f, [2, 3]), helper.make_tensor_value_info("k", i64, [2])])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    cov = ort_coverage(path)
    assert cov.float_left == {"Mul": 1, "Softmax": 1, "Where": 1}, cov.float_left
