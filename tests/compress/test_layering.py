"""One-way imports between compress/ and export/: export uses only compress's core modules (errors,
batching, metrics, ...), never the recipe, runner, CLI, data or session; the core modules import no
export module. Checked on the source (every import statement, function-local ones included)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: compress modules any package may use: they import nothing but each other
CORE = {"compress.core.errors", "compress.core.batching", "compress.core.metrics", "compress.core.registry", "compress.core.size",
        "compress.core.io", "compress.core.imports", "compress.core.targets", "compress.core.version", "compress.core.precision",
        "compress.core.moe", "compress.core.tracing"}


def _imports(path: Path) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            # `from compress import x` reaches compress/__init__'s lazy public API
            if node.module == "compress":
                out += [(node.lineno, f"compress.{a.name}") for a in node.names]
    return out


def test_export_imports_only_compress_core() -> None:
    bad = [f"{p.relative_to(ROOT)}:{line}: {name}"
           for p in sorted((ROOT / "export").rglob("*.py"))
           for line, name in _imports(p)
           if (name == "compress" or name.startswith("compress.")) and name not in CORE]
    assert not bad, "export/ reaches past compress's core modules:\n" + "\n".join(bad)


def test_compress_core_imports_no_other_package() -> None:
    bad = [f"{p.relative_to(ROOT)}:{line}: {name}"
           for mod in sorted(CORE)
           for p in [ROOT / (mod.replace(".", "/") + ".py")]
           for line, name in _imports(p)
           if name.split(".")[0] in {"export", "quantization", "pruning", "distillation"}
           or (name.startswith("compress.") and name not in CORE)]
    assert not bad, "\n".join(bad)


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
