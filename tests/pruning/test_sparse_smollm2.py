"""SparseGPT, Wanda and magnitude pruning on the real SmolLM2-135M weights (its first 2 decoder
layers): calibrated on 24 stdlib windows of 128 tokens, judged on held-out ones.

SparseGPT needs more calibration tokens than the widest Linear has inputs (down_proj: 1536): on the
fixture's 4 windows (512 tokens) it fits them (calibration error 0.006 against Wanda's 0.043 at 50%)
but is behind Wanda on held-out text (0.057 against 0.049); from 32 windows it leads there too
(0.036 against 0.044)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from compress.pruning.sparse.params import SparsityParams
from compress.pruning.sparse.wanda import wanda_mask
from torch import nn

import compress
from compress.core.sparsity import nm_groups_ok, set_mask

log = logging.getLogger(__name__)


def _hidden(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The last decoder layer's output (before the final norm)."""
    with torch.no_grad():
        return model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states[-1]


def _magnitude(model: nn.Module, params: SparsityParams) -> None:
    """Magnitude pruning, compared as Wanda compares (per row, or per N:M group): Wanda with unit norms."""
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear) and ".layers." in n:
            set_mask(m, wanda_mask(m.weight, torch.ones(m.in_features), params))


@pytest.mark.parametrize("pattern", ["unstructured", "2:4"])
def test_sparsegpt_error_is_below_wanda_and_below_magnitude(
        smollm2_two_layers: tuple[nn.Module, torch.Tensor, torch.Tensor], smollm2_dir: str, pattern: str) -> None:
    from compress.data.lm import split_files, token_stream
    from compress.models import load_tokenizer

    dense, _, held = smollm2_two_layers
    tok = load_tokenizer(smollm2_dir)
    calib = token_stream(split_files(0)["calibration"], tok, max_tokens=24 * 128).reshape(24, 128)
    batches = [calib[i : i + 8] for i in range(0, 24, 8)]
    ref = _hidden(dense, held)
    errors = {}
    for name in ("sparsegpt", "wanda", "magnitude"):
        model = copy.deepcopy(dense)
        if name == "magnitude":
            _magnitude(model, SparsityParams(pattern=pattern))
        else:
            getattr(compress, name)(model, batches, pattern=pattern, progress=False)
        lins = [m for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n]
        assert len(lins) == 14 and all(float((m.weight == 0).float().mean()) >= 0.499 for m in lins)
        if pattern == "2:4":
            assert all(nm_groups_ok(m.weight, 2, 4) for m in lins)
        errors[name] = float(((_hidden(model, held) - ref) ** 2).sum() / (ref**2).sum())
    log.warning("SmolLM2 2 layers, %s 50%%: held-out relative output error %s", pattern,
                {k: round(v, 5) for k, v in errors.items()})
    assert errors["sparsegpt"] < errors["wanda"] < errors["magnitude"], errors
