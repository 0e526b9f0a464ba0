"""A hostile pass over issue 31's fixes, crossed with the other features: each test is a defect
found there, seen failing before its fix (the commit that fixes it says how)."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from basetrainer.callbacks import losses_recorder, model_checkpoint
from basetrainer.callbacks.model_ema import ModelEMA
from basetrainer.engine import trainer
from basetrainer.metric import accuracy_recorder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- toys of this file
class GreyNet(nn.Module):
    """1-channel 8x8 images -> 3 class scores, through two Conv+BatchNorm layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv(x)))
        return self.head(torch.relu(self.bn2(self.conv2(x))).mean((2, 3)))


def grey_data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    x[:, 0, :2, :2] += y.view(-1, 1, 1).float()
    return TensorDataset(x, y)


class GreyTrainer(trainer.EngineTrainer):
    """GreyNet on grey_data, SGD, loss and accuracy recorders, ModelCheckpoint on the test loss,
    ModelEMA(decay) when ``cfg.ema_decay`` is set."""

    def __init__(self, cfg: dict) -> None:
        super().__init__(cfg)
        self.build(cfg)

    def build_train_loader(self, cfg, **kwargs):
        return self.build_dataloader(grey_data(40, 0), cfg.batch_size, 0, phase="train")

    def build_test_loader(self, cfg, **kwargs):
        return self.build_dataloader(grey_data(17, 1), cfg.batch_size, 0, phase="test", shuffle=False)

    def build_model(self, cfg, **kwargs):
        torch.manual_seed(cfg.seed)
        return self.build_model_parallel(GreyNet(), cfg.gpu_id, distributed=cfg.distributed)

    def build_criterion(self, cfg, **kwargs):
        return nn.CrossEntropyLoss()

    def build_optimizer(self, cfg, **kwargs):
        return torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)

    def build_callbacks(self, cfg, **kwargs):
        callbacks = [losses_recorder.LossesRecorder(indicator="loss"),
                     accuracy_recorder.AccuracyRecorder(indicator="Accuracy")]
        if cfg.get("ema_decay"):
            callbacks.append(ModelEMA(decay=cfg.ema_decay))
        return callbacks + [model_checkpoint.ModelCheckpoint(model_dir=os.path.join(cfg.work_dir, "model"),
                                                             indicator="loss", start_save=None, async_save=False)]


def grey_cfg(work_dir: str, **extra) -> dict:
    return {**dict(work_dir=work_dir, gpu_id=[], batch_size=8, num_epochs=3, progress=False, log_freq=1,
                   num_workers=0, seed=2020), **extra}


def run_ranks(tmp_path, world: int, body: str, timeout: int = 240) -> list:
    """Run ``body`` (the inside of ``def main(rank)``, with ``GreyTrainer``, ``grey_cfg`` and
    ``grey_data`` of this file at hand) on ``world`` gloo processes on 127.0.0.1; return what each
    rank's ``main`` returned (JSON)."""
    script = tmp_path / "ranks.py"
    head = textwrap.dedent(f"""\
        import json, os, sys
        import numpy as np
        import torch
        sys.path.insert(0, {os.path.join(ROOT, "tests")!r})
        from test_hostile_31 import GreyTrainer, grey_cfg, grey_data
        from basetrainer.engine.launch import launch
        OUT = {str(tmp_path)!r}
    """)
    tail = textwrap.dedent(f"""
        def worker():
            import torch.distributed as dist
            rank = dist.get_rank()
            result = main(rank)
            with open(os.path.join(OUT, f"rank{{rank}}.json"), "w") as f:
                json.dump(result, f)

        if __name__ == "__main__":
            launch(worker, num_gpus_per_machine={world}, dist_url="auto", distributed=True, args=())
    """)
    script.write_text(head + "\n\ndef main(rank):\n" + textwrap.indent(textwrap.dedent(body), "    ") + tail)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


# ----------------------------------------------------------------------------- evaluate(checkpoint=) + ModelEMA
def test_evaluate_a_checkpoint_after_training_with_model_ema_evaluates_that_file(tmp_path):
    """evaluate(checkpoint=f) on a trainer whose ModelEMA holds an average (after run()) gave the
    in-memory average's figures whatever f was (the best file, named 1.1093, evaluated to 1.1566,
    the same as last.pth): ModelEMA swapped its average in over the weights just loaded."""
    work = str(tmp_path / "run")
    ema = GreyTrainer(grey_cfg(work, ema_decay=0.5))
    ema.run()
    files = sorted(f for f in os.listdir(os.path.join(work, "model")) if f.startswith("model_"))
    assert len(files) == 3
    fresh = GreyTrainer(grey_cfg(str(tmp_path / "fresh")))   # no ModelEMA: evaluates what it loads
    for name in files + ["last.pth"]:
        path = os.path.join(work, "model", name)
        assert ema.evaluate(checkpoint=path) == fresh.evaluate(checkpoint=path), name
    # the per-epoch files hold the average that gave their figure (ModelEMA evaluate=True)
    first = os.path.join(work, "model", files[0])
    assert abs(ema.evaluate(checkpoint=first)["test/loss"] - float(files[0].split("_")[-1][:-4])) < 1e-4
    # without checkpoint=, the test phase runs on the average, as in training
    assert ema.evaluate()["test/loss"] == pytest.approx(ema.history.last["test/loss"], abs=1e-7)


# ----------------------------------------------------------------------------- parity: one output, several units
class BoxAndProbability(nn.Module):
    """A detection-style head ``[N, 5]``: four box coordinates in pixels (0 to 300) and one
    probability, in one output."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 64, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(torch.relu(self.conv(x)).flatten(1))
        return torch.cat([torch.sigmoid(y[:, :4]) * 300, torch.sigmoid(y[:, 4:])], dim=1)


def test_int8_judges_every_column_of_an_output_by_its_own_scale(tmp_path):
    """int8 quantizes a tensor with one step: the probability beside pixel coordinates came out
    0.42 off (ten times its spread, 0.044; its values 0.36 to 0.56), which was 0.029 of the
    output's scale (62), and the export was published."""
    pytest.importorskip("onnxruntime")
    from basetrainer.deploy.export import export_model

    torch.manual_seed(0)
    model = BoxAndProbability().eval()
    x = np.random.default_rng(0).standard_normal((40, 1, 8, 8)).astype(np.float32)
    calibration = np.random.default_rng(1).standard_normal((40, 1, 8, 8)).astype(np.float32)
    report = export_model(model, "onnx,onnx-fp16,onnx-int8", out_dir=str(tmp_path), input_size=[8, 8], check=x,
                          calibration=calibration, runs=0, batch=5, strict=False)
    rows = {row.format: row for row in report.rows}
    assert (rows["onnx"].status, rows["onnx-fp16"].status) == ("ok", "ok")
    int8 = rows["onnx-int8"]
    assert int8.status == "FAIL" and len(int8.problems) == 1
    assert int8.problems[0].startswith("max |Δ| 0.4") and " at [:, 4] > 0.25 x its scale " in int8.problems[0]
    assert int8.parity["rel"] > 0.25 and int8.parity["outputs"][0]["part"] == "[:, 4]"
    assert sorted(os.listdir(tmp_path)) == ["model.export.json", "model.export.md", "model.onnx", "model_fp16.onnx"]


def test_slices_are_judged_along_axis_1_and_the_last_axis():
    """The rule on planted differences: a channel of a map [N, C, H, W] and a feature of a
    [N, anchors, 5] output (features last) are judged by their own scale under int8; fp32/fp16
    keep the output's; slices of fewer than 8 values (a batch of 1) tell no spread; a slice of
    zeros must stay zeros."""
    from basetrainer.deploy.parity import BOUNDS, compare, failures

    rng = np.random.default_rng(0)
    int8 = BOUNDS["int8"]
    maps = rng.standard_normal((6, 3, 4, 4)) * np.array([100.0, 1.0, 0.0])[None, :, None, None]
    near = maps + rng.standard_normal(maps.shape) * np.array([2.0, 0.02, 0.0])[None, :, None, None]   # 2 % of each
    assert failures(compare([maps], [near], part_floor=int8.part_floor), int8) == []
    off = near.copy()
    off[:, 1] += 1.0   # one unit: 1 % of the output's scale, the whole spread of channel 1
    assert failures(compare([maps], [off]), int8) == []   # the output's scale alone: within
    found = failures(compare([maps], [off], part_floor=int8.part_floor), int8)
    assert len(found) == 1 and " at [:, 1] > 0.25 x its scale " in found[0]
    dead = near.copy()   # channel 2 is all zeros: its scale is the floor, 1 % of the output's (0.58)
    dead[0, 2, 0, 0] = 1e-3
    assert failures(compare([maps], [dead], part_floor=int8.part_floor), int8) == []
    dead[0, 2, 0, 0] = 0.5
    found = failures(compare([maps], [dead], part_floor=int8.part_floor), int8)
    assert len(found) == 1 and "at [:, 2] > 0.25 x its scale 0.5" in found[0]
    anchors = np.concatenate([rng.uniform(0, 300, (4, 50, 4)), rng.uniform(0.3, 0.6, (4, 50, 1))], axis=2)
    moved = anchors.copy()
    moved[..., 4] += 0.3
    found = failures(compare([anchors], [moved], part_floor=int8.part_floor), int8)
    assert len(found) == 1 and " at [..., 4] > " in found[0]
    assert failures(compare([anchors], [moved]), BOUNDS["fp16"]) == []    # fp16 keeps the output's scale
    one = anchors[:1, 0]                                                   # [1, 5]: one value per column
    assert failures(compare([one], [one + 1e-3], part_floor=int8.part_floor), int8) == []


# ----------------------------------------------------------------------------- Grad-CAM of a DDP model
@pytest.mark.distributed
@pytest.mark.slow
def test_torchcam_on_a_ddp_model_on_the_main_process_alone(tmp_path):
    """TorchCAM(trainer.model) of a DDP run, explained on rank 0 alone (the process that draws):
    DDP's forward broadcasts buffers to the other ranks, so the job died (gloo: 'Received data
    size doesn't match expected size', SIGABRT on rank 1). The maps are of the module inside,
    the target layer named as in the wrapped model or the module; training goes on after."""
    pytest.importorskip("torchcam")
    results = run_ranks(tmp_path, 2, """
        from basetrainer.runtime.modules import unwrap_model
        from basetrainer.utils.torchcam_utils import TorchCAM, cam_grid
        t = GreyTrainer(grey_cfg(os.path.join(OUT, "run"), num_epochs=1, distributed=True, gpu_id=[0, 1]))
        t.run()
        out = {}
        if rank == 0:
            x = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(0))
            before = {k: v.clone() for k, v in t.model.state_dict().items()}
            maps = {}
            for name, model, layer in (("ddp", t.model, "module.conv2"), ("ddp, bare name", t.model, "conv2"),
                                       ("module", unwrap_model(t.model), "conv2")):
                with TorchCAM(model, target_layer=layer, input_shape=(1, 8, 8)) as cam:
                    maps[name] = cam.explain(x)[0]
            out["same_maps"] = all(np.array_equal(a, b) for m in maps.values() for a, b in zip(m, maps["module"]))
            out["unchanged"] = all(torch.equal(v, t.model.state_dict()[k]) for k, v in before.items())
            out["grid"] = os.path.getsize(cam_grid(t.model, x, [0, 1, 2], os.path.join(OUT, "grid.png"))) > 0
        t.num_epochs = 2
        t.run()
        out["epochs"] = len(t.history)
        return out
    """)
    assert results[0] == {"same_maps": True, "unchanged": True, "grid": True, "epochs": 1}
    assert results[1] == {"epochs": 1}


@pytest.mark.distributed
def test_torchcam_refuses_a_sharded_model(tmp_path):
    """Under fsdp every forward gathers from all processes: Grad-CAM on one of them would hang
    the job. It is one clear error (before: torchcam ran the forward)."""
    pytest.importorskip("torchcam")
    results = run_ranks(tmp_path, 1, """
        from basetrainer.utils.torchcam_utils import TorchCAM
        t = GreyTrainer(grey_cfg(os.path.join(OUT, "run"), strategy="fsdp", distributed=True, gpu_id=[0]))
        try:
            TorchCAM(t.model, target_layer="conv2", input_shape=(1, 8, 8))
        except ValueError as e:
            return str(e)
        return "no error"
    """)
    assert "is sharded (fully_shard)" in results[0] and "Map it unsharded" in results[0]


# ----------------------------------------------------------------------------- export: what it is given
class Reduced(nn.Module):
    """A forward whose output has no batch axis (``how``: "scalar" or "over the batch")."""

    def __init__(self, how: str, channels: int = 1) -> None:
        super().__init__()
        self.how = how
        self.conv = nn.Conv2d(channels, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x).mean((2, 3))
        return {"scalar": y.sum(), "over the batch": y.sum(0), "batch first": y}[self.how]


def test_export_refuses_what_it_cannot_check_with_one_clear_error(tmp_path):
    """Bad input, one error naming it before any file: an output without the batch first (a 0-d
    output failed with numpy's 'zero-dimensional arrays cannot be concatenated'; one summed over
    the batch with 'output has shape (3,) in the export and (48,) in the model' in every row), a
    check folder for a model of 2 or 4 channels (torchvision's 'The size of tensor a (3) must
    match the size of tensor b (2)', a convolution's 'expected input ... to have 4 channels'),
    and weights='ema' for a module (ignored: the live weights were exported)."""
    pytest.importorskip("onnxruntime")
    from basetrainer.deploy.export import export_model

    folder = tmp_path / "check"
    from PIL import Image
    for c in ("a", "b"):
        (folder / c).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(np.full((8, 8, 3), 40 * i, np.uint8)).save(folder / c / f"{i}.png")
    out = str(tmp_path / "out")
    cases = [(dict(source=Reduced("scalar")), "output 0 of Reduced has shape () for a batch of 16"),
             (dict(source=Reduced("over the batch")), "output 0 of Reduced has shape (3,) for a batch of 16"),
             (dict(source=Reduced("batch first", 2), check=str(folder)), "takes 2 channels"),
             (dict(source=Reduced("batch first", 4), check=str(folder)), "takes 4 channels"),
             (dict(source=Reduced("batch first"), weights="ema"), "weights='ema'")]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            export_model(formats="onnx", out_dir=out, input_size=[8, 8], runs=0, **kwargs)
        assert not os.path.exists(out), kwargs
    report = export_model(Reduced("batch first", 2), "onnx", out_dir=out, input_size=[8, 8], runs=0,
                          check=np.zeros((4, 2, 8, 8), np.float32))   # an array of the model's channels: fine
    assert [row.status for row in report.rows] == ["ok", "ok"]


# ----------------------------------------------------------------------------- fsdp: activation checkpointing x BatchNorm
class Block(nn.Module):
    """Conv + BatchNorm + ReLU: a repeated block, so fsdp shards (and checkpoints) each."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


class BlockNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 4, 3, padding=1)
        self.blocks = nn.Sequential(Block(4), Block(4))
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class BlockTrainer(GreyTrainer):
    def build_model(self, cfg, **kwargs):
        torch.manual_seed(cfg.seed)
        return self.build_model_parallel(BlockNet(), cfg.gpu_id, distributed=cfg.distributed)


@pytest.mark.distributed
@pytest.mark.slow
def test_activation_checkpointing_moves_batchnorm_statistics_once_per_step(tmp_path):
    """fsdp's activation_checkpointing recomputes each block's forward in the backward, in train
    mode: BatchNorm updated its running statistics twice per step (num_batches_tracked 10 for
    5 steps; resnet18's running means 1.13 away from the run without it, its test loss 2.5e9
    against 1.6e9). Now the recomputation leaves them as the forward left them."""
    results = run_ranks(tmp_path, 2, """
        from test_hostile_31 import BlockTrainer
        out = {}
        for checkpointing in (False, True):
            t = BlockTrainer(grey_cfg(os.path.join(OUT, f"run{checkpointing}"), strategy="fsdp", distributed=True,
                                      gpu_id=[0, 1], num_epochs=1, activation_checkpointing=checkpointing,
                                      sync_bn=True))
            t.run()
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
            state = get_model_state_dict(t.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            out[str(checkpointing)] = {k: v.double().flatten().tolist() for k, v in state.items()}
        return out
    """)
    plain, checkpointed = results[0]["False"], results[0]["True"]
    assert plain["blocks.0.bn.num_batches_tracked"] == [5.0] == checkpointed["blocks.0.bn.num_batches_tracked"]
    for key in plain:
        assert np.allclose(plain[key], checkpointed[key], rtol=0, atol=1e-6), key


# ----------------------------------------------------------------------------- evaluate(batch_size=)
def test_batch_size_for_a_loader_that_has_its_own_is_an_error(tmp_path):
    """evaluate(batch_size=) and predict(batch_size=) are the batch of a data set they load; given
    with a DataLoader (or, for evaluate, with no loader: the test loader) it was ignored without a
    word. A data set takes it (and bad values are named)."""
    t = GreyTrainer(grey_cfg(str(tmp_path / "run")))
    data = grey_data(9, 3)
    for call in (lambda: t.evaluate(batch_size=5), lambda: t.evaluate(loader=t.test_loader, batch_size=5),
                 lambda: t.predict(t.test_loader, batch_size=5)):
        with pytest.raises(ValueError, match=r"batch_size=5 is the batch of a data set .* has its own"):
            call()
    assert t.evaluate(loader=data, batch_size=5) == t.evaluate(loader=data, batch_size=9)
    assert t.predict(data, batch_size=4).shape == (9, 3)
    with pytest.raises(ValueError, match="batch_size=0"):
        t.evaluate(loader=data, batch_size=0)


# ----------------------------------------------------------------------------- export --weights ema with two averages
class ZooTrainer(GreyTrainer):
    """A get_models net (shufflenet_v2_x0_5, 16x16 RGB) on 16 samples, so a checkpoint names
    its model; the ModelEMA callbacks of ``cfg.emas`` ((decay, evaluate), in list order)."""

    def build_train_loader(self, cfg, **kwargs):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(16, 3, 16, 16, generator=g), torch.randint(0, 3, (16,), generator=g))
        cfg.num_classes = 3
        return self.build_dataloader(data, cfg.batch_size, 0, phase="train")

    def build_test_loader(self, cfg, **kwargs):
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(6, 3, 16, 16, generator=g), torch.randint(0, 3, (6,), generator=g))
        return self.build_dataloader(data, cfg.batch_size, 0, phase="test", shuffle=False)

    def build_model(self, cfg, **kwargs):
        from basetrainer.models import build_models

        torch.manual_seed(cfg.seed)
        model = build_models.get_models(cfg.net_type, cfg.input_size, cfg.num_classes)
        return self.build_model_parallel(model, cfg.gpu_id, distributed=cfg.distributed)

    def build_callbacks(self, cfg, **kwargs):
        emas = [ModelEMA(decay=decay, evaluate=evaluate) for decay, evaluate in cfg.emas]
        return [losses_recorder.LossesRecorder(indicator="loss")] + emas + [
            model_checkpoint.ModelCheckpoint(model_dir=os.path.join(cfg.work_dir, "model"), indicator="loss",
                                             async_save=False)]


@pytest.mark.slow
def test_weights_ema_of_a_run_with_two_averages_is_the_evaluated_one(tmp_path):
    """With two ModelEMA callbacks (one evaluates, as allowed), weights='ema' took the first in
    the list: ModelEMA(0.9, evaluate=False)'s average, not the one the test figures and the best
    file hold. Now: the one that evaluated; with none evaluating, an error naming the decays."""
    from basetrainer.deploy.source import load_model
    from basetrainer.utils.torch_tools import load_state_dict

    work = str(tmp_path / "run")
    cfg = grey_cfg(work, net_type="shufflenet_v2_x0_5", input_size=[16, 16], num_epochs=1,
                   emas=[(0.9, False), (0.5, True)])
    ZooTrainer(cfg).run()
    best = next(f for f in os.listdir(os.path.join(work, "model")) if f.startswith("best_model_"))
    averaged = load_state_dict(os.path.join(work, "model", best))
    exported = load_model(os.path.join(work, "model", "last.pth"), weights="ema").model.state_dict()
    assert all(torch.equal(exported[k], v) for k, v in averaged.items())
    live = load_model(os.path.join(work, "model", "last.pth")).model.state_dict()
    assert any(not torch.equal(live[k], v) for k, v in averaged.items())

    work = str(tmp_path / "none")
    ZooTrainer(grey_cfg(work, net_type="shufflenet_v2_x0_5", input_size=[16, 16], num_epochs=1,
                        emas=[(0.9, False), (0.5, False)])).run()
    with pytest.raises(ValueError, match=r"2 ModelEMA averages \(decay 0.9, 0.5\)"):
        load_model(os.path.join(work, "model", "last.pth"), weights="ema")


# ----------------------------------------------------------------------------- a small disk that is not full
@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (root only; skipped elsewhere), unmounted after."""
    folder = tmp_path / "disk"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], capture_output=True)


class Column(nn.Module):
    """An output [N] (one value per image), which NCNN gives back as [N, 1]; ``width`` sets
    the weights' size (a Linear of width x 64 floats)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 64, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1)).sum(1)


def test_a_failure_on_a_small_disk_with_room_left_is_not_called_a_full_disk(small_disk):
    """On a disk of 1 MiB, every conversion that failed or disagreed was called a DiskFullError
    ('no space left ... writing the onnx-int8 files filled the disk', 1008 KB free before it and
    990 KB after, for 14 KB of files): the rule was 'less than 1 MiB free after it'. Now the
    conversion must also have used at least half of what was free; a real full disk still is one."""
    pytest.importorskip("onnxruntime")
    from basetrainer.deploy.export import export_model

    torch.manual_seed(0)
    x = np.random.default_rng(0).standard_normal((40, 1, 8, 8)).astype(np.float32)
    calibration = np.random.default_rng(1).standard_normal((40, 1, 8, 8)).astype(np.float32)
    formats = "onnx,onnx-int8" + (",ncnn" if _installed("pnnx", "ncnn") else "")
    report = export_model(BoxAndProbability().eval(), "onnx,onnx-int8", out_dir=str(small_disk / "a"),
                          input_size=[8, 8], check=x, calibration=calibration, runs=0, batch=5, strict=False)
    rows = {row.format: row for row in report.rows}
    assert rows["onnx"].status == "ok"
    assert rows["onnx-int8"].status == "FAIL" and rows["onnx-int8"].problems[0].startswith("max |Δ| 0.4")
    if "ncnn" in formats:   # the error path: NCNN's [N, 1] for an output [N] is a ParityError, not the disk
        report = export_model(Column().eval(), "onnx,ncnn", out_dir=str(small_disk / "b"), input_size=[8, 8],
                              check=x, runs=0, batch=5, strict=False)
        rows = {row.format: row for row in report.rows}
        assert rows["onnx"].status == "ok"
        assert rows["ncnn"].status == "error" and rows["ncnn"].problems[0].startswith("ParityError: "), rows["ncnn"]
    big = Column(width=2048).eval()   # 2 MiB of weights on a disk of 1 MiB: full
    report = export_model(big, "onnx", out_dir=str(small_disk / "c"), input_size=[8, 8], check=x, runs=0,
                          strict=False, report_files=False)
    assert report.rows[1].status == "error" and report.rows[1].problems[0].startswith("DiskFullError: ")
    assert os.listdir(small_disk / "c") == []   # nothing left behind, no staging folder


def _installed(*modules: str) -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in modules)


# ----------------------------------------------------------------------------- MapMetric: malformed records
def test_map_metric_refuses_boxes_scores_and_labels_it_cannot_count():
    """A detection box with a NaN coordinate matched its ground truth (AP 1.0), so did a NaN
    score, a label 1.7 was class 1, and an infinite ground-truth box gave AP nan: each is now an
    error naming the image and the record. Zero-area boxes stay valid (COCO's IoU with them is 0)."""
    pytest.importorskip("pycocotools")
    pytest.importorskip("torchmetrics")
    from basetrainer.metric.map_tools import MapMetric

    nan, inf = float("nan"), float("inf")
    gt = {"a.jpg": {"boxes": [[0, 0, 10, 10]], "labels": [1]}}
    good = {"a.jpg": {"boxes": [[0, 0, 10, 10]], "labels": [1], "scores": [0.9]}}
    assert MapMetric().evaluate(gt, good, ["x", "y"])[1] == pytest.approx(1.0)
    cases = [(gt, {"a.jpg": {**good["a.jpg"], "boxes": [[0, 0, nan, 10]]}}, r"dt_info\['a.jpg'\]: box 0 .*nan"),
             (gt, {"a.jpg": {**good["a.jpg"], "scores": [nan]}}, r"dt_info\['a.jpg'\]: score 0 is nan"),
             (gt, {"a.jpg": {**good["a.jpg"], "labels": [1.7]}}, r"dt_info of 'a.jpg': 1.7 is not a class index"),
             ({"a.jpg": {"boxes": [[0, 0, inf, 10]], "labels": [1]}}, good, r"gt_info\['a.jpg'\]: box 0 .*inf")]
    for truth, detections, message in cases:
        with pytest.raises(ValueError, match=message):
            MapMetric().evaluate(truth, detections, ["x", "y"])
    as_tensors = {"a.jpg": {**good["a.jpg"], "labels": list(torch.tensor([1]))}}   # 0-d tensors are indices
    assert MapMetric().evaluate(gt, as_tensors, ["x", "y"])[1] == pytest.approx(1.0)
    zero = {"a.jpg": {"boxes": [[5, 5, 5, 5]], "labels": [1], "scores": [0.9]}}
    assert MapMetric().evaluate(gt, zero, ["x", "y"])[1] == 0.0
