"""Builders by name: models (build_models.get_models), optimizers (get_optimizer) and losses
(get_criterion)."""
import logging
import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from basetrainer.criterion.criterion import FocalLoss, get_criterion
from basetrainer.models import build_models
from basetrainer.optimizer.build_optimizer import get_optimizer


@pytest.fixture(autouse=True)
def _propagate(monkeypatch):
    """log.set_logger (called by other tests) stops propagation; caplog listens at the root."""
    monkeypatch.setattr(logging.getLogger("basetrainer"), "propagate", True)


@pytest.fixture
def empty_hub(tmp_path, monkeypatch):
    """An empty torch hub cache: pretrained weights can't be had (and are never downloaded)."""
    hub = tmp_path / "hub"
    monkeypatch.setattr(torch.hub, "_hub_dir", str(hub))
    return hub


def first_conv(model: nn.Module) -> nn.Conv2d:
    return next(m for m in model.modules() if isinstance(m, nn.Conv2d))


# ------------------------------------------------------------------------------ models
@pytest.mark.slow
@pytest.mark.parametrize("net_type", ["resnet18", "mobilenet_v2", "mobilenet_v3_small", "efficientnet_b0"])
def test_get_models_small_input_shape_and_stem(net_type):
    torch.manual_seed(0)
    model = build_models.get_models(net_type, [32, 32], num_classes=10)
    model.eval()
    with torch.no_grad():
        out = model(torch.randn(2, 3, 32, 32))
    assert tuple(out.shape) == (2, 10)
    assert first_conv(model).stride == (1, 1)          # small input: stem stride 1
    heads = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert heads[-1].out_features == 10


def test_get_models_224_keeps_stem_stride_and_is_case_insensitive():
    model = build_models.get_models("ResNet18", [224, 224], num_classes=3)
    assert first_conv(model).stride == (2, 2)
    assert model.fc.out_features == 3 and model.fc.in_features == 512
    assert first_conv(build_models.get_models("mobilenet_v2", (65, 65), 3)).stride == (2, 2)
    assert first_conv(build_models.get_models("mobilenet_v2", (64, 200), 3)).stride == (1, 1)


def test_get_models_kwargs_are_passed_to_torchvision():
    model = build_models.get_models("mobilenet_v2", [32, 32], 5, width_mult=0.5)
    assert first_conv(model).out_channels == 16  # 32 * 0.5


def test_unknown_net_type_lists_valid_names():
    with pytest.raises(ValueError) as info:
        build_models.get_models("resnet19", [32, 32], 10)
    msg = str(info.value)
    assert "unknown net_type 'resnet19'" in msg
    for name in ("resnet18", "resnet34", "resnet50", "resnet101", "mobilenet_v2", "efficientnet_b0"):
        assert f"'{name}'" in msg


def test_pretrained_offline_warns_once_and_trains_from_scratch(empty_hub, caplog):
    with caplog.at_level(logging.WARNING, logger="basetrainer"):
        model = build_models.get_models("resnet18", [32, 32], 10, pretrained=True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    expected_file = os.path.basename(build_models.hub_weights_file("resnet18"))
    assert expected_file.startswith("resnet18-") and expected_file.endswith(".pth")
    assert expected_file in warnings[0]
    assert str(empty_hub / "checkpoints") in warnings[0]
    assert not (empty_hub / "checkpoints" / expected_file).exists()  # nothing downloaded
    model.eval()
    with torch.no_grad():
        assert tuple(model(torch.randn(2, 3, 32, 32)).shape) == (2, 10)


def test_pretrained_true_loads_the_cached_file(empty_hub):
    import torchvision
    torch.manual_seed(1)
    reference = torchvision.models.resnet18()          # 1000 classes, as torchvision's weights
    path = build_models.hub_weights_file("resnet18")
    assert path.startswith(str(empty_hub))
    os.makedirs(os.path.dirname(path))
    torch.save(reference.state_dict(), path)
    model = build_models.get_models("resnet18", [32, 32], 10, pretrained=True)
    ref = reference.state_dict()
    own = model.state_dict()
    for key in own:
        if key.startswith("fc."):
            continue
        assert torch.equal(own[key], ref[key]), key
    assert own["fc.weight"].shape == (10, 512)


def test_pretrained_path_loads_that_file(tmp_path):
    torch.manual_seed(2)
    source = build_models.get_models("resnet18", [32, 32], 10)
    path = str(tmp_path / "weights.pth")
    torch.save(source.state_dict(), path)
    torch.manual_seed(3)
    model = build_models.get_models("resnet18", [32, 32], 10, pretrained=path)
    src = source.state_dict()
    assert all(torch.equal(v, src[k]) for k, v in model.state_dict().items())


def test_pretrained_path_with_other_head_skips_only_the_head(tmp_path, caplog):
    import torchvision
    torch.manual_seed(4)
    source = torchvision.models.resnet18()                 # 1000-class head
    path = str(tmp_path / "imagenet.pth")
    torch.save({"state_dict": {"module." + k: v for k, v in source.state_dict().items()}}, path)
    with caplog.at_level(logging.WARNING, logger="basetrainer"):
        model = build_models.get_models("resnet18", [32, 32], 10, pretrained=path)
    assert torch.equal(model.conv1.weight, source.conv1.weight)
    assert torch.equal(model.layer4[1].bn2.running_var, source.layer4[1].bn2.running_var)
    assert model.fc.weight.shape == (10, 512)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "fc.weight" in text and "(1000, 512)" in text and "(10, 512)" in text


# ------------------------------------------------------------------------------ optimizers
class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(self.bn(self.conv(x)).mean(dim=(2, 3)))


@pytest.mark.parametrize("name,cls", [("SGD", torch.optim.SGD), ("sgd", torch.optim.SGD),
                                      ("Adam", torch.optim.Adam), ("ADAM", torch.optim.Adam),
                                      ("AdamW", torch.optim.AdamW), (" adamw ", torch.optim.AdamW),
                                      ("RMSprop", torch.optim.RMSprop), ("rmsprop", torch.optim.RMSprop)])
def test_get_optimizer_by_name(name, cls):
    model = BNNet()
    opt = get_optimizer(model, optim_type=name, lr=0.01, momentum=0.8, weight_decay=1e-4)
    assert type(opt) is cls
    group = opt.param_groups[0]
    assert (group["lr"], group["weight_decay"]) == (0.01, 1e-4)
    if cls in (torch.optim.SGD, torch.optim.RMSprop):
        assert group["momentum"] == 0.8
    assert len(opt.param_groups) == 1 and len(group["params"]) == 5


def test_get_optimizer_positional_like_the_seed_and_kwargs():
    model = BNNet()
    opt = get_optimizer(model, "SGD", 0.05, 0.9, 5e-4, nesterov=True)
    g = opt.param_groups[0]
    assert (g["lr"], g["momentum"], g["weight_decay"], g["nesterov"]) == (0.05, 0.9, 5e-4, True)


def test_frozen_parameters_are_left_out():
    model = BNNet()
    model.conv.weight.requires_grad_(False)
    opt = get_optimizer(model, "SGD", lr=0.1)
    ids = {id(p) for p in opt.param_groups[0]["params"]}
    assert id(model.conv.weight) not in ids and len(ids) == 4
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        get_optimizer(model, "SGD", lr=0.1)


def test_no_decay_norm_bias_groups():
    model = BNNet()
    opt = get_optimizer(model, "SGD", lr=0.1, momentum=0.9, weight_decay=1e-3, no_decay_norm_bias=True)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 1e-3 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(model.conv.weight), id(model.fc.weight)}
    assert {id(p) for p in no_decay["params"]} == {id(model.bn.weight), id(model.bn.bias), id(model.fc.bias)}


@pytest.mark.parametrize("bad", ["Adagrad", "", None])
def test_unknown_optimizer_lists_names(bad):
    with pytest.raises(ValueError) as info:
        get_optimizer(BNNet(), optim_type=bad, lr=0.1)
    msg = str(info.value)
    assert f"unknown optim_type {bad!r}" in msg
    assert "['Adam', 'AdamW', 'RMSprop', 'SGD']" in msg


@pytest.mark.parametrize("lr", [float("nan"), float("inf"), -1, -0.1, "0.1", True])
def test_optimizer_lr_must_be_finite_and_not_negative(lr):
    with pytest.raises(ValueError) as info:
        get_optimizer(BNNet(), "SGD", lr=lr)
    assert f"lr={lr!r} must be a finite number >= 0" in str(info.value)


def test_optimizer_lr_0_is_allowed():
    # torch accepts it: evaluation-only runs, BatchNorm recalibration
    assert get_optimizer(BNNet(), "SGD", lr=0).param_groups[0]["lr"] == 0


def test_optimizer_bad_numbers():
    with pytest.raises(ValueError, match=r"weight_decay=-1 must be >= 0"):
        get_optimizer(BNNet(), "SGD", lr=0.1, weight_decay=-1)


# ------------------------------------------------------------------------------ criteria
LOGITS = torch.tensor([[2.0, 0.0, 0.0], [0.5, 1.5, -1.0], [0.0, 0.0, 3.0]])
TARGETS = torch.tensor([0, 0, 2])


@pytest.mark.parametrize("name", ["CrossEntropyLoss", "CELoss", "celoss", "crossentropyloss"])
def test_cross_entropy_names(name):
    crit = get_criterion(name, 3, device="cpu")
    assert type(crit) is nn.CrossEntropyLoss
    assert torch.allclose(crit(LOGITS, TARGETS), F.cross_entropy(LOGITS, TARGETS))


def test_label_smoothing_equals_torch_ce_with_smoothing():
    crit = get_criterion("LabelSmoothing", 3, device=torch.device("cpu"))
    expected = F.cross_entropy(LOGITS, TARGETS, label_smoothing=0.1)
    assert torch.allclose(crit(LOGITS, TARGETS), expected)
    assert not torch.allclose(expected, F.cross_entropy(LOGITS, TARGETS))
    crit2 = get_criterion("labelsmoothing", 3, smoothing=0.2)
    assert torch.allclose(crit2(LOGITS, TARGETS), F.cross_entropy(LOGITS, TARGETS, label_smoothing=0.2))


def test_focal_loss_gamma_zero_is_cross_entropy():
    crit = get_criterion("FocalLoss", 3, gamma=0.0)
    assert isinstance(crit, FocalLoss)
    assert torch.allclose(crit(LOGITS, TARGETS), F.cross_entropy(LOGITS, TARGETS), atol=1e-6)


def _hand_focal(logits, targets, gamma, alpha=None):
    total = 0.0
    for row, t in zip(logits.tolist(), targets.tolist()):
        p = math.exp(row[t]) / sum(math.exp(v) for v in row)
        w = 1.0 if alpha is None else alpha[t]
        total += -w * (1 - p) ** gamma * math.log(p)
    return total / len(targets)


def test_focal_loss_gamma_two_hand_computed():
    crit = get_criterion("focalloss", 3, device="cpu")  # gamma defaults to 2
    # first sample alone: p = e^2 / (e^2 + 2) = 0.786986; (1 - p)^2 * -ln p = 0.045375 * 0.239545
    single = crit(LOGITS[:1], TARGETS[:1])
    assert single.item() == pytest.approx(0.0108693, abs=1e-6)
    assert crit(LOGITS, TARGETS).item() == pytest.approx(_hand_focal(LOGITS, TARGETS, 2.0), rel=1e-5)
    weighted = get_criterion("FocalLoss", 3, alpha=[0.25, 1.0, 2.0])
    assert weighted(LOGITS, TARGETS).item() == pytest.approx(
        _hand_focal(LOGITS, TARGETS, 2.0, [0.25, 1.0, 2.0]), rel=1e-5)
    assert crit(LOGITS, TARGETS).item() < F.cross_entropy(LOGITS, TARGETS).item()


def test_focal_loss_bad_arguments():
    with pytest.raises(ValueError, match="alpha has 2 values but num_classes=3"):
        get_criterion("FocalLoss", 3, alpha=[1.0, 2.0])
    with pytest.raises(ValueError, match="gamma=-1"):
        get_criterion("FocalLoss", 3, gamma=-1)


@pytest.mark.parametrize("bad", ["DiceLoss", "", 3])
def test_unknown_loss_lists_names(bad):
    with pytest.raises(ValueError) as info:
        get_criterion(bad, 3)
    msg = str(info.value)
    assert f"unknown loss_type {bad!r}" in msg
    for name in ("CELoss", "CrossEntropyLoss", "FocalLoss", "LabelSmoothing"):
        assert f"'{name}'" in msg


@pytest.mark.parametrize("device,pin,expected", [("cpu", None, False), ("cpu", True, False),
                                                 ("cuda", None, True), ("cuda", False, False)])
def test_build_dataloader_pins_memory_by_default_on_cuda_only(device, pin, expected):
    from conftest import ToyTrainer, blobs, toy_cfg
    t = ToyTrainer(toy_cfg())
    t.device = torch.device(device)   # only the loader is built: no CUDA call is made
    loader = t.build_dataloader(blobs(8, 2), 4, phase="test", pin_memory=pin)
    assert loader.pin_memory is expected
