"""One rank of the two-process DDP distillation check (run by test_ddp.py, not by pytest itself)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from compress.distillation.api import Distiller
from torch import nn


class Net(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.ReLU())
        self.fc = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x).mean((2, 3)))


def _trained_teacher(rank: int) -> dict[str, torch.Tensor]:
    """A recipe teacher with train_epochs, trained on this rank's shard: the ranks must agree on it."""
    from torch.utils.data import DataLoader, TensorDataset

    from compress.session import Session

    g = torch.Generator().manual_seed(200 + rank)
    shard = TensorDataset(torch.randn(32, 1, 4, 4, generator=g), torch.randint(0, 3, (32,), generator=g))
    loader = DataLoader(shard, batch_size=8)
    teacher = {"name": "mlp", "kwargs": {"hidden": 8, "in_features": 16, "num_classes": 3}, "train_epochs": 1}
    recipe = {
        "version": 1, "model": {"name": "mlp"},
        "stages": [{"name": "kd", "epochs": 1, "modifiers": [{"type": "distill", "teacher": teacher}]}],
    }
    torch.manual_seed(rank)  # different teacher inits per rank: DDP training must agree them
    student = nn.Sequential(nn.Flatten(), nn.Linear(16, 3))
    session = Session(recipe, student, train_data=loader)
    session.initialize()
    mod = session.modifiers[0][0]
    state = {k: v.clone() for k, v in mod.distiller.teacher.model.state_dict().items()}  # type: ignore[attr-defined]
    session.finalize()
    return state


def main(out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    teacher, student = Net(8), Net(4)
    ddp = nn.parallel.DistributedDataParallel(student)
    torch.manual_seed(rank)  # adapters start different on each rank: the distiller must agree them
    g = torch.Generator().manual_seed(100 + rank)  # each rank sees its own batches
    x0 = torch.randn(4, 1, 6, 6, generator=g)
    d = Distiller(teacher, ddp, losses=[{"type": "kd"}, {"type": "feature", "layers": {"body": "body"}}], example_inputs=x0)
    adapter0 = [p.detach().clone() for p in d.parameters()]
    opt = torch.optim.SGD([*ddp.parameters(), *d.parameters()], lr=0.1)
    for _ in range(3):
        x = torch.randn(4, 1, 6, 6, generator=g)
        loss = d(x, ddp(x))
        opt.zero_grad()
        loss.backward()
        opt.step()
    d.remove()
    teacher_state = _trained_teacher(rank)
    torch.save(
        {"adapter0": adapter0, "adapter": [p.detach() for p in d.parameters()], "student": student.state_dict(),
         "trained_teacher": teacher_state},
        f"{out}/rank{rank}.pt",
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
