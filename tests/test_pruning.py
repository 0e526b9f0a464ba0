"""Tests of structured pruning (basetrainer.pruning): CPU only, small inputs, < 60 s in all."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torchvision
from torch import nn

from basetrainer.pruning.checkpoint import PRUNED_FILENAME
from basetrainer.pruning.counter import count_macs, count_params, profile_model
from basetrainer.pruning.nni_pruning import model_pruning
from basetrainer.pruning.slim import SlimRegularizer

TP_REASON = 'torch-pruning is not installed (pip install "basetrainer[prune]")'
INPUT = [64, 64]  # [W, H]: small, so the whole file stays fast
NUM_CLASSES = 10
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny inputs gain nothing from threads; one thread keeps timings steady on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _resnet18() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=NUM_CLASSES)


def _mobilenet_v2() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.mobilenet_v2(num_classes=NUM_CLASSES)


def _example(batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, INPUT[1], INPUT[0])


def _check_works(model: nn.Module, batch: int = 2) -> None:
    """Outputs are [N, num_classes]; a backward pass reaches every parameter."""
    model.train()
    out = model(_example(batch))
    assert out.shape == (batch, NUM_CLASSES)
    out.square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())


def _only_plain_data(value) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _only_plain_data(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_only_plain_data(v) for v in value)
    return isinstance(value, (torch.Tensor, str, int, float, bool, type(None)))


@pytest.mark.parametrize("prune_type", ["l1", "L2", "fpgm", "slim"])
def test_resnet18_each_prune_type(prune_type, tmp_path):
    pytest.importorskip("torch_pruning", reason=TP_REASON)
    model = _resnet18()
    dense = profile_model(model, _example(1))
    head, head_bias = model.fc, model.fc.bias.detach().clone()

    pruned = model_pruning(model, INPUT, sparsity=0.5, output_prune=str(tmp_path),
                           prune_type=prune_type)

    cost = profile_model(pruned, _example(1))
    assert cost.params <= 0.35 * dense.params
    assert cost.macs <= 0.40 * dense.macs
    assert pruned.layer1[0].conv1.out_channels == 32 and pruned.layer4[1].conv2.out_channels == 256
    assert pruned.fc is head and head.out_features == NUM_CLASSES  # head kept, its outputs intact
    assert torch.equal(head.bias, head_bias)
    _check_works(pruned)
    report = json.loads((tmp_path / "prune_report.json").read_text())
    assert report["params"] == {"before": dense.params, "after": cost.params,
                                "ratio": round(cost.params / dense.params, 4)}
    assert report["macs"]["after"] == cost.macs and report["settings"]["prune_type"] == prune_type.lower()
    assert (tmp_path / "prune_report.txt").read_text().startswith("Structured pruning report")


def test_mobilenet_v2_l1(tmp_path):
    pytest.importorskip("torch_pruning", reason=TP_REASON)
    model = _mobilenet_v2()
    dense = profile_model(model, _example(1))
    pruned = model_pruning(model, INPUT, sparsity=0.5, output_prune=str(tmp_path), prune_type="l1")
    cost = profile_model(pruned, _example(1))
    assert cost.params <= 0.35 * dense.params and cost.macs <= 0.40 * dense.macs
    assert pruned.classifier[1].out_features == NUM_CLASSES
    _check_works(pruned)


def test_reuse_round_trip_and_weights_only_file(tmp_path):
    pytest.importorskip("torch_pruning", reason=TP_REASON)
    pruned = model_pruning(_resnet18(), [1, 3, 64, 64], sparsity=0.5, output_prune=str(tmp_path))

    payload = torch.load(tmp_path / PRUNED_FILENAME, weights_only=True)
    assert _only_plain_data(payload)
    assert payload["shapes"]["layer1.0.conv1"]["out_channels"] == 32

    torch.manual_seed(123)  # a differently initialised dense model: every weight must come from the file
    rebuilt = model_pruning(torchvision.models.resnet18(num_classes=NUM_CLASSES), INPUT,
                            output_prune=str(tmp_path), reuse=True)
    assert rebuilt.layer1[0].conv1.out_channels == 32
    pruned.eval()
    rebuilt.eval()
    x = _example()
    with torch.no_grad():
        assert torch.equal(pruned(x), rebuilt(x))
    _check_works(rebuilt)


def test_reuse_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="reuse=False") as info:
        model_pruning(_resnet18(), INPUT, output_prune=str(tmp_path / "nothing"), reuse=True)
    assert str(tmp_path / "nothing" / PRUNED_FILENAME) in str(info.value)

    pytest.importorskip("torch_pruning", reason=TP_REASON)
    model_pruning(_resnet18(), INPUT, output_prune=str(tmp_path))
    with pytest.raises(ValueError, match="same architecture"):
        model_pruning(_mobilenet_v2(), INPUT, output_prune=str(tmp_path), reuse=True)


def test_ignored_layers_by_name_and_module(tmp_path):
    pytest.importorskip("torch_pruning", reason=TP_REASON)
    model = _resnet18()
    layer2 = model.layer2
    pruned = model_pruning(model, INPUT, output_prune=str(tmp_path),
                           ignored_layers=["layer1.0.conv1", layer2])
    assert pruned.layer1[0].conv1.out_channels == 64  # kept, by name
    assert pruned.layer1[1].conv1.out_channels == 32  # its neighbour is pruned
    convs = [m for m in layer2.modules() if isinstance(m, nn.Conv2d)]
    assert [c.out_channels for c in convs] == [128, 128, 128, 128, 128]  # kept, by container
    assert pruned.layer3[0].conv1.out_channels == 128
    _check_works(pruned)

    with pytest.raises(ValueError, match="not_a_layer"):
        model_pruning(_resnet18(), INPUT, output_prune=str(tmp_path), ignored_layers=["not_a_layer"])


def test_fully_convolutional_model_keeps_its_output_channels(tmp_path, caplog):
    """No Linear: the last convolution is the head; [N, C, H, W] input with 1 channel."""
    pytest.importorskip("torch_pruning", reason=TP_REASON)
    net = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                        nn.Conv2d(32, 4, 1))
    with caplog.at_level("WARNING", logger="basetrainer.pruning.nni_pruning"):
        pruned = model_pruning(net, [2, 1, 32, 32], sparsity=0.3, output_prune=str(tmp_path),
                               round_to=8, not_an_option=1)
    assert "not_an_option" in caplog.text
    # round_to=8: torch-pruning rounds the kept channels down to a multiple of 8
    assert [m.out_channels for m in pruned if isinstance(m, nn.Conv2d)] == [8, 16, 4]
    assert pruned(torch.randn(2, 1, 32, 32)).shape == (2, 4, 32, 32)


@pytest.mark.parametrize("sparsity", [0, 1, -0.1, 1.5])
def test_bad_sparsity(sparsity, tmp_path):
    with pytest.raises(ValueError, match=r"sparsity.*\(0, 1\)") as info:
        model_pruning(_resnet18(), INPUT, sparsity=sparsity, output_prune=str(tmp_path))
    assert repr(sparsity) in str(info.value)


def test_bad_names_and_sizes(tmp_path):
    with pytest.raises(ValueError, match=r"unknown prune_type 'l3'; choose from \['fpgm', 'l1', 'l2', 'slim'\]"):
        model_pruning(_resnet18(), INPUT, prune_type="l3", output_prune=str(tmp_path))
    with pytest.raises(ValueError, match=r"unknown backend 'onnx'; choose from .*'nni'.*'torch-pruning'"):
        model_pruning(_resnet18(), INPUT, backend="onnx", output_prune=str(tmp_path))
    with pytest.raises(ValueError, match="input_size"):
        model_pruning(_resnet18(), [3, 64, 64], output_prune=str(tmp_path))
    with pytest.raises(ValueError, match="slim"):
        model_pruning(_resnet18(), INPUT, prune_type="slim", backend="nni", output_prune=str(tmp_path))
    assert not list(tmp_path.iterdir())  # nothing written when the arguments are wrong


def test_nni_backend(tmp_path):
    if importlib.util.find_spec("nni") is None:
        with pytest.raises(ImportError, match=r'pip install "basetrainer\[nni\]"'):
            model_pruning(_resnet18(), INPUT, backend="nni", output_prune=str(tmp_path))
        return
    pytest.importorskip("torch_pruning", reason=TP_REASON)
    model = _resnet18()
    dense = profile_model(model, _example(1))
    pruned = model_pruning(model, INPUT, backend="nni", prune_type="l1", output_prune=str(tmp_path))
    cost = profile_model(pruned, _example(1))
    assert cost.params <= 0.35 * dense.params and cost.macs <= 0.40 * dense.macs
    _check_works(pruned)


def test_missing_torch_pruning_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch_pruning", None)  # makes `import torch_pruning` fail
    with pytest.raises(ImportError, match=r'pip install "basetrainer\[prune\]"'):
        model_pruning(_resnet18(), INPUT, output_prune=str(tmp_path))


def test_mask_importance_removes_the_masked_channels():
    """The NNI backend's second half: keep masks drive torch-pruning's structural step."""
    pytest.importorskip("torch_pruning", reason=TP_REASON)
    from basetrainer.pruning.nni_masks import MaskImportance
    from basetrainer.pruning.structural import prune_channels

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(8, 4))
    weight = net[0].weight.detach().clone()
    keep = torch.tensor([1.0, 0, 1, 0, 0, 1, 1, 0])
    masks = {"0": keep, "3": torch.tensor([0.0, 0, 0, 0, 1, 1, 1, 1])}
    prune_channels(net, torch.randn(1, 3, 16, 16), MaskImportance(masks, net), 0.5, [net[7]])
    assert torch.equal(net[0].weight, weight[keep.bool()])
    assert net[3].out_channels == 4 and net[7].in_features == 4


def test_slim_keeps_the_channels_with_the_largest_bn_scales(tmp_path):
    pytest.importorskip("torch_pruning", reason=TP_REASON)
    net = nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(6, 2))
    scales = torch.tensor([0.1, -2.0, 0.05, 3.0, 0.2, 1.0])
    with torch.no_grad():
        net[1].weight.copy_(scales)
    model_pruning(net, [1, 3, 8, 8], sparsity=0.5, prune_type="slim", output_prune=str(tmp_path))
    assert torch.equal(net[1].weight.detach(), torch.tensor([-2.0, 3.0, 1.0]))


@pytest.mark.distributed
def test_import_does_not_load_backends():
    code = ("import sys, basetrainer.pruning.nni_pruning, basetrainer.pruning.slim; "
            "loaded = [m for m in ('torch_pruning', 'nni') if m in sys.modules]; "
            "assert not loaded, loaded")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_counter_formulas():
    conv = nn.Conv2d(4, 8, 3, padding=1, groups=2)
    assert count_macs(conv, torch.randn(2, 4, 5, 5)) == (8 * 5 * 5) * (4 // 2) * 9  # per sample
    linear = nn.Linear(6, 3)
    assert count_macs(linear, torch.randn(4, 6)) == 18
    assert count_params(nn.Sequential(conv, conv)) == 8 * 2 * 9 + 8  # shared weights count once


def test_slim_regularizer_adds_l1_subgradient():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.LazyLinear(2))
    x = torch.randn(2, 3, 6, 6)
    model(x)  # materialise the lazy layer
    with torch.no_grad():
        model[1].weight.copy_(torch.tensor([0.5, -0.2, 0.0, 1.5]))

    def bn_grad() -> torch.Tensor:
        model.zero_grad()
        model(x).sum().backward()
        return model[1].weight.grad.clone()

    plain = bn_grad()
    plain_conv = model[0].weight.grad.clone()
    penalty = 1e-2
    callback = SlimRegularizer(penalty=penalty)
    callback.set_trainer(SimpleNamespace(model=nn.DataParallel(model)))  # wrapped: unwrapped inside
    callback.on_train_begin({})
    callback.on_batch_begin(0, {})
    expected = plain + penalty * torch.sign(model[1].weight.detach())
    assert torch.allclose(bn_grad(), expected)
    assert bn_grad()[2] == plain[2]  # sign(0) == 0
    assert torch.equal(model[0].weight.grad, plain_conv)  # only BatchNorm weights are touched
    callback.on_train_end({})
    assert torch.allclose(bn_grad(), plain)
    with pytest.raises(ValueError, match="penalty"):
        SlimRegularizer(penalty=-1)
