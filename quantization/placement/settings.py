"""The selection and placement settings every quantizing algorithm that prepares a model shares
(:class:`PrepareParams`): declared here, below preparation and placement, which both read them."""

from __future__ import annotations

from typing import ClassVar, Literal

from compress.quantization.placement.cost_table import PORTABLE_CPU, DeployCpu
from compress.quantization.placement.runtimes import Target
from compress.quantization.placement.speed_check import SpeedCheck
from pydantic import Field, PositiveInt

from compress.core.params import Selection

FirstLast = Literal["quantize", "float", "w8"]
#: what the cost table's whole-model prediction does: log it ("warn") or keep the model float ("float")
ModelCheck = Literal["auto", "warn", "float"]


class PrepareParams(Selection):
    """How layers are swapped and activation quantizers placed: the settings every quantizing
    algorithm that prepares the model shares (QuantizeParams, the ``qat`` modifier).

    ``first_last``: "float" keeps the first and last layer unquantized, "w8" gives them 8-bit
    per-channel weights (useful under 4-bit schemes). ``quantize_ops``: quantize the activations
    at tensor operations too (residual adds, concats, attention products), not only layer inputs.
    ``runtime``: the runtime whose fusion rules place the activation quantizers (onnxruntime,
    tensorrt, openvino). ``quantize_embeddings``: store embedding tables as int8 rows (static schemes;
    a table whose int8 form loses fidelity stays float, named in ``placement.floats``).
    ``speed_check``: time each layer's ONNX Runtime integer kernel against its float kernel at the
    traced shape (the batch scaled to ``speed_check.batch``) and keep the layers float where int8 is
    slower (quantization/placement/speed_check.py; runtime onnxruntime).
    ``cost_table``: without ``speed_check``, keep float the layers the shipped ORT CPU cost table
    for ``deploy_cpu`` says run slower in int8 (quantization/placement/cost_table.py): nothing is
    timed, so the placement is reproducible; False quantizes them all.
    ``deploy_cpu``: the CPU the model will be served on, ``isa:vendor`` (``vnni:intel``, ``vnni:amd``,
    ``amx:intel``, ``avx2:intel``, ``avx2:amd``), whose table decides; the default ``vnni:intel`` does
    not depend on the machine that quantizes; ``"this-machine"`` reads the quantizing CPU's table.
    ``batch_sizes``: the batches the model will be served at (default: batch 1; a recipe takes its
    ``validate.batch_sizes``): the table predicts the whole int8 model against fp32 at each of them.
    ``model_check``: where that prediction says int8 is not faster at every one of them, ``"float"``
    keeps the whole model float (the reason in ``placement.model_float``), ``"warn"`` logs it and
    keeps int8, ``"auto"`` (default) keeps it float where int8 is predicted slower at a batch of 16
    or more and warns at smaller ones (benchmarks/RESULTS.md, ``export_int8_quickstart``).
    """

    first_last: FirstLast = "quantize"
    quantize_ops: bool = True
    runtime: Target = "onnxruntime"
    quantize_embeddings: bool = True
    speed_check: SpeedCheck | None = None
    cost_table: bool = True
    batch_sizes: tuple[PositiveInt, ...] | None = Field(None, min_length=1)
    model_check: ModelCheck = "auto"
    deploy_cpu: DeployCpu = PORTABLE_CPU

    renamed: ClassVar[dict[str, str]] = {**Selection.renamed, "target": "runtime"}
