"""``Distiller``: the distillation loss of a student against a frozen teacher, for any training loop.

    distiller = compress.Distiller(teacher, student, losses=[{"type": "kd", "temperature": 4}])
    for x, y in loader:
        out = student(x)
        loss = distiller(x, out, F.cross_entropy(out, y))   # task loss + weighted KD terms
        loss.backward(); opt.step(); opt.zero_grad()
    distiller.remove()                                      # hooks gone, the student as before

The teacher sees the same batch as the student. Intermediate features are read by removable
forward hooks; adapters (when widths differ) are trained with the student: pass
``distiller.parameters()`` to the optimizer, or let ``bind_optimizer(opt)`` keep them in it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any

import torch
from compress.distillation.adapters import AdapterSet
from compress.distillation.capture import FeatureCapture
from compress.distillation.losses import (
    attention_kl,
    cosine_loss,
    divergence,
    feature_mse,
    kd_kl,
    mean_pool,
    soft_target_ce,
)
from compress.distillation.spec import (
    AttentionLoss,
    CosineLoss,
    FeatureLoss,
    HiddenStateLoss,
    KDLoss,
    LossSpec,
    LossTerm,
    SoftTargetLoss,
    TeacherDtype,
    coerce_losses,
)
from compress.distillation.teacher import Teacher, is_hf, load_teacher_model
from pydantic import ConfigDict, Field, ValidationError, field_validator
from torch import nn

from compress.core.batching import call_model, primary_output, split_batch, to_device
from compress.core.errors import CompressError, RecipeError
from compress.core.params import ApiParams

log = logging.getLogger(__name__)



def parse_losses(losses: Sequence[LossTerm | Mapping[str, Any]] | None, *, where: str) -> list[LossTerm]:
    """Loss terms from specs or mappings (``{"type": "kd", ...}``); default: KD at T=4."""
    if losses is None:
        return [KDLoss()]
    items = [t if isinstance(t, LossTerm) else dict(t) for t in losses]
    if not items:
        raise RecipeError(f"{where}: losses is empty; give at least one term, e.g. {{'type': 'kd'}}")
    try:
        return list(coerce_losses(items))
    except ValidationError as exc:
        err = exc.errors()[0]
        path = ".".join(str(p) for p in err["loc"])
        raise RecipeError(f"{where}: losses.{path}: {str(err['msg']).removeprefix('Value error, ')}") from None


def _names(terms: list[LossTerm]) -> list[str]:
    out: list[str] = []
    for t in terms:
        base = t.name or t.type
        name, k = base, 2
        while name in out:
            name, k = f"{base}_{k}", k + 1
        out.append(name)
    return out


def _desc(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"Tensor[{'x'.join(str(d) for d in x.shape)}]"
    return type(x).__name__


def _mask(inputs: Any) -> torch.Tensor | None:
    return inputs.get("attention_mask") if isinstance(inputs, Mapping) else None


def _field(outputs: Any, key: str, *, role: str, where: str) -> Any:
    value = outputs.get(key) if isinstance(outputs, Mapping) else getattr(outputs, key, None)
    if value is None:
        raise RecipeError(f"{where}: the {role}'s outputs ({_desc(outputs)}) carry no '{key}'")
    return value


def _uniform(n_student: int, n_teacher: int, *, states: bool) -> dict[int, int]:
    # hidden states include the embeddings (index 0 to 0); attention maps are per layer (last to last)
    if states:
        return {i: round(i * (n_teacher - 1) / max(n_student - 1, 1)) for i in range(n_student)}
    return {i: round((i + 1) * n_teacher / n_student) - 1 for i in range(n_student)}


def _default_losses() -> list[LossSpec]:
    return [KDLoss()]


class DistillParams(ApiParams):
    """The settings of distillation: :class:`Distiller` takes them and the ``distill`` recipe
    modifier is made of them (distillation/modifiers.py). ``losses``: the terms added to the task
    loss (``kd``, ``soft_ce``, ``feature``, ``hidden_states``, ``attention``, ``cosine``; default KD
    at T=4); ``task_weight`` scales the task loss; ``teacher_dtype`` keeps the teacher in half precision."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    losses: list[LossSpec] = Field(default_factory=_default_losses, min_length=1)
    task_weight: float = Field(1.0, ge=0)
    teacher_dtype: TeacherDtype = "float32"

    @field_validator("losses", mode="before")
    @classmethod
    def _typed_losses(cls, v: Any) -> Any:
        return coerce_losses(v)


class Distiller:
    """Distillation terms of ``student`` against a frozen ``teacher``, added to the task loss.

    ``teacher``: an ``nn.Module`` (frozen in place: eval mode, no grad), a :class:`Teacher`, or a
    model spec mapping (``{"name": "resnet", "kwargs": {...}, "checkpoint": "t.pt"}`` or
    ``{"hf_path": ...}``) loaded like a recipe's model.

    ``params``: :class:`DistillParams`; ``losses`` (loss specs or mappings, see distillation.spec),
    ``task_weight`` and ``teacher_dtype`` given as keywords override its settings of those names.
    ``total_steps`` drives scheduled loss weights when calls pass no ``progress``.
    ``example_inputs`` builds feature adapters up front, so that ``parameters()`` can go into an
    optimizer before training. Hugging Face students get ``output_hidden_states`` /
    ``output_attentions`` (and eager attention) switched on while hidden-state or attention terms
    are in use; :meth:`remove` restores them.
    """

    def __init__(
        self,
        teacher: nn.Module | Teacher | Mapping[str, Any],
        student: nn.Module,
        *,
        params: DistillParams | None = None,
        losses: Sequence[LossTerm | Mapping[str, Any]] | None = None,
        task_weight: float | None = None,
        teacher_dtype: TeacherDtype | None = None,
        total_steps: int | None = None,
        example_inputs: Any = None,
        where: str = "Distiller",
    ) -> None:
        self.where = where
        p = (params or DistillParams()).given(
            where, losses=parse_losses(losses, where=where) if losses is not None else None,
            task_weight=task_weight, teacher_dtype=teacher_dtype)
        self.terms: list[LossTerm] = list(p.losses)
        self.names = _names(self.terms)
        self.task_weight = float(p.task_weight)
        self.total_steps = total_steps
        self.student = _unwrap(student)
        device = _device_of(self.student)
        if isinstance(teacher, Mapping):  # a model spec: zoo / factory / HF path, with its checkpoint
            if teacher.get("train_epochs"):
                raise RecipeError(f"{where}: teacher.train_epochs is for recipes; give the Distiller a trained teacher")
            teacher = load_teacher_model(teacher, where=f"{where}: teacher")
        self.teacher = teacher if isinstance(teacher, Teacher) else Teacher(teacher, device=device, dtype=p.teacher_dtype)
        self.adapters = AdapterSet()
        self.steps = 0
        self.last: dict[str, torch.Tensor] = {}
        self._built = False
        self._undo: list[Any] = []
        feats = [t for t in self.terms if isinstance(t, FeatureLoss)]
        self._hidden = any(isinstance(t, HiddenStateLoss) for t in self.terms)
        self._attn = any(isinstance(t, AttentionLoss) for t in self.terms)
        self._logit_terms = any(isinstance(t, (KDLoss, SoftTargetLoss)) for t in self.terms)
        self._s_layers = [s for t in feats for s in t.layers]
        self._t_layers = [t_ for t in feats for t_ in t.layers.values()]
        self._t_capture = FeatureCapture(self.teacher.model, self._t_layers, where=where, role="teacher", detach=True)
        self._s_capture = self._attach(self.student)
        if self._hidden or self._attn:
            self._prepare_hf(self.teacher.model, role="teacher", set_flags=False)
        if example_inputs is not None:
            self.probe(example_inputs)

    # ---- setup and teardown ------------------------------------------------------------------
    def _attach(self, student: nn.Module) -> FeatureCapture:
        if self._hidden or self._attn:
            self._prepare_hf(student, role="student", set_flags=True)
        return FeatureCapture(student, self._s_layers, where=self.where, role="student")

    def _prepare_hf(self, model: nn.Module, *, role: str, set_flags: bool) -> None:
        if not is_hf(model):
            raise RecipeError(
                f"{self.where}: hidden_states/attention terms need a Hugging Face {role} whose outputs carry them;"
                f" {type(model).__name__} is not one (use a 'feature' term with layer names instead)"
            )
        hf: Any = model  # a transformers PreTrainedModel: config and set_attn_implementation
        cfg = hf.config
        if self._attn and getattr(cfg, "_attn_implementation", "eager") != "eager":
            old = cfg._attn_implementation
            hf.set_attn_implementation("eager")
            self._undo.append(lambda m=hf, o=old: m.set_attn_implementation(o))
        if set_flags:
            for flag, on in (("output_hidden_states", self._hidden), ("output_attentions", self._attn)):
                if on and not getattr(cfg, flag, False):
                    setattr(cfg, flag, True)
                    self._undo.append(lambda c=cfg, f=flag: setattr(c, f, False))

    def retarget(self, student: nn.Module) -> None:
        """Watch ``student`` instead (a modifier replaced the model object); adapters are kept."""
        student = _unwrap(student)
        if student is self.student:
            return
        self._s_capture.remove()
        self.student = student
        self._s_capture = self._attach(student)

    def remove(self) -> None:
        """Remove every hook, restore changed model settings, take adapters out of the optimizer."""
        self._s_capture.remove()
        self._t_capture.remove()
        while self._undo:
            self._undo.pop()()
        self.adapters.close()

    def __enter__(self) -> Distiller:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.remove()

    # ---- adapters and optimizer -----------------------------------------------------------------
    @property
    def needs_adapters(self) -> bool:
        return any(getattr(t, "adapter", "none") == "auto" for t in self.terms)

    def parameters(self) -> Iterator[nn.Parameter]:
        """The adapters' parameters, to train with the student's."""
        if self.needs_adapters and not self._built:
            raise CompressError(
                f"{self.where}: adapters are built from feature shapes; pass example_inputs= to the Distiller"
                " (or call it on one batch) before asking for parameters(), or use bind_optimizer(opt)"
            )
        return self.adapters.parameters()

    def bind_optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Keep the adapters' parameters in ``optimizer`` as they are built and rebuilt."""
        self.adapters.bind_optimizer(optimizer)

    @torch.no_grad()
    def probe(self, inputs: Any) -> None:
        """Run student and teacher once on ``inputs`` (eval mode, no grad) to check the mapping and
        build the adapters; BN statistics and the step count are left alone."""
        was = self.student.training
        self.student.eval()
        try:
            self.compute(inputs, call_model(self.student, inputs), progress=0.0, count=False)
        finally:
            self.student.train(was)

    # ---- the loss -----------------------------------------------------------------------------
    def __call__(
        self, inputs: Any, student_outputs: Any, task_loss: torch.Tensor | None = None, *, progress: float | None = None
    ) -> torch.Tensor:
        """``task_weight * task_loss`` plus the weighted distillation terms for this batch."""
        total = self.compute(inputs, student_outputs, progress=progress)
        if task_loss is None:
            return total
        return task_loss * self.task_weight + total

    def compute(self, inputs: Any, student_outputs: Any, *, progress: float | None = None, count: bool = True) -> torch.Tensor:
        """The weighted sum of the distillation terms; ``self.last`` holds each term (detached)."""
        if inputs is None or student_outputs is None:
            raise CompressError(
                f"{self.where}: distillation needs the batch's inputs and the student's outputs"
                " (session.loss(loss, inputs=x, outputs=y))"
            )
        p = self._progress(progress)
        s_feats = self._s_capture.pop()
        t_out = self.teacher(inputs, hidden_states=self._hidden, attentions=self._attn)
        t_feats = self._t_capture.pop()
        mask = _mask(inputs)
        total: torch.Tensor | None = None
        parts: dict[str, torch.Tensor] = {}
        for name, term in zip(self.names, self.terms):
            value = self._term(term, name, student_outputs, t_out, s_feats, t_feats, mask)
            parts[name] = value.detach()
            weighted = value * term.weight_at(p)
            total = weighted if total is None else total + weighted
        if self._logit_terms:
            s, t = self._logits(student_outputs, t_out, "kd")
            parts["teacher_kl"], parts["top1_agreement"] = divergence(s, t)
        self._built = True
        self.last = parts
        if count:
            self.steps += 1
        if total is None:  # parse_losses guarantees a term; kept for type checkers
            raise CompressError(f"{self.where}: no loss terms")
        return total

    def _progress(self, progress: float | None) -> float:
        if progress is not None:
            return progress
        if not any(t.scheduled for t in self.terms):
            return 0.0
        if self.total_steps is None:
            raise RecipeError(f"{self.where}: scheduled loss weights need total_steps= (or progress= per call)")
        return self.steps / max(self.total_steps, 1)

    def _logits(self, s_out: Any, t_out: Any, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            s, t = primary_output(s_out), primary_output(t_out)
        except TypeError as exc:
            raise RecipeError(f"{self.where}: {what}: {exc}") from None
        if s.shape != t.shape:
            raise RecipeError(
                f"{self.where}: {what}: student output {_desc(s_out)} -> {_desc(s)} and teacher output"
                f" {_desc(t_out)} -> {_desc(t)} do not match; the teacher must predict the same outputs"
            )
        return s, t

    def _term(
        self,
        term: LossTerm,
        name: str,
        s_out: Any,
        t_out: Any,
        s_feats: dict[str, torch.Tensor],
        t_feats: dict[str, torch.Tensor],
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        where = f"{self.where}: {name}"
        if isinstance(term, KDLoss):
            s, t = self._logits(s_out, t_out, name)
            return kd_kl(s, t, temperature=term.temperature)
        if isinstance(term, SoftTargetLoss):
            s, t = self._logits(s_out, t_out, name)
            return soft_target_ce(s, t, temperature=term.temperature)
        if isinstance(term, FeatureLoss):
            values = []
            for sl, tl in term.layers.items():
                fs, ft = s_feats.get(sl), t_feats.get(tl)
                if fs is None or ft is None:
                    role, layer = ("student", sl) if fs is None else ("teacher", tl)
                    raise CompressError(
                        f"{where}: {role} layer '{layer}' produced no tensor in this forward"
                        " (pass the outputs of the model this distiller watches)"
                    )
                fs = self.adapters.adapt(f"{name}:{sl}", fs, ft, mode=term.adapter, where=f"{where}: {sl}->{tl}")
                values.append(feature_mse(fs, ft, normalize=term.normalize))
            return torch.stack(values).mean()
        if isinstance(term, HiddenStateLoss):
            hs = _field(s_out, "hidden_states", role="student", where=where)
            ht = _field(t_out, "hidden_states", role="teacher", where=where)
            values = []
            for i, j in self._mapping(term.layers, len(hs), len(ht), states=True, where=where).items():
                fs = self.adapters.adapt(f"{name}:{i}", hs[i], ht[j], mode=term.adapter, where=f"{where}: {i}->{j}")
                values.append(feature_mse(fs, ht[j], normalize=term.normalize, mask=mask))
            return torch.stack(values).mean()
        if isinstance(term, AttentionLoss):
            a_s = _field(s_out, "attentions", role="student", where=where)
            a_t = _field(t_out, "attentions", role="teacher", where=where)
            values = []
            for i, j in self._mapping(term.layers, len(a_s), len(a_t), states=False, where=where).items():
                if a_s[i] is None or a_t[j] is None or a_s[i].shape != a_t[j].shape:
                    raise RecipeError(
                        f"{where}: attention maps of student layer {i} ({_desc(a_s[i])}) and teacher layer {j}"
                        f" ({_desc(a_t[j])}) differ; attention distillation needs equal head counts"
                    )
                values.append(attention_kl(a_s[i], a_t[j], mask=mask))
            return torch.stack(values).mean()
        if isinstance(term, CosineLoss):
            es = self._embedding(s_out, term.pooling, mask, role="student", where=where)
            et = self._embedding(t_out, term.pooling, mask, role="teacher", where=where)
            es = self.adapters.adapt(f"{name}:embedding", es, et, mode=term.adapter, where=where)
            return cosine_loss(es, et)
        raise RecipeError(f"{where}: unsupported loss type '{term.type}'")

    def _mapping(
        self, layers: dict[int, int] | None, n_s: int, n_t: int, *, states: bool, where: str
    ) -> dict[int, int]:
        mapping = layers if layers is not None else _uniform(n_s, n_t, states=states)
        for i, j in mapping.items():
            if not (0 <= i < n_s and 0 <= j < n_t):
                what = "hidden states" if states else "attention layers"
                raise RecipeError(f"{where}: layer pair {i}->{j} out of range (student has {n_s} {what}, teacher {n_t})")
        return mapping

    @staticmethod
    def _embedding(out: Any, pooling: str, mask: torch.Tensor | None, *, role: str, where: str) -> torch.Tensor:
        if isinstance(out, torch.Tensor) and out.dim() == 2:
            return out
        if pooling == "pooler":
            return _field(out, "pooler_output", role=role, where=where)
        try:
            hidden = primary_output(out)
        except TypeError as exc:
            raise RecipeError(f"{where}: {exc}") from None
        if hidden.dim() == 2:
            return hidden
        if hidden.dim() != 3:
            raise RecipeError(f"{where}: the {role}'s output {_desc(hidden)} is neither [B, D] nor [B, L, D] states")
        return hidden[:, 0] if pooling == "cls" else mean_pool(hidden, mask)

    # ---- monitoring --------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, batches: Iterable[Any], *, max_batches: int | None = None) -> dict[str, float]:
        """Divergence to the teacher on held-out batches (eval mode): mean of each term, and for
        logit terms the KL at T=1 and the top-1 agreement."""
        device = _device_of(self.student)
        was = self.student.training
        self.student.eval()
        sums: dict[str, float] = {}
        n = 0
        try:
            for i, batch in enumerate(batches):
                if max_batches is not None and i >= max_batches:
                    break
                inputs, _ = split_batch(batch)
                inputs = to_device(inputs, device)
                self.compute(inputs, call_model(self.student, inputs), progress=0.0, count=False)
                for k, v in self.last.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
                n += 1
        finally:
            self.student.train(was)
        return {k: v / n for k, v in sums.items()} if n else {}


def _unwrap(model: nn.Module) -> nn.Module:
    # hooks go on the real modules; DDP / DataParallel only wrap them
    inner = getattr(model, "module", None)
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)) and isinstance(inner, nn.Module):
        return inner
    return model


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")
