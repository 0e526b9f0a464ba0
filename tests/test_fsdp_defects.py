"""strategy: fsdp with models a meta-device build does not suit (issue 28.2: a constructor that
reads a tensor's value; 28.3: one buffer shared by several modules): each trains and ends
within 1e-5 of the one-process run, and resumes exactly from its sharded checkpoint."""
import logging
import os

import pytest
import torch
from torch import nn

from basetrainer.callbacks.callbacks import Callback
from basetrainer.callbacks.losses_recorder import LossesRecorder
from basetrainer.callbacks.model_checkpoint import ModelCheckpoint
from basetrainer.runtime import checkpoint, comm, fsdp_build, sharding

from conftest import StopAt, run_distributed, weight_diff
from fsdp_common import BlockTrainer, fsdp_cfg, full_weights

# ----------------------------------------------------------------------------- the models
class ScaledBlock(nn.Module):
    def __init__(self, width: int, scale: float, mask: torch.Tensor = None) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.scale = scale                      # a python float read from a tensor at construction
        if mask is not None:
            self.register_buffer("mask", mask)  # the same tensor in every block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.scale * torch.tanh(self.fc(x))
        return x + (y * self.mask if hasattr(self, "mask") else y)


class ReadsTensorsNet(nn.Module):
    """As timm's ViT/ConvNeXt/Swin: per-block rates read with ``.item()`` from a linspace."""

    def __init__(self, width: int = 24, depth: int = 3) -> None:
        super().__init__()
        self.built_on = torch.empty(0).device.type        # where the constructor ran
        rates = [x.item() for x in torch.linspace(0.5, 1.0, depth)]
        self.stem = nn.Linear(16, width)
        self.blocks = nn.Sequential(*[ScaledBlock(width, r) for r in rates])
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(torch.relu(self.stem(x))))


class SharedBufferNet(nn.Module):
    """One mask (persistent) and one positional table (not persistent) registered in every
    block: the same tensors under several names."""

    def __init__(self, width: int = 24, depth: int = 3) -> None:
        super().__init__()
        self.built_on = torch.empty(0).device.type
        mask = (torch.arange(width) % 3 != 0).float()
        self.stem = nn.Linear(16, width)
        self.blocks = nn.Sequential(*[ScaledBlock(width, 1.0, mask) for _ in range(depth)])
        table = torch.linspace(-0.5, 0.5, width)
        for block in self.blocks:
            block.register_buffer("pos", table, persistent=False)
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        for block in self.blocks:
            x = block(x + block.pos)
        return self.head(x)


class HostileNet(nn.Module):
    """All at once: rates read with ``.tolist()``, a mask shared by every block, a weight tied
    between two root layers, and a plain tensor attribute (neither parameter nor buffer)."""

    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.built_on = torch.empty(0).device.type
        rates = torch.linspace(0.4, 0.8, depth).tolist()
        mask = (torch.arange(width) % 4 != 1).float()
        self.stem = nn.Linear(16, width, bias=False)
        self.blocks = nn.Sequential(*[ScaledBlock(width, r, mask) for r in rates])
        self.unstem = nn.Linear(width, 16, bias=False)
        self.unstem.weight = self.stem.weight               # tied (both outside every block)
        self.offset = torch.full((16,), 0.1)                # a plain attribute: moves with no one
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.unstem(self.blocks(self.stem(x))) + self.offset))


class PlainAttributeNet(nn.Module):
    """Meta-safe but for a plain tensor attribute: on meta it would stay there, never given
    values (sharding fills parameters and buffers), and fail in the first forward."""

    def __init__(self, width: int = 24) -> None:
        super().__init__()
        self.built_on = torch.empty(0).device.type
        self.stem = nn.Linear(16, width)
        self.blocks = nn.Sequential(*[ScaledBlock(width, 1.0) for _ in range(2)])
        self.offset = torch.full((width,), 0.1)
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(torch.relu(self.stem(x)) + self.offset))


MODELS = {"reads": ReadsTensorsNet, "shared_buffer": SharedBufferNet, "hostile": HostileNet,
          "plain": PlainAttributeNet}


class DefectTrainer(BlockTrainer):
    def build_model(self, cfg, **kwargs):
        torch.manual_seed(cfg.seed)
        net = cfg.get("net")
        model = MODELS[net]() if net in MODELS else None
        if model is None:
            return super().build_model(cfg, **kwargs)
        return self.build_model_parallel(model, cfg.gpu_id, distributed=cfg.distributed)


class Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


# ----------------------------------------------------------------------------- 28.2 and 28.3
CASES = [  # (name, config overrides)
    ("reads", dict(net="reads")),
    ("shared_buffer", dict(net="shared_buffer")),
    ("hostile", dict(net="hostile", lr=0.05)),
]


def _train(rank, cases, work):
    out = {}
    log = Messages()
    logging.getLogger("basetrainer.runtime.fsdp_build").addHandler(log)
    logging.getLogger("basetrainer.runtime.fsdp_build").setLevel(logging.INFO)
    for name, over in cases:
        t = DefectTrainer(fsdp_cfg(**over), callbacks=[LossesRecorder()])
        built_on = t.unwrapped_model.built_on
        t.run()
        model = t.unwrapped_model
        out[name] = {"weights": full_weights(t), "sharded": sharding.is_fsdp(t.model), "built_on": built_on,
                     "shared_mask": (model.blocks[0].mask is model.blocks[2].mask
                                     if hasattr(model.blocks[0], "mask") else None)}
    # a sharded checkpoint of the shared-buffer model, stopped mid-epoch and resumed
    if cases and cases[0][1].get("strategy") == "fsdp":
        def callbacks():
            return [LossesRecorder(), ModelCheckpoint(model_dir=os.path.join(work, "model"), save_freq_steps=3,
                                                      async_save=False)]
        cfg = dict(net="shared_buffer", strategy="fsdp", work_dir=work)
        with pytest.raises(KeyboardInterrupt):
            DefectTrainer(fsdp_cfg(**cfg), callbacks=callbacks() + [StopAt(1, 6, how=KeyboardInterrupt)]).run()
        resumed = DefectTrainer(fsdp_cfg(**cfg, resume="auto"), callbacks=callbacks())
        resumed.run()
        out["resumed"] = {"weights": full_weights(resumed), "start": resumed.start_epoch}
    out["log"] = log.lines
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_trains_models_that_read_tensors_or_share_buffers_as_one_process(tmp_path):
    single = _train(0, [(n, {**o, "strategy": "ddp"}) for n, o in CASES], "")
    fsdp = [(n, {**o, "strategy": "fsdp"}) for n, o in CASES]
    ranks = run_distributed(_train, 2, tmp_path, fsdp, str(tmp_path / "resume"), timeout=300)
    for rank, r in enumerate(ranks):
        for name, _ in CASES:
            assert r[name]["sharded"], name
            diff = weight_diff(single[name]["weights"], r[name]["weights"])
            assert diff < 1e-5, (name, rank, diff)
        assert r["shared_buffer"]["shared_mask"] is True and r["hostile"]["shared_mask"] is True
        # the sharded checkpoint of the shared-buffer model resumed mid-epoch 1, to the same weights
        assert r["resumed"]["start"] == 1
        assert weight_diff(single["shared_buffer"]["weights"], r["resumed"]["weights"]) < 1e-5
    # rank 0 builds as one process; rank 1 tried the meta device, and built normally where the
    # constructor needed real values (said once, at info level)
    assert [r["reads"]["built_on"] for r in ranks] == ["cpu", "cpu"]
    assert [r["hostile"]["built_on"] for r in ranks] == ["cpu", "cpu"]
    assert [r["shared_buffer"]["built_on"] for r in ranks] == ["cpu", "meta"]
    for rank in ranks:   # rank 1 says it, and rank 0 (which logs at info) names the rank
        fallbacks = [line for line in rank["log"] if "fsdp_meta_init" in line]
        assert len(fallbacks) == 2, rank["log"]
        assert "Tensor.item() cannot be called on meta tensors" in fallbacks[0]
        assert "Cannot copy out of meta tensor" in fallbacks[1]      # .tolist()
    assert all("rank(s) [1]" in line for line in ranks[0]["log"] if "fsdp_meta_init" in line)


def _meta_init(rank, cases):
    out = {}
    for name, over in cases:
        t = DefectTrainer(fsdp_cfg(**{"strategy": "fsdp", "num_epochs": 1, **over}), callbacks=[LossesRecorder()])
        built_on = t.unwrapped_model.built_on
        t.run()
        out[name] = (built_on, full_weights(t))
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_meta_init_key(tmp_path):
    ranks = run_distributed(_meta_init, 2, tmp_path, [("false", dict(net="reads", fsdp_meta_init=False)),
                                                      ("plain", dict(net="plain")),
                                                      ("auto_safe", dict(net="shared_buffer", fsdp_meta_init="auto")),
                                                      ("true_safe", dict(net="shared_buffer", fsdp_meta_init=True))], timeout=300)
    assert [r["false"][0] for r in ranks] == ["cpu", "cpu"]     # false: every rank builds normally
    reference = _meta_init(0, [("one", dict(net="reads", strategy="ddp", distributed=False))])["one"][1]
    assert weight_diff(reference, ranks[1]["false"][1]) < 1e-5
    for name in ("auto_safe", "true_safe"):   # a meta-safe model: rank 1 built it on meta
        assert [r[name][0] for r in ranks] == ["cpu", "meta"]
        assert weight_diff(ranks[0][name][1], ranks[1][name][1]) == 0.0
    # a plain tensor attribute would stay on meta: rank 1 built normally, and trained as rank 0
    assert [r["plain"][0] for r in ranks] == ["cpu", "cpu"]
    assert weight_diff(ranks[0]["plain"][1], ranks[1]["plain"][1]) == 0.0
    with pytest.raises(pytest.fail.Exception, match=r"(?s)fsdp_meta_init.*true.*plain tensor attributes \['offset'\]"
                                                    r".*register them as buffers"):
        run_distributed(_meta_init, 2, tmp_path / "plain", [("strict", dict(net="plain", fsdp_meta_init=True))],
                        timeout=120)
    # true: a constructor that needs real values is an error naming the key and the fix
    with pytest.raises(pytest.fail.Exception, match=r"(?s)fsdp_meta_init.*true.*Tensor.item\(\).*"
                                                    r"fsdp_meta_init: auto"):
        run_distributed(_meta_init, 2, tmp_path / "strict", [("strict", dict(net="reads", fsdp_meta_init=True))],
                        timeout=120)


def test_fsdp_meta_init_values_are_checked():
    for value in ("maybe", 3):
        with pytest.raises((TypeError, ValueError), match="fsdp_meta_init"):
            sharding.meta_init(fsdp_cfg(strategy="fsdp", fsdp_meta_init=value))
    assert sharding.meta_init(fsdp_cfg(strategy="fsdp")) == "auto"
    assert sharding.meta_init(fsdp_cfg(fsdp_meta_init="False")) is False
    assert sharding.meta_init(fsdp_cfg(fsdp_meta_init="true")) is True


def test_the_meta_build_attempt_travels_with_its_build(monkeypatch):
    """What construct() leaves for shard() travels in the BuildAttempt given to both (issue 34.1),
    not in process-wide flags: rank 1's fallback from meta (shard() finds a plain tensor attribute
    there, before any collective) is recorded on that build's attempt, and a second build in the
    same process starts from its own."""
    monkeypatch.setattr(comm, "is_dist", lambda: True)   # as rank 1 of a group, up to shard()'s collectives
    monkeypatch.setattr(comm, "get_rank", lambda: 1)
    cfg = fsdp_cfg(strategy="fsdp")

    def build(net, attempt):
        def build_model():
            model = net()
            if model.built_on == "meta":   # build_model_parallel: shard() checks the meta build first
                fsdp_build.shard(model, torch.device("cpu"), cfg, attempt=attempt)
            return model
        return build_model

    first, second = fsdp_build.BuildAttempt(), fsdp_build.BuildAttempt()
    model = fsdp_build.construct(cfg, build(PlainAttributeNet, first), first)
    assert (model.built_on, model.offset.device.type) == ("cpu", "cpu")   # built again, normally
    assert "['offset']" in first.normal_because and (first.on_meta, first.talking) == (False, False)
    model = fsdp_build.construct(cfg, lambda: ReadsTensorsNet(), second)
    assert model.built_on == "cpu" and "Tensor.item()" in second.normal_because
    third = fsdp_build.BuildAttempt()   # a meta-safe model: left on meta (no shard() here: it would all-gather)
    model = fsdp_build.construct(cfg, lambda: SharedBufferNet(), third)
    assert model.built_on == "meta" and third.normal_because is None and "['offset']" in first.normal_because


# ----------------------------------------------------------------------------- 28.8
def _run_epochs(rank, work, epochs):
    cb = [LossesRecorder(), ModelCheckpoint(model_dir=os.path.join(work, "model"), save_freq_steps=3,
                                            async_save=False)]
    t = DefectTrainer(fsdp_cfg(strategy="fsdp", work_dir=work, num_epochs=epochs, resume="auto"), callbacks=cb)
    t.run()
    return full_weights(t), t.start_epoch


def _damage_newest(folder, rank_file):
    """Truncate one rank's shard of the newest save; return its folder's name and file sizes."""
    name = checkpoint.load_file(os.path.join(folder, "last.pth"))["shards"]
    shard = os.path.join(folder, name, rank_file)
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    return name, _sizes(os.path.join(folder, name))


def _sizes(path):
    return {n: os.path.getsize(os.path.join(path, n)) for n in sorted(os.listdir(path))}


@pytest.mark.distributed
@pytest.mark.slow
def test_a_damaged_sharded_save_is_kept_whole_beside_the_fallback(tmp_path):
    """Issue 28.8: after falling back to last.prev.pth, the damaged save's shards (the damaged
    one and the other ranks' intact ones) stay with last.pth.damaged; twice in a row too; and
    the run trained on from the fallback ends as one uninterrupted process."""
    work = str(tmp_path / "run")
    folder = os.path.join(work, "model")
    run_distributed(_run_epochs, 2, tmp_path / "a", work, 1, timeout=300)
    first, first_sizes = _damage_newest(folder, "__1_0.distcp")
    run_distributed(_run_epochs, 2, tmp_path / "b", work, 2, timeout=300)
    second, second_sizes = _damage_newest(folder, "__0_0.distcp")
    weights, start = run_distributed(_run_epochs, 2, tmp_path / "c", work, 3, timeout=300)[0]
    assert start == 1                                   # epoch 1's last.prev.pth: inside epoch 1
    kept = {n: checkpoint.load_file(os.path.join(folder, n))["shards"]
            for n in ("last.pth.damaged", "last.pth.damaged.2")}
    assert kept == {"last.pth.damaged": first, "last.pth.damaged.2": second}
    assert _sizes(os.path.join(folder, first)) == first_sizes       # whole, as it was left
    assert _sizes(os.path.join(folder, second)) == second_sizes
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(first_sizes) & set(second_sizes)
    reference = DefectTrainer(fsdp_cfg(strategy="ddp", distributed=False, num_epochs=3))
    reference.run()
    assert weight_diff(full_weights(reference), weights) < 1e-5


def _resumable(epoch):
    return {"format": checkpoint.FORMAT, "epoch": epoch, "phase": "end", "batch": 0, "global_step": 9 * (epoch + 1),
            "model": {"w": torch.full((2,), float(epoch))}}


@pytest.mark.parametrize("pointer", ["readable", "unreadable"])
def test_the_fallback_keeps_or_says_it_removes_the_damaged_save_s_shards(tmp_path, caplog, pointer):
    """In one process: a damaged last.pth whose pointer reads keeps its shard folder (a folder
    missing its .metadata here); one that cannot be read cannot say which folder is its, and the
    warning says the next save removes the folders no readable checkpoint refers to."""
    folder = str(tmp_path)
    torch.save(_resumable(0), os.path.join(folder, "last.prev.pth"))
    shards = os.path.join(folder, "last-shards-00000018-0123abcd")
    os.makedirs(shards)
    with open(os.path.join(shards, "__0_0.distcp"), "wb") as f:
        f.write(b"the other rank's intact shard")
    if pointer == "readable":
        torch.save({**_resumable(1), "shards": os.path.basename(shards)}, os.path.join(folder, "last.pth"))
    else:
        with open(os.path.join(folder, "last.pth"), "wb") as f:
            f.write(b"not a torch file")
    ckpt = checkpoint.CheckpointFolder(folder)
    with caplog.at_level(logging.WARNING):
        path, state = ckpt.find_resumable()
        assert path.endswith("last.prev.pth") and state["epoch"] == 0
        ckpt.commit(_resumable(1), background=False)
    assert os.path.exists(os.path.join(folder, "last.pth.damaged"))
    if pointer == "readable":
        assert os.listdir(shards) == ["__0_0.distcp"]
        assert f"its shards stay in {os.path.basename(shards)}" in caplog.text
    else:
        assert not os.path.exists(shards)
        assert "cannot be read, so which shard folder is its is unknown: the next save removes" in caplog.text
