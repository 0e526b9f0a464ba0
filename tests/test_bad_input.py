"""Bad input gets a clear, early error naming the key and the fix (DESIGN.md §3)."""
import os
import pickle

import pytest
import torch
from torch import nn

from basetrainer.dataloader.image_folder import image_folder
from basetrainer.dataloader.loader import build_dataloader
from basetrainer.engine import trainer as trainer_mod
from basetrainer.models import build_models
from basetrainer.utils import setup_config, torch_tools
from conftest import TinyNet, ToyTrainer, blobs, make_image_folder, toy_cfg


# ------------------------------------------------------------------------------ batch_size / num_epochs
@pytest.mark.parametrize("value", [0, -4])
def test_batch_size_not_positive_config(value):
    with pytest.raises(ValueError) as info:
        setup_config.validate(setup_config.Config(batch_size=value))
    assert f"'batch_size' = {value}" in str(info.value) and "positive integer" in str(info.value)
    # the trainer checks it in __init__, before any hook runs
    with pytest.raises(ValueError, match=rf"'batch_size' = {value} must be a positive integer"):
        ToyTrainer(toy_cfg(batch_size=value))


@pytest.mark.parametrize("value", [0, -1, 2.0, True])
def test_batch_size_not_positive_build_dataloader(value):
    with pytest.raises(ValueError) as info:
        build_dataloader(blobs(8), value)
    assert f"batch_size={value!r} must be a positive integer" in str(info.value)


def test_batch_size_of_wrong_type_in_trainer():
    with pytest.raises(TypeError) as info:
        ToyTrainer(toy_cfg(batch_size="32"))
    msg = str(info.value)
    assert "'batch_size'" in msg and "'32'" in msg and "an integer" in msg


@pytest.mark.parametrize("value", [0, -2])
def test_num_epochs_not_positive(value):
    with pytest.raises(ValueError, match=rf"'num_epochs' = {value} must be a positive integer"):
        ToyTrainer(toy_cfg(num_epochs=value))
    t = ToyTrainer(toy_cfg(num_epochs=1))
    t.num_epochs = value
    with pytest.raises(ValueError, match=rf"num_epochs={value} must be a positive integer"):
        t.run()


def test_other_numbers_out_of_range():
    for key, value, words in [("lr", -1, "'lr' = -1 must be a finite number >= 0"),
                              ("lr", float("nan"), "'lr' = nan must be a finite number >= 0"),
                              ("lr", float("inf"), "'lr' = inf must be a finite number >= 0"),
                              ("num_workers", -1, "'num_workers' = -1 must be >= 0"),
                              ("log_freq", 0, "'log_freq' = 0 must be a positive integer"),
                              ("accumulate_steps", 0, "'accumulate_steps' = 0 must be a positive integer")]:
        with pytest.raises(ValueError) as info:
            ToyTrainer(toy_cfg(**{key: value}))
        assert words in str(info.value), key


@pytest.mark.parametrize("key", ["momentum", "weight_decay", "clip_grad_norm", "num_warn_up"])
@pytest.mark.parametrize("text,value", [(".nan", "nan"), (".inf", "inf"), ("-1", "-1")])
def test_other_numbers_not_finite_or_negative_name_the_key(key, text, value):
    import yaml

    cfg = setup_config.Config(yaml.safe_load(f"{key}: {text}"))   # NaN once passed, and the run failed later
    with pytest.raises(ValueError) as info:                        # blaming the learning rate
        setup_config.validate(cfg)
    assert str(info.value) == f"config key {key!r} = {value} must be >= 0 and finite"


@pytest.mark.parametrize("seed", [2 ** 64, -2 ** 63, 2 ** 62])
def test_a_seed_torch_cannot_take_names_the_key(seed):
    with pytest.raises(ValueError, match=rf"config key 'seed' = {seed} is out of range"):
        ToyTrainer(toy_cfg(seed=seed))


@pytest.mark.parametrize("text,value", [(".nan", "nan"), (".inf", "inf"), ("-1", "-1"), ("-.inf", "-inf")])
def test_lr_not_finite_or_negative_in_config(text, value):
    import yaml

    cfg = setup_config.Config(yaml.safe_load(f"lr: {text}"))
    with pytest.raises(ValueError) as info:
        setup_config.validate(cfg)
    msg = str(info.value)
    assert f"config key 'lr' = {value}" in msg and "must be a finite number >= 0" in msg and "0.1" in msg


def test_lr_0_runs_and_leaves_the_weights_but_recalibrates_batchnorm():
    setup_config.validate(setup_config.Config(lr=0))
    t = ToyTrainer(toy_cfg(lr=0, bn=True, num_epochs=1))
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    t.run()
    after = t.model.state_dict()
    for key in before:
        if "running" in key or "num_batches" in key:
            assert not torch.equal(before[key], after[key]), key        # the statistics moved
        else:
            assert torch.equal(before[key], after[key]), key            # the weights did not


def test_batch_larger_than_training_set_with_drop_last():
    with pytest.raises(ValueError) as info:
        build_dataloader(blobs(10), 16, phase="train", drop_last=True)
    msg = str(info.value)
    assert "batch_size=16" in msg and "(10 samples)" in msg and "drop_last=True" in msg
    assert "Lower batch_size or set drop_last=False" in msg
    with pytest.raises(ValueError, match=r"batch_size=16 is larger than the training set \(10 samples\)"):
        ToyTrainer(toy_cfg(n_train=10, batch_size=16, drop_last=True))
    # without drop_last the one short batch is fine
    assert len(build_dataloader(blobs(10), 16, phase="train", drop_last=False)) == 1


def test_empty_dataset_and_bad_phase():
    empty = torch.utils.data.TensorDataset(torch.zeros(0, 3))
    with pytest.raises(ValueError, match="the train dataset is empty: check the train_data"):
        build_dataloader(empty, 4)
    with pytest.raises(ValueError, match="phase='val' must be 'train' or 'test'"):
        build_dataloader(blobs(8), 4, phase="val")


# ------------------------------------------------------------------------------ input_size
@pytest.mark.parametrize("size", [[32], [32, 32, 3], "32", 32, [32.0, 32], [0, 32], [True, 32], None])
def test_input_size_not_two_ints(size):
    with pytest.raises(ValueError) as info:
        build_models.get_models("resnet18", size, 10)
    msg = str(info.value)
    assert f"input_size={size!r}" in msg and "two positive integers [W, H]" in msg


@pytest.mark.parametrize("n", [0, -1, 2.5, True])
def test_num_classes_not_positive_int(n):
    with pytest.raises(ValueError, match=rf"num_classes={n!r} must be a positive integer"):
        build_models.get_models("resnet18", [32, 32], n)


# ------------------------------------------------------------------------------ image folders
def test_missing_train_folder(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError) as info:
        image_folder(missing, key="train_data")
    msg = str(info.value)
    assert f"train_data={missing!r}" in msg and "does not exist" in msg and "subfolder" in msg
    with pytest.raises(ValueError, match="train_data is empty"):
        image_folder("", key="train_data")
    with pytest.raises(ValueError, match="test_data is empty"):
        image_folder([], key="test_data")


def test_empty_folder(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "readme.txt").write_text("no images")
    with pytest.raises(ValueError) as info:
        image_folder(str(tmp_path / "train"), key="train_data")
    msg = str(info.value)
    assert "train_data=" in msg and "has no class subfolders" in msg and "root/<class>/<image>" in msg


def test_class_folder_without_images(tmp_path):
    root = make_image_folder(str(tmp_path / "train"), ["cat", "dog"], per_class=2)
    (tmp_path / "train" / "bird").mkdir()
    (tmp_path / "train" / "bird" / "notes.txt").write_text("x")
    with pytest.raises(ValueError) as info:
        image_folder(root, key="train_data")
    msg = str(info.value)
    assert "['bird']" in msg and "hold no images" in msg and "train_data=" in msg


def test_folder_with_one_class(tmp_path):
    root = make_image_folder(str(tmp_path / "train"), ["cat"], per_class=2)
    with pytest.raises(ValueError) as info:
        image_folder(root, key="train_data")
    msg = str(info.value)
    assert "only one class ('cat')" in msg and "at least two class subfolders" in msg


def test_test_folder_with_other_classes(tmp_path):
    root = make_image_folder(str(tmp_path / "val"), ["cat", "cow"], per_class=1)
    with pytest.raises(ValueError) as info:
        image_folder(root, key="test_data", classes=["cat", "dog"])
    msg = str(info.value)
    assert "test_data=" in msg and "['cat', 'cow']" in msg and "['cat', 'dog']" in msg


def test_good_folder_loads(tmp_path):
    root = make_image_folder(str(tmp_path / "train"), ["a", "b", "c"], per_class=2)
    ds = image_folder(root)
    assert ds.classes == ["a", "b", "c"] and len(ds) == 6


# ------------------------------------------------------------------------------ weight files
@pytest.fixture
def tiny_pth(tmp_path):
    torch.manual_seed(0)
    model = TinyNet()
    path = str(tmp_path / "tiny.pth")
    torch.save(model.state_dict(), path)
    return model, path


def test_finetune_file_missing(tmp_path):
    missing = str(tmp_path / "missing.pth")
    with pytest.raises(FileNotFoundError) as info:
        torch_tools.load_state_dict(missing)
    msg = str(info.value)
    assert repr(missing) in msg and "does not exist" in msg and "finetune" in msg


def test_pretrained_path_missing(tmp_path):
    missing = str(tmp_path / "imagenet.pth")
    with pytest.raises(FileNotFoundError) as info:
        build_models.get_models("resnet18", [32, 32], 10, pretrained=missing)
    msg = str(info.value)
    assert repr(missing) in msg and "pretrained" in msg


def test_finetune_file_truncated(tiny_pth, tmp_path):
    _, path = tiny_pth
    data = open(path, "rb").read()
    half = str(tmp_path / "half.pth")
    with open(half, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(ValueError) as info:
        torch_tools.load_state_dict(half)
    msg = str(info.value)
    assert repr(half) in msg and "truncated or not a torch file" in msg
    empty = str(tmp_path / "empty.pth")
    open(empty, "wb").close()
    with pytest.raises(ValueError, match=r"is empty \(0 bytes\)"):
        torch_tools.load_state_dict(empty)
    text = str(tmp_path / "text.pth")
    with open(text, "w") as f:
        f.write("not a checkpoint")
    with pytest.raises(ValueError) as info:
        torch_tools.load_state_dict(text)
    msg = str(info.value)  # garbage is not reported as "pickled code"
    assert repr(text) in msg and "truncated or not a torch file" in msg and "refused" not in msg


def test_file_without_a_state_dict(tmp_path):
    path = str(tmp_path / "list.pth")
    torch.save([1, 2, 3], path)
    with pytest.raises(ValueError, match=r"does not hold a model state_dict \(a dict of tensors\)"):
        torch_tools.load_state_dict(path)


def test_a_file_that_is_no_checkpoint_is_one_user_error(tiny_pth, tmp_path):
    """--resume/--finetune/--pretrained /etc/passwd ended with torch's IndexError and a traceback;
    a truncated, empty or text file, or one without weights, with a ValueError and a traceback
    (hostile pass): each is a CheckpointError (a ValueError), which a command says in one line."""
    from basetrainer.runtime.errors import CheckpointError

    passwd = tmp_path / "passwd"   # the text of /etc/passwd, which torch's legacy reader unpickles
    passwd.write_text("root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n")
    half = tmp_path / "half.pth"
    half.write_bytes(open(tiny_pth[1], "rb").read()[:200])
    (tmp_path / "empty.pth").write_bytes(b"")
    (tmp_path / "text.pth").write_text("hello world\n")
    for name in ("passwd", "half.pth", "empty.pth", "text.pth"):
        path = str(tmp_path / name)
        with pytest.raises(CheckpointError, match=f"^checkpoint file {path!r} is "):
            torch_tools.load_state_dict(path)
        with pytest.raises(CheckpointError):   # pretrained: the same one place reads the file
            build_models.get_models("resnet18", [32, 32], 10, pretrained=path)
    assert "give a file written by torch.save" in str(pytest.raises(CheckpointError, torch_tools.load_state_dict,
                                                                    str(passwd)).value)
    other = str(tmp_path / "a.pth")
    torch.save({"a": 1}, other)
    with pytest.raises(CheckpointError, match=r"does not hold a model state_dict \(a dict of tensors\): give a "
                                              r"file written by torch.save\(model.state_dict\(\)\)"):
        torch_tools.load_state_dict(other)


def test_a_checkpoint_that_is_a_folder_or_no_torch_zip_says_so_in_plain_words(tiny_pth, tmp_path):
    """A folder was reported as 'does not exist'; a zip that is not torch's pasted torch's own
    'Could this error message be improved?' appeal; /etc/passwd said 'list index out of range'
    (second hostile pass)."""
    import zipfile

    from basetrainer.runtime.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"is a folder, not a file: give the file inside it"):
        torch_tools.load_state_dict(str(tmp_path))
    other = tmp_path / "other.zip"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("a.txt", "not torch")
    passwd = tmp_path / "passwd"
    passwd.write_text("root:x:0:0:root:/root:/bin/bash\n")
    half = tmp_path / "half.pth"
    half.write_bytes(open(tiny_pth[1], "rb").read()[:-100])
    for path in (other, passwd, half):
        message = str(pytest.raises(CheckpointError, torch_tools.load_state_dict, str(path)).value)
        assert "Could this error" not in message and "miniz" not in message and "list index" not in message, message
        assert message.endswith("give a file written by torch.save (a checkpoint or a state_dict)"), message
    assert "(torch.load: IndexError)" in str(pytest.raises(CheckpointError, torch_tools.load_state_dict,
                                                           str(passwd)).value)


def test_good_file_round_trip_and_module_prefix(tiny_pth, tmp_path):
    model, path = tiny_pth
    state = torch_tools.load_state_dict(path)
    assert list(state) == list(model.state_dict())
    wrapped = str(tmp_path / "wrapped.pth")
    torch.save({"model": {"module." + k: v for k, v in model.state_dict().items()}, "epoch": 3}, wrapped)
    other = TinyNet()
    torch_tools.load_weights(other, wrapped)
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), model.state_dict().values()))


@pytest.mark.slow
def test_weights_for_another_architecture(tmp_path):
    import torchvision
    r18 = str(tmp_path / "resnet18.pth")
    torch.save(torchvision.models.resnet18(num_classes=10).state_dict(), r18)
    r34 = torchvision.models.resnet34(num_classes=10)
    with pytest.raises(ValueError) as info:
        torch_tools.load_weights(r34, r18)
    msg = str(info.value)
    assert r18 in msg and "do not fit ResNet" in msg and "another architecture" in msg
    assert "missing keys: layer1.2.conv1.weight" in msg
    assert "in all)" in msg                                   # a long list is cut, with its count
    # the other way round: resnet34 weights into resnet18 name unexpected keys
    r34_path = str(tmp_path / "resnet34.pth")
    torch.save(r34.state_dict(), r34_path)
    with pytest.raises(ValueError) as info:
        torch_tools.load_weights(torchvision.models.resnet18(num_classes=10),
                                 torch_tools.load_state_dict(r34_path), source=r34_path)
    msg = str(info.value)
    assert r34_path in msg and "unexpected keys: layer1.2.conv1.weight" in msg


def test_weights_with_another_number_of_classes(tiny_pth):
    _, path = tiny_pth
    with pytest.raises(ValueError) as info:
        torch_tools.load_weights(TinyNet(num_classes=7), path)
    msg = str(info.value)
    assert "shape mismatch: net.2.weight: file (4, 32) vs model (7, 32)" in msg


class _Payload:
    """Pickles to a call that creates a file when unpickled: code a .pth could carry."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (os.mkdir, (self.target,))


def test_pickle_that_would_run_code_is_refused(tmp_path):
    evil = str(tmp_path / "evil.pth")
    side_effect = str(tmp_path / "pwned")
    torch.save({"weight": torch.zeros(2), "extra": _Payload(side_effect)}, evil)
    with pytest.raises(ValueError) as info:
        torch_tools.load_state_dict(evil)
    msg = str(info.value)
    assert "refused to load" in msg and repr(evil) in msg and "would run code" in msg
    assert "mkdir" in msg                                     # the details name the blocked call
    assert not os.path.exists(side_effect)
    # the payload is live: an unsafe load does run it (so the refusal above is what protected us)
    probe = str(tmp_path / "probe.pth")
    torch.save(_Payload(str(tmp_path / "ran")), probe)
    torch.load(probe, weights_only=False)
    assert os.path.isdir(tmp_path / "ran")


def test_resume_from_a_weights_only_file(tiny_pth):
    _, path = tiny_pth
    t = ToyTrainer(toy_cfg(resume=path, num_epochs=1))
    with pytest.raises(ValueError) as info:
        t.run()
    msg = str(info.value)
    assert repr(path) in msg and "weights only" in msg and "finetune" in msg


# ------------------------------------------------------------------------------ devices
def test_gpu_id_not_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError) as info:
        ToyTrainer(toy_cfg(gpu_id=[3]))
    msg = str(info.value)
    assert "gpu_id=[3]" in msg and "[3] not present" in msg and "1 CUDA device(s)" in msg
    assert "ids 0..0" in msg and "[] for the CPU" in msg
    with pytest.raises(ValueError, match=r"gpu_id=\[0, -1\]: \[-1\] not present"):
        ToyTrainer(toy_cfg(gpu_id=[0, -1]))


def test_gpu_id_without_cuda_trains_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    t = ToyTrainer(toy_cfg(gpu_id=[0, 1], num_epochs=1))
    assert str(t.device) == "cpu" and isinstance(t.model, TinyNet)
    assert len(t.run()) == 1


def test_fp16_on_cpu_is_refused():
    t = ToyTrainer(toy_cfg(amp="fp16", num_epochs=1))
    with pytest.raises(ValueError, match="amp='fp16' needs a CUDA device"):
        t.run()
    t = ToyTrainer(toy_cfg(amp="fp8", num_epochs=1))
    with pytest.raises(ValueError, match=r"amp='fp8' is not a precision; choose from \['bf16', 'fp16', 'none'\]"):
        t.run()


# ------------------------------------------------------------------------------ hooks
class NoHooks(trainer_mod.EngineTrainer):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.build(cfg)


class OnlyLoaders(NoHooks):
    def build_train_loader(self, cfg, **kwargs):
        return self.build_dataloader(blobs(16), cfg.batch_size, 0, phase="train")

    def build_test_loader(self, cfg, **kwargs):
        return None


class ModelNone(ToyTrainer):
    def build_model(self, cfg, **kwargs):
        return None

    def build_optimizer(self, cfg, **kwargs):
        return None


@pytest.mark.parametrize("cls,hook", [(NoHooks, "build_train_loader"), (OnlyLoaders, "build_model")])
def test_hooks_not_implemented(cls, hook):
    with pytest.raises(NotImplementedError) as info:
        cls(toy_cfg())
    msg = str(info.value)
    assert f"{cls.__name__} must implement {hook}(self, cfg, **kwargs)" in msg


def test_build_model_returning_none():
    with pytest.raises(ValueError, match="ModelNone.build_model returned None; return the model"):
        ModelNone(toy_cfg())


class NaNNet(TinyNet):
    def forward(self, x):
        out = super().forward(x)
        return out * float("nan") if self.training and getattr(self, "poison", False) else out


def test_non_finite_loss_names_epoch_and_step():
    model = NaNNet()
    model.poison = True
    t = ToyTrainer(toy_cfg(num_epochs=1, n_train=32, batch_size=8, log_freq=100), model=model)
    with pytest.raises(FloatingPointError) as info:
        t.run()
    msg = str(info.value)
    assert "non-finite loss at epoch 0, step 0" in msg and "loss=nan" in msg
    assert "Lower the learning rate" in msg


def test_accuracy_target_beyond_the_models_classes():
    from basetrainer.metric.accuracy_recorder import AccuracyRecorder
    rec = AccuracyRecorder()
    rec.train.update(torch.randn(4, 3), torch.tensor([0, 1, 2, 5]))   # 3 outputs, class 5
    with pytest.raises(ValueError, match="target class index is >= 3.*num_classes"):
        rec.compute(rec.train, reduce=False)


# ------------------------------------------------------------------------------ damaged images
@pytest.mark.parametrize("workers", [0, 2])
def test_a_truncated_image_names_its_file(tmp_path, workers):
    from torchvision import transforms
    from torch.utils.data import DataLoader

    root = make_image_folder(str(tmp_path / "train"), ["a", "b"], per_class=3, size=32)
    bad = os.path.join(root, "b", "1.png")
    with open(bad, "r+b") as f:
        f.truncate(os.path.getsize(bad) // 2)
    dataset = image_folder(root, transform=transforms.ToTensor(), key="train_data")
    batches = iter(DataLoader(dataset, batch_size=2, num_workers=workers))
    with pytest.raises(Exception) as err:
        for _ in batches:
            pass
    assert bad in str(err.value)
    if workers:   # end them now: left to the garbage collector (the error's traceback holds the
        batches._shutdown_workers()   # iterator in a cycle) torch 2.14 takes 10 s to join them


def test_bad_images_can_be_skipped_with_a_warning_each(tmp_path, caplog):
    from torchvision import transforms

    root = make_image_folder(str(tmp_path / "train"), ["a", "b"], per_class=3, size=32)
    bad = [os.path.join(root, "a", "0.png"), os.path.join(root, "b", "2.png")]
    for path in bad:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    with caplog.at_level("WARNING", logger="basetrainer"):
        dataset = image_folder(root, transform=transforms.ToTensor(), key="train_data", bad_images="skip")
    assert len(dataset) == 4
    assert all(path in caplog.text for path in bad)
    assert all(x.shape == (3, 32, 32) for x, _ in dataset)


@pytest.mark.parametrize("value,message", [(-1, "save_freq_steps=-1 must be an integer >= 0"),
                                           (2.5, "save_freq_steps=2.5 must be an integer >= 0"),
                                           (True, "save_freq_steps=True must be an integer >= 0")])
def test_save_freq_steps_out_of_range_is_refused(value, message, tmp_path):
    from basetrainer.callbacks.model_checkpoint import ModelCheckpoint

    with pytest.raises(ValueError) as info:
        ModelCheckpoint(model_dir=str(tmp_path), save_freq_steps=value)
    assert message in str(info.value)


def test_save_freq_steps_none_means_off(tmp_path):
    from basetrainer.callbacks.model_checkpoint import ModelCheckpoint

    assert ModelCheckpoint(model_dir=str(tmp_path), save_freq_steps=None).save_freq_steps == 0


def test_a_test_loader_that_would_drop_every_sample_is_refused():
    from basetrainer.dataloader.loader import build_dataloader

    with pytest.raises(ValueError, match=r"batch_size=32 is larger than the test set \(20 samples\) with drop_last=True"):
        build_dataloader(torch.utils.data.TensorDataset(torch.zeros(20, 2)), 32, phase="test", drop_last=True)
    assert len(build_dataloader(torch.utils.data.TensorDataset(torch.zeros(20, 2)), 8, phase="test",
                                drop_last=True).sampler) == 16
