"""Where a converted FP8 model departs from its fake-quant model on a GPU, layer by layer.

    python -m benchmarks.cuda_fp8_parity [--json PATH]        # CUDA; TRITON_INTERPRET=1 runs it on CPU

For each FP8Linear of a transformers Llama (random weights, small), given the exact input the
fake-quant layer sees: how many of the activations the Triton kernel quantizes differ from the fake
quantizer's (field ``codes_differing``: dequantized values, so a per-token scale one ulp apart counts
even where the codes agree), and how far the fp8 GEMM (cuBLASLt) and the fake-quant layer are each from a float64
product of the same dequantized codes. Then the logits of the whole model: converted vs fake-quant,
float vs fake-quant, in fp32 and deployed in fp16. It tells code differences from accumulation
differences, which is what a parity bound has to be built on.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch


def _llama(hidden: int, layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def probe(scheme: str, hidden: int, layers: int, dev: torch.device) -> dict[str, Any]:
    from compress.export.validation.cuda import cast_float_layers
    from compress.quantization.lowering.convert import convert_with_report
    from compress.quantization.lowering.fp8 import FP8Linear

    import compress

    model = _llama(hidden, layers)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    fq = compress.quantize(copy.deepcopy(model), scheme, [{"input_ids": ids}]).eval()
    conv, _ = convert_with_report(fq, placed="fuse")
    fq, conv, model, ids = fq.to(dev), conv.to(dev), model.to(dev), ids.to(dev)
    inputs: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda m, a, o, n=n: inputs.__setitem__(n, a[0].detach()))
             for n, m in fq.named_modules() if n and hasattr(m, "weight_quantizer")]
    with torch.no_grad():
        ref = fq(input_ids=ids).logits
        for h in hooks:
            h.remove()
        conv_mods = dict(conv.named_modules())
        rows = []
        for name, x in inputs.items():
            fl, cl = dict(fq.named_modules())[name], conv_mods[name]
            if not isinstance(cl, FP8Linear):
                continue
            flat = x.reshape(-1, cl.in_features)
            # a placed quantizer upstream already gave the layer fake-quantized values (its own is None)
            iq = fl.input_quantizer
            xq_fake = (x if iq is None else iq(x)).reshape(-1, cl.in_features).float()
            q, s = cl._quantize_input(flat)
            xq_kernel = q.float() * s.float().reshape(-1, 1) if s.numel() > 1 else q.float() * s.float()
            w = fl.weight_quantizer(fl.weight).float()
            b = None if fl.bias is None else fl.bias.double()
            y64 = torch.nn.functional.linear(xq_fake.double(), w.double(), b)
            rows.append({"layer": name, "codes_differing": float((xq_kernel != xq_fake).float().mean()),
                         "fake_vs_f64": _rel(fl(x).reshape(-1, cl.out_features), y64),
                         "fp8_gemm_vs_f64": _rel(cl(x).reshape(-1, cl.out_features), y64)})
        y = conv(input_ids=ids).logits
        fp = model(input_ids=ids).logits
        half = cast_float_layers(copy.deepcopy(conv), torch.float16)
        y16 = half(input_ids=ids).logits.float()
    return {"scheme": scheme, "hidden": hidden, "layers": layers, "per_layer": rows,
            "logits": {"converted_vs_fakequant": _rel(y, ref), "converted_fp16_vs_fakequant": _rel(y16, ref),
                       "float_vs_fakequant": _rel(fp, ref)}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cuda_fp8_parity", description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = []
    for scheme in ("FP8_DYNAMIC", "FP8"):
        for hidden, layers in ((64, 2), (256, 2)):
            r = probe(scheme, hidden, layers, dev)
            out.append(r)
            worst = max(r["per_layer"], key=lambda x: x["fp8_gemm_vs_f64"])
            print(f"{scheme} hidden {hidden}: logits rel diff converted/fake {r['logits']['converted_vs_fakequant']:.4f}, "
                  f"fp16 {r['logits']['converted_fp16_vs_fakequant']:.4f}, float/fake {r['logits']['float_vs_fakequant']:.4f}; "
                  f"codes differing max {max(x['codes_differing'] for x in r['per_layer']):.5f}; "
                  f"worst layer {worst['layer']}: fp8 gemm {worst['fp8_gemm_vs_f64']:.2e}, fake {worst['fake_vs_f64']:.2e}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": str(dev), "gpu": torch.cuda.get_device_name(0) if dev.type == "cuda"
                                         else "cpu", "runs": out}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
