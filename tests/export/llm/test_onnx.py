"""LLM ONNX export with a key/value cache: ORT's greedy tokens equal the PyTorch fake-quant model's
(transformers' own generate), int4 layers are MatMulNBits, the cache and shapes are dynamic."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from compress.export.llm.onnx import MatMulNBitsLinear, OrtGenerator, export_llm_onnx, generate_ort  # noqa: E402
from compress.quantization.lowering.int4 import Int4Weight, dequantize_int4  # noqa: E402
from compress.quantization.numerics.spec import QuantScheme, QuantSpec  # noqa: E402

import compress  # noqa: E402
from compress.core.errors import ExportError, UnsupportedModelError  # noqa: E402

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 256}


def _w4(group: int | None, *, symmetric: bool) -> QuantScheme:
    gran = {"granularity": "group", "group_size": group} if group else {"granularity": "channel"}
    return QuantScheme(weights=QuantSpec(bits=4, symmetric=symmetric, dtype="int8" if symmetric else "uint8", **gran),  # type: ignore[arg-type]
                       inputs=None)


def _model(kind: str, scheme: QuantScheme | str | None, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL))
    model.eval()
    return model if scheme is None else compress.quantize(model, scheme, ignore=["lm_head"])


def _prompts(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of 7 and 4 tokens, the second left-padded: ``(input_ids, attention_mask)``."""
    ids = torch.randint(1, SMALL["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    return ids, mask


def _hf_greedy(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, new: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              pad_token_id=0)


@pytest.mark.parametrize(
    ("kind", "scheme", "weights"),
    [
        ("llama", _w4(32, symmetric=False), "int4"),
        ("qwen2", _w4(None, symmetric=True), "int4"),
        ("qwen2", _w4(32, symmetric=True), "fp32"),
    ],
    ids=["llama-gqa-asym-g32-int4", "qwen2-sym-per-channel-int4", "qwen2-fake-quant-fp32"],
)
def test_ort_greedy_tokens_match_pytorch(kind: str, scheme: QuantScheme, weights: str, tmp_path: Path) -> None:
    fq = _model(kind, scheme)
    # float compute (accuracy_level 0) and the lm_head as the model holds it: transformers' own tokens
    path = export_llm_onnx(fq, tmp_path / "m.onnx", weights=weights, accuracy_level=0,  # type: ignore[arg-type]
                           lm_head="float")
    nodes = [n for n in onnx.load(str(path)).graph.node if n.op_type == "MatMulNBits"]
    assert len(nodes) == (8 if weights == "int4" else 0)  # per layer q/k/v and gate/up packed: 4
    if nodes:  # q/k/v packed: K = 64, N = 64 + 2 x 32; g32 blocks, or one 64-wide block per channel; zero points when asym
        attrs = {a.name: a.i for a in nodes[0].attribute}
        assert nodes[0].domain == "com.microsoft"
        assert attrs == {"K": 64, "N": 128, "bits": 4, "block_size": scheme.weights.group_size or 64, "accuracy_level": 0}
        assert len(nodes[0].input) == (3 if scheme.weights.symmetric else 4)
    ids, mask = _prompts(1)  # 7 tokens and a left-padded 4: neither the traced length (3) nor past (2)
    new = 12
    ref = _hf_greedy(fq, ids, mask, new)
    got = generate_ort(path, ids, attention_mask=mask, max_new_tokens=new)
    assert got.shape == ref.shape == (2, 7 + new)
    assert torch.equal(got, ref), (got.tolist(), ref.tolist())
    # the logits themselves, past the first step: the cache carries the state exactly enough
    gen = OrtGenerator(path)
    logits = [gen.prefill(ids.numpy(), mask.numpy())] + [gen.step(ref[:, 7 + i].numpy()) for i in range(3)]
    full_mask = torch.cat([mask, torch.ones(2, 3, dtype=torch.long)], dim=1)
    with torch.no_grad():
        hf = fq(ref[:, :10], attention_mask=full_mask, position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0)).logits
    np.testing.assert_allclose(np.stack(logits, 1), hf[:, 6:].numpy(), atol=2e-5, rtol=1e-4)


def test_matmul_nbits_layout_pads_ragged_blocks_exactly(tmp_path: Path) -> None:
    # K=80 in groups of 32: a shorter last group, padded up to MatMulNBits' block with zero-point codes
    g = torch.Generator().manual_seed(2)
    n, k = 24, 80
    w = Int4Weight(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), torch.rand(n, 3, generator=g) * 0.1,
                   torch.randint(0, 16, (n, 3), generator=g, dtype=torch.uint8), 32, False)
    layer = MatMulNBitsLinear(w, torch.randn(n, generator=g))
    x = torch.randn(5, k, generator=g)
    ref = nn.functional.linear(x, dequantize_int4(w), layer.bias)
    torch.testing.assert_close(layer(x), ref, atol=1e-6, rtol=0)  # MatMulNBits' definition, in torch
    path = tmp_path / "one.onnx"
    with pytest.warns(DeprecationWarning):  # the TorchScript exporter, as export_llm_onnx uses it
        torch.onnx.export(layer, (x,), str(path), input_names=["x"], dynamo=False, custom_opsets={"com.microsoft": 1})
    import onnxruntime as ort

    (y,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})
    np.testing.assert_allclose(y, ref.numpy(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("bits", "block", "zero_points"), [(4, 32, False), (4, 128, True), (8, 32, False)])
def test_accuracy_level_4_forward_is_what_orts_kernel_computes(bits: int, block: int, zero_points: bool,
                                                               tmp_path: Path) -> None:
    # at accuracy_level 4 ORT quantizes the activations to int8 per weight block; the layer's torch forward
    # (what the export's check compares with) does the same: ORT within float rounding of it, where the
    # float-activation product is ~40 dB away. K=80 with blocks of 128: one ragged block.
    g = torch.Generator().manual_seed(5)
    n, k = 48, 80 if block == 128 else 96
    groups = -(-k // block)
    w = Int4Weight(torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.uint8),
                   torch.rand(n, groups, generator=g) * 0.01,
                   torch.randint(0, 1 << bits, (n, groups), generator=g, dtype=torch.uint8) if zero_points
                   else torch.full((n, groups), 1 << (bits - 1), dtype=torch.uint8), block, not zero_points,
                   offset=1 << (bits - 1))
    layer = MatMulNBitsLinear(w, None, accuracy_level=4, bits=bits)
    x = torch.randn(5, k, generator=g)
    x[:, 3] *= 20  # an outlier feature: its blocks' activation scale is coarse
    path = tmp_path / "one.onnx"
    with pytest.warns(DeprecationWarning):
        torch.onnx.export(layer, (x,), str(path), input_names=["x"], dynamo=False, custom_opsets={"com.microsoft": 1})
    import onnxruntime as ort

    (y,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})
    got = torch.from_numpy(y)

    def sqnr(ref: torch.Tensor) -> float:
        return float(10 * torch.log10((ref ** 2).mean() / ((got - ref) ** 2).mean()))

    assert sqnr(layer(x)) > 100
    assert sqnr(x @ dequantize_int4(w).T) < 60


def test_default_int4_file_quantizes_the_float_lm_head_as_llamacpp_q8_0(tmp_path: Path) -> None:
    # by default a float lm_head (ignored by the quantization, as llm-compressor's default is) becomes an
    # 8-bit MatMulNBits in blocks of 32 at accuracy_level 4, as every layer's MatMulNBits; lm_head="float" keeps
    # it a MatMul; the export's check (40 dB against the traced module) passes on both
    model = _model("llama", _w4(32, symmetric=True))
    default = onnx.load(str(export_llm_onnx(model, tmp_path / "d.onnx")))
    nodes = [n for n in default.graph.node if n.op_type == "MatMulNBits"]
    attrs = [{a.name: a.i for a in n.attribute} for n in nodes]
    assert len(nodes) == 9 and all(a["accuracy_level"] == 4 for a in attrs)
    assert [a for a in attrs if a["bits"] == 8] == [
        {"K": 64, "N": 256, "bits": 8, "block_size": 32, "accuracy_level": 4}]
    head = next(n for n in nodes if {a.name: a.i for a in n.attribute}["bits"] == 8)
    assert len(head.input) == 3  # symmetric: no zero points
    kept = onnx.load(str(export_llm_onnx(model, tmp_path / "f.onnx", lm_head="float")))
    assert sum(n.op_type == "MatMulNBits" for n in kept.graph.node) == 8
    with pytest.raises(ExportError, match="lm_head must be"):
        export_llm_onnx(model, tmp_path / "x.onnx", lm_head="int4")  # type: ignore[arg-type]
    # auto: float where the file computes in float (accuracy_level 0), so it keeps the model's numbers
    level0 = onnx.load(str(export_llm_onnx(model, tmp_path / "l0.onnx", accuracy_level=0)))
    assert sum(n.op_type == "MatMulNBits" for n in level0.graph.node) == 8


def test_packed_projections_compute_each_layers_columns(tmp_path: Path) -> None:
    # q (asymmetric, zero points), k (symmetric: no zero-point tensor) and v (with a bias) read one
    # input: packed into one MatMulNBits, its output is theirs side by side, in torch and in ORT
    from compress.export.llm.matmul_nbits import _cat

    g = torch.Generator().manual_seed(3)
    k = 96  # three blocks of 32: an odd count, so each row's packed zero points end in a pad nibble

    def layer(n: int, zp: bool, bias: bool) -> MatMulNBitsLinear:
        zps = torch.randint(0, 16, (n, 3), generator=g, dtype=torch.uint8) if zp else torch.full((n, 3), 8, dtype=torch.uint8)
        w = Int4Weight(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), torch.rand(n, 3, generator=g) * 0.1,
                       zps, 32, not zp)
        return MatMulNBitsLinear(w, torch.randn(n, generator=g) if bias else None)

    parts = [layer(40, True, False), layer(16, False, False), layer(16, False, True)]
    assert parts[1].zero_points is None and parts[0].zero_points is not None
    packed = _cat(parts)
    x = torch.randn(2, 3, k, generator=g)
    want = torch.cat([m(x) for m in parts], dim=-1)
    torch.testing.assert_close(packed(x), want, atol=0, rtol=0)
    path = tmp_path / "packed.onnx"
    with pytest.warns(DeprecationWarning):
        torch.onnx.export(packed, (x,), str(path), input_names=["x"], dynamo=False, custom_opsets={"com.microsoft": 1})
    import onnxruntime as ort

    (y,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})
    np.testing.assert_allclose(y, want.numpy(), atol=1e-5, rtol=1e-5)


def test_gate_up_pack_only_where_the_mlp_computes_down_act_gate_times_up() -> None:
    """Packing is decided by what the MLP computes, not by its class name: a gated MLP of any class
    packs; one that wires the same parts otherwise (the activation on up) keeps them separate."""
    from types import SimpleNamespace

    from compress.export.llm.matmul_nbits import PackedGateUpMLP, pack_projections

    g = torch.Generator().manual_seed(4)

    def nbits(n: int, k: int) -> MatMulNBitsLinear:
        w = Int4Weight(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), torch.rand(n, 2, generator=g) * 0.1,
                       torch.full((n, 2), 8, dtype=torch.uint8), 32, True)
        return MatMulNBitsLinear(w, None)

    class AnyGatedMLP(torch.nn.Module):
        def __init__(self, act_on_up: bool = False) -> None:
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nbits(64, 64), nbits(64, 64), nbits(64, 64)
            self.act_fn, self.act_on_up = torch.nn.SiLU(), act_on_up

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.act_on_up:
                return self.down_proj(self.gate_proj(x) * self.act_fn(self.up_proj(x)))
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    gated, other = SimpleNamespace(self_attn=SimpleNamespace(), mlp=AnyGatedMLP()), \
        SimpleNamespace(self_attn=SimpleNamespace(), mlp=AnyGatedMLP(act_on_up=True))
    x = torch.randn(2, 5, 64, generator=g)
    want = gated.mlp(x)
    assert pack_projections([gated, other], attn="self_attn") == 1
    assert isinstance(gated.mlp, PackedGateUpMLP) and isinstance(other.mlp, AnyGatedMLP)
    torch.testing.assert_close(gated.mlp(x), want)


def test_refuses_what_it_cannot_export(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="weights must be"):
        export_llm_onnx(_model("llama", None), tmp_path / "a.onnx", weights="int8")  # type: ignore[arg-type]
    with pytest.raises(UnsupportedModelError, match="no weight-only 4-bit"):
        export_llm_onnx(_model("llama", None), tmp_path / "b.onnx", weights="int4")
    with pytest.raises(UnsupportedModelError, match="W8A8"):
        export_llm_onnx(_model("llama", "w8a8_dynamic"), tmp_path / "c.onnx")
    # ALiBi instead of positions: Bloom's forward takes no position_ids to feed
    bloom = transformers.BloomForCausalLM(transformers.BloomConfig(hidden_size=32, n_layer=1, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match=r"BloomForCausalLM: its forward takes no position_ids"):
        export_llm_onnx(bloom, tmp_path / "d.onnx", weights="fp32")
    assert not (tmp_path / "d.onnx").exists()


def test_export_checks_the_file_in_ort(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a graph that drops the zero points computes something else than PyTorch: the export refuses it
    from compress.export.llm import onnx as llm_onnx

    def no_zero_points(g: object, x: object, b: object, scales: object, zp: object, *attrs: int) -> object:
        return original(g, x, b, scales, None, *attrs)

    original = llm_onnx._MatMulNBitsFn.symbolic
    monkeypatch.setattr(llm_onnx._MatMulNBitsFn, "symbolic", staticmethod(no_zero_points))
    with pytest.raises(ExportError, match="differ from the PyTorch model"):
        export_llm_onnx(_model("llama", _w4(32, symmetric=False)), tmp_path / "bad.onnx")


def test_position_ids_input_generates_the_same_tokens(tmp_path: Path) -> None:
    # Optimum's ORTModelForCausalLM feeds position_ids (without it: its legacy-model warning); the
    # graph with that input computes what the mask-derived one does, left padding included
    model = _model("qwen2", _w4(32, symmetric=True))
    plain = export_llm_onnx(model, tmp_path / "plain.onnx")
    explicit = export_llm_onnx(model, tmp_path / "pos.onnx", position_ids=True)
    names = [i.name for i in onnx.load(str(explicit)).graph.input]
    assert names[:4] == ["input_ids", "attention_mask", "position_ids", "past_key_values.0.key"]
    ids, mask = _prompts(5)
    want = generate_ort(plain, ids, attention_mask=mask, max_new_tokens=6)
    assert torch.equal(generate_ort(explicit, ids, attention_mask=mask, max_new_tokens=6), want)


@pytest.mark.parametrize("attention", ["fused", "decomposed"])
def test_last_position_logits_generate_the_same_tokens(attention: str, tmp_path: Path) -> None:
    """``logits="last"`` outputs the last position's logits only (``[B, 1, V]``, the lm_head not run
    over the rest of the prompt): the same values as that position of the full file, and the same
    greedy tokens, left padding included; on both attention forms and in the W8A8 file too."""
    import onnxruntime as ort
    from compress.export.llm.attention import fused_attention_supported

    if attention == "fused" and not fused_attention_supported():
        pytest.skip("this onnxruntime's GroupQueryAttention lacks the fused form's inputs")
    model = _model("llama", _w4(32, symmetric=False))
    full = export_llm_onnx(model, tmp_path / "all.onnx", attention=attention)  # type: ignore[arg-type]
    last = export_llm_onnx(model, tmp_path / "last.onnx", attention=attention, logits="last")  # type: ignore[arg-type]
    assert onnx.load(str(last)).graph.output[0].type.tensor_type.shape.dim[1].dim_value == 1
    meta = {p.key: p.value for p in onnx.load(str(last)).metadata_props}
    assert meta["compress.logits"] == "last"
    ids, mask = _prompts(3)
    feed = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
    for name in [i.name for i in onnx.load(str(full)).graph.input][2:]:
        feed[name] = np.zeros((2, SMALL["num_key_value_heads"], 0, 16), np.float32)
    a = ort.InferenceSession(str(full)).run(["logits"], feed)[0]
    b = ort.InferenceSession(str(last)).run(["logits"], feed)[0]
    assert a.shape == (2, 7, 256) and b.shape == (2, 1, 256)
    np.testing.assert_allclose(b[:, 0], a[:, -1], rtol=1e-5, atol=1e-5)
    want = generate_ort(full, ids, attention_mask=mask, max_new_tokens=5)
    assert torch.equal(generate_ort(last, ids, attention_mask=mask, max_new_tokens=5), want)
    w8 = export_llm_onnx(_model("llama", "w8a8_dynamic"), tmp_path / "w8.onnx", weights="w8a8", logits="last")
    assert generate_ort(w8, ids, attention_mask=mask, max_new_tokens=3).shape == (2, 10)
    with pytest.raises(ExportError, match="logits must be 'all' or 'last'"):
        export_llm_onnx(model, tmp_path / "x.onnx", logits="first")  # type: ignore[arg-type]


def test_shared_kv_buffer_generates_what_separate_presents_do(tmp_path: Path) -> None:
    """A fused-attention file decodes with its keys and values appended in place to one buffer per
    layer (bound as both the past input and the present output): the same logits as feeding the
    past and taking the present back, for a left-padded batch, past the buffer's first 256 slots
    (where it grows); a decomposed file, which concatenates, takes the past as arrays."""
    from compress.export.llm.attention import fused_attention_supported

    if not fused_attention_supported():
        pytest.skip("this onnxruntime's GroupQueryAttention lacks the fused form's inputs")
    model = _model("llama", _w4(32, symmetric=False))
    path = export_llm_onnx(model, tmp_path / "m.onnx", attention="fused")
    shared, separate = OrtGenerator(path), OrtGenerator(path, share_buffer=False)
    assert shared.share_buffer and not separate.share_buffer
    ids, mask = _prompts(4)
    a, b = shared.prefill(ids.numpy(), mask.numpy()), separate.prefill(ids.numpy(), mask.numpy())
    np.testing.assert_array_equal(a, b)
    for _ in range(260):
        nxt = b.argmax(-1).astype(np.int64)
        a, b = shared.step(nxt), separate.step(nxt)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert shared.mask.shape[1] == 267 and shared._capacity == 512
    decomposed = export_llm_onnx(model, tmp_path / "d.onnx", attention="decomposed")
    assert not OrtGenerator(decomposed).share_buffer


@pytest.mark.parametrize("attention", ["fused", "decomposed"])
def test_prefill_of_an_all_positions_file_runs_in_bounded_chunks(attention: str, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A file whose logits cover every position is prefilled in runs whose logits stay within the
    bound (here 3 positions of a batch of 2): the same last logits and the same decode as one run."""
    from compress.export.llm import ort as llm_ort
    from compress.export.llm.attention import fused_attention_supported

    if attention == "fused" and not fused_attention_supported():
        pytest.skip("this onnxruntime's GroupQueryAttention lacks the fused form's inputs")
    model = _model("llama", _w4(32, symmetric=False))
    path = export_llm_onnx(model, tmp_path / "m.onnx", attention=attention)  # type: ignore[arg-type]
    ids, mask = _prompts(2)
    whole = OrtGenerator(path)
    assert whole.all_logits
    want = [whole.prefill(ids.numpy(), mask.numpy())]
    runs: list[int] = []
    monkeypatch.setattr(llm_ort, "PREFILL_LOGITS_BYTES", 3 * 2 * 4 * int(model.config.vocab_size))
    chunked = OrtGenerator(path)
    real_run = chunked._run
    monkeypatch.setattr(chunked, "_run", lambda i, p: runs.append(i.shape[1]) or real_run(i, p))
    got = [chunked.prefill(ids.numpy(), mask.numpy())]
    assert max(runs) == 3 and sum(runs) == ids.shape[1]
    for _ in range(3):
        nxt = want[-1].argmax(-1).astype(np.int64)
        want.append(whole.step(nxt))
        got.append(chunked.step(nxt))
    for a, b in zip(want, got, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_ort_decode_profile_attributes_the_step_to_op_types(tmp_path: Path) -> None:
    # the profiler behind benchmarks/ort_decode_profile.py on a small int4 Llama: decode steps only,
    # every MatMulNBits of the model (q/k/v and gate/up packed, the lm_head) once per step, the shares summing to the whole node time
    from benchmarks.ort_decode_profile import profile_decode

    path = export_llm_onnx(_model("llama", _w4(32, symmetric=True)), tmp_path / "m.onnx", weights="int4")
    data = profile_decode(path, threads=1, steps=3, prompt=8)
    ops = {r["op"]: r for r in data["rows"]}
    assert data["steps"] == 3 and ops["MatMulNBits"]["nodes_per_step"] == 2 * 4 + 1  # and the 8-bit lm_head
    assert abs(sum(r["share"] for r in data["rows"]) - 1) < 1e-6
    assert 0 < data["node_ms"] <= data["model_run_ms"]


def test_level4_floors_take_one_margin_on_both_measures() -> None:
    """The shipped AWQ recipe's file (SmolLM2, w4 g128): 37.8 dB and 16 of 19 greedy positions against
    a yardstick of 34.0 dB and 18 of 19 passes; a dropped zero point (below 20 dB) does not, nor does
    a file that flips half the positions."""
    from compress.export.llm.ort import level4_floors

    sqnr_floor, top1_floor = level4_floors(34.0, 18 / 19)

    def passes(sqnr: float, top1: float) -> bool:
        return sqnr >= sqnr_floor and top1 >= top1_floor

    assert sqnr_floor == pytest.approx(28.0)
    assert passes(37.8, 16 / 19)
    assert not passes(19.0, 1.0)
    assert not passes(37.8, 0.5)
    assert level4_floors(60.0, 1.0) == pytest.approx((40.0, 0.8005), abs=1e-3)  # capped at the float floor
