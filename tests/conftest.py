"""Suite-wide test settings.

torch runs on one intra-op thread: the suite trains many tiny models, for which a second thread
only adds synchronization, and on a shared 2-core box two threads per process oversubscribe the
cores (small MLP steps measured 50x slower). Subprocess tests set OMP_NUM_THREADS themselves.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
