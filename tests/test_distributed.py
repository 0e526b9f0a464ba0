"""DDP on CPU (gloo, 2 processes on 127.0.0.1): equivalence with one process, exact metrics,
sharding, launch(), torchrun, two machines on loopback, failures that end the job."""
import glob
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch.utils.data import DistributedSampler

from basetrainer.callbacks.log_history import LogHistory
from basetrainer.callbacks.losses_recorder import LossesRecorder
from basetrainer.callbacks.model_checkpoint import ModelCheckpoint
from basetrainer.dataloader.loader import ShardSampler
from basetrainer.runtime import comm
from basetrainer.metric.accuracy_recorder import AccuracyRecorder

from conftest import (ROOT, ToyTrainer, blobs, free_port, make_image_folder, run_distributed, toy_cfg,
                      weight_diff)

PY = sys.executable
TIMEOUT = 180


def _weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.unwrapped_model.state_dict().items()}


def _train(rank, cfg):
    t = ToyTrainer(cfg, callbacks=[AccuracyRecorder(), LossesRecorder()])
    history = t.run()
    return {"weights": _weights(t), "history": history.epochs, "world": comm.get_world_size(),
            "local_batch": len(next(iter(t.train_loader.batch_sampler)))}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("shuffle", [True, False])
def test_ddp_equals_single_process(tmp_path, shuffle):
    cfg = toy_cfg(num_epochs=3, batch_size=32, n_train=128, n_test=0, shuffle=shuffle, lr=0.2, momentum=0.9)
    single = _train(0, cfg)
    results = run_distributed(_train, 2, tmp_path, toy_cfg(**{**cfg, "distributed": True}), timeout=TIMEOUT)
    assert [r["world"] for r in results] == [2, 2]
    assert [r["local_batch"] for r in results] == [16, 16]
    for r in results:
        assert weight_diff(single["weights"], r["weights"]) <= 1e-5
    # training figures are the whole data set's, equal to the single run's
    for s, d in zip(single["history"], results[0]["history"]):
        assert d["train/loss"] == pytest.approx(s["train/loss"], abs=1e-5)
        assert d["train/Accuracy"] == pytest.approx(s["train/Accuracy"], abs=1e-9)


@pytest.mark.distributed
@pytest.mark.slow
def test_ddp_sync_bn_equals_single_process(tmp_path):
    cfg = toy_cfg(num_epochs=3, batch_size=32, n_train=128, n_test=0, bn=True, lr=0.1, momentum=0.9)
    single = _train(0, cfg)
    results = run_distributed(_train, 2, tmp_path, toy_cfg(**{**cfg, "distributed": True, "sync_bn": True}),
                              timeout=TIMEOUT)
    for r in results:
        assert weight_diff(single["weights"], r["weights"]) <= 1e-5


@pytest.mark.distributed
@pytest.mark.slow
def test_ddp_test_metrics_equal_single_on_101_samples(tmp_path):
    # 101 test samples over 2 ranks: 51 + 50, no padding, no duplicates
    cfg = toy_cfg(num_epochs=1, batch_size=8, n_train=64, n_test=101, lr=0.01)
    single = _train(0, cfg)
    results = run_distributed(_train, 2, tmp_path, toy_cfg(**{**cfg, "distributed": True}), timeout=TIMEOUT)
    for r in results:
        for key in ("test/Accuracy", "test/loss"):
            assert r["history"][0][key] == pytest.approx(single["history"][0][key], abs=1e-6), key
    # a toy model after one tiny epoch is not perfect: the figure is a real fraction
    assert 0 < single["history"][0]["test/Accuracy"] <= 1


def test_shards_are_disjoint_cover_and_reshuffle():
    ds = blobs(101)
    shards = [list(ShardSampler(ds, num_replicas=2, rank=r)) for r in range(2)]
    assert len(shards[0]) == 51 and len(shards[1]) == 50
    assert sorted(shards[0] + shards[1]) == list(range(101))
    orders = []
    for epoch in range(2):
        ranks = []
        for r in range(2):
            s = DistributedSampler(blobs(128), num_replicas=2, rank=r, shuffle=True, seed=0)
            s.set_epoch(epoch)
            ranks.append(list(s))
        assert not set(ranks[0]) & set(ranks[1])
        assert sorted(ranks[0] + ranks[1]) == list(range(128))
        orders.append(ranks[0])
    assert orders[0] != orders[1]


def _rank_lengths_mismatch(rank):
    from torch.utils.data import DataLoader
    from basetrainer.dataloader.loader import check_equal_lengths

    loader = DataLoader(list(range(10 + rank * 4)), batch_size=2)
    try:
        check_equal_lengths(loader)
    except RuntimeError as e:
        return str(e)
    return ""


@pytest.mark.distributed
def test_unequal_batch_counts_caught_before_training(tmp_path):
    messages = run_distributed(_rank_lengths_mismatch, 2, tmp_path, timeout=TIMEOUT)
    for m in messages:
        assert "different numbers of train batches [5, 7]" in m


LAUNCH_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    sys.path.insert(0, {tests!r})
    from conftest import ToyTrainer, toy_cfg
    from basetrainer.engine.launch import launch
    from basetrainer.callbacks.log_history import LogHistory
    from basetrainer.callbacks.model_checkpoint import ModelCheckpoint
    from basetrainer.callbacks.losses_recorder import LossesRecorder

    from basetrainer.callbacks.callbacks import Callback

    class Boom(Callback):
        def __init__(self, rank):
            super().__init__()
            self.rank = rank

        def on_epoch_end(self, epoch, logs=None):
            if self.trainer.rank == self.rank:
                raise RuntimeError("rank %d failed on purpose" % self.rank)

    def main(cfg):
        t = ToyTrainer(cfg, callbacks=[LossesRecorder(),
                                       LogHistory(os.path.join(cfg.work_dir, "log"), log_freq=2),
                                       ModelCheckpoint(model_dir=os.path.join(cfg.work_dir, "model"), indicator="loss"),
                                       Boom(cfg.fail_rank)])
        t.run()
        if t.rank == 0:
            torch.save(t.unwrapped_model.state_dict(), os.path.join(cfg.work_dir, "final.pt"))

    if __name__ == "__main__":
        work_dir, machines, machine_rank, url = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
        fail_rank = int(sys.argv[5]) if len(sys.argv) > 5 else -1
        procs = int(os.environ.get("PROCS", "2"))
        cfg = toy_cfg(num_epochs=3, batch_size=32, n_train=128, distributed=True, work_dir=work_dir,
                      gpu_id=list(range(procs)), fail_rank=fail_rank)
        launch(main, num_gpus_per_machine=procs, dist_url=url, num_machines=machines,
               machine_rank=machine_rank, distributed=True, args=(cfg,), timeout=60)
""")


@pytest.fixture
def launch_script(tmp_path):
    path = tmp_path / "launch_toy.py"
    path.write_text(LAUNCH_SCRIPT.format(tests=os.path.join(ROOT, "tests")))
    return str(path)


def _single_weights():
    cfg = toy_cfg(num_epochs=3, batch_size=32, n_train=128)
    return _weights_of(ToyTrainer(cfg, callbacks=[LossesRecorder()]))


def _weights_of(trainer):
    trainer.run()
    return _weights(trainer)


@pytest.mark.distributed
@pytest.mark.slow
def test_launch_spawns_two_cpu_processes_and_only_rank0_writes(tmp_path, launch_script):
    work = tmp_path / "work"
    proc = subprocess.run([PY, launch_script, str(work), "1", "0", "auto"], capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert weight_diff(_single_weights(), torch.load(work / "final.pt", weights_only=True)) <= 1e-5
    # one TensorBoard event file and one history: rank 1 wrote nothing
    assert len(glob.glob(str(work / "log" / "events.out.tfevents.*"))) == 1
    files = sorted(os.listdir(work / "model"))
    assert "last.pth" in files and len([f for f in files if f.startswith("best_model_")]) == 1
    assert not [f for f in files if ".tmp" in f]
    rows = (work / "log" / "history.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + 3


RESULT_SCRIPT = textwrap.dedent("""
    import pickle, sys
    sys.path.insert(0, {tests!r})
    from conftest import ToyTrainer, toy_cfg
    from basetrainer.callbacks.losses_recorder import LossesRecorder
    from basetrainer.engine.launch import launch

    def main(cfg):
        return ToyTrainer(cfg, callbacks=[LossesRecorder()]).run()    # the History, in every process

    def unpicklable(cfg):
        return lambda: None

    if __name__ == "__main__":
        got = {{}}
        for procs in (1, 2):
            cfg = toy_cfg(num_epochs=2, batch_size=32, n_train=128, distributed=procs > 1, gpu_id=list(range(procs)))
            got[procs] = launch(main, num_gpus_per_machine=procs, dist_url="auto", distributed=procs > 1,
                                args=(cfg,), timeout=60)
        got["lambda"] = launch(unpicklable, num_gpus_per_machine=2, dist_url="auto", distributed=True,
                               args=(toy_cfg(distributed=True, gpu_id=[0, 1]),), timeout=60)
        with open(sys.argv[1], "wb") as f:
            pickle.dump(got, f)
""")


@pytest.mark.distributed
@pytest.mark.slow
def test_launch_returns_the_result_in_the_same_shape_for_one_and_two_processes(tmp_path):
    import pickle

    from basetrainer.engine.history import History

    script = tmp_path / "result_toy.py"
    script.write_text(RESULT_SCRIPT.format(tests=os.path.join(ROOT, "tests")))
    out = tmp_path / "results.pkl"
    proc = subprocess.run([PY, str(script), str(out)], capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out, "rb") as f:
        got = pickle.load(f)
    one, two = got[1], got[2]
    assert isinstance(one, History) and isinstance(two, History)   # before: a History, then None under DDP
    assert [r["epoch"] for r in one.epochs] == [r["epoch"] for r in two.epochs] == [0, 1]
    assert two["train/loss"] == pytest.approx(one["train/loss"], rel=1e-4)   # DDP equals one process
    assert got["lambda"] is None
    assert "launch: main_func returned a function, which can't be sent back to the launching process" in proc.stdout \
        + proc.stderr


EXIT_SCRIPT = textwrap.dedent("""
    import atexit, os, sys
    sys.path.insert(0, {tests!r})
    from conftest import ToyTrainer, toy_cfg
    from basetrainer.callbacks.losses_recorder import LossesRecorder
    from basetrainer.engine.launch import launch

    def threads_left(path):
        task = "/proc/self/task"
        names = sorted(open(os.path.join(task, t, "comm")).read().strip() for t in os.listdir(task))
        with open(path, "w") as f:
            f.write("\\n".join(names))

    def main(cfg):
        # at interpreter exit (before its last garbage collection) list the threads still running
        atexit.register(threads_left, os.path.join(cfg.work_dir, "threads_%s.txt" % os.environ["RANK"]))
        t = ToyTrainer(cfg, callbacks=[LossesRecorder()])  # the trainer <-> callback cycle outlives main
        t.run()

    if __name__ == "__main__":
        cfg = toy_cfg(num_epochs=1, batch_size=32, n_train=128, distributed=True, work_dir=sys.argv[1],
                      gpu_id=[0, 1])
        os.makedirs(cfg.work_dir, exist_ok=True)
        launch(main, num_gpus_per_machine=2, dist_url="auto", distributed=True, args=(cfg,), timeout=60)
""")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="lists threads through Linux's /proc")
def test_launch_joins_the_group_threads_before_interpreter_exit(tmp_path):
    # A gloo worker thread still alive when the interpreter shuts down can abort a rank whose
    # training succeeded (SIGABRT, "terminate called without an active exception"): launch must
    # free the DDP model and destroy the group, joining its threads, before the worker exits.
    script = tmp_path / "exit_toy.py"
    script.write_text(EXIT_SCRIPT.format(tests=os.path.join(ROOT, "tests")))
    work = tmp_path / "work"
    proc = subprocess.run([PY, str(script), str(work)], capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        names = (work / f"threads_{rank}.txt").read_text().split()
        assert "python" in names  # the list was read from this process
        assert not [n for n in names if "gloo" in n or "tcpstore" in n], (rank, names)


@pytest.mark.distributed
def test_busy_port_is_replaced_and_training_runs(tmp_path, launch_script):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc = subprocess.run([PY, launch_script, str(tmp_path / "w"), "1", "0", f"tcp://127.0.0.1:{port}"],
                              capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"port {port} is busy" in proc.stdout + proc.stderr
    assert (tmp_path / "w" / "final.pt").is_file()


@pytest.mark.distributed
@pytest.mark.slow
def test_two_machines_on_loopback_train_together(tmp_path, launch_script):
    url = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "PROCS": "1"}
    work = tmp_path / "multi"
    procs = [subprocess.Popen([PY, launch_script, str(work), "2", str(r), url], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    # 2 machines x 1 process, global batch 32: the same weights as one process
    assert weight_diff(_single_weights(), torch.load(work / "final.pt", weights_only=True)) <= 1e-5


@pytest.mark.distributed
@pytest.mark.slow
def test_failing_rank_ends_the_job_nonzero_fast_without_orphans(tmp_path, launch_script):
    marker = str(tmp_path / "failjob")
    start = time.monotonic()
    proc = subprocess.run([PY, launch_script, marker, "1", "0", "auto", "1"], capture_output=True, text=True,
                          timeout=TIMEOUT)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert elapsed < 60
    assert "rank 1 failed on purpose" in proc.stderr
    assert "Boom.on_epoch_end" in proc.stderr  # the callback is named
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes left behind: {left}"


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_trains_the_example(tmp_path):
    data = tmp_path / "data"
    make_image_folder(str(data / "train"), ["a", "b"], per_class=8)
    make_image_folder(str(data / "val"), ["a", "b"], per_class=3)
    torchrun = os.path.join(os.path.dirname(PY), "torchrun")
    cmd = [torchrun, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           os.path.join(ROOT, "examples", "example.py"), "--distributed", "--gpu_id", "0", "1",
           "--train_data", str(data / "train"), "--test_data", str(data / "val"), "--net_type", "mobilenet_v3_small",
           "--input_size", "32", "32", "--batch_size", "8", "--num_epochs", "1", "--no-progress",
           "--work_dir", str(tmp_path / "work"), "--log_freq", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final test/Accuracy" in proc.stdout
    assert "processes: 2" in proc.stdout
    assert (tmp_path / "work" / "model" / "last.pth").is_file()


def _prune_rank(rank, out):
    pytest.importorskip("torch_pruning", reason="torch-pruning (extra 'prune') is not installed")
    from basetrainer.models.build_models import get_models
    from basetrainer.pruning.nni_pruning import model_pruning

    torch.manual_seed(100 + rank)  # each rank starts from different dense weights
    model = get_models("resnet18", [32, 32], 10)
    dense = sum(p.numel() for p in model.parameters())
    model = model_pruning(model, [32, 32], sparsity=0.5, output_prune=out)
    return {"dense": dense, "state": {k: v.clone() for k, v in model.state_dict().items()}}


@pytest.mark.distributed
@pytest.mark.slow
def test_ddp_prunes_once_on_rank0_and_every_rank_holds_it(tmp_path):
    pytest.importorskip("torch_pruning", reason="torch-pruning (extra 'prune') is not installed")
    results = run_distributed(_prune_rank, 2, tmp_path, str(tmp_path / "prune"), timeout=TIMEOUT)
    assert weight_diff(results[0]["state"], results[1]["state"]) == 0.0
    pruned = sum(v.numel() for k, v in results[0]["state"].items() if "running" not in k and "num_batches" not in k)
    assert pruned <= 0.35 * results[0]["dense"]


PREEMPT_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from conftest import ToyTrainer, toy_cfg
    from basetrainer.callbacks.callbacks import Callback
    from basetrainer.callbacks.model_checkpoint import ModelCheckpoint
    from basetrainer.engine.launch import launch

    class SignalRank1(Callback):
        def on_batch_end(self, batch, logs=None):
            if self.trainer.rank == 1 and (self.trainer.epoch, batch) == (1, 0):
                os.kill(os.getpid(), signal.SIGTERM)

    def main(cfg):
        ToyTrainer(cfg, callbacks=[ModelCheckpoint(model_dir=os.path.join(cfg.work_dir, "model")),
                                   SignalRank1()]).run()

    if __name__ == "__main__":
        cfg = toy_cfg(num_epochs=3, batch_size=16, n_train=128, distributed=True, work_dir=sys.argv[1],
                      gpu_id=[0, 1], log_freq=2)
        launch(main, num_gpus_per_machine=2, dist_url="auto", distributed=True, args=(cfg,), timeout=60)
""")


@pytest.mark.distributed
@pytest.mark.slow
def test_sigterm_on_one_rank_stops_all_ranks_at_the_same_step(tmp_path):
    from basetrainer.runtime import checkpoint

    script = tmp_path / "preempt.py"
    script.write_text(PREEMPT_SCRIPT.format(tests=os.path.join(ROOT, "tests")))
    start = time.monotonic()
    proc = subprocess.run([PY, str(script), str(tmp_path / "w")], capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode != 0 and time.monotonic() - start < 60
    state = checkpoint.load_file(str(tmp_path / "w" / "model" / "last.pth"))
    # the signal came after step 1 of epoch 1 on rank 1; the ranks agree at the next log point (step 2)
    assert (state["epoch"], state["epoch_complete"], state["batch"]) == (1, False, 2)
    assert len(state["rng"]) == 2  # every rank's generators
