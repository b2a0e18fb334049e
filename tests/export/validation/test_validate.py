"""Validation in runtimes: records, side-by-side speedup, thresholds, the one-shot API and the CLI entry."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from compress.export.onnx import export_onnx
from compress.export.validation.measure import check_thresholds, validate_exports
from compress.export.validation.runtimes import default_threads, load_session

from compress import validate
from compress.core.errors import RecipeError
from compress.recipe import Thresholds, ValidateSpec
from compress.validation import run_validate

_SPEC = {"batch_sizes": [1, 4], "warmup": 1, "runs": 3}


@pytest.fixture(scope="module")
def records(resnet_exports: Any, quantized_resnet: Any, trained_resnet: Any, digits: Any) -> Any:
    spec = ValidateSpec(runtimes=["onnxruntime", "openvino"], **_SPEC)
    return validate_exports(resnet_exports, spec, eval_loader=digits.eval, reference=quantized_resnet,
                            baseline_reference=trained_resnet)


def test_records_per_runtime_and_role(records: Any) -> None:
    assert [(r.runtime, r.role) for r in records] == [
        ("onnxruntime", "final"), ("onnxruntime", "baseline"), ("openvino", "final"), ("openvino", "baseline"),
    ]
    for r in records:
        assert r.threads == default_threads() and r.samples == 256
        assert set(r.latency_ms) == {1, 4} and all(v is not None and v > 0 for v in r.latency_ms.values())
        assert r.metric == "accuracy" and r.accuracy is not None
    final, base = records[0], records[1]
    assert final.precision == "int8" and base.precision == "fp32"
    assert final.speedup is not None and set(final.speedup) == {1, 4} and base.speedup is None
    assert final.size_ratio is not None and final.size_ratio < 0.35
    assert final.integer_nodes and final.integer_nodes > 0
    assert final.parity["top1_agreement"] >= 0.99
    assert base.parity["max_abs_diff"] < 1e-4  # fp32 export against the fp32 model
    assert abs(final.accuracy - final.reference_accuracy) <= 0.02
    assert base.accuracy == pytest.approx(base.reference_accuracy, abs=1e-9)
    from compress.core.machine import has_vnni

    assert any("VNNI" in n for n in final.notes) == (has_vnni() is False)
    assert not any("VNNI" in n for n in base.notes)


def test_openvino_agrees_with_ort_on_int8_file(int8_path: Path, digits: Any) -> None:
    ort_s, ov_s = load_session("onnxruntime", int8_path, threads=1), load_session("openvino", int8_path, threads=1)
    agree = total = 0
    for x, _ in digits.eval:
        a = ort_s.run({"input": x.numpy()})[0]
        b = ov_s.run({ov_s.input_names[0]: x.numpy()})[0]
        agree += int((a.argmax(1) == b.argmax(1)).sum())
        total += len(a)
    assert agree / total >= 0.98


def test_check_thresholds_takes_the_worst_runtime(records: Any) -> None:
    ok = check_thresholds(Thresholds(max_accuracy_drop=0.05, max_size_ratio=0.5), records)
    assert [t.name for t in ok] == ["max_accuracy_drop", "max_size_ratio"] and all(t.passed for t in ok)
    bad = {t.name: t for t in check_thresholds(Thresholds(min_speedup=1000.0, max_size_ratio=0.01, min_cosine=1.0),
                                               records)}
    assert not any(t.passed for t in bad.values())
    finals = [r for r in records if r.role == "final"]
    assert bad["min_cosine"].value == min(r.parity["cosine"] for r in finals)
    assert bad["min_cosine"].where in ("onnxruntime", "openvino")
    # the drop is measured against the fp32 baseline accuracy when given, per runtime, worst one kept
    t = check_thresholds(Thresholds(max_accuracy_drop=0.0), records, baseline_accuracy=1.0)[0]
    assert t.value == pytest.approx(1.0 - min(r.accuracy for r in finals)) and not t.passed


def test_a_drop_in_perplexity_is_its_rise() -> None:
    """Lower-is-better metrics: a rise of 5 on a budget of 1 fails, a fall passes."""
    th = Thresholds(max_accuracy_drop=1.0)
    worse = check_thresholds(th, [], baseline_accuracy=100.0, final_accuracy=105.0, higher_is_better=False)[0]
    assert worse.value == pytest.approx(5.0) and not worse.passed
    better = check_thresholds(th, [], baseline_accuracy=100.0, final_accuracy=99.0, higher_is_better=False)[0]
    assert better.value == pytest.approx(-1.0) and better.passed
    # the same figures read as an accuracy: 105 is a gain
    assert check_thresholds(th, [], baseline_accuracy=100.0, final_accuracy=105.0)[0].passed


def test_one_shot_validate_with_onnx_reference(int8_path: Path, fp32_path: Path) -> None:
    recs = validate(int8_path, reference=fp32_path, data="digits", batch_sizes=[2], warmup=0, runs=2, eval_samples=64)
    assert [r.role for r in recs] == ["final", "baseline"]
    assert recs[0].speedup is not None and 2 in recs[0].speedup
    assert recs[0].parity["top1_agreement"] >= 0.95  # int8 against the fp32 file
    assert recs[0].accuracy is not None and recs[0].samples == 64


def test_one_shot_validate_random_inputs(int8_path: Path, quantized_resnet: Any) -> None:
    recs = validate(int8_path, reference=quantized_resnet, batch_sizes=[3], warmup=0, runs=2, threads=1)
    assert len(recs) == 1 and recs[0].accuracy is None and recs[0].threads == 1
    assert recs[0].parity["cosine"] > 0.95


def test_static_batch_model_runs_in_chunks(trained_resnet: Any, tmp_path: Path, digits: Any) -> None:
    path = export_onnx(trained_resnet, torch.randn(4, 1, 8, 8), tmp_path / "static.onnx", dynamic_batch=False)
    recs = validate(path, reference=trained_resnet, data=digits.eval, batch_sizes=[1, 4], warmup=0, runs=1,
                    eval_samples=70)
    r = recs[0]
    assert r.samples == 70 and r.parity["max_abs_diff"] < 1e-4
    assert r.latency_ms[1] is None and r.latency_ms[4] is not None
    assert any("static batch 4" in n for n in r.notes)


def test_embedding_task(tiny_bert: Any, text_batch: Any, tmp_path: Path) -> None:
    model = tiny_bert()
    path = export_onnx(model, text_batch(2, 10, seed=0), tmp_path / "bert.onnx")
    data = [(text_batch(4, 10, seed=s), None) for s in range(3)]
    recs = validate(path, reference=model, data=data, batch_sizes=[2], warmup=0, runs=1, task="embedding")
    r = recs[0]
    assert r.metric == "embedding_cosine" and r.accuracy == pytest.approx(1.0, abs=1e-5)
    assert r.parity["top1_agreement"] is None and r.parity["max_abs_diff"] < 1e-4


def test_cli_run_and_errors(int8_path: Path, fp32_path: Path, tmp_path: Path) -> None:
    rows = run_validate(int8_path, reference=fp32_path, data="digits", batch_sizes=[1, 2], warmup=0, runs=1,
                        eval_samples=32)
    assert rows[0]["b2_speedup"] is not None and rows[0]["accuracy"] is not None and rows[0]["threads"]
    with pytest.raises(RecipeError, match="MODEL: file"):
        run_validate(tmp_path / "missing.onnx")
    with pytest.raises(RecipeError, match="unknown runtime 'onnxrt'"):
        run_validate(int8_path, runtimes=["onnxrt"])
    with pytest.raises(RecipeError, match="--reference"):
        run_validate(int8_path, reference=tmp_path / "nope.onnx")
    (tmp_path / "junk.onnx").write_bytes(b"\x00\xffnot a protobuf")
    with pytest.raises(RecipeError, match=r"MODEL: .* is not an ONNX model"):
        run_validate(tmp_path / "junk.onnx")


def test_parity_numbers_are_right() -> None:
    from compress.export.validation.parity import Parity

    rng = np.random.default_rng(0)
    ref = rng.standard_normal((50, 10))
    noise = 0.01 * rng.standard_normal((50, 10))
    p = Parity()
    p.update(ref, ref + noise)
    res = p.result()
    expect = 10 * np.log10((ref**2).sum() / (noise**2).sum())
    assert res["sqnr_db"] == pytest.approx(expect, rel=1e-9)
    assert res["max_abs_diff"] == pytest.approx(np.abs(noise).max())
    flipped = ref.copy()
    flipped[:5] = -flipped[:5]
    q = Parity()
    q.update(ref, flipped)
    assert q.result()["top1_agreement"] == pytest.approx((50 - (ref[:5].argmax(1) != (-ref[:5]).argmax(1)).sum()) / 50)


def test_cli_rows_and_inspect(int8_path: Path, fp32_path: Path) -> None:
    import json

    from compress.export.inspect import inspect_onnx

    rows = run_validate(int8_path, reference=fp32_path, data="digits", data_kwargs={"image_size": 8},
                        batch_sizes=[2], runs=1, threads=1)
    assert [r["role"] for r in rows] == ["final", "baseline"]
    assert rows[0]["b2_speedup"] is not None and rows[0]["accuracy"] is not None and rows[0]["threads"] == 1
    json.dumps(rows, default=str)
    with pytest.raises(RecipeError, match="run folder"):  # --backend cuda validates a run, not an ONNX file
        run_validate(int8_path, backend="cuda")
    text = inspect_onnx(int8_path)
    assert "onnx-int8-qdq" in text and "QLinearConv" in text and "input: float32[batch, 1, 8, 8]" in text
    assert "recipe.hash=abc123" in text


def test_cuda_runtime_without_cuda_is_a_skipped_record(resnet_exports: Any, quantized_resnet: Any, digits: Any) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the cuda runtime runs for real (tests/export/validation/test_cuda_runtime.py)")
    recs = validate_exports(resnet_exports, ValidateSpec(runtimes=["cuda"], **_SPEC), eval_loader=digits.eval,
                            reference=quantized_resnet)
    assert len(recs) == 1 and recs[0].runtime == "cuda" and recs[0].notes == ["skipped: no CUDA device"]
    # a skipped runtime measured nothing: a limit nobody measured is missed, not passed
    (t,) = check_thresholds(Thresholds(min_speedup=100.0), recs)
    assert t.value is None and not t.passed


@pytest.mark.parametrize("factor", [2.0, 0.5])
def test_a_file_slower_than_fp32_says_so(resnet_exports: Any, quantized_resnet: Any, trained_resnet: Any,
                                         digits: Any, monkeypatch: pytest.MonkeyPatch, factor: float) -> None:
    """Timings replaced by ones where int8 takes ``factor`` x fp32's time at batch 4: the record notes the
    slowdown by batch size only when it is one."""
    import compress.export.validation.measure as v

    def timed(sessions: Any, example: Any, batch_sizes: Any, warmup: int, runs: int) -> Any:
        return {"final": {1: 1.0, 4: 4.0 * factor}, "baseline": {1: 1.0, 4: 4.0}}, []

    monkeypatch.setattr(v, "time_side_by_side", timed)
    final = validate_exports(resnet_exports, ValidateSpec(runtimes=["onnxruntime"], **_SPEC), eval_loader=digits.eval,
                             reference=quantized_resnet, baseline_reference=trained_resnet)[0]
    slow = [n for n in final.notes if "slower than fp32" in n]
    assert final.speedup == {1: 1.0, 4: pytest.approx(1 / factor)}
    assert len(slow) == (1 if factor > 1 else 0)
    assert all(n.startswith("int8 measured slower than fp32 (batch 4: 0.50x)") for n in slow)


def test_lm_validation_reads_logits_in_bounded_row_groups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An LM's ONNX file is scored a few rows at a time and its references recomputed per group,
    never an eval set's (or a whole batch's) full-vocabulary logits, with the same figures."""
    pytest.importorskip("transformers")
    import compress.export.validation.references as references

    from compress.models.families import tiny_decoder
    from compress.training import evaluate

    model = tiny_decoder("llama")
    g = torch.Generator().manual_seed(0)
    batches = [({"input_ids": x}, x) for x in (torch.randint(3, 256, (3, 16), generator=g) for _ in range(2))]
    path = export_onnx(model, {"input_ids": batches[0][0]["input_ids"]}, tmp_path / "lm.onnx")

    def check() -> Any:
        return validate(path, reference=model, data=batches, metric="perplexity", batch_sizes=[1], warmup=1, runs=1)[0]

    whole = check()
    row_bytes = 16 * 256 * 4  # one row's float32 logits
    monkeypatch.setattr(references, "OUTPUT_BYTES", 2 * row_bytes)
    monkeypatch.setattr(references, "REFERENCE_CACHE_BYTES", 0)
    seen: list[int] = []
    run = references.run_session

    def spy(session: Any, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        out = run(session, feeds)
        seen.append(out[0].nbytes)
        return out

    monkeypatch.setattr(references, "run_session", spy)
    grouped = check()
    assert seen and max(seen) <= 2 * row_bytes  # no run returned more than two rows' logits
    assert grouped.accuracy == pytest.approx(whole.accuracy, rel=1e-9)
    assert grouped.parity == pytest.approx(whole.parity)
    assert whole.parity["sqnr_db"] > 60 and whole.parity["top1_agreement"] == 1.0
    assert whole.accuracy == pytest.approx(evaluate(model, batches, metric="perplexity"), rel=1e-5)
    assert whole.reference_accuracy == pytest.approx(whole.accuracy, rel=1e-5)
