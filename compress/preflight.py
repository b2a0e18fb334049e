"""Checks a run makes before any work: every conflict between recipe fields, this machine and the
data that would otherwise surface minutes later (after training, at export or validation).

``compress apply`` runs them before training and ``--dry-run`` runs the same ones, so a dry run
that passes means the run will not stop on any of these. Each failure is a RecipeError naming the
recipe field and its line.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch import nn

from compress.core.errors import RecipeError, UnsupportedModelError
from compress.core.imports import install_hint
from compress.recipe import Recipe


def check_recipe(recipe: Recipe, *, device: str | None = None) -> None:
    """The conflicts a recipe can have with itself and with this machine (no model, no data)."""
    check_device(recipe, device)
    _check_distributed(recipe, device)
    _check_schemes_export(recipe)
    _check_runtimes(recipe)


def check_device(recipe: Recipe, flag: str | None) -> None:
    """A CUDA request on a machine without CUDA."""
    if (flag or recipe.train.device) == "cuda" and not torch.cuda.is_available():
        where = "--device cuda" if flag else f"{recipe.where('train.device')}: 'cuda'"
        raise RecipeError(f"{where}: this machine has no CUDA device (torch {torch.__version__})")


def _check_distributed(recipe: Recipe, flag: str | None) -> None:
    """FSDP's options with another strategy. (CPU offload while training on the CPU runs: the state is
    in host memory anyway, so the same recipe runs on a CPU machine and on GPUs.)"""
    d = recipe.distributed
    if d.cpu_offload and d.strategy != "fsdp":
        raise RecipeError(f"{recipe.where('distributed.cpu_offload')}: offloads FSDP's sharded state; "
                          "set distributed.strategy: fsdp")
    if d.mixed_precision != "none" and d.strategy != "fsdp":
        raise RecipeError(f"{recipe.where('distributed.mixed_precision')}: is FSDP's compute dtype; set "
                          "distributed.strategy: fsdp (or train.amp for DDP on CUDA)")


def _check_schemes_export(recipe: Recipe) -> None:
    """Schemes the ONNX export has no form for, refused before the run: fp4 has none at all (the
    compressed-tensors checkpoint holds it); fp8 none on CPU; dynamic (per-token) activations no static
    QDQ form, which the generation export (decoder LLMs) writes as MatMulInteger instead."""
    export = recipe.export
    if not export.enabled or not export.onnx:
        return
    for i, stage in enumerate(recipe.stages):
        for j, spec in enumerate(stage.modifiers):
            resolve = getattr(spec, "resolved_scheme", None)
            if resolve is None:
                continue
            scheme = resolve()
            where = recipe.where(f'stages.{i}.modifiers.{j}.scheme')
            if any(s is not None and s.is_fp4 for s in (scheme.weights, scheme.inputs)):
                raise RecipeError(
                    f"{where}: fp4 (NVFP4/MXFP4) schemes have no ONNX form, so the export after training would "
                    "fail; set export.onnx: false and export.compressed_tensors: true (the checkpoint vLLM serves)"
                )
            if export.generation:
                continue
            if any(s is not None and s.is_float for s in (scheme.weights, scheme.inputs, scheme.outputs)):
                raise RecipeError(
                    f"{where}: float8 schemes have no ONNX (CPU) export, so the export after training would "
                    "fail; set export.enabled: false and validate on a GPU: compress validate RUN_DIR --backend cuda"
                )
            inputs = scheme.inputs
            if inputs is not None and inputs.dynamic:
                raise RecipeError(
                    f"{where}: dynamic ({inputs.granularity}) activations "
                    "have no QDQ ONNX form, so the export after training would fail; use a static scheme "
                    "(w8a8), export.generation: true for a decoder LLM, or export.enabled: false"
                )


def _check_runtimes(recipe: Recipe) -> None:
    v = recipe.validate_
    if not v.enabled or not recipe.export.enabled or not recipe.export.onnx:
        return
    for k, rt in enumerate(v.runtimes):
        if rt == "openvino" and importlib.util.find_spec("openvino") is None:
            raise RecipeError(
                f"{recipe.where(f'validate.runtimes.{k}')}: runtime 'openvino' is not installed here; "
                f"{install_hint('openvino')}, or drop it from validate.runtimes"
            )
        # without CUDA, the cuda runtime is skipped with a note (one recipe serves a laptop and a GPU
        # server); with CUDA but no Triton it could only fail, after training
        if rt == "cuda" and torch.cuda.is_available() and importlib.util.find_spec("triton") is None:
            raise RecipeError(
                f"{recipe.where(f'validate.runtimes.{k}')}: runtime 'cuda' runs the Triton int8 kernels; "
                f"{install_hint('triton')}"
            )


def check_data_fits(recipe: Recipe, model: nn.Module, example_inputs: Any) -> None:
    """The data's batches run through the model (one forward on the example batch, no grad, CPU),
    so a data source of another input shape is named now, not at the first training step."""
    if example_inputs is None:
        return
    from compress.core.batching import call_model, to_device
    from compress.core.tracing import iter_tensors

    p = next(model.parameters(), None)
    device = p.device if p is not None else torch.device("cpu")
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            call_model(model, to_device(example_inputs, device))
    except Exception as exc:  # any failure of the user's model on the user's data is a mismatch to report
        shapes = ", ".join(str(list(t.shape)) for t in iter_tensors(example_inputs)) or "?"
        why = " ".join(f"{type(exc).__name__}: {exc}".split())[:240]
        raise RecipeError(
            f"{recipe.where('data.source')}: batches of data '{recipe.data.source}' (inputs {shapes}) do not fit "
            f"the model ({why})"
        ) from None
    finally:
        model.train(was_training)


def check_exports(recipe: Recipe, model: nn.Module, example_inputs: Any) -> None:
    """Each LLM export the recipe's ``export:`` section asks for can take the model, judged from its
    structure alone (export.llm.support: config and module tree, so a dry run's meta-device model is
    judged as the loaded one): a family the export refuses is named now, in the export's own words,
    not after the training and calibration. Nothing is checked where the run would not export (export
    off, or data without an example batch)."""
    if not recipe.export.enabled or example_inputs is None:
        return
    from compress.export.llm.support import requested_checks

    for field, check in requested_checks(recipe.export):
        try:
            check(model)
        except UnsupportedModelError as exc:
            raise RecipeError(f"{recipe.where(f'export.{field}')}: {exc}") from None
