"""Module selection: globs, ``re:`` regexes, ``type:`` names, ignore lists, type filters, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from compress.core.errors import TargetMatchError
from compress.core.targets import pattern_matches, select_modules


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.layer1 = nn.Sequential(Block(4), Block(4))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.layer1(self.stem(x))).flatten(1))


@pytest.fixture
def net() -> Net:
    torch.manual_seed(0)
    return Net()


def names(model: nn.Module, targets: list[str], **kw: object) -> list[str]:
    return list(select_modules(model, targets, **kw))  # type: ignore[arg-type]


def test_glob_matches_names_in_model_order(net: Net) -> None:
    assert names(net, ["layer1.*.conv"]) == ["layer1.0.conv", "layer1.1.conv"]
    assert names(net, ["head"]) == ["head"]
    assert names(net, ["layer1.?.bn"]) == ["layer1.0.bn", "layer1.1.bn"]


def test_glob_star_crosses_dots_and_selects_every_named_module(net: Net) -> None:
    all_named = [n for n, _ in net.named_modules() if n]
    assert names(net, ["*"]) == all_named
    assert "" not in names(net, ["*"])  # the root module is never a target


def test_result_maps_names_to_the_modules_themselves(net: Net) -> None:
    out = select_modules(net, ["head", "stem"])
    assert list(out) == ["stem", "head"]  # model order, not pattern order
    assert out["head"] is net.head and out["stem"] is net.stem


def test_regex_is_a_fullmatch(net: Net) -> None:
    assert names(net, [r"re:layer1\.\d\.conv"]) == ["layer1.0.conv", "layer1.1.conv"]
    # "conv" alone is found inside names but a fullmatch needs the whole name
    with pytest.raises(TargetMatchError, match=r"pattern 're:conv' matches no module"):
        select_modules(net, ["re:conv"])
    assert names(net, ["re:.*conv"]) == ["layer1.0.conv", "layer1.1.conv"]


def test_type_short_and_qualified_names(net: Net) -> None:
    assert names(net, ["type:Conv2d"]) == ["stem", "layer1.0.conv", "layer1.1.conv"]
    assert names(net, ["type:torch.nn.modules.linear.Linear"]) == ["head"]
    # base classes in the MRO count too
    assert names(net, ["type:_ConvNd"]) == ["stem", "layer1.0.conv", "layer1.1.conv"]
    assert names(net, [f"type:{Block.__module__}.{Block.__qualname__}"]) == ["layer1.0", "layer1.1"]


def test_pattern_matches_each_kind() -> None:
    lin = nn.Linear(2, 2)
    assert pattern_matches("a.*", "a.b", lin)
    assert not pattern_matches("a.*", "ab", lin)
    assert pattern_matches("re:a\\.b+", "a.bbb", lin)
    assert not pattern_matches("re:a\\.b", "a.bc", lin)
    assert pattern_matches("type:Linear", "whatever", lin)
    assert not pattern_matches("type:Conv2d", "whatever", lin)
    assert not pattern_matches("type:linear", "x", lin)  # type names are case-sensitive


def test_ignore_removes_modules(net: Net) -> None:
    out = names(net, ["type:Conv2d"], ignore=["stem"])
    assert out == ["layer1.0.conv", "layer1.1.conv"]
    out = names(net, ["*"], ignore=["re:layer1.*", "type:ReLU", "pool"])
    assert out == ["stem", "head"]


def test_type_filter_restricts_the_result(net: Net) -> None:
    assert names(net, ["*"], types=(nn.Conv2d, nn.Linear)) == [
        "stem",
        "layer1.0.conv",
        "layer1.1.conv",
        "head",
    ]
    assert names(net, ["layer1.*"], types=(nn.BatchNorm2d,)) == ["layer1.0.bn", "layer1.1.bn"]


def test_target_matching_only_other_types_is_an_error_naming_the_type(net: Net) -> None:
    with pytest.raises(TargetMatchError) as info:
        select_modules(net, ["head", "layer1.*.bn"], types=(nn.Linear,), where="stages.0.modifiers.0.targets")
    assert str(info.value).startswith(
        "stages.0.modifiers.0.targets: pattern 'layer1.*.bn' matches no module of type Linear in Net"
    )


def test_unmatched_target_names_the_pattern_and_shows_module_names(net: Net) -> None:
    with pytest.raises(TargetMatchError) as info:
        select_modules(net, ["stem", "layer9.*"], where="recipe.yaml:12: stages.1.modifiers.0.targets")
    msg = str(info.value)
    assert msg == (
        "recipe.yaml:12: stages.1.modifiers.0.targets: pattern 'layer9.*' matches no module in Net"
        " (module names look like: stem, layer1, layer1.0, layer1.0.conv, ...)"
    )
    assert info.value.exit_code == 2


def test_unmatched_ignore_pattern_is_an_error_too(net: Net) -> None:
    with pytest.raises(TargetMatchError, match=r"ignore: pattern 'haed' matches no module"):
        select_modules(net, ["*"], ignore=["haed"], where="ignore")


def test_unmatched_type_pattern(net: Net) -> None:
    with pytest.raises(TargetMatchError, match=r"pattern 'type:Conv1d' matches no module"):
        select_modules(net, ["type:Conv1d"])


def test_require_match_false_returns_what_matched(net: Net) -> None:
    assert names(net, ["head", "nothing*"], ignore=["nope"], require_match=False) == ["head"]


def test_invalid_regex_is_a_target_match_error(net: Net) -> None:
    with pytest.raises(TargetMatchError) as info:
        select_modules(net, ["re:layer1.(conv"], where="targets")
    msg = str(info.value)
    assert msg.startswith("targets: invalid regex 're:layer1.(conv': ")
    assert "\n" not in msg
    # also in the ignore list, checked before any matching
    with pytest.raises(TargetMatchError, match=r"invalid regex 're:\['"):
        select_modules(net, ["*"], ignore=["re:["])


def test_empty_targets_select_nothing(net: Net) -> None:
    assert select_modules(net, []) == {}


def test_model_without_children() -> None:
    with pytest.raises(
        TargetMatchError, match=r"matches no module in Linear \(module names look like: <none>\)"
    ):
        select_modules(nn.Linear(2, 2), ["*"])
