"""Train the project's reference decoder LLM: a small LlamaForCausalLM (grouped-query attention,
SwiGLU, RoPE; every Linear width divisible by 128) on the Python standard library's source, with a
byte-level BPE tokenizer trained on the same train files. ``python -m benchmarks.train_reference_llm
--out runs/reference_llm``.

Trained far enough that quantization shows: 2000 steps of 16 x 128 tokens (4.1M tokens, two passes
over the 2.0M-token train split; 0.55-0.9 s a step on 2 EPYC cores, 19-31 min) reach held-out
perplexity 17.5-17.8, and round-to-nearest w3 g128 then costs +4.1-4.4% perplexity, w4 +0.6-1.0%
(230 steps reached 115 and moved by 0.35% at w3: methods could not be told apart).

Reproducible on one machine: a fixed seed, a fixed step count (not a time budget), a fixed batch
generator and a deterministic file split (compress.data.lm.split_files); only the eval files are
used for the held-out perplexity it logs. Two reruns on one AVX-512 machine logged the same losses
for the first 40 steps, to the last digit, as the saved model's ``training.json``. Not across
CPUs: torch picks its float kernels by instruction set (vector width, so the order of each sum),
which is the likely cause; rounding that differs from the first step is amplified by training. The same command gave 17.8 on an AVX2 CPU and 17.52 on an
AVX-512 one, so a figure measured on the reference model holds for the model it names in its
section (perplexity, machine), not for a retrained one.

The output is a Hugging Face directory (config.json, model.safetensors, tokenizer files and
``training.json``) that a recipe loads with ``model.hf_path`` and ``data: {source: text_lm, kwargs:
{tokenizer: DIR}}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.llm_quant import perplexity
from compress.core.metrics import causal_lm_nll
from compress.data.lm import TokenWindows, iter_texts, split_files, token_stream, train_tokenizer

log = logging.getLogger("benchmarks.train_reference_llm")


def llama_config(
    *, vocab_size: int, hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int, seq_len: int
) -> Any:
    """The reference architecture: LLaMA with GQA, SwiGLU and RoPE, tied input/output embeddings."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max(seq_len, 128),
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def train(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    files = split_files(args.split_seed)
    tok = train_tokenizer(iter_texts(files["train"]), vocab_size=args.vocab)
    train_tokens = token_stream(files["train"], tok, max_tokens=args.max_train_tokens)
    eval_windows = TokenWindows(token_stream(files["eval"], tok, max_tokens=args.eval_tokens), args.seq_len)
    log.info("tokenizer %d, train tokens %d, eval windows %d (%.1f s)", len(tok), len(train_tokens),
             len(eval_windows), time.perf_counter() - t0)
    cfg = llama_config(vocab_size=len(tok), hidden=args.hidden, layers=args.layers, intermediate=args.intermediate,
                       heads=args.heads, kv_heads=args.kv_heads, seq_len=args.seq_len)
    model = LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    warm = max(args.steps // 20, 1)

    def lr_at(step: int) -> float:
        if step < warm:
            return args.lr * (step + 1) / warm
        t = (step - warm) / max(args.steps - warm, 1)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    # random windows of the train stream, a fixed generator: the same batches on every run
    gen = torch.Generator().manual_seed(args.seed)
    n_starts = len(train_tokens) - args.seq_len - 1
    history: list[dict[str, float]] = []
    t_train = time.perf_counter()
    model.train()
    running, since = 0.0, 0
    for step in range(args.steps):
        starts = torch.randint(0, n_starts, (args.batch_size,), generator=gen)
        x = torch.stack([train_tokens[s : s + args.seq_len] for s in starts.tolist()])
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        nll, n = causal_lm_nll(model(input_ids=x).logits, x)
        loss = nll / n
        opt.zero_grad(set_to_none=True)
        loss.float().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running += float(loss.detach())
        since += 1
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            # the last row may cover fewer than log_every steps
            row = {"step": step + 1, "train_loss": running / since, "seconds": time.perf_counter() - t_train}
            running, since = 0.0, 0
            history.append(row)
            log.info("step %d loss %.3f (%.0f s)", row["step"], row["train_loss"], row["seconds"])
            model.train()
    train_s = time.perf_counter() - t_train
    ppl = perplexity(model, eval_windows.windows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    info = {
        "params": n_params,
        "config": {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                               "num_attention_heads", "num_key_value_heads")},
        "args": vars(args),
        "train_tokens_seen": args.steps * args.batch_size * args.seq_len,
        "train_stream_tokens": len(train_tokens),
        "eval_tokens": int(eval_windows.windows.numel()),
        "eval_perplexity": ppl,
        "train_seconds": train_s,
        "total_seconds": time.perf_counter() - t0,
        "torch_threads": args.threads,
        "history": history,
    }
    (out / "training.json").write_text(json.dumps(info, indent=1), encoding="utf-8")
    log.info("held-out perplexity %.2f after %d steps (%.0f s); saved %s", ppl, args.steps, train_s, out)
    return info


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/reference_llm")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split-seed", type=int, default=0, help="the file split (text_lm's data.seed)")
    p.add_argument("--max-train-tokens", type=int, default=None)
    p.add_argument("--eval-tokens", type=int, default=65536)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--log-every", type=int, default=20)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    train(parse_args(argv))


if __name__ == "__main__":
    main()
