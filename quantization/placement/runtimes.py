"""Runtime profiles: where each target runtime wants activation quantizers, as data.

A runtime turns a QDQ graph into integer kernels by matching patterns around each op; a quantizer
in the wrong place leaves the op in float (and can make the int8 model slower than fp32). Each
profile says, per op kind (see quantization/placement/trace.py):

- ``inputs``: which activation operands get a quantizer: ``"all"`` (every floating activation
  operand), ``"residual"`` (for adds: only the operand not made by a weighted op, as TensorRT's
  explicit-quantization rules ask) or ``"none"``;
- ``output``: the runtime fuses the op only when its output goes to a quantizer (ORT's QDQ
  selectors: QLinearConv, QLinearAdd, QLinearConcat, QLinearAveragePool);
- ``shared``: inputs and output share one scale (concat needs no requantization then);
- ``fold_output``: when a foldable activation follows, quantize after it even if no reader asks
  (ORT fuses a Gemm and its Relu into a float FusedGemm before its QDQ fusion otherwise);
- ``constants``: the op fuses also when an operand is a constant (a parameter or buffer, a Python
  number, a tensor made outside the traced ops) or an activation broadcast against the other
  (position embeddings, ``var + eps``, GELU's ``1 + tanh``, attention biases): every floating operand
  gets a per-tensor quantizer, a constant its own, calibrated from its value (ORT's QLinearAdd takes
  a quantized initializer and broadcasts).

``fold``: activations that fold into the producer's output quantizer (ORT drops a Relu/Clip whose
Q clamps the same range); ``pass_through``: ops after which a tensor keeps its quantizer (the
runtime drops DQ -> op -> Q with equal scales around them); ``extend``: elementwise ops with an
integer kernel that pays off only when their inputs are quantized anyway (between two integer
convs): they get an output quantizer then, and SiLU (hardswish) runs as ``x * sigmoid(x)``
(``x * hardsigmoid(x)``) with one on the gate. With ``mul`` in it, a product whose output is
quantized anyway also gets quantized operands where one 8-bit scale holds them (integer_chains.py,
``integer_products``: RMSNorm's, rotary's and SwiGLU's products).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from compress.core.errors import CompressError

Inputs = Literal["all", "residual", "none"]


@dataclass(frozen=True)
class OpRule:
    """How a runtime wants one op kind quantized."""

    inputs: Inputs = "all"
    output: bool = False
    shared: bool = False
    fold_output: bool = False
    constants: bool = False


@dataclass(frozen=True)
class RuntimeProfile:
    """A target runtime's placement rules (see the module docstring)."""

    name: str
    rules: Mapping[str, OpRule]
    fold: frozenset[str] = frozenset()
    pass_through: frozenset[str] = frozenset()
    extend: frozenset[str] = frozenset()
    #: attention scores in integer up to the softmax (QLinearMatMul for ``q @ k^T``, QLinearMul by the
    #: scale, QLinearWhere for a boolean/causal mask, QLinearSoftmax), as ORT's quantize_static runs them
    integer_scores: bool = False
    description: str = ""


_WEIGHTED = {"linear": OpRule(), "addmm": OpRule(), "matmul": OpRule(), "sdpa": OpRule()}

ONNXRUNTIME = RuntimeProfile(
    name="onnxruntime",
    rules={
        **_WEIGHTED,
        "linear": OpRule(fold_output=True),
        "addmm": OpRule(fold_output=True),
        "conv": OpRule(output=True),  # QLinearConv needs its output to go to a single Q
        "add": OpRule(output=True, constants=True),  # QLinearAdd, also with a constant or broadcast operand
        "cat": OpRule(output=True),  # QLinearConcat requantizes each input: no scale needs sharing
        "avg_pool": OpRule(output=True),  # QLinearAveragePool / QLinearGlobalAveragePool
    },
    fold=frozenset({"relu", "relu6"}),
    pass_through=frozenset({"reshape", "max_pool", "dropout", "pad"}),
    # QLinearSigmoid, QLinearMul, QLinearSoftmax, QLinearLeakyRelu; hardsigmoid has no integer kernel,
    # but its output quantized makes ``x * hardsigmoid(x)`` a QLinearMul (as quantize_static places it)
    extend=frozenset({"silu", "sigmoid", "mul", "softmax", "leaky_relu", "hardsigmoid", "hardswish"}),
    # off: ORT's CPU kernels ran the integer scores slower than float ones, and slower than fp32, on
    # the transformers suite (BERT 0.94x of fp32 against 1.38x, GPT-2 1.06x against 1.13x, Llama
    # 0.90x against 1.15x; 8 x 64 tokens, AVX-512 VNNI, under load: benchmarks/RESULTS.md
    # `attention_int8`) at the same fidelity (MiniLM's sentence-embedding cosine 0.9877 against 0.9889)
    integer_scores=False,
    description="ONNX Runtime CPU QDQ fusion (QLinearConv, QLinearMatMul/MatMulIntegerToFloat, QGemm, "
    "QLinearAdd, QLinearConcat, QLinearAveragePool; QLinearSigmoid/QLinearMul/QLinearSoftmax/"
    "QLinearLeakyRelu between quantized tensors); Relu/Clip fold into the Q before them",
)

TENSORRT = RuntimeProfile(
    name="tensorrt",
    rules={**_WEIGHTED, "conv": OpRule(), "add": OpRule(inputs="residual")},
    pass_through=frozenset({"dropout"}),
    description="TensorRT explicit quantization: Q/DQ on the inputs of weighted ops and on the residual "
    "input of an add, no output quantizers (TensorRT propagates scales and fuses the rest)",
)

OPENVINO = RuntimeProfile(
    name="openvino",
    rules={**_WEIGHTED, "conv": OpRule(), "add": OpRule(), "cat": OpRule(shared=True), "avg_pool": OpRule()},
    pass_through=frozenset({"reshape", "max_pool", "dropout", "pad"}),
    description="OpenVINO low-precision transformations: FakeQuantize on the inputs of convolutions, "
    "matmuls, eltwise adds, concats (one scale) and pools; outputs follow from the next input",
)

PROFILES: dict[str, RuntimeProfile] = {p.name: p for p in (ONNXRUNTIME, TENSORRT, OPENVINO)}
Target = Literal["onnxruntime", "tensorrt", "openvino"]


def get_profile(name: str) -> RuntimeProfile:
    """The profile of a target runtime by name."""
    try:
        return PROFILES[name]
    except KeyError:
        raise CompressError(f"unknown target runtime '{name}'; choose one of {sorted(PROFILES)}") from None

