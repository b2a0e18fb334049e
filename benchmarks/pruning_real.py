"""Real-model pruning suite: transformers' own model definitions, built from configs with random
weights (offline), pruned at ratio 0.5 by ``compress.prune`` and by Torch-Pruning side by side.

    python -m benchmarks.pruning_real [--quick] [--no-onnx]

Per model: whether the pruned model is correct (its forward runs, same output shapes, finite),
params and MACs after / before (one counter for both tools: ``pruning.counting``), how many
conv/linear layers got narrower, the time the pruning call took, and for compress the ONNX Runtime
parity of the pruned model (``compress.export_onnx``, max |ORT - PyTorch| on the first output).
Torch-Pruning runs as documented for transformers: ``MetaPruner`` with MagnitudeImportance(p=2),
the classifier / LM head ignored, the q/k/v Linears given with their head counts and
``prune_num_heads=True``; head-count attributes set from the pruned q after the step.

``SUITE`` is also what ``tests/pruning/test_real_models.py`` prunes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from compress.core.moe import unpack_experts

Builder = Callable[[], tuple[nn.Module, Any]]
log = logging.getLogger("benchmarks.pruning_real")


def _img(size: int = 32) -> torch.Tensor:
    return torch.randn(2, 3, size, size)


def _ids(vocab: int = 256, n: int = 12) -> torch.Tensor:
    return torch.randint(0, vocab, (2, n))


def _suite() -> dict[str, Builder]:
    import transformers as T

    def vision(cfg_cls: Any, model_cls: Any, size: int = 32, **cfg: Any) -> Builder:
        return lambda: (model_cls(cfg_cls(num_labels=10, **cfg)), _img(size))

    def text(cfg_cls: Any, model_cls: Any, inputs: Callable[[], dict[str, torch.Tensor]], **cfg: Any) -> Builder:
        return lambda: (model_cls(cfg_cls(vocab_size=256, use_cache=False, **cfg)), inputs())

    llm = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    return {
        "vit": vision(T.ViTConfig, T.ViTForImageClassification, hidden_size=64, num_hidden_layers=2,
                      num_attention_heads=4, intermediate_size=128, image_size=32, patch_size=8),
        "swin": vision(T.SwinConfig, T.SwinForImageClassification, image_size=32, patch_size=2, embed_dim=16,
                       depths=[1, 1], num_heads=[2, 4], window_size=4),
        "mobilevit": vision(T.MobileViTConfig, T.MobileViTForImageClassification, image_size=32, hidden_sizes=[32, 48, 64],
                            neck_hidden_sizes=[8, 16, 24, 32, 40, 48, 64], num_attention_heads=2),
        "levit": vision(T.LevitConfig, T.LevitForImageClassification, 64, image_size=64, hidden_sizes=[32, 48, 64],
                        num_attention_heads=[2, 3, 4], depths=[1, 1, 1], key_dim=[8, 8, 8]),
        "dinov2": vision(T.Dinov2Config, T.Dinov2ForImageClassification, hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, image_size=32, patch_size=8),
        "convnext": vision(T.ConvNextConfig, T.ConvNextForImageClassification, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2),
        "convnextv2": vision(T.ConvNextV2Config, T.ConvNextV2ForImageClassification, hidden_sizes=[16, 32], depths=[1, 1],
                             num_stages=2),
        "resnet": vision(T.ResNetConfig, T.ResNetForImageClassification, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1]),
        "regnet": vision(T.RegNetConfig, T.RegNetForImageClassification, embedding_size=16, hidden_sizes=[24, 48],
                         depths=[1, 1], groups_width=8),
        "mobilenetv2": vision(T.MobileNetV2Config, T.MobileNetV2ForImageClassification, image_size=32, depth_multiplier=0.35),
        "bert": text(T.BertConfig, T.BertForSequenceClassification, lambda: {"input_ids": _ids()}, hidden_size=64,
                     num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, num_labels=3),
        "gpt2": text(T.GPT2Config, T.GPT2LMHeadModel, lambda: {"input_ids": _ids()}, n_embd=64, n_layer=2, n_head=4,
                     bos_token_id=0, eos_token_id=0),
        "t5": text(T.T5Config, T.T5ForConditionalGeneration, lambda: {"input_ids": _ids(), "decoder_input_ids": _ids(n=7)},
                   d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4),
        "llama": text(T.LlamaConfig, T.LlamaForCausalLM, lambda: {"input_ids": _ids()}, **llm),
        "qwen2": text(T.Qwen2Config, T.Qwen2ForCausalLM, lambda: {"input_ids": _ids()}, **llm),
        "bloom": text(T.BloomConfig, T.BloomForCausalLM, lambda: {"input_ids": _ids()}, hidden_size=64, n_layer=2, n_head=4),
        "mixtral": text(T.MixtralConfig, T.MixtralForCausalLM, lambda: {"input_ids": _ids()}, **llm, num_local_experts=4,
                        num_experts_per_tok=2),
    }


SUITE: dict[str, Builder] = {}


def build(name: str, seed: int = 0) -> tuple[nn.Module, Any]:
    """Model ``name`` of the suite (eval mode, seeded) and its example inputs."""
    if not SUITE:
        SUITE.update(_suite())
    torch.manual_seed(seed)
    model, x = SUITE[name]()
    # MoE experts as per-expert Linears for both tools and for the MAC counter, which does not see
    # transformers' grouped-matmul kernel (compress.prune unpacks them itself; test_moe.py covers that)
    unpack_experts(model)
    for m in model.modules():  # outputs without KV caches, so the ONNX export sees tensors only
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "use_cache"):
            cfg.use_cache = False
    return model.eval(), x


def names() -> list[str]:
    if not SUITE:
        SUITE.update(_suite())
    return list(SUITE)


def run(model: nn.Module, x: Any) -> list[torch.Tensor]:
    from compress.core.tracing import iter_tensors

    with torch.no_grad():
        out = model(**x) if isinstance(x, dict) else model(x)
    return list(iter_tensors(out))


def narrowed(model: nn.Module, before: dict[str, tuple[int, ...]]) -> int:
    """Conv/linear layers whose weight lost rows or columns."""
    return sum(
        1 for n, m in model.named_modules()
        if isinstance(m, (nn.Conv2d, nn.Linear, nn.Conv1d)) or type(m).__name__ == "Conv1D"
        if n + ".weight" in before and tuple(m.weight.shape) != before[n + ".weight"]
    )


def check(model: nn.Module, x: Any, shapes: list[tuple[int, ...]]) -> str:
    """'ok', or what is wrong with the pruned model."""
    try:
        outs = run(model, x)
    except Exception as exc:  # the benchmark records any failure of a pruned model
        return f"forward fails ({type(exc).__name__})"
    if [tuple(t.shape) for t in outs] != shapes:
        return "output shape changed"
    if not all(bool(torch.isfinite(t.float()).all()) for t in outs):
        return "non-finite output"
    return "ok"


def onnx_parity(model: nn.Module, x: Any, path: Path) -> float:
    import onnxruntime as ort
    from compress.export.onnx import export_onnx

    export_onnx(model, x, path, dynamic_batch=False)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = x if isinstance(x, dict) else {"x": x}
    feed = {i.name: v.numpy() for i, v in zip(sess.get_inputs(), feeds.values())}
    got = sess.run(None, feed)[0]
    return float(np.abs(got - run(model, x)[0].numpy()).max())


# ---- Torch-Pruning (benchmark only) ----------------------------------------------------------

_HEAD_ATTRS = ("num_attention_heads", "num_heads", "n_heads", "n_head")
_QKV = (("query", "key", "value"), ("q", "k", "v"), ("q_proj", "k_proj", "v_proj"))


def tp_prune(model: nn.Module, x: Any, ratio: float) -> None:
    import torch_pruning as tp

    heads: dict[nn.Module, int] = {}
    owners: list[tuple[nn.Module, nn.Linear]] = []
    for m in model.modules():
        count = next((getattr(m, a) for a in _HEAD_ATTRS if isinstance(getattr(m, a, None), int)), None)
        for names_ in _QKV:
            lins = [lin for lin in (getattr(m, n, None) for n in names_) if isinstance(lin, nn.Linear)]
            if count and len(lins) == len(names_):
                heads.update(dict.fromkeys(lins, count))
                owners.append((m, lins[0]))
    outs = {getattr(model.config, "num_labels", -1), getattr(model.config, "vocab_size", -2)}
    ignored = [m for m in model.modules() if isinstance(m, nn.Linear) and m.out_features in outs]
    pruner = tp.pruner.MetaPruner(
        model, x, importance=tp.importance.MagnitudeImportance(p=2), pruning_ratio=ratio, ignored_layers=ignored,
        num_heads=heads, prune_num_heads=bool(heads), prune_head_dims=False, head_pruning_ratio=ratio,
    )
    pruner.step()
    for m, q in owners:  # Torch-Pruning leaves head counts to the user
        hd = next((getattr(m, a) for a in ("attention_head_size", "head_dim", "key_value_proj_dim") if isinstance(getattr(m, a, None), int)), None)
        if hd:
            for a in _HEAD_ATTRS:
                if isinstance(getattr(m, a, None), int):
                    setattr(m, a, q.out_features // hd)
            if isinstance(getattr(m, "all_head_size", None), int):
                m.all_head_size = q.out_features  # type: ignore[assignment]


# ---- the run ------------------------------------------------------------------------------------


class _Timeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Timeout


def measure(name: str, *, with_onnx: bool, tmp: Path, limit_s: int = 180) -> dict[str, Any]:
    from compress.pruning.api import prune
    from compress.pruning.counting import count_macs, count_params

    row: dict[str, Any] = {"model": name}
    for tool in ("ours", "tp"):
        model, x = build(name)
        shapes = [tuple(t.shape) for t in run(model, x)]
        before = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        p0, m0 = count_params(model), count_macs(model, x)
        t0 = time.perf_counter()
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(limit_s)  # Torch-Pruning's group search does not finish on the causal LMs
        try:
            if tool == "ours":
                result = prune(model, x, ratio=0.5)
                row["pinned"] = len(result.pinned)
            else:
                tp_prune(model, x, 0.5)
            signal.alarm(0)
            status = check(model, x, shapes)
        except _Timeout:
            status = f"no result in {limit_s} s"
        except Exception as exc:  # a refusal is a result too
            status = f"refused ({type(exc).__name__})"
            log.info("%s %s: %s", name, tool, exc)
        finally:
            signal.alarm(0)
        row[f"{tool}_s"] = round(time.perf_counter() - t0, 2)
        row[f"{tool}"] = status
        if status == "ok":
            row[f"{tool}_params"] = round(count_params(model) / p0, 3)
            row[f"{tool}_macs"] = round(count_macs(model, x) / m0, 3)
            row[f"{tool}_layers"] = f"{narrowed(model, before)}/{sum(1 for k in before if k.endswith('.weight') and len(before[k]) >= 2)}"
            if tool == "ours" and with_onnx:
                try:
                    row["onnx_max_abs"] = f"{onnx_parity(model, x, tmp / f'{name}.onnx'):.1e}"
                except Exception as exc:  # recorded, with the unpruned model's export tried for context
                    row["onnx_max_abs"] = f"export fails ({type(exc).__name__})"
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="vit, llama and regnet only")
    ap.add_argument("--no-onnx", action="store_true")
    ap.add_argument("--models", nargs="*", default=None,
                    help="rerun these models only, keeping the other rows of the last run (results/pruning_real.json)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    from benchmarks._results import RESULTS_DIR, table, write_section

    todo = ["vit", "llama", "regnet"] if args.quick else args.models or names()
    kept: dict[str, dict[str, Any]] = {}
    last = RESULTS_DIR / "pruning_real.json"
    if args.models and last.exists():
        kept = {r["model"]: r for r in json.loads(last.read_text())["rows"] if r["model"] not in args.models}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as d:
        for n in todo:
            rows.append(measure(n, with_onnx=not args.no_onnx, tmp=Path(d)))
            print(rows[-1], flush=True)
            merged = {**kept, **{r["model"]: r for r in rows}}
            ordered = [merged[m] for m in names() if m in merged]
            _write(ordered, len(kept) + len(todo), table, write_section)


def _write(rows: list[dict[str, Any]], total: int, table: Any, write_section: Any) -> None:
    """The section so far (rewritten after every model, so a cut-short run leaves what it measured)."""
    ours_ok = sum(r["ours"] == "ok" for r in rows)
    tp_ok = sum(r["tp"] == "ok" for r in rows)
    cols = ["model", "ours", "ours_params", "ours_macs", "ours_layers", "ours_s", "pinned", "onnx_max_abs",
            "tp", "tp_params", "tp_macs", "tp_layers", "tp_s"]
    md = (
        "## Real-model pruning suite (`python -m benchmarks.pruning_real`)\n\n"
        "transformers' model definitions from configs (random weights, offline), `compress.prune(model, x, "
        "ratio=0.5)` (L2, local) beside Torch-Pruning 1.6 `MetaPruner` (MagnitudeImportance p=2, heads given, "
        "classifier/LM head ignored) on the same model. params/MACs: after / before (one counter); layers: "
        "conv/linear layers narrowed / all; s: seconds of the pruning call (1 thread, load average "
        f"{os.getloadavg()[0]:.1f} at this write); MoE experts unpacked into per-expert Linears before both tools "
        "and the counter (compress/moe.py); pinned: groups our cut kept whole because cutting them alone broke the forward; "
        f"onnx: max |ORT - PyTorch| of the pruned model's first output. Torch-Pruning gets {180} s per model.\n\n"
        f"Correctly pruned: ours {ours_ok}/{len(rows)}, Torch-Pruning {tp_ok}/{len(rows)}"
        + (f" ({len(rows)} of {total} models measured so far)" if len(rows) < total else "") + ".\n\n" + table(rows, cols)
    )
    write_section("pruning_real", md, {"rows": rows})


if __name__ == "__main__":
    main()
