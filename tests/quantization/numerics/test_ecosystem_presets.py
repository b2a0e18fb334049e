"""The llm-compressor / vLLM preset names mean here what they mean in compressed-tensors."""

from __future__ import annotations

import pytest
from compress.quantization.numerics.spec import ECOSYSTEM_PRESETS, QuantScheme, QuantSpec

from compress.core.errors import RecipeError


def _same(ours: QuantSpec | None, theirs: object | None) -> None:
    assert (ours is None) == (theirs is None)
    if ours is None or theirs is None:
        return
    raw = theirs.strategy  # type: ignore[attr-defined]
    strategy = str(getattr(raw, "value", raw))  # group, channel, token (an enum or its value)
    assert ours.bits == theirs.num_bits  # type: ignore[attr-defined]
    assert ours.symmetric == theirs.symmetric  # type: ignore[attr-defined]
    assert ours.dynamic == bool(theirs.dynamic)  # type: ignore[attr-defined]
    # NVFP4's "tensor_group": groups under one per-tensor global scale, our group granularity with
    # e4m3 group scales
    assert ours.granularity == ("group" if strategy == "tensor_group" else strategy)
    assert (strategy == "tensor_group") == (ours.scale_dtype == "fp8_e4m3")
    kind = theirs.type  # type: ignore[attr-defined]
    assert ours.is_float == (str(getattr(kind, "value", kind)) == "float")  # FP8's e4m3 vs the int presets
    if ours.is_fp4:  # e8m0 (MX) scales are stored as uint8 exponents there
        assert str(theirs.scale_dtype) == {"fp8_e4m3": "torch.float8_e4m3fn", "e8m0": "torch.uint8"}[ours.scale_dtype]  # type: ignore[attr-defined]
    if strategy in ("group", "tensor_group"):
        assert ours.group_size == theirs.group_size  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", sorted(ECOSYSTEM_PRESETS))
def test_each_name_matches_compressed_tensors(name: str) -> None:
    ct = pytest.importorskip("compressed_tensors.quantization.quant_scheme")
    theirs = ct.PRESET_SCHEMES[name]
    ours = QuantScheme.preset(name)
    _same(ours.weights, theirs.get("weights"))
    _same(ours.inputs, theirs.get("input_activations"))


def test_lower_case_names_stay_ours_and_others_resolve_case_insensitively() -> None:
    assert QuantScheme.preset("w8a8").inputs is not None and not QuantScheme.preset("w8a8").inputs.dynamic
    assert QuantScheme.preset("W8A8").inputs is not None and QuantScheme.preset("W8A8").inputs.dynamic
    assert QuantScheme.preset("w4a16") == QuantScheme.preset("W4A16")
    assert QuantScheme.preset("nvfp4") == QuantScheme.preset("NVFP4")
    with pytest.raises(RecipeError, match="did you mean 'W4A16'"):
        QuantScheme.preset("W4A61")
