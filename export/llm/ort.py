"""A generation file of :func:`export.llm.onnx.export_llm_onnx` in ONNX Runtime: the export's check
against the traced module (:func:`check_in_ort`), and greedy generation (:class:`OrtGenerator`,
:func:`generate_ort`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from compress.export.llm.decoder import KVDecoder, positions
from compress.export.llm.matmul_nbits import MatMulNBitsLinear

from compress.core.errors import ExportError
from compress.core.machine import has_vnni
from compress.core.ort import inference_session, session_options

log = logging.getLogger(__name__)

#: Float-compute files (fp32 weights, MatMulNBits, whose traced forward quantizes the activations as
#: ORT's kernel does at accuracy_level 4) differ from the traced module only by float rounding, which
#: grows with depth: SmolLM2-135M (30 layers) GPTQ w4 g64 measured 78.8 dB logits SQNR, a 2-layer model 120+ dB. A wrong graph (a dropped zero point, a transposed
#: or mis-scaled weight) lands below 20 dB, so 40 dB (1% noise amplitude) separates the two with
#: room on either side, where a relative max difference (the former 1e-4) failed deep models.
FLOAT_MIN_SQNR_DB = 40.0
#: greedy agreement floor for float compute: at 40+ dB a top-1 flips only on a near tie of the
#: two best logits; more than one position in ten flipping means the logits are wrong
MIN_TOP1 = 0.9


#: the level-4 floor's margin under the int8 activations' own effect: tie flips and that effect are
#: both rounding decisions of the same int8 grid, so the file lands near it on either side (36.8 dB
#: against 34.2 on SmolLM2 RTN, 37.8 against 34.0 with AWQ g128); 6 dB (twice the noise amplitude)
#: keeps a right file above the floor
LEVEL4_MARGIN_DB = 6.0
#: the same margin on greedy agreement: near a tie a flip is about as likely as the noise is large,
#: so twice the amplitude allows twice the flips (SmolLM2 AWQ g128: 3 of 19 positions flipped where
#: the int8 activations alone flipped 1, at 37.8 dB)
LEVEL4_FLIP_FACTOR = 10 ** (LEVEL4_MARGIN_DB / 20)


def level4_floors(quant_sqnr_db: float, quant_top1: float) -> tuple[float, float]:
    """The (SQNR dB, top-1) floors of an accuracy_level-4 file, from what the int8 activations alone
    move the module's logits (``quant_*``): :data:`LEVEL4_MARGIN_DB` under its SQNR (capped at the
    float floor), :data:`LEVEL4_FLIP_FACTOR` times its greedy flips."""
    return (min(FLOAT_MIN_SQNR_DB, quant_sqnr_db - LEVEL4_MARGIN_DB),
            1.0 - LEVEL4_FLIP_FACTOR * (1.0 - min(MIN_TOP1, quant_top1)))


@dataclass(frozen=True)
class OrtCheck:
    """What :func:`export_llm_onnx`'s check measured: ORT's file against the traced module over a
    prefill and decode steps (``sqnr_db``, ``top1``), and for W8A8 the fake-quant model against its
    float self (``quant_sqnr_db``, ``quant_top1``), the yardstick the file's deviation is held to."""

    sqnr_db: float
    top1: float
    max_rel: float
    quant_sqnr_db: float | None = None
    quant_top1: float | None = None


def _sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    noise = float(((got - ref) ** 2).mean())
    return 999.0 if noise == 0 else 10 * math.log10(max(float((ref**2).mean()), 1e-30) / noise)


def _generation_logits(run: Any, dec: KVDecoder, ids: torch.Tensor, mask: torch.Tensor,
                       steps: list[torch.Tensor]) -> torch.Tensor:
    """Logits ``[N, V]`` of the unpadded prefill positions and of each decode step, as generation
    meets them: ``run(input_ids, attention_mask, past) -> (logits, present)`` with its own cache."""
    logits, past = run(ids, mask, dec.empty_past(ids.shape[0]))
    rows = [logits[mask.bool()] if logits.shape[1] == ids.shape[1] else logits[:, -1]]  # every position, or the last
    for tok in steps:
        mask = torch.cat([mask, torch.ones_like(tok)], dim=1)
        logits, past = run(tok, mask, past)
        rows.append(logits[:, -1])
    return torch.cat(rows)


def decoder_steps(dec: KVDecoder) -> Callable[[torch.Tensor, torch.Tensor, list[torch.Tensor]],
                                               tuple[torch.Tensor, list[torch.Tensor]]]:
    """``(ids, mask, past) -> (logits, present)``: one generation step of ``dec`` in PyTorch, no grad."""
    def run(i: torch.Tensor, m: torch.Tensor, past: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with torch.no_grad():
            logits, *present = dec(*dec.feed(i, m, past))
        return logits, present
    return run


def check_in_ort(path: Path, dec: KVDecoder, *, float_check: bool, float_dec: KVDecoder | None = None) -> OrtCheck:
    """Run the file in ORT as deployed (full graph optimizations, integer kernels fused) the way
    generation does — a left-padded batch of two prompts prefilled, then three greedy decode steps
    on each side's own cache — against the traced module, and judge what a deep model's user sees:
    the logits' SQNR and top-1 (greedy token) agreement.

    - fp32 and int4 files (``float_check``): SQNR >= :data:`FLOAT_MIN_SQNR_DB` and top-1 >= :data:`MIN_TOP1`.
      MatMulNBits at accuracy_level 4 is traced with the int8 activations its kernel computes with
      (one op: 130 dB from ORT), but in a deep model a value on a rounding tie takes the
      neighbouring code on one side and the flips cascade (SmolLM2-135M RTN g32: 36.8 dB, top-1
      1.0); there the floor is lowered to what the int8 activations themselves move the module's
      logits (the module at accuracy_level 0 against itself at 4: 34.2 dB, top-1 0.947 there, the
      yardstick W8A8 uses below) less :data:`LEVEL4_MARGIN_DB`, which a wrong graph (a dropped zero
      point: below 20 dB) stays under, and top-1 down to :data:`LEVEL4_FLIP_FACTOR` times that
      yardstick's flips (measured on a few dozen positions, so SQNR is the finer of the two).
    - W8A8 (``float_dec`` is the model with its quantizers off): the file may not differ from the
      fake-quant model more than quantization moved that model from float (SQNR at least the
      quantization's own, top-1 at least its own). A difference is expected at all because a
      value on a rounding tie takes the neighbouring code when ORT sums int8 products exactly and
      PyTorch in float; in a deep static-W8A8 model such flips cascade (SmolLM2-135M with
      SmoothQuant: 24.5 dB on held-out text, against 17.9 dB of quantization error, and ORT's own
      unfused float graph differs from its fused integer one by as much), so an elementwise
      tolerance cannot tell a right file from a wrong one; a wrong zero point or int16 saturation
      lands far below the quantization's own error.
    """
    torch.manual_seed(0)
    vocab = int(dec.lm.config.vocab_size)
    n_past = 2 * dec.n_layers
    # prompts the model itself writes (greedy from one random token): random ids are far outside the
    # ranges static activation scales were calibrated on, where W8A8 clips and the yardstick means little
    ids = torch.randint(0, vocab, (2, 1))
    with torch.no_grad():
        logits, *past = dec(*dec.feed(ids, torch.ones_like(ids), dec.empty_past(2)))
        for _ in range(7):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
            logits, *past = dec(*dec.feed(nxt, torch.ones_like(ids), past))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second prompt left-padded

    sess = inference_session(path, session_options(log_severity=3))
    names = [i.name for i in sess.get_inputs()]

    def ort_run(i: torch.Tensor, m: torch.Tensor, past: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        out = sess.run(None, dict(zip(names, [t.numpy() for t in dec.feed(i, m, past)])))
        return torch.from_numpy(out[0]), [torch.from_numpy(o) for o in out[1 : 1 + n_past]]

    # the decode tokens are the reference's greedy ones, fed to every run alike so positions align
    with torch.no_grad():
        first, _ = decoder_steps(dec)(ids, mask, dec.empty_past(2))
    steps, nxt = [], first[:, -1].argmax(-1, keepdim=True)
    for _ in range(3):
        steps.append(nxt)
        nxt = (nxt * 7 + 13) % vocab  # later steps: fixed tokens, the check needs positions, not sense
    ref = _generation_logits(decoder_steps(dec), dec, ids, mask, steps)
    got = _generation_logits(ort_run, dec, ids, mask, steps)
    result = OrtCheck(sqnr_db=_sqnr_db(ref, got), top1=float((ref.argmax(-1) == got.argmax(-1)).float().mean()),
                      max_rel=float((got - ref).abs().max()) / (float(ref.abs().max()) or 1.0))
    level4 = [m for m in dec.modules() if isinstance(m, MatMulNBitsLinear) and m.accuracy_level == 4]
    flt = None
    if float_dec is not None:
        flt = _generation_logits(decoder_steps(float_dec), float_dec, ids, mask, steps)
    elif float_check and level4:  # the yardstick: the same module with float activations (accuracy_level 0)
        for m in level4:
            m.accuracy_level = 0
        try:
            flt = _generation_logits(decoder_steps(dec), dec, ids, mask, steps)
        finally:
            for m in level4:
                m.accuracy_level = 4
    if flt is not None:
        result = OrtCheck(result.sqnr_db, result.top1, result.max_rel, quant_sqnr_db=_sqnr_db(flt, ref),
                          quant_top1=float((flt.argmax(-1) == ref.argmax(-1)).float().mean()))
    log.info("%s in ONNX Runtime vs PyTorch: logits SQNR %.1f dB, greedy top-1 %.3f, max error %.2e of the "
             "largest logit%s", path.name, result.sqnr_db, result.top1, result.max_rel,
             "" if result.quant_sqnr_db is None else
             f" (quantization vs float activations: {result.quant_sqnr_db:.1f} dB, top-1 {result.quant_top1:.3f})")
    if float_check and result.quant_sqnr_db is not None and result.quant_top1 is not None:
        sqnr_floor, top1_floor = level4_floors(result.quant_sqnr_db, result.quant_top1)
    elif float_check:
        sqnr_floor, top1_floor = FLOAT_MIN_SQNR_DB, MIN_TOP1
    elif result.quant_sqnr_db is not None and result.quant_top1 is not None:
        sqnr_floor, top1_floor = result.quant_sqnr_db, result.quant_top1
    else:
        return result
    if result.sqnr_db < sqnr_floor or result.top1 < top1_floor:
        hint = ""
        if float_dec is not None and has_vnni() is False and _full_8bit_codes(dec):
            hint = ("; with 8-bit weights ORT's u8s8 integer kernels overflow int16 on CPUs without VNNI (this one): "
                    "quantize with weights: {reduce_range: true} (7-bit codes)")
        raise ExportError(
            f"{path}: ONNX Runtime's outputs differ from the PyTorch model's (logits SQNR {result.sqnr_db:.1f} dB, "
            f"greedy top-1 {result.top1:.3f}; the floor is {sqnr_floor:.1f} dB and {top1_floor:.3f}): the exported "
            f"graph does not compute the model{hint}"
        )
    return result


def _full_8bit_codes(dec: KVDecoder) -> bool:
    """Whether any W8A8 layer's weight codes leave the 7-bit range ORT's u8s8 kernels sum exactly."""
    for mod in dec.modules():
        codes = getattr(mod, "codes", None)
        if isinstance(codes, torch.Tensor) and codes.dtype == torch.int8 and (
                int(codes.min()) < -64 or int(codes.max()) > 63):
            return True
    return False


# ---- generation in ONNX Runtime -------------------------------------------------------------------


#: float32 bytes of logits one prefill run may return (a file with every position's logits, a large
#: vocabulary: 4 prompts of 480 tokens at 262k entries are 2 GB in one run)
PREFILL_LOGITS_BYTES = 256 * 2**20


class OrtGenerator:
    """Greedy generation on an :func:`export_llm_onnx` file: ``prefill`` then ``step`` per token.

    A file with fused attention (GroupQueryAttention) keeps its keys and values in one buffer per
    layer that the op appends to in place: each past is bound (ORT IOBinding) as both the input and
    the present output, as ONNX Runtime GenAI's ``past_present_share_buffer`` does, so no step copies
    the cache (SmolLM2-135M int4, 1 thread: 1.07x decode speed at 128-176 tokens, 1.36x at
    1000-1048, the same logits bit for bit). The buffer grows by doubling when a step would pass it.
    ``share_buffer=False`` feeds the past as arrays and takes the present back every step instead."""

    def __init__(self, path: str | Path, *, threads: int | None = None, share_buffer: bool = True) -> None:
        so = session_options(threads=threads, inter_op_threads=1 if threads is not None else None, log_severity=2)
        self.session = inference_session(path, so)
        names = [i.name for i in self.session.get_inputs()]
        past = [i for i in self.session.get_inputs() if i.name.startswith("past_key_values.")]
        if names[:2] != ["input_ids", "attention_mask"] or not past:
            raise ExportError(f"{path}: not an export_llm_onnx file (inputs {names[:3]}...)")
        self.past_names = [i.name for i in past]
        self.position_ids = "position_ids" in names
        self.n_kv, self.head_dim = int(past[0].shape[1]), int(past[0].shape[3])
        self.output_names = [o.name for o in self.session.get_outputs()]
        logits = self.session.get_outputs()[0].shape
        #: the file outputs every position's logits (``logits="all"``), not the last one's only
        self.all_logits = not (len(logits) == 3 and logits[1] == 1)
        self.vocab = int(logits[-1]) if isinstance(logits[-1], int) else None
        meta = self.session.get_modelmeta().custom_metadata_map
        #: the past bound in place (fused attention only: the decomposed graph concatenates a new present)
        self.share_buffer = share_buffer and meta.get("compress.attention") == "fused"
        self.past: list[np.ndarray] = []
        self.mask = np.ones((0, 0), dtype=np.int64)
        self._buffers: list[Any] = []

    def prefill(self, input_ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
        """Run the prompts ``[B, S]`` with an empty cache; returns the last position's logits ``[B, V]``.

        ``attention_mask`` ``[B, S]`` (1 = token, 0 = padding) allows left-padded prompts of
        different lengths; None means no padding. A file that outputs every position's logits is
        prefilled in runs of as many positions as keep them within :data:`PREFILL_LOGITS_BYTES`
        (multi-token steps on the cache, the same logits; its prefill time is then their sum)."""
        b, s = input_ids.shape
        mask = np.ones(input_ids.shape, dtype=np.int64) if attention_mask is None else attention_mask.astype(np.int64)
        if mask.shape != input_ids.shape:
            raise ExportError(f"attention_mask has shape {mask.shape}, input_ids {input_ids.shape}")
        step = s
        if self.all_logits and self.vocab:
            step = max(1, min(s, PREFILL_LOGITS_BYTES // (4 * b * self.vocab)))
        if self.share_buffer:
            self._buffers = []
            self._reserve(b, max(256, 2 * s))
        else:
            self.past = [np.zeros((b, self.n_kv, 0, self.head_dim), dtype=np.float32)] * len(self.past_names)
        logits = np.zeros((b, 0), dtype=np.float32)
        for start in range(0, s, step):
            end = min(start + step, s)
            self.mask = mask[:, :end]
            logits = self._run(input_ids[:, start:end], self.past)
        return logits

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """Feed one token per sequence ``[B]``; returns the next logits ``[B, V]``."""
        self.mask = np.concatenate([self.mask, np.ones((self.mask.shape[0], 1), dtype=np.int64)], axis=1)
        if self.share_buffer and self.mask.shape[1] > self._capacity:
            self._reserve(self.mask.shape[0], 2 * self._capacity)
        return self._run(tokens.reshape(-1, 1), self.past)

    @property
    def _capacity(self) -> int:
        return int(self._buffers[0].shape()[2]) if self._buffers else 0

    def _reserve(self, batch: int, length: int) -> None:
        """Buffers of ``length`` slots per layer, the cache so far copied into the new ones."""
        import onnxruntime as ort

        old = [b.numpy() for b in self._buffers]
        new = np.zeros((len(self.past_names), batch, self.n_kv, length, self.head_dim), dtype=np.float32)
        for i, o in enumerate(old):
            new[i, :, :, : o.shape[2]] = o
        self._buffers = [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(n)) for n in new]

    def _run(self, ids: np.ndarray, past: list[np.ndarray]) -> np.ndarray:
        feed = {"input_ids": ids.astype(np.int64), "attention_mask": self.mask}
        if self.position_ids:
            feed["position_ids"] = positions(torch.from_numpy(self.mask), ids.shape[1]).numpy()
        if self.share_buffer:
            binding = self.session.io_binding()
            for name, value in feed.items():
                binding.bind_cpu_input(name, value)
            binding.bind_output(self.output_names[0])
            for name, out, buf in zip(self.past_names, self.output_names[1:], self._buffers, strict=True):
                binding.bind_ortvalue_input(name, buf)
                binding.bind_ortvalue_output(out, buf)
            self.session.run_with_iobinding(binding)
            return binding.get_outputs()[0].numpy()[:, -1]
        logits, *present = self.session.run(self.output_names, {**feed, **dict(zip(self.past_names, past))})
        self.past = present
        return logits[:, -1]


def generate_ort(
    path: str | Path | OrtGenerator,
    input_ids: torch.Tensor | np.ndarray,
    *,
    max_new_tokens: int,
    attention_mask: torch.Tensor | np.ndarray | None = None,
    eos_token_id: int | None = None,
) -> torch.Tensor:
    """Greedy continuation ``[B, S + new]`` of ``input_ids`` computed by ONNX Runtime.

    ``attention_mask`` marks left padding (0) of prompts of different lengths; generation stops
    early when every sequence produced ``eos_token_id``."""
    gen = path if isinstance(path, OrtGenerator) else OrtGenerator(path)
    ids = np.asarray(input_ids.cpu().numpy() if isinstance(input_ids, torch.Tensor) else input_ids, dtype=np.int64)
    if ids.ndim != 2:
        raise ExportError(f"generate_ort: input_ids must be [batch, sequence] (got shape {ids.shape})")
    out = [ids]
    mask = None if attention_mask is None else np.asarray(
        attention_mask.cpu().numpy() if isinstance(attention_mask, torch.Tensor) else attention_mask)
    logits = gen.prefill(ids, mask)
    done = np.zeros(ids.shape[0], dtype=bool)
    for i in range(max_new_tokens):
        nxt = logits.argmax(-1).astype(np.int64)
        out.append(nxt[:, None])
        if eos_token_id is not None:
            done |= nxt == eos_token_id
            if done.all():
                break
        if i + 1 < max_new_tokens:
            logits = gen.step(nxt)
    return torch.from_numpy(np.concatenate(out, axis=1))
