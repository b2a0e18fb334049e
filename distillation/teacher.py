"""Teachers: a frozen model run without grad, in eval mode, on the student's device.

``self`` is the frozen snapshot of the model taken before compression (``state.original_model``);
any other teacher is loaded like a recipe's model and, without a checkpoint, trained first.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

import torch
from compress.distillation.spec import TeacherDtype, TeacherSpec
from torch import nn

from compress.core.batching import call_model
from compress.core.errors import CompressError, RecipeError
from compress.core.modifier import State
from compress.core.services import load_model_reference, train_model

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def is_hf(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face model whose outputs can carry hidden states / attentions."""
    return hasattr(getattr(model, "config", None), "output_hidden_states")


def _cast_inputs(obj: Any, dtype: torch.dtype) -> Any:
    # only floating inputs change dtype: token ids and masks stay integers
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, Mapping):
        return {k: _cast_inputs(v, dtype) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_cast_inputs(v, dtype) for v in obj)
    return obj


class Teacher:
    """A frozen teacher. Calling it runs ``model`` on the student's inputs without grad.

    ``dtype`` (float16 / bfloat16) keeps a half-precision copy to save memory; outputs stay in that
    dtype and the losses compute in float32. The model is frozen in place unless ``copy`` is set.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        device: torch.device | str | None = None,
        dtype: TeacherDtype = "float32",
        copy_model: bool = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise RecipeError(f"a teacher must be a torch nn.Module, not {type(model).__name__}")
        self.dtype = DTYPES[dtype]
        if copy_model or (self.dtype != torch.float32 and _dtype_of(model) != self.dtype):
            # a half copy must not change a model others hold (the session's snapshot)
            model = copy.deepcopy(model)
        if device is not None:
            model.to(device)
        if self.dtype != torch.float32:
            model.to(self.dtype)
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self.model = model

    @torch.no_grad()
    def __call__(self, inputs: Any, *, hidden_states: bool = False, attentions: bool = False) -> Any:
        if self.model.training:  # someone called .train() on it: a teacher never updates BN statistics
            self.model.eval()
        if self.dtype != torch.float32:
            inputs = _cast_inputs(inputs, self.dtype)
        if (hidden_states or attentions) and is_hf(self.model):
            extra: dict[str, bool] = {}
            if hidden_states:
                extra["output_hidden_states"] = True
            if attentions:
                extra["output_attentions"] = True
            if isinstance(inputs, Mapping):
                return self.model(**inputs, **extra)
            return self.model(inputs, **extra)
        return call_model(self.model, inputs)


def _dtype_of(model: nn.Module) -> torch.dtype:
    p = next(model.parameters(), None)
    return p.dtype if p is not None else torch.float32


def build_teacher(spec: TeacherSpec | None, state: State, *, dtype: TeacherDtype, where: str) -> Teacher:
    """The teacher a ``distill`` modifier names (None: ``self``), frozen on ``state.device``."""
    if spec is None:
        if state.original_model is None:
            raise CompressError(
                f"{where}: teacher 'self' needs the session's snapshot of the uncompressed model, and there is none"
            )
        return Teacher(state.original_model, device=state.device, dtype=dtype)
    if not isinstance(spec, TeacherSpec):
        raise RecipeError(f"{where}: teacher must be 'self' or a model spec, not {spec!r}")
    model = load_teacher_model(spec, where=f"{where}.teacher")
    model.to(state.device)
    # a resumed stage's checkpoint holds the trained teacher (its metrics too): not trained again
    if spec.train_epochs > 0 and spec.checkpoint is None and not state.resuming:
        _train(model, spec, state, where=where)
    teacher = Teacher(model, device=state.device, dtype=dtype)
    if state.evaluate is not None:
        state.metrics["distill.teacher_metric"] = float(state.evaluate(teacher.model))
    return teacher


def load_teacher_model(spec: TeacherSpec | Mapping[str, Any], *, where: str = "teacher") -> nn.Module:
    """The (untrained unless it has a checkpoint or HF weights) model a teacher spec describes."""
    if not isinstance(spec, TeacherSpec):
        from pydantic import ValidationError

        try:
            spec = TeacherSpec.model_validate(dict(spec))
        except ValidationError as exc:
            err = exc.errors()[0]
            path = ".".join(str(p) for p in err["loc"])
            raise RecipeError(f"{where}{'.' + path if path else ''}: {str(err['msg']).removeprefix('Value error, ')}") from None
    fields = {k: getattr(spec, k) for k in ("name", "kwargs", "hf_path", "checkpoint", "pruning_plan")}
    return load_model_reference(fields, where=lambda path: f"{where}.{path.removeprefix('model.')}")


def _train(model: nn.Module, spec: TeacherSpec, state: State, *, where: str) -> None:
    if state.train_data is None:
        raise RecipeError(f"{where}.teacher.train_epochs: training the teacher needs training data, and the run has none")
    log.info("%s: training teacher '%s' for %g epochs", where, spec.name, spec.train_epochs)
    final_loss = train_model(model, state.train_data, epochs=spec.train_epochs, lr=spec.train_lr,
                             device=state.device, desc="teacher")
    if final_loss is not None:
        state.metrics["distill.teacher_train_loss"] = final_loss
    if state.out_dir is not None:
        path = state.out_dir / f"teacher_{state.stage_name or state.stage_index}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), path)
        state.artifacts.append(str(path))
