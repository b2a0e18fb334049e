"""ort_coverage's float ops left: float work ORT has an integer kernel for, counted by op type."""

from __future__ import annotations

from pathlib import Path

import onnx
from compress.export.validation.runtimes import ort_coverage
from onnx import TensorProto, helper


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


def test_float_output_of_an_integer_kernel_is_not_typed_as_codes(tmp_path: Path) -> None:
    """ONNX shape inference leaves contrib ops' outputs untyped; ort_coverage types QLinear* outputs
    as codes but not MatMulIntegerToFloat's (float), so a float MatMul after it still counts as float."""
    import numpy as np
    from onnx import numpy_helper

    inits = [numpy_helper.from_array(v, n) for n, v in [
        ("b", np.ones((4, 3), np.int8)), ("sa", np.array(0.1, np.float32)), ("sb", np.array(0.2, np.float32)),
        ("za", np.array(128, np.uint8)), ("zb", np.array(0, np.int8)), ("k", np.full((3, 5), 2.0, np.float32))]]
    nodes = [
        helper.make_node("MatMulIntegerToFloat", ["a", "b", "sa", "sb", "za", "zb"], ["m"], domain="com.microsoft"),
        helper.make_node("MatMul", ["m", "k"], ["y"]),
    ]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("a", TensorProto.UINT8, [2, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5])], inits)
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]),
              str(path))
    cov = ort_coverage(path)
    assert [f.split(":")[0] for f in cov.float_nodes] == ["MatMul"] and cov.float_left == {"MatMul": 1}, cov
