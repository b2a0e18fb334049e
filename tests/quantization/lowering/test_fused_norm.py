"""FusedRMSNorm in converted transformers decoders: the norms of Llama and Qwen2 (GQA, random weights)
run as one kernel that also quantizes for q/k/v and gate/up, so no per-token quantize kernel runs for
those after the warm-up call; outputs are the same bits as the unfused call; Gemma's (1 + weight)
norm fails the proof and stays, with its reason."""

from __future__ import annotations

import copy
import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

if not torch.cuda.is_available():  # before the kernels are first imported (jit decides then)
    os.environ.setdefault("TRITON_INTERPRET", "1")

transformers = pytest.importorskip("transformers")

from compress.quantization.lowering.convert import convert_with_report  # noqa: E402
from compress.quantization.lowering.fused_norm import FusedRMSNorm, fuse_rmsnorms, prove  # noqa: E402

import compress  # noqa: E402
from tests.quantization.lowering.kernels.kernel_cases import QuantizeSpy  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton extra")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 96, "max_position_embeddings": 64}


def _converted(arch: str, scheme: str, *, fuse_norms: bool = True, device: str = DEV) -> tuple[nn.Module, list[Any]]:
    cls, cfg = {"llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
                "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
                "gemma": (transformers.GemmaForCausalLM, transformers.GemmaConfig)}[arch]
    torch.manual_seed(0)
    model = cls(cfg(**SMALL, **({"head_dim": 16} if arch == "gemma" else {}))).eval()
    for m in model.modules():  # random norm weights: ones (or Gemma's zeros) would hide a wrong formula
        if type(m).__name__.endswith("RMSNorm"):
            nn.init.normal_(m.weight, mean=1.0 if arch != "gemma" else 0.0, std=0.3)
    g = torch.Generator().manual_seed(3)
    data = [{"input_ids": torch.randint(0, 96, (2, 12), generator=g)}]
    fq = compress.quantize(model, scheme, data, ignore=["lm_head"]).eval().to(device)
    return convert_with_report(fq, fuse_norms=fuse_norms)


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Iterator[QuantizeSpy]:
    yield QuantizeSpy(monkeypatch)


@pytest.mark.parametrize(("arch", "scheme"), [("llama", "W8A8"), ("qwen2", "W8A8"), ("llama", "FP8_DYNAMIC")])
def test_fused_norms_quantize_for_qkv_and_gate_up(arch: str, scheme: str, spy: QuantizeSpy) -> None:
    conv, report = _converted(arch, scheme)
    norms = [r for r in report if r.kind == "norm"]
    # every decoder norm and the final one (which feeds the float lm_head: norm only)
    assert len(norms) == 2 * SMALL["num_hidden_layers"] + 1
    assert all(r.int8_type == "FusedRMSNorm" for r in norms)
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(5)).to(DEV)
    with torch.no_grad():
        first = conv(input_ids=ids).logits  # warm-up: the readers claim their norms
        unfused_calls, spy.calls = spy.calls, 0
        second = conv(input_ids=ids).logits
    layers = conv.model.layers
    assert all(isinstance(layer.input_layernorm, FusedRMSNorm) and layer.input_layernorm.fused for layer in layers)
    assert all(layer.post_attention_layernorm.fused for layer in layers)
    assert not conv.model.norm.fused  # lm_head is float: nobody claimed it
    # before: q/k/v, gate/up, o_proj, down_proj quantize their inputs (4 per layer, q/k/v sharing);
    # now only o_proj and down_proj, whose inputs no norm produces
    assert unfused_calls == 4 * len(layers)
    assert spy.calls == 2 * len(layers)
    # the same norm output, the same codes (the kernel writes quantize_per_token's bits): same logits
    assert torch.equal(first, second)
    # against a model converted without fused norms: torch's RMSNorm differs from the kernel's by a
    # float32 ulp or so (summation order), which moves a code by one step at most, rarely
    plain, _ = _converted(arch, scheme, fuse_norms=False)
    assert not any(isinstance(m, FusedRMSNorm) for m in plain.modules())
    with torch.no_grad():
        ref = plain(input_ids=ids).logits
    assert (second - ref).abs().max().item() <= 0.02 * ref.abs().max().item()


def test_gemma_norms_fail_the_proof_and_stay_with_a_reason() -> None:
    conv, report = _converted("gemma", "W8A8")
    norms = [r for r in report if r.kind == "norm"]
    assert norms and all(not r.converted for r in norms)
    assert all("not weight * (x * rsqrt(mean(x^2) + eps))" in r.reason for r in norms)
    assert type(conv.model.layers[0].input_layernorm).__name__ == "GemmaRMSNorm"
    assert sum(r.converted for r in report if r.kind == "layer") == 7 * SMALL["num_hidden_layers"]


def test_the_proof_rejects_other_forms_and_accepts_llamas() -> None:
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class NoRsqrtRMSNorm(nn.Module):  # right attributes, wrong math
        def __init__(self) -> None:
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(32)), 1e-6

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.weight * x

    llama = LlamaRMSNorm(32)
    nn.init.normal_(llama.weight)
    gemma = GemmaRMSNorm(32)
    nn.init.normal_(gemma.weight)
    assert prove(llama) is None
    assert prove(gemma) is not None and prove(NoRsqrtRMSNorm()) is not None
    root = nn.ModuleDict({"a": llama, "b": gemma, "c": NoRsqrtRMSNorm(), "d": nn.LayerNorm(32)})
    seen: list[tuple[str, str, str | None]] = []
    assert fuse_rmsnorms(root, record=lambda *r: seen.append(r)) == 1
    assert [(n, t, why is None) for n, t, why in seen] == [("a", "LlamaRMSNorm", True), ("b", "GemmaRMSNorm", False),
                                                            ("c", "NoRsqrtRMSNorm", False)]
    assert isinstance(root["a"], FusedRMSNorm) and root["a"].weight is llama.weight


def test_fuse_norms_off_keeps_the_float_norms() -> None:
    conv, report = _converted("llama", "W8A8", fuse_norms=False)
    assert not [r for r in report if r.kind == "norm"]
    assert type(conv.model.norm).__name__ == "LlamaRMSNorm"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scheme", ["W8A8", "FP8_DYNAMIC"])
def test_fused_norms_on_cuda_in_fp16_and_under_cuda_graphs(scheme: str, spy: QuantizeSpy) -> None:
    from compress.export.validation.cuda import cast_float_layers
    from compress.quantization.lowering.fp8 import fp8_capable

    if scheme == "FP8_DYNAMIC" and not fp8_capable(torch.device("cuda"))[0]:
        pytest.skip("fp8 needs compute capability 8.9")
    conv, report = _converted("llama", scheme, device="cuda")
    assert sum(r.converted for r in report if r.kind == "norm") == 2 * SMALL["num_hidden_layers"] + 1
    conv = cast_float_layers(conv, torch.float16).eval()
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(5)).cuda()
    with torch.no_grad():
        first = conv(input_ids=ids).logits
        unfused_calls, spy.calls = spy.calls, 0
        second = conv(input_ids=ids).logits
    n = SMALL["num_hidden_layers"]
    assert (unfused_calls, spy.calls) == (4 * n, 2 * n)
    assert torch.equal(first, second)
    # captured after the warm-up: the replay runs the fused kernels and gives the same logits
    static_ids = ids.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        conv(input_ids=static_ids)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = conv(input_ids=static_ids).logits
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, second)
    plain, _ = _converted("llama", scheme, fuse_norms=False, device="cuda")
    plain = cast_float_layers(plain, torch.float16).eval()
    with torch.no_grad():
        ref = plain(input_ids=ids).logits.float()
    assert (second.float() - ref).abs().max().item() <= 0.02 * ref.abs().max().item()


def test_the_converted_model_deep_copies_with_its_adopted_readers() -> None:
    conv, _ = _converted("llama", "W8A8")
    ids = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(7)).to(DEV)
    with torch.no_grad():
        conv(input_ids=ids)
        y = conv(input_ids=ids).logits
        twin = copy.deepcopy(conv)
        assert torch.equal(twin(input_ids=ids).logits, y)
    consumer = twin.model.layers[0].input_layernorm._consumer
    assert consumer is not None and consumer.layer is twin.model.layers[0].self_attn.q_proj


def test_readers_that_disagree_one_group_fused_the_other_quantizes_itself(spy: QuantizeSpy) -> None:
    """A norm read by a SmoothQuant-scaled per-token layer (claims it first: its pre-scale goes into the
    norm's codes) and by a narrow-range one (another quantization: quantizes for itself)."""
    from compress.quantization.lowering.int8 import Int8Linear
    from compress.quantization.numerics.calibration import calibrate
    from compress.quantization.numerics.modules import QUANT_LAYERS
    from compress.quantization.numerics.spec import resolve_scheme
    from compress.quantization.preparation import calibrate_weight
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    def layer(scheme: Any, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        s = resolve_scheme(scheme)
        q = QUANT_LAYERS[nn.Linear].from_float(nn.Linear(96, 40), s, name="0", weights=s.weights)
        calibrate_weight(q)
        calibrate(nn.Sequential(q), [torch.randn(8, 96)])
        return q.eval()

    smooth = layer("w8a8_dynamic", 1)
    smooth.input_quantizer.pre_quant_scale = torch.rand(96, generator=torch.Generator().manual_seed(2)) + 0.5
    a = Int8Linear.from_quant(smooth).to(DEV)
    b = Int8Linear.from_quant(layer({"preset": "w8a8_dynamic", "inputs": {"narrow_range": True}}, 3)).to(DEV)
    assert a.input_signature() != b.input_signature() and a.shared_codes is None
    torch.manual_seed(4)
    norm = LlamaRMSNorm(96)
    nn.init.normal_(norm.weight, mean=1.0, std=0.3)
    fused = FusedRMSNorm.from_module(norm).to(DEV)
    x = torch.randn(3, 5, 96, generator=torch.Generator().manual_seed(5)).to(DEV)
    with torch.no_grad():
        y = fused(x)
        first = (a(y), b(y))
        assert spy.calls == 2 and fused.fused and a.shared_codes is not None  # a lone reader got a group of one
        spy.calls = 0
        y = fused(x)
        second = (a(y), b(y))
    assert spy.calls == 1  # b's own quantization; a's codes (pre-scale included) came from the norm
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


@pytest.mark.parametrize("fuse_norms", [False, True])
def test_converted_decoder_runs_under_inference_mode(fuse_norms: bool, spy: QuantizeSpy) -> None:
    # inference tensors have no version counter: shared codes are not reused there (they were read
    # unconditionally before, and a converted Llama raised under torch.inference_mode)
    conv, _ = _converted("llama", "W8A8", fuse_norms=fuse_norms)
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(8)).to(DEV)
    with torch.no_grad():
        conv(input_ids=ids)
        ref = conv(input_ids=ids).logits
    spy.calls = 0
    with torch.inference_mode():
        y = conv(input_ids=ids).logits
    assert spy.calls == 7 * SMALL["num_hidden_layers"]  # every layer quantizes its own input
    assert torch.equal(y, ref)


@pytest.mark.slow  # 22 s in a full run: a benchmark script under the Triton interpreter
def test_benchmark_script_interpret_smoke() -> None:
    # benchmarks/cuda_fused_norm.py runs on a lent GPU only: check here that it runs end to end (tiny widths)
    import subprocess
    import sys
    from pathlib import Path

    r = subprocess.run([sys.executable, "-m", "benchmarks.cuda_fused_norm", "--interpret-smoke"], capture_output=True,
                       text=True, timeout=300, cwd=Path(__file__).resolve().parents[3])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "norm rows 2:" in r.stderr and "decode batch 2 W8A8+fused_norms:" in r.stderr
    assert "3 RMSNorms run as one kernel" in r.stderr
