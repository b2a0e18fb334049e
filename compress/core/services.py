"""Services the floors below the top need from it: load a model reference, train a model, save a
quantized transformers model as the checkpoint its runtimes load, turn a data source name into eval
batches (``compress.validate(..., data="digits")``).

Loading and training are the top floor's work (compress.models, compress.training), but a
distillation teacher is a model reference, trained first when it has no weights. So the services
are slots that ``compress/__init__.py`` fills when the package is imported (it always is first:
every core module lives inside that package), and callers below the top go through
:func:`load_model_reference` and :func:`train_model` without importing anything above the core.
Kept free of heavy imports so that ``import compress`` stays cheap.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from compress.core.errors import CompressError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from compress.core.reference import ModelSpec, Where


class ModelLoader(Protocol):
    def __call__(self, spec: ModelSpec | Mapping[str, Any], *, where: Where = "model") -> nn.Module: ...


class ModelTrainer(Protocol):
    def __call__(self, model: nn.Module, data: Iterable[Any], *, epochs: float, lr: float | None,
                 device: torch.device, desc: str) -> float | None: ...


class QuantizedSaver(Protocol):
    def __call__(self, model: nn.Module, out_dir: Any, **kwargs: Any) -> Any: ...


class EvalData(Protocol):
    def __call__(self, data: Any) -> Any: ...


_loader: ModelLoader | None = None
_trainer: ModelTrainer | None = None
_saver: QuantizedSaver | None = None
_eval_data: EvalData | None = None


def provide(*, loader: ModelLoader, trainer: ModelTrainer, saver: QuantizedSaver | None = None,
            eval_data: EvalData | None = None) -> None:
    """Fill the service slots (the top floor does, once, when ``compress`` is imported)."""
    global _loader, _trainer, _saver, _eval_data
    _loader, _trainer, _saver, _eval_data = loader, trainer, saver, eval_data


def eval_batches(data: Any) -> Any:
    """The eval batches ``data`` names: a data source name or a DataSpec built into its eval split, an
    iterable of batches as it is."""
    if _eval_data is None:
        raise CompressError("no eval-data resolver is registered: import compress first")
    return _eval_data(data)


def save_quantized(model: nn.Module, out_dir: Any, **kwargs: Any) -> Any:
    """Write a quantized transformers ``model`` as a compressed checkpoint (compressed-tensors);
    raises UnsupportedModelError when its scheme has no such form."""
    if _saver is None:
        raise CompressError("no quantized-model saver is registered: import compress first")
    return _saver(model, out_dir, **kwargs)


def load_model_reference(spec: ModelSpec | Mapping[str, Any], *, where: Where = "model") -> nn.Module:
    """Build the model a ModelSpec (or a mapping of its fields) describes."""
    if _loader is None:
        raise CompressError("no model loader is registered: import compress first")
    return _loader(spec, where=where)


def train_model(model: nn.Module, data: Iterable[Any], *, epochs: float, lr: float | None = None,
                device: torch.device, desc: str) -> float | None:
    """Train ``model`` on ``data`` with the built-in trainer (data-parallel under torchrun); the final loss."""
    if _trainer is None:
        raise CompressError("no trainer is registered: import compress first")
    return _trainer(model, data, epochs=epochs, lr=lr, device=device, desc=desc)
