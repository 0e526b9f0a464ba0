"""strategy: fsdp (FSDP2 over gloo on the CPU): exact against one process and DDP, sharded
checkpoints that reshard to another world size, refuse planted code, survive a crash during a
save, and an elastic restart under torchrun."""
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
import torchvision
from torch import nn

from basetrainer.callbacks.callbacks import Callback
from basetrainer.callbacks.losses_recorder import LossesRecorder
from basetrainer.callbacks.model_checkpoint import ModelCheckpoint
from basetrainer.callbacks.model_ema import ModelEMA
from basetrainer.metric.accuracy_recorder import AccuracyRecorder
from basetrainer.runtime import checkpoint, comm, fsdp_build, fsdp_weights, shard_io, sharded, sharding

from conftest import ROOT, StopAt, free_port, run_distributed, run_script, script_fixture, weight_diff
from fsdp_common import Block, BlockNet, BlockTrainer, fsdp_cfg, full_weights

PY = sys.executable


# ----------------------------------------------------------------------------- exactness
EXACT_CASES = [  # (name, config overrides)
    ("fsdp", dict(strategy="fsdp")),
    ("ddp", dict(strategy="ddp")),
    ("fsdp_accumulate_clip", dict(strategy="fsdp", accumulate_steps=2, clip_grad_norm=0.5)),
    ("fsdp_activation_checkpointing", dict(strategy="fsdp", activation_checkpointing=True)),
    ("fsdp_no_reshard", dict(strategy="fsdp", reshard_after_forward=False)),
    ("fsdp_bf16", dict(strategy="fsdp", amp="bf16")),   # bf16 compute, float32 reduction (gloo)
    ("fsdp_tied", dict(strategy="fsdp", net="tied", lr=0.02)),    # a weight shared by two layers stays shared
]
APPROXIMATE = {"fsdp_bf16": 0.05}   # bf16 rounds differently in one process (autocast) and under FSDP


def _train(rank, cases):
    out = {}
    for name, over in cases:
        ema = ModelEMA(decay=0.9, evaluate=True)   # the test phase runs on the (sharded) average
        t = BlockTrainer(fsdp_cfg(**over), callbacks=[LossesRecorder(), AccuracyRecorder(), ema])
        history = t.run()
        ema_full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in ema.ema.items()}
        out[name] = {"weights": full_weights(t), "history": history.epochs, "ema": ema_full,
                     "sharded": sharding.is_fsdp(t.model),
                     "local": sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                                  for p in t.model.parameters()),
                     "tied": (t.unwrapped_model.stem.weight is t.unwrapped_model.unstem.weight
                              if over.get("net") == "tied" else None)}
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_equals_one_process_and_ddp_on_uneven_data(tmp_path):
    # 251 samples, global batch 30 (the last batch splits 6/5), a 37-sample test set (19/18)
    single = _train(0, [(name, {**over, "strategy": "ddp"}) for name, over in EXACT_CASES])
    ranks = run_distributed(_train, 2, tmp_path, EXACT_CASES, timeout=300)
    total = sum(p.numel() for p in BlockNet().parameters())
    for rank in ranks:
        assert rank["fsdp"]["sharded"] and not rank["ddp"]["sharded"]
        assert rank["fsdp"]["local"] < 0.6 * total      # each rank holds about half the parameters
        for name, _ in EXACT_CASES:
            one, r = single[name], rank[name]
            tol = APPROXIMATE.get(name, 1e-5)
            assert weight_diff(one["weights"], r["weights"]) < tol, name
            assert weight_diff(one["ema"], r["ema"]) < tol, name
            for a, b in zip(one["history"], r["history"]):
                assert b["train/loss"] == pytest.approx(a["train/loss"], abs=tol / 10), name
                assert b["test/Accuracy"] == pytest.approx(a["test/Accuracy"], abs=1e-9), name
                assert b["test/loss"] == pytest.approx(a["test/loss"], abs=tol / 10), name
        assert rank["fsdp_tied"]["tied"] is True and rank["fsdp_tied"]["sharded"]
        assert weight_diff(rank["fsdp"]["weights"], rank["ddp"]["weights"]) < 1e-5
        for option in ("fsdp_activation_checkpointing", "fsdp_no_reshard"):
            assert weight_diff(rank["fsdp"]["weights"], rank[option]["weights"]) < 1e-6, option


# ----------------------------------------------------------------------------- resume on another world size
def _cfg(work, strategy, **over):
    return fsdp_cfg(strategy=strategy, work_dir=str(work), **over)


def _callbacks(work):
    return [LossesRecorder(), AccuracyRecorder(), ModelEMA(decay=0.9, evaluate=False),
            ModelCheckpoint(model_dir=os.path.join(str(work), "model"), indicator="Accuracy", save_freq_steps=3,
                            async_save=False)]


def _first_part(rank, runs):
    """For each (strategy, work, stop inside): stop inside epoch 1 (after its step-6 checkpoint),
    or train 2 whole epochs."""
    for strategy, work, inside in runs:
        if inside:
            with pytest.raises(KeyboardInterrupt):
                BlockTrainer(_cfg(work, strategy), callbacks=_callbacks(work) + [StopAt(1, 6, how=KeyboardInterrupt)]).run()
        else:
            BlockTrainer(_cfg(work, strategy, num_epochs=2), callbacks=_callbacks(work)).run()
    return comm.get_world_size()


def _second_part(rank, runs):
    out = []
    for strategy, work, _ in runs:
        callbacks = _callbacks(work)
        t = BlockTrainer(_cfg(work, strategy, resume="auto"), callbacks=callbacks)
        t.run()
        ema = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in callbacks[2].ema.items()}
        out.append((full_weights(t), ema))
    return out


def _reference(tmp_path):
    callbacks = _callbacks(tmp_path / "reference")
    t = BlockTrainer(_cfg(tmp_path / "reference", "ddp", distributed=False), callbacks=callbacks)
    t.run()
    return full_weights(t), callbacks[2].ema


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("worlds", [(2, 1), (1, 3)])
def test_resume_on_another_world_size_continues_exactly(tmp_path, worlds):
    """ddp and fsdp checkpoints, mid-epoch and at an epoch's end, resumed on another world size."""
    runs = [(strategy, str(tmp_path / f"{strategy}_{'inside' if inside else 'at_end'}"), inside)
            for strategy in ("fsdp", "ddp") for inside in (True, False)]
    before, after = worlds
    run_distributed(_first_part, before, tmp_path / "a", runs, timeout=300)
    # and each kind of checkpoint taken up by the other strategy (a copy of the mid-epoch runs)
    for strategy, work, inside in (list(runs[::2]) if after == 1 else []):
        other = "ddp" if strategy == "fsdp" else "fsdp"
        shutil.copytree(work, work + "_as_" + other)
        runs.append((other, work + "_as_" + other, inside))
    # the sharded layout: a pointer file and one shard per rank
    state = checkpoint.load_file(os.path.join(runs[0][1], "model", "last.pth"))
    assert state["shards"].startswith(sharded.PREFIX) and state["world_size"] == before
    files = os.listdir(os.path.join(runs[0][1], "model", state["shards"]))
    assert sorted(f for f in files if f.endswith(".distcp")) == [f"__{r}_0.distcp" for r in range(before)]
    assert checkpoint.position(state) == (1, "train", 6)
    assert "shards" not in checkpoint.load_file(os.path.join(runs[2][1], "model", "last.pth"))   # ddp: one file
    resumed = run_distributed(_second_part, after, tmp_path / "b", runs, timeout=300)
    reference, reference_ema = _reference(tmp_path)
    for rank in resumed:
        for (strategy, work, inside), (weights, ema) in zip(runs, rank):
            assert weight_diff(reference, weights) < 1e-5, (strategy, work)
            assert weight_diff(reference_ema, ema) < 1e-5, (strategy, work)   # sharded callback state too


# ----------------------------------------------------------------------------- the files of a sharded run
def _fsdp_run(rank, work):
    t = BlockTrainer(_cfg(work, "fsdp", num_epochs=1), callbacks=_callbacks(work))   # best = final weights
    t.run()
    return full_weights(t)


@pytest.mark.distributed
@pytest.mark.slow
def test_sharded_checkpoint_files_and_planted_code_is_refused(tmp_path):
    work = str(tmp_path / "run")
    weights = run_distributed(_fsdp_run, 2, tmp_path, work, timeout=300)[0]
    folder = os.path.join(work, "model")
    last = checkpoint.load_file(os.path.join(folder, "last.pth"))          # weights_only
    prev = checkpoint.load_file(os.path.join(folder, "last.prev.pth"))
    assert last["shards"] != prev["shards"]
    shard_dirs = sorted(n for n in os.listdir(folder) if n.startswith(sharded.PREFIX))
    assert shard_dirs == sorted([last["shards"], prev["shards"]])          # older ones were removed
    assert last["model"]["stem.weight"] == "dcp:model/stem.weight"         # tensors live in the shards
    best = [n for n in os.listdir(folder) if n.startswith("best_model_")]
    assert len(best) == 1                                                  # one ordinary .pth, whole weights
    assert weight_diff(torch.load(os.path.join(folder, best[0]), weights_only=True), weights) == 0.0

    # one file from the shards, in a plain process (no process group), equal to the weights
    one = subprocess.run([PY, "-m", "basetrainer.runtime.sharded", os.path.join(folder, "last.pth"),
                          str(tmp_path / "one.pth")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert one.returncode == 0, one.stderr[-3000:]
    assert weight_diff(torch.load(tmp_path / "one.pth", weights_only=True), weights) == 0.0

    # a damaged shard (same size, bytes overwritten) is found at resume: it falls back to last.prev.pth
    shard = os.path.join(folder, last["shards"], "__1_0.distcp")
    original = open(shard, "rb").read()
    with open(shard, "r+b") as f:
        f.seek(len(original) // 2)
        f.write(b"\0" * 64)
    path, _ = checkpoint.CheckpointFolder(folder).find_resumable()
    assert path.endswith("last.prev.pth")
    with open(shard, "wb") as f:
        f.write(original)
    assert checkpoint.CheckpointFolder(folder).find_resumable()[0].endswith("last.pth")
    with pytest.raises(ValueError, match="sharded checkpoint's last.pth.*python -m basetrainer.runtime.sharded"):
        checkpoint.extract_state_dict(last, source=os.path.join(folder, "last.pth"))   # e.g. finetune: last.pth

    # a .metadata that runs code when unpickled is refused, and the code never runs
    witness = tmp_path / "code_ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {witness}",))

    with open(os.path.join(folder, last["shards"], ".metadata"), "wb") as f:
        pickle.dump(Payload(), f)
    with pytest.raises(shard_io.UnsafeCheckpointError, match="posix.system|os.system"):
        shard_io.read_metadata(os.path.join(folder, last["shards"]))
    path, state = checkpoint.CheckpointFolder(folder).find_resumable()    # resume falls back to last.prev.pth
    assert path.endswith("last.prev.pth") and not witness.exists()
    # and a torch.load of the same file would have run it: the test's payload is real
    with open(os.path.join(folder, last["shards"], ".metadata"), "rb") as f:
        pickle.load(f)
    assert witness.exists()


class WithUnused(BlockNet):
    """A head that never gets a gradient (so the optimizer holds no state for it)."""

    def __init__(self):
        super().__init__()
        self.unused = nn.Linear(24, 2)


class UnusedTrainer(BlockTrainer):
    def build_model(self, cfg, **kwargs):
        torch.manual_seed(cfg.seed)
        return self.build_model_parallel(WithUnused(), cfg.gpu_id, distributed=cfg.distributed)

    def build_optimizer(self, cfg, **kwargs):
        return torch.optim.Adam(self.model.parameters(), lr=0.01)


class Snapshot(Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            self.trainer.save_checkpoint(path=os.path.join(self.trainer.cfg.work_dir, "model", "snapshot.pth"))


def _snapshot_and_resume(rank, work):
    t = UnusedTrainer(_cfg(work, "fsdp", num_epochs=2), callbacks=_callbacks(work) + [Snapshot()])
    t.run()
    # the snapshot's shards outlive the later saves; a new run resumes from it (Adam has no
    # state for the unused head, which must not stop the load)
    resumed = UnusedTrainer(_cfg(work + "_from_snapshot", "fsdp", num_epochs=2, resume=os.path.join(
        work, "model", "snapshot.pth")), callbacks=_callbacks(work + "_from_snapshot"))
    resumed.run()
    return full_weights(t), full_weights(resumed), resumed.global_step


@pytest.mark.distributed
@pytest.mark.slow
def test_a_snapshot_outlives_later_saves_and_a_parameter_without_state_resumes(tmp_path):
    work = str(tmp_path / "run")
    first, second, steps = run_distributed(_snapshot_and_resume, 2, tmp_path, work, timeout=300)[0]
    snapshot = checkpoint.load_file(os.path.join(work, "model", "snapshot.pth"))
    assert checkpoint.position(snapshot)[0] == 0 and snapshot["shards"].startswith("snapshot.pth-shards-")
    assert steps == 2 * 9 and weight_diff(first, second) < 1e-6   # trained on from epoch 0's end, to the same weights


def test_wrap_choice_and_clear_errors():
    resnet = torchvision.models.resnet18(weights=None)
    assert {type(m).__name__ for m in fsdp_build.blocks_to_wrap(resnet)} == {"BasicBlock"}
    assert len(fsdp_build.blocks_to_wrap(resnet)) == 8
    mobilenet = torchvision.models.mobilenet_v2(weights=None)
    assert {type(m).__name__ for m in fsdp_build.blocks_to_wrap(mobilenet)} == {"InvertedResidual"}
    assert len(fsdp_build.blocks_to_wrap(BlockNet(), wrap=["Block"])) == 3
    assert len(fsdp_build.blocks_to_wrap(BlockNet(), policy=lambda m: isinstance(m, nn.Linear))) == 5
    with pytest.raises(ValueError, match="fsdp_wrap.*'Blok'.*match no module class"):
        fsdp_build.blocks_to_wrap(BlockNet(), wrap=["Blok"])
    tied = BlockNet()
    tied.blocks[1].fc.weight = tied.blocks[0].fc.weight     # shared by two blocks: sharded apart
    with pytest.raises(ValueError, match=r"blocks.0.fc.weight.*blocks.1.fc.weight.*tied.*fsdp_wrap"):
        fsdp_weights.tied(tied, fsdp_build.blocks_to_wrap(tied))
    with pytest.raises(ValueError, match="no process group|none is initialised"):
        BlockTrainer(fsdp_cfg(strategy="fsdp"))
    with pytest.raises(ValueError, match="DataParallel"):
        BlockTrainer(fsdp_cfg(strategy="fsdp", gpu_id=[0, 1], distributed=False))
    with pytest.raises(ValueError, match="amp: fp16.*amp: bf16"):
        BlockTrainer(fsdp_cfg(strategy="fsdp", amp="fp16"))
    # a full disk during a sharded save: DCP keeps each rank's error in its exception's failures
    from torch.distributed.checkpoint.api import CheckpointException
    from basetrainer.runtime import atomic
    import errno
    full = OSError(errno.ENOSPC, "No space left on device")
    assert atomic.space_error(CheckpointException("save failed", {1: (full, None)})) is full
    assert atomic.space_error(CheckpointException("save failed", {0: (RuntimeError("x"), None)})) is None
    with pytest.raises(ValueError, match="use_prune.*strategy: ddp"):
        BlockTrainer(fsdp_cfg(strategy="fsdp", use_prune=True))
    with pytest.raises(ValueError, match="'strategy' = 'zero3'"):
        BlockTrainer(fsdp_cfg(strategy="zero3"))


# ----------------------------------------------------------------------------- crashes and restarts
SCRIPT = textwrap.dedent('''
    import os, signal, sys
    sys.path[:0] = [{root!r}, {tests!r}]
    import torch
    from basetrainer.callbacks.callbacks import Callback
    from basetrainer.callbacks.model_checkpoint import ModelCheckpoint
    from basetrainer.engine.launch import launch
    from fsdp_common import BlockTrainer, fsdp_cfg, full_weights

    work, mode = sys.argv[1], sys.argv[2]

    class Kill(Callback):
        """SIGKILL this process once (a marker file remembers): rank 1, epoch 1, after step 5 (and
        its checkpoint, written after every on_batch_end: when step 6 is prepared)."""
        def on_batch_prepare(self, epoch, batch, logs=None):
            marker = os.path.join(work, "killed")
            if (mode == "elastic" and self.trainer.rank == 1 and self.trainer.epoch == 1 and batch == 5
                    and not os.path.exists(marker)):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)

    class Where(Callback):
        """Writes where each attempt of the job starts (epoch, optimizer steps already taken)."""
        def on_train_begin(self, logs=None):
            if self.trainer.rank == 0:
                name = "attempt_" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "x") + ".txt"
                with open(os.path.join(work, name), "w") as f:
                    f.write(f"{{self.trainer.start_epoch}} {{self.trainer.global_step}}")

    def main(cfg):
        if mode == "save-crash":   # SIGKILL while the second sharded save writes its files
            import torch.distributed.checkpoint.filesystem as fs
            finish = fs.FileSystemWriter.finish
            calls = []
            def dying_finish(self, *a, **k):
                calls.append(1)
                if len(calls) == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
                return finish(self, *a, **k)
            fs.FileSystemWriter.finish = dying_finish
        cb = [ModelCheckpoint(model_dir=os.path.join(work, "model"), save_freq_steps=3, async_save=False), Kill(), Where()]
        t = BlockTrainer(fsdp_cfg(strategy="fsdp", work_dir=work, resume="auto", distributed=True), callbacks=cb)
        t.run()
        weights = full_weights(t)
        if t.rank == 0:
            torch.save(weights, os.path.join(work, "final.pt"))

    if __name__ == "__main__":
        # under torchrun launch joins the group torchrun describes; else it starts one process
        launch(main, num_gpus_per_machine=1, dist_url="auto", distributed=True, args=(None,), backend="gloo")
''')


script = script_fixture(SCRIPT, "train_fsdp.py")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    t = BlockTrainer(_cfg(tmp_path_factory.mktemp("ref"), "ddp", distributed=False))
    t.run()
    return full_weights(t)


@pytest.mark.distributed
@pytest.mark.slow
def test_sigkill_during_a_sharded_save_leaves_the_previous_last_loadable(tmp_path, script, reference):
    work = str(tmp_path / "run")
    os.makedirs(work)
    crashed = run_script(script, work, "save-crash", timeout=240)
    assert crashed.returncode != 0
    folder = os.path.join(work, "model")
    state = checkpoint.load_file(os.path.join(folder, "last.pth"))
    assert checkpoint.position(state) == (0, "train", 3)       # the first save; the second never finished
    partial = [n for n in os.listdir(folder) if n.startswith(sharded.PREFIX) and n != state["shards"]]
    assert len(partial) == 1 and not os.path.exists(os.path.join(folder, partial[0], ".metadata"))
    path, _ = checkpoint.CheckpointFolder(folder).find_resumable()
    assert path.endswith("last.pth")
    done = run_script(script, work, "resume", timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert weight_diff(reference, torch.load(os.path.join(work, "final.pt"), weights_only=True)) < 1e-6
    assert not os.path.exists(os.path.join(folder, partial[0]))   # the killed save's files are gone


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_max_restarts_resumes_a_killed_rank_exactly(tmp_path, script, reference):
    work = str(tmp_path / "run")
    os.makedirs(work)
    cmd = [PY, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--monitor-interval", "0.5",
           script, work, "elastic"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-4000:]
    assert os.path.exists(os.path.join(work, "killed"))          # a rank was killed, and the group restarted
    # the first attempt started from scratch; the restart at the step-3 checkpoint of epoch 1
    assert open(os.path.join(work, "attempt_0.txt")).read() == "0 0"
    assert open(os.path.join(work, "attempt_1.txt")).read() == "1 12"
    assert weight_diff(reference, torch.load(os.path.join(work, "final.pt"), weights_only=True)) < 1e-6
