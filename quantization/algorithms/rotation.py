"""Rotations (QuaRot, Ashkboos et al., 2024; SpinQuant's R1/R2, Liu et al., 2024): orthogonal
transforms folded into a decoder's weights so that its float function is unchanged while the
tensors the quantizers see lose their outlier channels.

- **The residual stream (R1).** Every norm's weight is first folded into the Linears that read its
  output (so the norms are plain ``x / rms(x)``, which commutes with any rotation), then the
  embedding's rows, every Linear that reads the residual (q/k/v, gate/up, the router, lm_head) and
  every Linear that writes it (o_proj, down_proj: rows, bias) are rotated by one orthogonal ``Q``.
  A tied lm_head is untied (its folded weight is no longer the embedding).
- **Per head (R2).** Each value head's output is rotated by an orthogonal ``H`` of the head size and
  o_proj's input columns by the same ``H``: attention mixes positions, never channels, so the pair
  cancels; under grouped-query attention every query head reads its key/value head's rotation.

Nothing is looked up in a table of architectures: the norms and the Linears they feed are AWQ's fold
groups (found in the traced layer and proved there, with Gemma's ``1 + weight`` norms); the writers
are the Linears of the residual's width that read no norm; the value/output pairs are proved by
rotating them and checking the layer's output. The whole model is then checked on a probe: logits
within ``tol`` (relative) of the float model's, or the model is restored and refused in one line
(LayerNorm with a mean or a bias, or a norm on a writer's output such as Gemma-2's post-norms, which
no fold makes commute).

``Q`` is a random Hadamard matrix (Sylvester's construction times a Paley one, for any width
``2^k * (q + 1)`` with ``q`` a prime 3 mod 4: SmolLM2's 576 is 72 x 8) with random signs, or a
random orthogonal matrix (``matrix="random"``) where no Hadamard is built.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, Literal

import torch
from compress.quantization.algorithms.awq_folds import find_fold_groups, first_sequence, primary_output
from compress.quantization.algorithms.sequential import Call, decoder_layers
from compress.quantization.numerics.modules import QUANT_TYPES
from compress.quantization.preparation import unwrap
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from compress.core.errors import UnsupportedModelError

log = logging.getLogger(__name__)


class RotationParams(BaseModel):
    """The rotation's settings: ``matrix`` (random ``hadamard``, or a ``random`` orthogonal one),
    ``heads`` (also rotate each value/output head pair, R2), ``seed``, and ``tol`` (the largest
    relative change of the logits on the probe that counts as exact)."""

    model_config = ConfigDict(extra="forbid")

    matrix: Literal["hadamard", "random"] = "hadamard"
    heads: bool = True
    seed: int = Field(0, ge=0)
    tol: float = Field(1e-4, gt=0, lt=1)


# ---- orthogonal matrices ---------------------------------------------------------------------------


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))


def _paley(q: int) -> torch.Tensor:
    """Paley's construction I: a Hadamard matrix of order ``q + 1`` for a prime ``q`` = 3 mod 4."""
    residues = {(i * i) % q for i in range(1, q)}
    chi = torch.tensor([0] + [1 if i in residues else -1 for i in range(1, q)], dtype=torch.float64)
    idx = (torch.arange(q).unsqueeze(0) - torch.arange(q).unsqueeze(1)) % q
    jac = chi[idx]  # Q[i, j] = chi(j - i): skew-symmetric for q = 3 mod 4
    s = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    s[0, 1:] = 1
    s[1:, 0] = -1
    s[1:, 1:] = jac
    return s + torch.eye(q + 1, dtype=torch.float64)


def hadamard(n: int) -> torch.Tensor | None:
    """A Hadamard matrix of order ``n`` (entries +-1, ``H H^T = n I``; float64), or None when none is
    built here: ``n = 2^k`` (Sylvester) or ``2^k * (q + 1)`` with ``q`` a prime 3 mod 4 (Paley)."""
    if n < 1:
        return None
    base: torch.Tensor | None = None
    k = (n & -n).bit_length() - 1  # the power of two in n
    odd = n >> k
    for j in range(k + 1):  # the smallest Paley block that takes the odd part
        m = odd << j
        if m == 1:
            base = torch.ones(1, 1, dtype=torch.float64)
            break
        if m % 4 == 0 and _is_prime(m - 1) and (m - 1) % 4 == 3:
            base = _paley(m - 1)
            break
    if base is None:
        return None
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    while base.shape[0] < n:
        base = torch.kron(base, h2)
    return base


def orthogonal(n: int, kind: str = "hadamard", *, seed: int = 0) -> torch.Tensor:
    """An ``n x n`` orthogonal matrix (float64): a Hadamard matrix with random column signs, scaled by
    ``1 / sqrt(n)`` (QuaRot's randomized Hadamard), or for ``kind="random"`` (or a width no Hadamard
    is built for) the Q factor of a Gaussian matrix."""
    g = torch.Generator().manual_seed(seed)
    h = hadamard(n) if kind == "hadamard" else None
    if h is not None:
        signs = torch.randint(0, 2, (n,), generator=g).to(torch.float64) * 2 - 1
        return h * signs / math.sqrt(n)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


# ---- the model's structure ---------------------------------------------------------------------------


def _forward(root: nn.Module, ids: torch.Tensor) -> Any:
    """The model on the probe without a KV cache (a layer rerun on a captured call must not append
    to one)."""
    with torch.no_grad():
        return root(ids, use_cache=False)


def _layer_calls(root: nn.Module, layers: nn.ModuleList, ids: torch.Tensor) -> list[Call]:
    """Each decoder layer's ``(args, kwargs)`` on the probe ``ids`` (one float forward)."""
    calls: list[Call | None] = [None] * len(layers)

    def grab(i: int) -> Any:
        def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if calls[i] is None:
                calls[i] = (tuple(args), dict(kwargs))
        return hook

    hs = [layer.register_forward_pre_hook(grab(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        _forward(root, ids)
    finally:
        for h in hs:
            h.remove()
    if any(c is None for c in calls):
        raise UnsupportedModelError("rotate: a decoder layer was not called on the probe")
    return [c for c in calls if c is not None]


def _head_input_producer(root: nn.Module, head: nn.Module, ids: torch.Tensor, layers: nn.ModuleList) -> str | None:
    """The name of the module outside the decoder layers whose output the head reads (the final
    norm); matched by storage, since the model may hand the head a view of it (a position slice)."""
    produced: dict[int, str] = {}
    seen: list[torch.Tensor] = []  # outputs kept alive: storage pointers stay unique
    inside = {id(m) for layer in layers for m in layer.modules()}
    hs = []
    for name, mod in root.named_modules():
        if id(mod) in inside or mod is head or not any(True for _ in mod.parameters(recurse=False)):
            continue

        def post(_: nn.Module, __: Any, out: Any, n: str = name) -> None:
            if isinstance(out, torch.Tensor):
                produced[out.untyped_storage().data_ptr()] = n
                seen.append(out)
        hs.append(mod.register_forward_hook(post))
    got: list[int] = []
    hs.append(head.register_forward_pre_hook(lambda _, a: got.append(a[0].untyped_storage().data_ptr())))
    try:
        _forward(root, ids)
    finally:
        for h in hs:
            h.remove()
    return produced.get(got[0]) if got else None


def _multiplies_by_one_plus_weight(norm: nn.Module, width: int) -> bool:
    """Whether ``norm`` scales by ``1 + weight`` (Gemma's RMSNorm) rather than by ``weight``: with
    its weight zeroed, a plain norm outputs zeros and an offset one the normalized input."""
    w = norm.get_parameter("weight")
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w.zero_()
            out = primary_output(norm(torch.randn(4, width, generator=torch.Generator().manual_seed(0)).to(w.dtype)))
    finally:
        with torch.no_grad():
            w.copy_(saved)
    return bool(out.abs().amax() > 1e-3)


def untie_head(model: nn.Module) -> None:
    """Give a causal LM's output head its own copy of the embedding table, and say so in its config."""
    root: Any = unwrap(model)
    head, emb = root.get_output_embeddings(), root.get_input_embeddings()
    if head is not None and emb is not None and head.weight is emb.weight:
        head.weight = nn.Parameter(head.weight.detach().clone())
    cfg = getattr(root, "config", None)
    if cfg is not None:
        cfg.tie_word_embeddings = False
        text = getattr(cfg, "get_text_config", None)
        if callable(text):
            text().tie_word_embeddings = False


def _norm_factor(norm: nn.Module, offset: bool) -> torch.Tensor:
    w = norm.get_parameter("weight").detach().double()
    return 1 + w if offset else w


def _fold_norm(norm: nn.Module, readers: Sequence[nn.Linear], offset: bool) -> None:
    """Fold the norm's per-channel weight into the readers' input columns; the norm multiplies by 1."""
    if getattr(norm, "bias", None) is not None:
        raise UnsupportedModelError("rotate: a norm with a bias (LayerNorm) does not commute with a rotation")
    f = _norm_factor(norm, offset)
    with torch.no_grad():
        for lin in readers:
            lin.weight.copy_((lin.weight.double() * f.unsqueeze(0)).to(lin.weight.dtype))
        w = norm.get_parameter("weight")
        w.fill_(0.0 if offset else 1.0)


def _rotate_in(lin: nn.Linear, q: torch.Tensor) -> None:
    with torch.no_grad():
        lin.weight.copy_((lin.weight.double() @ q).to(lin.weight.dtype))


def _rotate_out(lin: nn.Linear, q: torch.Tensor) -> None:
    with torch.no_grad():
        lin.weight.copy_((q.T @ lin.weight.double()).to(lin.weight.dtype))
        if lin.bias is not None:
            lin.bias.copy_((lin.bias.double() @ q).to(lin.bias.dtype))


def _rotate_heads(producer: nn.Linear, consumer: nn.Linear, h: torch.Tensor) -> None:
    """Rotate each head of ``producer``'s output by ``h`` and ``consumer``'s matching input columns."""
    d = h.shape[0]
    with torch.no_grad():
        w = producer.weight.double().reshape(-1, d, producer.in_features)
        producer.weight.copy_(torch.einsum("dk,hdi->hki", h, w).reshape(producer.weight.shape).to(producer.weight.dtype))
        if producer.bias is not None:
            b = producer.bias.double().reshape(-1, d)
            producer.bias.copy_((b @ h).reshape(-1).to(producer.bias.dtype))
        c = consumer.weight.double().reshape(consumer.out_features, -1, d)
        consumer.weight.copy_((c @ h).reshape(consumer.weight.shape).to(consumer.weight.dtype))


def _output_of(layer: nn.Module, lin: nn.Module, call: Call) -> torch.Tensor:
    """``lin``'s output when ``layer`` runs ``call``."""
    got: list[torch.Tensor] = []
    h = lin.register_forward_hook(lambda _, __, out: got.append(out.detach().double().clone()))
    try:
        layer(*call[0], **call[1])
    finally:
        h.remove()
    return got[0]


def _head_dim(root: nn.Module) -> int | None:
    cfg = getattr(root, "config", None)
    d = getattr(cfg, "head_dim", None)
    if isinstance(d, int) and d > 0:
        return d
    hidden, heads = getattr(cfg, "hidden_size", None), getattr(cfg, "num_attention_heads", None)
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _logits(root: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = _forward(root, ids)
    return primary_output(getattr(out, "logits", out)).float()


@torch.no_grad()
def rotate(model: nn.Module, params: RotationParams | None = None) -> dict[str, Any]:
    """Rotate ``model`` (a transformers decoder LLM, float, not yet quantized) in place, exactly:
    R1 on the residual stream, and with ``params.heads`` R2 on each value/output head pair. Run it
    before quantizing (``compress.gptq``, ``compress.quantize``, ...). Returns a report: the width,
    the matrix kind, the layers and head pairs rotated, and the logits' relative change on the probe.
    UnsupportedModelError (the model restored) when the rotation is not exact on this model."""
    p = params or RotationParams()
    root = unwrap(model)
    if any(isinstance(m, QUANT_TYPES) for m in root.modules()):
        raise UnsupportedModelError("rotate: the model is quantized already; rotate the float model, then quantize")
    get_in, get_out = getattr(root, "get_input_embeddings", None), getattr(root, "get_output_embeddings", None)
    emb = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    if not isinstance(emb, nn.Embedding) or not isinstance(head, nn.Linear):
        raise UnsupportedModelError("rotate: needs a causal LM with an input embedding and a Linear output head")
    _, layers = decoder_layers(root)
    width = emb.embedding_dim
    was_training = root.training
    root.eval()
    ids = torch.randint(0, emb.num_embeddings, (1, 24), generator=torch.Generator().manual_seed(p.seed))
    ref = _logits(root, ids)
    saved = {k: v.detach().clone() for k, v in root.state_dict().items()}
    tied = head.weight is emb.weight
    try:
        report = _rotate(root, layers, emb, head, ids, width, tied, p)
        err = _relative(_logits(root, ids), ref)
        if not err < p.tol:
            raise UnsupportedModelError(
                f"rotate: the rotated model's logits moved by {err:.2e} (relative) on the probe, more than "
                f"tol {p.tol:g}: a norm or op of this model does not commute with the rotation (LayerNorm's mean, "
                "a norm on a layer's output before the residual add)")
    except Exception:
        if tied and head.weight is not emb.weight:
            head.weight = emb.weight
            cfg = getattr(root, "config", None)
            if cfg is not None:
                cfg.tie_word_embeddings = True
        root.load_state_dict(saved)
        raise
    finally:
        root.train(was_training)
    report["logits_relative_change"] = err
    log.info("rotate: %s %d x %d on the residual stream of %d layers%s; logits moved %.1e (relative)",
             p.matrix, width, width, len(layers),
             f", {report['head_pairs']} value/output head pairs" if report["head_pairs"] else "", err)
    return report


def _rotate(root: nn.Module, layers: nn.ModuleList, emb: nn.Embedding, head: nn.Linear, ids: torch.Tensor,
            width: int, tied: bool, p: RotationParams) -> dict[str, Any]:
    calls = _layer_calls(root, layers, ids)
    final_norm = _head_input_producer(root, head, ids, layers)
    plans = []
    for i, layer in enumerate(layers):
        lins = {n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
        groups = find_fold_groups(layer, list(lins), first_sequence(calls[i]))
        readers: list[str] = []
        norms: list[tuple[str, list[str], bool]] = []
        for g in groups:
            producer = layer.get_submodule(g.producer) if g.producer is not None else None
            if producer is None or isinstance(producer, nn.Linear) or lins[g.consumers[0]].in_features != width:
                continue  # a Linear fed by no norm (o_proj, down_proj) reads the attention or the MLP
            readers += g.consumers
            # the norm's form is read off the norm itself (AWQ's fold proof may accept either where
            # the residual dominates the layer's output)
            offset = _multiplies_by_one_plus_weight(producer, width)
            norms.append((g.producer, g.consumers, offset))  # type: ignore[arg-type]
        writers = [n for n, m in lins.items() if m.out_features == width and n not in readers]
        if not readers or not writers:
            raise UnsupportedModelError(f"rotate: decoder layer {i} has no Linear reading or writing the residual "
                                        f"stream of width {width} (readers {readers}, writers {writers})")
        plans.append((layer, lins, readers, norms, writers))
    # 1. norms folded into their readers (the norms then multiply by 1)
    for layer, lins, _, norms, _ in plans:
        for norm, consumers, offset in norms:
            _fold_norm(layer.get_submodule(norm), [lins[c] for c in consumers], offset)
    if tied:  # the head's folded, rotated weight is no longer the embedding table
        untie_head(root)
    if final_norm is not None:
        fnorm = root.get_submodule(final_norm)
        _fold_norm(fnorm, [head], _multiplies_by_one_plus_weight(fnorm, width))
    # 2. the residual stream
    q = orthogonal(width, p.matrix, seed=p.seed)
    emb.weight.copy_((emb.weight.double() @ q).to(emb.weight.dtype))
    for _, lins, readers, _, writers in plans:
        for n in readers:
            _rotate_in(lins[n], q)
        for n in writers:
            _rotate_out(lins[n], q)
    _rotate_in(head, q)
    # 3. value/output head pairs: for each writer, the reader whose per-head rotation its output
    # does not see (v_proj for o_proj), proved on the writer's own output
    pairs_done = 0
    d = _head_dim(root)
    if p.heads and d is not None:
        h = orthogonal(d, p.matrix, seed=p.seed + 1)
        for i, (layer, lins, readers, _, writers) in enumerate(plans):
            call = first_sequence(calls[i])
            x = call[0][0] if call[0] else None
            if not isinstance(x, torch.Tensor):
                continue
            rcall = ((x @ q.to(x.dtype), *call[0][1:]), call[1])  # the layer's input after R1
            for wname in writers:
                if lins[wname].in_features % d:
                    continue
                before = _output_of(layer, lins[wname], rcall)
                for rname in readers:
                    a, b = lins[rname], lins[wname]
                    if a.out_features % d:
                        continue
                    keep = [t.detach().clone() for t in (a.weight, b.weight, a.bias) if t is not None]
                    _rotate_heads(a, b, h)
                    if _relative(_output_of(layer, b, rcall), before) < min(p.tol, 1e-5):
                        pairs_done += 1
                        break
                    for t, v in zip([t for t in (a.weight, b.weight, a.bias) if t is not None], keep, strict=True):
                        t.copy_(v)
    return {"width": width, "matrix": p.matrix, "layers": len(plans), "head_pairs": pairs_done,
            "final_norm": final_norm, "untied_head": tied}
