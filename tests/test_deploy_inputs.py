"""What an export feeds the model: one image input, its channels read from the layer the image
first reaches (or given), its size; and the numeric options checked before any file is written."""
import pytest
import torch
from torch import nn

from basetrainer.deploy.__main__ import main as cli
from basetrainer.deploy.export import export_model

SIZE = 16


class LinearFirst(nn.Module):
    """A grayscale model whose head (an nn.Linear) is registered before its first convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 3)
        self.conv = nn.Conv2d(1, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).mean((2, 3)))


class StemAfterBlocks(nn.Module):
    """Its first registered convolution (inside a ModuleList) takes 8 channels; the image (1
    channel) reaches ``stem`` first."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Conv2d(8, 8, 3, padding=1) for _ in range(2)])
        self.stem = nn.Sequential(nn.Identity(), nn.Conv2d(1, 8, 3, padding=1))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x * 2.0)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean((2, 3)))


class ConvInAList(nn.Module):
    """Its head is registered first; the layer that takes the image sits inside a ModuleList."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 2)
        self.layers = nn.ModuleList([nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU()),
                                     nn.Conv2d(8, 8, 3, padding=1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean((2, 3)))


class RepeatsToRgb(nn.Module):
    """A grayscale model on an RGB backbone: the image (1 channel) is repeated to 3 channels
    before the first convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x.repeat(1, 3, 1, 1)).mean((2, 3)))


class Flat(nn.Module):
    """No convolution: an MLP on the flattened 1x16x16 image."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(SIZE * SIZE, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1))


def _onnx(tmp_path, model, **kw):
    settings = dict(out_dir=str(tmp_path / "out"), input_size=[SIZE, SIZE], runs=0, name="m", report_files=False)
    return export_model(model, "onnx", **{**settings, **kw})


@pytest.mark.slow
@pytest.mark.parametrize("make", [LinearFirst, StemAfterBlocks, ConvInAList])
def test_channels_come_from_the_layer_the_image_reaches_first(tmp_path, make):
    from basetrainer.deploy.inputs import first_layer

    torch.manual_seed(0)
    model = make().eval()
    assert first_layer(model, [SIZE, SIZE])[1].in_channels == 1
    report = _onnx(tmp_path, model)
    assert report.input_shape == [1, 1, SIZE, SIZE]
    assert report.rows[1].status == "ok" and report.rows[1].parity["max_abs"] <= 1e-4


@pytest.mark.slow
def test_channels_are_those_that_give_the_first_layer_what_it_takes(tmp_path):
    """The first convolution takes 3 channels, made from a 1-channel image: the image has 1
    (with 3 the convolution would get 9); given 1 it is taken, given 3 it is an error."""
    assert _onnx(tmp_path, RepeatsToRgb()).input_shape == [1, 1, SIZE, SIZE]
    assert _onnx(tmp_path, RepeatsToRgb(), channels=1).rows[1].status == "ok"
    with pytest.raises(ValueError, match=r"channels=3, but the layer the image reaches first \(conv, Conv2d\) takes "
                                         r"3 channel\(s\) and gets 9 from an image of 3; pass channels=1 "
                                         r"\(--channels 1\)"):
        _onnx(tmp_path, RepeatsToRgb(), channels=3)


def test_given_channels_that_the_model_does_not_take_are_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"channels=3, but the layer the image reaches first \(conv, Conv2d\) takes "
                                         r"1 channel\(s\) and gets 3 from an image of 3; pass channels=1 "
                                         r"\(--channels 1\)"):
        _onnx(tmp_path, LinearFirst(), channels=3)
    with pytest.raises(ValueError, match=r"channels=0 must be a positive integer \(--channels 1 for grayscale"):
        _onnx(tmp_path, LinearFirst(), channels=0)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_model_without_convolution_takes_the_channels_given(tmp_path):
    with pytest.raises(ValueError, match=r"inputs of 16x16 \(W x H\) with 3 channel\(s\).*3 channels are a guess \(no "
                                         r"convolution takes the image\): pass channels=C \(--channels C\)"):
        _onnx(tmp_path, Flat())
    assert _onnx(tmp_path, Flat(), channels=1).input_shape == [1, 1, SIZE, SIZE]


def test_a_model_with_two_inputs_is_refused_saying_export_takes_one(tmp_path):
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x, y):
            return self.conv(x).mean((2, 3)) + y

    with pytest.raises(ValueError, match=r"export takes one image input, and Pair.forward\(x, y\) needs 2 \(x, y\): "
                                         r"wrap the model in a module whose forward\(x\) takes the image alone"):
        _onnx(tmp_path, Pair())

    class Masked(Pair):
        def forward(self, x, *, mask, **options):
            return self.conv(x * mask).mean((2, 3))

    with pytest.raises(ValueError, match=r"Masked.forward\(x, \*, mask, \*\*options\) needs 2 \(x, mask\)"):
        _onnx(tmp_path, Masked())
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_second_input_with_a_default_is_fine(tmp_path):
    class Optional(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x, scale=None):
            return self.conv(x).mean((2, 3)) * (1.0 if scale is None else scale)

    assert _onnx(tmp_path, Optional()).rows[1].status == "ok"


@pytest.mark.parametrize("key, value", [("batch", 0), ("batch", -3), ("runs", -1), ("warmup", -1),
                                        ("check_limit", 0), ("threads", 0), ("calibration_images", 0)])
def test_numeric_options_out_of_range_are_refused_before_anything(tmp_path, key, value):
    with pytest.raises(ValueError, match=rf"^{key}={value} must be a"):
        _onnx(tmp_path, nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten()), **{key: value})
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, message", [
    (["--batch", "0"], "error: batch=0 must be a positive integer (--batch N, e.g. --batch 37)"),
    (["--batch", "-3"], "error: batch=-3 must be a positive integer (--batch N, e.g. --batch 37)"),
    (["--channels", "1"], "error: channels=1, but the layer the image reaches first (conv1, Conv2d) takes 3 "
                          "channel(s) and gets 1 from an image of 1; pass channels=3 (--channels 3)"),
])
def test_command_line_bad_numbers_exit_2(tmp_path, capsys, args, message):
    from basetrainer.models.build_models import get_models

    weights = str(tmp_path / "w.pth")
    torch.save(get_models("resnet18", [SIZE, SIZE], 4).state_dict(), weights)
    out = tmp_path / "out"
    code = cli([weights, "--net-type", "resnet18", "--input-size", str(SIZE), str(SIZE), "--out-dir", str(out),
                "--runs", "0"] + args)
    assert (code, capsys.readouterr().err.strip().splitlines()[-1]) == (2, message)
    assert not out.exists()


def test_an_out_dir_that_is_a_file_is_refused_before_anything(tmp_path, capsys):
    """--out-dir of a regular file said 'error: [Errno 17] File exists: ...', naming neither the
    flag nor the fix, after the model was loaded (hostile pass)."""
    from basetrainer.models.build_models import get_models
    from basetrainer.runtime.errors import FolderError

    weights = str(tmp_path / "w.pth")
    torch.save(get_models("resnet18", [SIZE, SIZE], 4).state_dict(), weights)
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    for out in (str(a_file), str(a_file / "sub")):
        code = cli([weights, "--net-type", "resnet18", "--input-size", str(SIZE), str(SIZE), "--out-dir", out,
                    "--runs", "0"])
        said = "is a file, not a folder" if out == str(a_file) else f"cannot be made: {a_file} is a file, not a folder"
        assert (code, capsys.readouterr().err.strip().splitlines()[-1]) == (
            2, f"error: out_dir={out!r} {said}; give out_dir a folder path")
        with pytest.raises(FolderError, match=f"^out_dir={out!r} {said}"):   # a Python caller: the same error
            export_model(str(tmp_path / "never-read.pth"), "onnx", out_dir=out)
    assert a_file.read_text() == "not a folder"


def test_a_scripted_model_takes_the_channels_of_its_first_convolution():
    """torch.jit.script modules take no hooks: the first convolution registered is the guess (as
    before), and a given value is taken (the forward pass checks it)."""
    from basetrainer.deploy.inputs import channels_of

    scripted = torch.jit.script(StemAfterBlocks().eval())
    assert channels_of(scripted, [SIZE, SIZE]) == (8, True)
    assert channels_of(scripted, [SIZE, SIZE], 1) == (1, False)
