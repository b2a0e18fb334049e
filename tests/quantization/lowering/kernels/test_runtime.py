"""Without a GPU and without the interpreter the kernels refuse to run, clearly; no Triton at import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env={**clean, **env}, timeout=120
    )


def test_cpu_tensors_without_interpreter_raise_clear_error() -> None:
    r = _run(
        """
        import torch
        if torch.cuda.is_available():
            print("CUDA"); raise SystemExit(0)
        from compress.core.errors import CompressError
        from compress.quantization.lowering.kernels import int8_gemm
        a = torch.ones(4, 8, dtype=torch.int8)
        try:
            int8_gemm(a, a, a_scale=torch.ones(1), b_scale=torch.ones(4))
        except CompressError as e:
            print("ERR", e)
        """
    )
    assert r.returncode == 0, r.stderr
    if "CUDA" not in r.stdout:
        assert "ERR int8_gemm run on CUDA devices (got a cpu tensor)" in r.stdout


def test_importing_quantization_does_not_import_triton() -> None:
    r = _run("import sys, quantization, quantization.lowering.kernels; print('triton' in sys.modules)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


ROOT = Path(__file__).resolve().parents[4]  # benchmarks/ is a top-level folder of the repository


def test_benchmark_script_without_cuda_exits_2_with_one_line() -> None:
    r = subprocess.run([sys.executable, "-m", "benchmarks.cuda_int8"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    if r.returncode == 0:  # a CUDA machine ran it for real
        return
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "benchmarks.cuda_int8: needs a CUDA GPU (none found); --interpret-smoke checks the script on CPU"
    ]


def test_benchmark_script_interpret_smoke(tmp_path: Path) -> None:
    # the kernel parts of the script end to end on tiny shapes (the models part is slower: run by hand)
    out = tmp_path / "smoke.json"
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.cuda_int8", "--interpret-smoke", "--skip", "models", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["gpu"].startswith("cpu") and len(data["gemm"]) == 2 and len(data["conv"]) == 2
    for row in data["gemm"]:
        assert {"M", "N", "K", "ours_tops", "fp16_tflops", "int_mm_tops", "speedup_vs_fp16", "speedup_vs_int_mm",
                "sqnr_db"} <= set(row)
        assert row["sqnr_db"] > 35  # int8 per-token x per-channel on Gaussian data: ~40 dB
    assert all(row["sqnr_db"] > 35 for row in data["conv"])


def test_w4a16_benchmark_script_interpret_smoke(tmp_path: Path) -> None:
    # no GPU is needed to check that the W4A16 benchmark runs end to end (tiny shapes, interpreter)
    out = tmp_path / "w4a16.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.w4a16", "--interpret-smoke", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["gpu"].startswith("cpu") and [row["M"] for row in data["rows"]] == [1, 5]
    # the kernel against fp64 on the same int4 weight: fp16 rounding only (~70 dB), not a quantization error
    assert all(row["sqnr_db"] > 60 for row in data["rows"])


def test_decode_benchmark_script_interpret_smoke(tmp_path: Path) -> None:
    out = tmp_path / "decode.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.cuda_decode", "--interpret-smoke", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(row["M"], row["N"]) for row in rows] == [(1, 40), (3, 40), (1, 24), (3, 24)]
    assert all(row["split_bit_exact"] for row in rows)


def test_split_k_gemm_compiles_for_hopper_with_ordered_arrival() -> None:
    # the split-K fixup is only correct if each program's partial sums land before its arrival is
    # counted: a CTA barrier, then one acq_rel atomic on the counter, then the read-back (a barrier
    # broadcasts the count). Checked in the PTX Triton emits for sm90, no GPU needed.
    r = _run(
        """
        import re
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from compress.quantization.lowering.kernels import gemm as g

        fn = g._gemm_kernel
        names = list(fn.arg_names)
        ptrs = {"a_ptr": "*i8", "b_ptr": "*i8", "c_ptr": "*fp16", "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32",
                "bias_ptr": "*fp32", "colsum_ptr": "*i32", "ws_ptr": "*i32"}
        for split in (True, False):
            const = {"A_PER_ROW": True, "HAS_BIAS": True, "HAS_ZP": False, "ACT": 0, "BLOCK_M": 16, "BLOCK_N": 64,
                     "BLOCK_K": 256, "GROUP_M": 8, "EVEN_K": True, "SPLIT": split}
            sig = {n: ptrs.get(n, "constexpr" if n in const else "i32") for n in names}
            src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(c),): v for c, v in const.items()})
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
            lines = [ln.strip() for ln in ptx.splitlines()]
            adds = [i for i, ln in enumerate(lines) if re.search(r"(red|atom)[.a-z]*[.]add[.]u32", ln) and "acq_rel" not in ln]
            counter = [i for i, ln in enumerate(lines) if "atom.global.gpu.acq_rel.add" in ln]
            xchg = [i for i, ln in enumerate(lines) if ".exch." in ln]
            if not split:
                print("plain", len(adds), len(counter), len(xchg))
                continue
            bar_between = any("bar.sync" in ln for ln in lines[max(adds):counter[0]])
            bar_after = any("bar.sync" in ln for ln in lines[counter[0]:min(xchg)])
            print("split", len(counter), max(adds) < counter[0] < min(xchg), bar_between, bar_after)
        """
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "split 1 True True True" in r.stdout and "plain 0 0 0" in r.stdout


def test_w4a16_kernel_compiles_for_hopper_without_a_gpu() -> None:
    # Triton compiles to PTX and cubin without a device: the CUDA path (not the interpreter's) builds.
    # benchmarks.w4a16 --compile-check does every config and specialization for sm80 and sm90.
    r = _run(
        """
        from benchmarks.w4a16 import compile_variant
        from compress.quantization.lowering.kernels.w4a16 import W4Config
        row = compile_variant(90, W4Config(1, 32, 128, split_k=8, acc3=True, prefetch=True), "bf16", TILE_IN_GROUP=False,
                              HAS_GIDX=True, EVEN_K=False)
        fast = compile_variant(90, W4Config(16, 64, 128, split_k=4, prefetch=True))
        deep = compile_variant(90, W4Config(1, 64, 256, split_k=8, acc3=True, prefetch=True), TILE_IN_GROUP=False,
                               TILE_GROUPS=2)
        print("OK", row["cubin_bytes"] > 0, fast["vector_loads"] > 0, deep["vector_loads"] > 0)
        """
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "OK True True True" in r.stdout  # and the weight tiles load 16 bytes at a time, deep tiles too


def test_gpu_check_script_parses_and_refuses_unknown_steps(tmp_path: Path) -> None:
    # the one-call GPU script (benchmarks/gpu_check.sh) is only run on a lent GPU: check here that
    # bash parses it and that a misspelled step stops it with exit 2 before anything runs
    script = ROOT / "benchmarks" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    r = subprocess.run(["bash", str(script), str(tmp_path / "out"), "bogus"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "unknown step 'bogus'" in r.stderr


def test_cuda_e2e_merge_keeps_the_latest_measurement_per_row_and_the_gpu_machine(tmp_path: Path, monkeypatch) -> None:
    import json

    import benchmarks._results as results
    from benchmarks import cuda_e2e

    monkeypatch.setattr(results, "RESULTS", tmp_path / "RESULTS.md")
    monkeypatch.setattr(results, "RESULTS_DIR", tmp_path / "results")
    gpu_machine = {"cpu": "Intel Xeon", "cores": 16, "memory_gib": 125.9, "gpu": "NVIDIA H200", "python": "3.12.3",
                   "torch": "2.11.0"}

    def row(part: str, scheme: str, speedup: float, date: str | None, mode: str = "eager") -> dict:
        r = {"part": part, "model": part, "phase": "prefill", "batch": 1, "tokens": 8, "scheme": scheme, "mode": mode,
             "fp16_ms": 1.0, "ms": 1.0 / speedup, "speedup": speedup, "cosine": 1.0, "sqnr_db": 40.0,
             "fp16_cosine": 1.0, "layers": {"Int8Linear": 1}, "float_layers": {}}
        return r if date is None else {**r, "date": date}

    older = {"gpu": "NVIDIA H200", "machine": gpu_machine, "plan": cuda_e2e.FULL,
             "rows": [row("llama", "W8A8", 1.10, None), row("bert", "W8A8", 0.90, None)],
             "profiles": {"llama prefill 8": {"fp16": {"total_ms": 1.0}}}}
    newer = {"gpu": "NVIDIA H200", "machine": gpu_machine, "plan": cuda_e2e.FULL,
             "rows": [row("bert", "W8A8", 0.95, "2026-11-26 09:14"), row("bert", "W8A8", 0.91, "2026-11-26 09:14", "compile"),
                      row("llama", "W8A8", 1.00, None)],  # an old row the device run carried along
             "profiles": {"bert batch 32": {"fp16": {"total_ms": 2.0}}}}
    first = {**newer, "rows": [row("llama", "W8A8", 1.20, "2026-11-26 09:07")], "profiles": {}}
    files = []
    for i, run in enumerate((older, first, newer)):
        files.append(tmp_path / f"run{i}.json")
        files[-1].write_text(json.dumps(run))
    cuda_e2e.merge(files, tmp_path / "merged.json")
    merged = json.loads((tmp_path / "merged.json").read_text())
    speedups = {(r["part"], r["mode"]): r["speedup"] for r in merged["rows"]}
    assert speedups == {("llama", "eager"): 1.20, ("bert", "eager"): 0.95, ("bert", "compile"): 0.91}
    assert set(merged["profiles"]) == {"llama prefill 8", "bert batch 32"}
    section = (tmp_path / "RESULTS.md").read_text()
    assert "GPU NVIDIA H200" in section and "Intel Xeon" in section  # the GPU machine's record, not this one's
    other = {**older, "gpu": "NVIDIA H100"}
    files[0].write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="different GPUs"):
        cuda_e2e.merge(files, tmp_path / "merged.json")
