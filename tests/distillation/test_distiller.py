"""The Distiller API: gradients, frozen teacher, adapters, hook removal, optimizer binding, errors."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from compress.distillation.api import Distiller
from compress.distillation.teacher import Teacher
from torch import nn

import compress
from compress.core.errors import CompressError, RecipeError, TargetMatchError


class ConvNet(nn.Module):
    """A small conv classifier whose width can differ between teacher and student."""

    def __init__(self, width: int, classes: int = 5) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.block(self.body(x))).flatten(1))


class TokenNet(nn.Module):
    """Returns a token sequence [B, L, D] from an intermediate layer and logits."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(6, width)
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(x)).mean(1)


@pytest.fixture
def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 1, 6, 6, generator=g), torch.randint(0, 5, (8,), generator=g)


def _models(sw: int = 4, tw: int = 8) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return ConvNet(tw), ConvNet(sw)


def _hook_counts(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_compress_reexports_distiller() -> None:
    assert compress.Distiller is Distiller


def test_gradients_reach_student_only_and_teacher_is_unchanged(data: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, y = data
    teacher, student = _models()
    teacher.train()  # the distiller must put it in eval mode: BN statistics must not move
    before = copy.deepcopy(teacher.state_dict())
    d = Distiller(teacher, student, losses=[{"type": "kd"}, {"type": "feature", "layers": {"block": "block"}}], example_inputs=x)
    opt = torch.optim.SGD([*student.parameters(), *d.parameters()], lr=0.1)
    s_before = copy.deepcopy(student.state_dict())
    for _ in range(3):
        out = student(x)
        loss = d(x, out, F.cross_entropy(out, y))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(p.grad is None for p in teacher.parameters())
    assert all(not p.requires_grad for p in teacher.parameters())
    assert not teacher.training
    for k, v in teacher.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert any(not torch.equal(v, s_before[k]) for k, v in student.state_dict().items())
    assert all(p.grad is not None for p in d.parameters())


def test_total_is_task_weight_times_task_plus_weighted_terms(data: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, y = data
    teacher, student = _models(tw=4)
    d = Distiller(teacher, student, losses=[{"type": "kd", "temperature": 2.0, "weight": 0.7}], task_weight=0.3)
    out = student(x)
    task = F.cross_entropy(out, y)
    total = d(x, out, task)
    ref = 0.3 * task + 0.7 * compress_kd(out, teacher(x), 2.0)
    assert total.item() == pytest.approx(ref.item(), rel=1e-5)
    assert d(x, student(x)).item() == pytest.approx(0.7 * d.last["kd"].item(), rel=1e-5)


def compress_kd(s: torch.Tensor, t: torch.Tensor, temp: float) -> torch.Tensor:
    ps, pt = F.log_softmax(s / temp, -1), F.softmax(t / temp, -1)
    return F.kl_div(ps, pt, reduction="batchmean") * temp**2


def test_adapters_have_the_right_shapes(data: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, _ = data
    teacher, student = _models(sw=3, tw=8)
    d = Distiller(teacher, student, losses=[{"type": "feature", "layers": {"body": "body", "block": "block"}}], example_inputs=x)
    convs = dict(d.adapters.modules.items())
    assert set(convs) == {"feature:body", "feature:block"}
    for a in convs.values():
        assert isinstance(a, nn.Conv2d)
        assert (a.in_channels, a.out_channels, a.kernel_size) == (3, 8, (1, 1))
    torch.manual_seed(1)
    tok_t, tok_s = TokenNet(12), TokenNet(5)
    z = torch.randn(2, 4, 6)
    d2 = Distiller(tok_t, tok_s, losses=[{"type": "feature", "layers": {"proj": "proj"}}], example_inputs=z)
    lin = d2.adapters.modules["feature:proj"]
    assert isinstance(lin, nn.Linear) and (lin.in_features, lin.out_features) == (5, 12)
    # equal widths need no adapter
    t3, s3 = _models(sw=8, tw=8)
    d3 = Distiller(t3, s3, losses=[{"type": "feature", "layers": {"block": "block"}}], example_inputs=x)
    assert list(d3.parameters()) == []


def test_remove_restores_hooks_and_forward_exactly(data: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, _ = data
    teacher, student = _models()
    student.eval()
    ref = student(x).detach().clone()
    hooks_s, hooks_t = _hook_counts(student), _hook_counts(teacher)
    d = Distiller(teacher, student, losses=[{"type": "feature", "layers": {"body.1": "body.1", "block": "block"}}])
    assert _hook_counts(student) > hooks_s and _hook_counts(teacher) > hooks_t
    d(x, student(x))
    d.remove()
    assert _hook_counts(student) == hooks_s and _hook_counts(teacher) == hooks_t
    assert torch.equal(student(x), ref)
    assert type(student) is ConvNet and type(student.block) is nn.Sequential


def test_capture_follows_a_module_swapped_after_setup(data: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, _ = data
    teacher, student = _models(sw=8, tw=8)
    d = Distiller(teacher, student, losses=[{"type": "feature", "layers": {"block.0": "block.0"}}])
    old = student.block[0]
    new = nn.Conv2d(8, 8, 3, padding=1)  # what a fake-quant module swap does
    student.block[0] = new
    d(x, student(x))  # would raise "produced no tensor" if the hook stayed on the old module
    assert len(new._forward_hooks) == 1 and len(old._forward_hooks) == 0
    d.remove()
    assert len(new._forward_hooks) == 0


def test_adapter_is_rebuilt_and_rebound_when_pruning_narrows_the_student(data: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, _ = data
    teacher, student = _models(sw=8, tw=8)
    opt = torch.optim.SGD(student.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    d = Distiller(teacher, student, losses=[{"type": "feature", "layers": {"block": "block"}}])
    d.bind_optimizer(opt)
    d(x, student(x)).backward()
    n_model = len(list(student.parameters()))
    assert sum(len(g["params"]) for g in opt.param_groups) == n_model  # equal widths: nothing added
    # physically narrow the block's output conv, as structured pruning does
    conv = student.block[0]
    student.block[0] = nn.Conv2d(8, 5, 3, padding=1)
    student.fc = nn.Linear(5, 5)
    del conv
    opt.zero_grad()
    d(x, student(x)).backward()
    a = d.adapters.modules["feature:block"]
    assert isinstance(a, nn.Conv2d) and (a.in_channels, a.out_channels) == (5, 8)
    ids = {id(p) for g in opt.param_groups for p in g["params"]}
    assert id(a.weight) in ids
    opt.step()
    sched.step()  # a scheduler built before the adapter still works (no new param group)
    d.remove()
    ids = {id(p) for g in opt.param_groups for p in g["params"]}
    assert id(a.weight) not in ids


def test_parameters_before_adapters_exist_is_a_clear_error() -> None:
    teacher, student = _models()
    d = Distiller(teacher, student, losses=[{"type": "feature", "layers": {"block": "block"}}])
    with pytest.raises(CompressError, match="example_inputs"):
        list(d.parameters())


def test_missing_layer_is_a_target_error_naming_it() -> None:
    teacher, student = _models()
    with pytest.raises(TargetMatchError, match=r"student layer 'blok'.*did you mean 'block'"):
        Distiller(teacher, student, losses=[{"type": "feature", "layers": {"blok": "block"}}])
    with pytest.raises(TargetMatchError, match="teacher layer 'nope'"):
        Distiller(teacher, student, losses=[{"type": "feature", "layers": {"block": "nope"}}])


def test_shape_mismatch_without_adapters_is_an_error(data: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, _ = data
    teacher, student = _models(sw=4, tw=8)
    with pytest.raises(RecipeError, match=r"student feature 8x4x6x6 and teacher feature 8x8x6x6 differ.*adapter: auto"):
        Distiller(
            teacher, student, losses=[{"type": "feature", "layers": {"block": "block"}, "adapter": "none"}], example_inputs=x
        )


def test_feature_maps_of_different_resolution_are_an_error(data: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, _ = data
    teacher, student = _models(sw=4, tw=4)
    teacher.block = nn.Sequential(nn.Conv2d(4, 4, 3, stride=2, padding=1), nn.ReLU())
    with pytest.raises(RecipeError, match="spatial size"):
        Distiller(teacher, student, losses=[{"type": "feature", "layers": {"block": "block"}}], example_inputs=x)


def test_mismatched_output_types_are_an_error(data: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, _ = data
    torch.manual_seed(0)
    student = ConvNet(4, classes=5)
    teacher = ConvNet(4, classes=7)
    d = Distiller(teacher, student)
    with pytest.raises(RecipeError, match=r"student output Tensor\[8x5\].*teacher output Tensor\[8x7\]"):
        d(x, student(x))

    class Embedder(nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"last_hidden_state": x.flatten(2)}

    d2 = Distiller(Embedder(), student)
    with pytest.raises(RecipeError, match=r"teacher output dict -> Tensor\[8x1x36\]"):
        d2(x, student(x))


def test_invalid_loss_specs_are_recipe_errors() -> None:
    teacher, student = _models()
    with pytest.raises(RecipeError, match=r"losses.0.type: unknown loss type 'soft-ce'.*did you mean 'soft_ce'"):
        Distiller(teacher, student, losses=[{"type": "soft-ce"}])
    with pytest.raises(RecipeError, match=r"losses.1.temperatur: unknown field.*did you mean 'temperature'"):
        Distiller(teacher, student, losses=[{"type": "kd"}, {"type": "kd", "temperatur": 2}])
    with pytest.raises(RecipeError, match=r"losses.0.temperature: .*greater than 0"):
        Distiller(teacher, student, losses=[{"type": "kd", "temperature": 0}])
    with pytest.raises(RecipeError, match="empty"):
        Distiller(teacher, student, losses=[])


def test_scheduled_weight_needs_a_length_and_follows_progress(data: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, _ = data
    teacher, student = _models(tw=4)
    spec = {"type": "kd", "weight": 0.0, "weight_end": 2.0, "weight_schedule": "linear"}
    d = Distiller(teacher, student, losses=[spec])
    with pytest.raises(RecipeError, match="total_steps"):
        d(x, student(x))
    d = Distiller(teacher, student, losses=[spec], total_steps=4)
    first = d(x, student(x))
    assert first.item() == 0.0
    d(x, student(x))
    half = d(x, student(x), progress=0.5)
    assert half.item() == pytest.approx(d.last["kd"].item(), rel=1e-6)


def test_half_precision_teacher_keeps_the_given_model_untouched(data: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, _ = data
    teacher, student = _models(tw=4)
    d = Distiller(teacher, student, teacher_dtype="bfloat16")
    assert next(teacher.parameters()).dtype == torch.float32  # a copy was cast, not the caller's model
    assert next(d.teacher.model.parameters()).dtype == torch.bfloat16
    out = student(x)
    loss = d(x, out)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    ref = Distiller(Teacher(teacher), student)(x, out)
    assert loss.item() == pytest.approx(ref.item(), rel=0.1, abs=1e-3)


def test_ddp_wrapped_student_is_unwrapped_for_hooks(data: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, _ = data
    teacher, student = _models()
    wrapped = nn.DataParallel(student)  # same .module convention as DistributedDataParallel
    d = Distiller(teacher, wrapped, losses=[{"type": "feature", "layers": {"block": "block"}}], example_inputs=x)
    assert d.student is student
    d(x, wrapped(x))
    d.remove()


def test_teacher_from_a_model_spec(tmp_path: Path, data: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, _ = data
    from compress.models import build_zoo_model

    torch.manual_seed(0)
    zoo_teacher = build_zoo_model("mlp", {"hidden": 8, "in_features": 36, "num_classes": 5})
    path = tmp_path / "t.pt"
    torch.save(zoo_teacher.state_dict(), path)
    student = ConvNet(4)
    spec = {"name": "mlp", "kwargs": {"hidden": 8, "in_features": 36, "num_classes": 5}, "checkpoint": str(path)}
    d = Distiller(spec, student)
    d(x, student(x))
    assert torch.equal(d.teacher.model(x), zoo_teacher(x))
    with pytest.raises(RecipeError, match="teacher 'mlp' has no weights"):
        Distiller({"name": "mlp"}, student)
    with pytest.raises(RecipeError, match="train_epochs is for recipes"):
        Distiller({"name": "mlp", "train_epochs": 2}, student)
