"""Distillation tests run torch on one thread: on a loaded 2-core box, two intra-op threads made
small MLP steps 50x slower (oversubscription), and these tests train small models."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
