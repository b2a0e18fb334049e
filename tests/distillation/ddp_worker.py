"""One rank of the two-process DDP distillation check (run by test_ddp.py, not by pytest itself)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from distillation.api import Distiller


class Net(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.ReLU())
        self.fc = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x).mean((2, 3)))


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
    torch.save(
        {"adapter0": adapter0, "adapter": [p.detach() for p in d.parameters()], "student": student.state_dict()},
        f"{out}/rank{rank}.pt",
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
