"""Fingerprints of what the algorithms produce, for checking that a refactor changed no result:
run it on two checkouts and compare (``python -m benchmarks.same_outputs > a.json``).

Each row is a hash of a fixed-seed, transformers-config or zoo model's output after GPTQ, AWQ,
SmoothQuant W8A8 and structured pruning, and of the int8 ONNX bytes that PTQ and export_onnx write
for a ResNet, a BERT and a ViT. It is a hash, not a tolerance: the same code path gives the same bits.
"""

from __future__ import annotations

import copy
import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

import compress


def _digest(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()[:16]
    return hashlib.sha256(Path(t).read_bytes()).hexdigest()[:16]


def fingerprints() -> dict[str, str]:
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM, ViTConfig, ViTModel

    out: dict[str, str] = {}
    work = Path(tempfile.mkdtemp())
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    fp = LlamaForCausalLM(cfg).eval()
    data = [torch.randint(0, 256, (4, 32)) for _ in range(4)]
    x = torch.randint(0, 256, (2, 24))
    head = ["lm_head"]
    with torch.no_grad():
        out["gptq w4"] = _digest(compress.gptq(copy.deepcopy(fp), data, scheme="w4_weight_only", ignore=head,
                                               progress=False)(x).logits)
        out["awq w4"] = _digest(compress.awq(copy.deepcopy(fp), data, scheme="w4_weight_only", ignore=head,
                                             progress=False)(x).logits)
        sq = compress.QuantizeParams(smoothquant=0.5, quantize_ops=False)
        out["smoothquant w8a8"] = _digest(compress.quantize(copy.deepcopy(fp), "w8a8", data, ignore=head, params=sq,
                                                            progress=False)(x).logits)
    resnet = compress.load_model({"name": "resnet", "kwargs": {"width": 16, "num_classes": 10, "in_channels": 1}})
    torch.manual_seed(1)
    imgs = [torch.randn(8, 1, 8, 8) for _ in range(3)]
    q = compress.quantize(copy.deepcopy(resnet).eval(), "w8a8", imgs, progress=False)
    out["resnet int8 onnx"] = _digest(compress.export_onnx(q, imgs[0][:1], work / "resnet.onnx"))
    pruned = compress.prune(copy.deepcopy(resnet), imgs[0], ratio=0.5, importance="l2", round_to=4, progress=False)
    with torch.no_grad():
        out["prune l2 0.5"] = _digest(pruned.model(imgs[1]))
    torch.manual_seed(0)
    bert = BertModel(BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=128)).eval()
    ids = [{"input_ids": torch.randint(0, 512, (4, 32)), "attention_mask": torch.ones(4, 32, dtype=torch.long)}
           for _ in range(3)]
    q = compress.quantize(bert, "w8a8", ids, params=compress.QuantizeParams(batch_sizes=(8,)), progress=False)
    out["bert int8 onnx"] = _digest(compress.export_onnx(q, {k: v[:1] for k, v in ids[0].items()}, work / "bert.onnx"))
    torch.manual_seed(0)
    vit = ViTModel(ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=128)).eval()
    images = [torch.randn(4, 3, 32, 32) for _ in range(3)]
    q = compress.quantize(vit, "w8a8", images, params=compress.QuantizeParams(batch_sizes=(32,)), progress=False)
    out["vit int8 onnx"] = _digest(compress.export_onnx(q, images[0][:1], work / "vit.onnx"))
    return out


def main() -> None:
    print(json.dumps(fingerprints(), indent=1))


if __name__ == "__main__":
    main()
