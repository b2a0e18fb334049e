"""The built-in Trainer drives a Session through its public event API only (what any user's loop may use).
The floors between packages are tested in tests/test_layering.py."""

from __future__ import annotations


class _PublicOnlySession:
    """The Session's public event API and nothing else (no ``state``): what a trainer may use."""

    def __init__(self) -> None:
        self.optimizer = None
        self.steps_per_epoch: int | None = None
        self.stage: object | None = object()
        self.events: list[str] = []

    @property
    def finished(self) -> bool:
        return self.stage is None

    def loss(self, loss, *, inputs=None, outputs=None):  # type: ignore[no-untyped-def]
        self.events.append("loss")
        return loss

    def step(self) -> None:
        self.events.append("step")

    def epoch_end(self) -> None:
        self.events.append("epoch_end")
        self.stage = None  # the stage ends after one epoch


def test_the_trainer_drives_a_session_through_its_public_api_only() -> None:
    import torch

    from compress.recipe import TrainSpec
    from compress.training import Trainer

    torch.manual_seed(0)
    data = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(3)]
    s = _PublicOnlySession()
    Trainer(TrainSpec(device="cpu"), progress=False).fit(torch.nn.Linear(4, 3), data, epochs=5,
                                                         session=s)  # type: ignore[arg-type]
    assert s.events == ["loss", "step"] * 3 + ["epoch_end"]  # stopped when the stage ended
    assert s.steps_per_epoch == 3 and s.optimizer is not None
