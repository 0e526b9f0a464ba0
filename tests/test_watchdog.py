"""The stall watchdog (issue 36): a rank that stops progressing ends the job within
``stall_timeout`` with a report naming every rank's place and the rank that differs, exit status
3 on every process, none left behind, and the last checkpoint loadable. Without the watchdog
(``stall_timeout: 0``) the same scripts hang until the process group's timeout (30 minutes)."""
import datetime
import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from basetrainer.callbacks.callbacks import Callback
from basetrainer.engine import launch as launch_mod
from basetrainer.engine import spawn as spawn_mod
from basetrainer.runtime import crash_report, processes, stacks, stall_report, watchdog
from basetrainer.utils import setup_config

from conftest import ToyTrainer, free_port, run_script, script_fixture, toy_cfg

SCRIPT = textwrap.dedent("""
    import os, sys, time, torch
    sys.path.insert(0, {tests!r})
    from conftest import ToyTrainer, toy_cfg
    from basetrainer.callbacks.callbacks import Callback
    from basetrainer.callbacks.losses_recorder import LossesRecorder
    from basetrainer.callbacks.model_checkpoint import ModelCheckpoint
    from basetrainer.engine.launch import launch

    def stalled(work):
        with open(os.path.join(work, "stalled_at"), "w") as f:
            f.write(repr(time.time()))

    class OneSided(Callback):   # (a) a collective on rank 0 only
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1 and self.trainer.rank == 0:
                stalled(self.trainer.cfg.work_dir)
                torch.distributed.all_reduce(torch.ones(1))   # LINE-A

    class Sleeper(Callback):    # (b) one rank asleep in on_epoch_end; (e) one process: a stalled tracker call
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1 and self.trainer.rank == int(os.environ["SLEEPER"]):
                stalled(self.trainer.cfg.work_dir)
                time.sleep(3600)   # LINE-B

    class Stuck(torch.utils.data.Dataset):   # (d) a data worker of rank 1 that never returns an item
        def __init__(self, data):
            self.data = data
        def __len__(self):
            return len(self.data)
        def __getitem__(self, index):
            armed = os.path.join(os.environ["WORK"], "armed")
            if os.environ.get("RANK", "0") == os.environ["STUCK"] and os.path.exists(armed) \\
                    and not os.path.exists(armed + ".used"):
                open(armed + ".used", "w").write(str(index))
                stalled(os.environ["WORK"])
                time.sleep(3600)   # LINE-D
            return self.data[index]

    class Arm(Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1 and self.trainer.rank == int(os.environ["STUCK"]):
                open(os.path.join(self.trainer.cfg.work_dir, "armed"), "w").close()

    class Trainer(ToyTrainer):
        def train_step(self, data, batch):   # (c) one rank swallows an exception and skips a batch
            if os.environ.get("EXTRA") == str(self.rank) and self.epoch == 1 and batch == 1:
                stalled(self.cfg.work_dir)
                torch.distributed.all_reduce(torch.zeros(1000))   # LINE-X: a collective of this rank only
            try:
                if os.environ.get("SKIP") == str(self.rank) and self.epoch == 1 and batch == 1:
                    stalled(self.cfg.work_dir)
                    raise RuntimeError("a corrupt batch")   # LINE-C
                self.last = super().train_step(data, batch)
            except RuntimeError:
                pass
            return self.last

        def build_train_loader(self, cfg, **kwargs):
            from conftest import blobs
            data = blobs(cfg.n_train, 4, seed=0)
            return self.build_dataloader(Stuck(data) if cfg.num_workers else data, cfg.batch_size, cfg.num_workers,
                                         phase="train")

    def main(work, scenario, stall):
        open(os.path.join(work, "pids", str(os.getpid())), "w").close()
        single = scenario.startswith("single")
        cfg = toy_cfg(num_epochs=3, batch_size=16, n_train=64, work_dir=work, distributed=not single,
                      stall_timeout=stall, num_workers=1 if scenario.endswith("d") else 0, bn=scenario == "cbn")
        callbacks = [LossesRecorder(), ModelCheckpoint(model_dir=os.path.join(work, "model"), indicator="loss"),
                     OneSided() if scenario == "a" else Arm() if scenario.endswith("d") else Sleeper()]
        Trainer(cfg, callbacks=callbacks).run()

    if __name__ == "__main__":
        work, scenario, stall, procs = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
        os.makedirs(os.path.join(work, "pids"), exist_ok=True)
        os.environ["WORK"] = work
        if "LOCAL_RANK" in os.environ:   # torchrun: the launcher joins its world
            procs = int(os.environ["LOCAL_WORLD_SIZE"])
        launch(main, num_gpus_per_machine=procs, distributed=not scenario.startswith("single"),
               args=(work, scenario, stall))
""")
script = script_fixture(SCRIPT, "train_stall.py")

STALL = 2.0


def _line(path, marker):
    with open(path) as f:
        return next(i for i, text in enumerate(f, start=1) if marker in text)


def _srun(cmd, procs, env):
    """The processes srun would start: one per task, with SLURM's variables (no launcher)."""
    port, started = free_port(), []
    for rank in range(procs):
        slurm = {"SLURM_NTASKS": str(procs), "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
                 "SLURM_NTASKS_PER_NODE": str(procs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        started.append(subprocess.Popen(cmd, env={**env, **slurm}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True))
    outputs = [p.communicate(timeout=180) for p in started]
    return subprocess.CompletedProcess(cmd, max(p.returncode for p in started), "".join(o for o, _ in outputs),
                                       "".join(e for _, e in outputs)), [p.returncode for p in started]


def _stall(script, tmp_path, scenario, procs, sleeper=1, torchrun=False, slurm=False):
    work = str(tmp_path / "work")
    env = {**os.environ, "SLEEPER": str(sleeper), "STUCK": str(sleeper)}
    if scenario in ("c", "cbn"):
        env["SKIP"] = str(sleeper)
    if scenario == "x":
        env["EXTRA"] = str(sleeper)
    start = time.monotonic()
    if slurm:
        done, codes = _srun([sys.executable, script, work, scenario, str(STALL), str(procs)], procs, env)
        assert codes == [watchdog.EXIT_STALL] * procs, (codes, done.stderr[-3000:])
    elif torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs), "--master_addr",
               "127.0.0.1", "--master_port", str(free_port()), script, work, scenario, str(STALL), str(procs)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    else:
        done = run_script(script, work, scenario, STALL, procs, env=env, timeout=180)
    wall = time.monotonic() - start
    report = os.path.join(work, "log", stall_report.REPORT)
    with open(os.path.join(work, "stalled_at")) as f:
        to_report = os.stat(report).st_mtime - float(f.read())
    pids = [int(p) for p in os.listdir(os.path.join(work, "pids"))]
    with open(report) as f:
        text = f.read()
    return done, text, to_report, wall, pids, work


def _check_common(done, text, to_report, pids, work, procs, status=watchdog.EXIT_STALL):
    assert done.returncode == status, (done.returncode, done.stderr[-3000:])
    assert to_report <= STALL + 15, to_report
    assert not [p for p in pids if processes.running(p)], "a rank outlived the job"
    assert f"see {os.path.join(work, 'log', stall_report.REPORT)}" in done.stderr
    assert text in done.stderr   # printed as written
    for rank in range(procs):
        assert os.path.isfile(os.path.join(work, "log", f"stall-rank{rank}.txt"))
    left = [n for n in os.listdir(os.path.join(work, "log")) if n.startswith("crash-") or ".tmp" in n]
    assert not left, left   # no crash file (no fatal signal), no temp file
    # the last checkpoint (epoch 0's) is whole
    state = torch.load(os.path.join(work, "model", "last.pth"), weights_only=True)
    assert state["epoch"] == 0, sorted(state)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_collective_a_callback_runs_on_rank_0_only_is_reported_naming_rank_0_and_the_line(script, tmp_path):
    done, text, to_report, wall, pids, work = _stall(script, tmp_path, "a", 2)
    _check_common(done, text, to_report, pids, work, 2)
    line = _line(script, "LINE-A")
    rank0 = next(t for t in text.splitlines() if t.startswith("rank 0"))
    assert "in callback OneSided.on_epoch_end" in rank0 and f"{script}:{line})" in rank0, text
    assert "torch.distributed.all_reduce" in rank0, text
    assert "differs: rank(s) [0]" in text, text
    assert "waiting in collective #" in next(t for t in text.splitlines() if t.startswith("rank 1")), text


@pytest.mark.slow
@pytest.mark.distributed
def test_under_torchrun_each_rank_exits_3_and_the_report_names_rank_0(script, tmp_path):
    done, text, to_report, wall, pids, work = _stall(script, tmp_path, "a", 2, torchrun=True)
    _check_common(done, text, to_report, pids, work, 2, status=1)   # torchrun's own status: a child failed
    assert "exitcode: 3" in done.stderr or "exitcode  : 3" in done.stderr, done.stderr[-3000:]
    assert "differs: rank(s) [0]" in text, text


@pytest.mark.slow
@pytest.mark.distributed
def test_under_slurm_each_task_exits_3_and_the_report_names_rank_0(script, tmp_path):
    done, text, to_report, wall, pids, work = _stall(script, tmp_path, "a", 2, slurm=True)
    _check_common(done, text, to_report, pids, work, 2)
    assert "differs: rank(s) [0]" in text, text
    rank0 = next(t for t in text.splitlines() if t.startswith("rank 0"))
    assert "in callback OneSided.on_epoch_end" in rank0 and f"{script}:{_line(script, 'LINE-A')})" in rank0, text


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("procs", [2, 3])
def test_a_rank_asleep_in_on_epoch_end_is_reported_as_the_rank_that_differs(script, tmp_path, procs):
    done, text, to_report, wall, pids, work = _stall(script, tmp_path, "b", procs, sleeper=1)
    _check_common(done, text, to_report, pids, work, procs)
    rank1 = next(t for t in text.splitlines() if t.startswith("rank 1"))
    assert "in callback Sleeper.on_epoch_end" in rank1 and f"{script}:{_line(script, 'LINE-B')})" in rank1, text
    assert "differs: rank(s) [1]" in text, text
    summary = json.load(open(os.path.join(work, "log", "stall-rank1.json")))
    assert summary["rank"] == 1 and summary["user"]["function"] == "on_epoch_end"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("procs", [2, 3])
def test_a_rank_that_swallows_an_exception_and_skips_a_batch_is_named_in_the_failure_report(script, tmp_path, procs):
    # its next collective meets another rank's gradients: gloo aborts it (SIGABRT), the others'
    # collectives fail; rank 0 writes where each rank was, from its traceback and rank 1's stacks
    done, text, to_report, wall, pids, work = _stall(script, tmp_path, "c", procs, sleeper=1)
    assert done.returncode == 1 and "process 1 terminated with signal SIGABRT" in done.stderr, done.stderr[-3000:]
    assert to_report <= STALL + 15 and wall < 60, (to_report, wall)
    assert not [p for p in pids if processes.running(p)], "a rank outlived the job"
    assert text in done.stderr and f"see {os.path.join(work, 'log', stall_report.REPORT)}" in done.stderr
    lines = text.splitlines()
    assert lines[0].startswith("basetrainer failure report") and "rank(s) [1] ended on a fatal signal" in lines[0]
    rank1 = next(t for t in lines if t.startswith("rank 1"))
    assert "ended on a fatal signal (Aborted" in rank1 and "in collective" in rank1, text
    assert f"user code at main ({script}:" in rank1 and "basetrainer at " in rank1, text
    for rank in [0] + list(range(2, procs)):
        line = next(t for t in lines if t.startswith(f"rank {rank} "))
        assert "its collective failed (RuntimeError:" in line and "Connection" in line, text
        assert os.path.isfile(os.path.join(work, "log", f"stall-rank{rank}.txt"))
    assert "differs: rank(s) [1]:" in text, text
    logs = sorted(os.listdir(os.path.join(work, "log")))
    assert [n for n in logs if n.startswith("crash-")] == ["crash-rank1.txt"], logs   # the others' removed
    state = torch.load(os.path.join(work, "model", "last.pth"), weights_only=True)
    assert state["epoch"] == 0, sorted(state)


@pytest.mark.slow
@pytest.mark.distributed
def test_with_batchnorm_a_skipped_batch_stalls_and_the_report_names_the_rank_that_skipped(script, tmp_path):
    # DDP's forward broadcasts the buffers first: the skipping rank's collectives pair with the next
    # step's silently until one meets another kind; a stall, not an abort (hostile pass, F1)
    done, text, to_report, wall, pids, work = _stall(script, tmp_path, "cbn", 2, sleeper=1)
    _check_common(done, text, to_report, pids, work, 2)
    rank1 = next(t for t in text.splitlines() if t.startswith("rank 1"))
    assert "6 train batches done, 5 of them through the engine's train_step" in rank1, text
    assert "differs: rank(s) [1]: finished train batches without the engine's train step" in text, text


@pytest.mark.slow
@pytest.mark.distributed
def test_a_collective_one_rank_runs_alone_is_named_even_when_gloo_aborts_the_other_rank(script, tmp_path):
    # rank 1's all_reduce of 1000 floats meets rank 0's gradient all-reduce: gloo aborts rank 0
    # (the receiver of the larger message), but the report names rank 1 and its line (F2)
    done, text, to_report, wall, pids, work = _stall(script, tmp_path, "x", 2, sleeper=1)
    assert done.returncode == 1 and "terminated with signal SIGABRT" in done.stderr, done.stderr[-3000:]
    assert not [p for p in pids if processes.running(p)], "a rank outlived the job"
    rank1 = next(t for t in text.splitlines() if t.startswith("rank 1"))
    assert "torch.distributed.all_reduce" in rank1 and f"{script}:{_line(script, 'LINE-X')})" in rank1, text
    assert "differs: rank(s) [1]: in a torch.distributed collective of their own" in text, text


@pytest.fixture
def no_faulthandler():
    import faulthandler

    was = faulthandler.is_enabled()   # pytest turns it on
    faulthandler.disable()
    yield faulthandler
    if was:
        faulthandler.enable()
    else:
        faulthandler.disable()


def test_fatal_stacks_go_to_the_crash_file_while_a_job_runs_and_read_back_as_the_rank_summary(tmp_path,
                                                                                              no_faulthandler):
    folder, path = str(tmp_path / "log"), str(tmp_path / "log" / "crash-rank1.txt")
    with watchdog.Watchdog(0, folder, rank=1, world_size=2, exit=False):   # stall_timeout 0: still on
        assert stacks.read_crash(folder, 1, time.time() - 5) is None   # only the header: the rank runs
        assert stacks.alive(folder, 1, time.time() - 5)
        with open(path, "a") as f:   # what faulthandler writes at SIGABRT, from this very frame
            f.write("Fatal Python error: Aborted\n\n")
            f.flush()
            no_faulthandler.dump_traceback(f, all_threads=True)
        crash = stacks.read_crash(folder, 1, time.time() - 5)
    assert crash["crashed"] == "Aborted" and crash["rank"] == 1 and crash["pid"] == os.getpid(), crash
    assert crash["user"]["function"] == "test_fatal_stacks_go_to_the_crash_file_while_a_job_runs_and_read_back_as_" \
                                        "the_rank_summary" and crash["user"]["file"] == __file__, crash
    assert not os.path.exists(path) and not no_faulthandler.is_enabled()
    assert not stacks.alive(folder, 1, time.time() - 5)   # ended through Python: its file is gone


def test_a_crash_file_of_an_earlier_run_is_kept_and_a_killed_rank_is_told_apart(tmp_path, no_faulthandler):
    folder = str(tmp_path)
    with open(os.path.join(folder, "crash-rank0.txt"), "w") as f:   # an earlier run's rank 0 aborted
        f.write(stacks.CRASH_HEADER.format(rank=0, pid=os.getpid(), host="h", thread=1, elsewhere="") + "Fatal Python error: "
                "Aborted\n\nThread 0x0000000000000001 (most recent call first):\n  File \"t.py\", line 3 in f\n")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    with open(os.path.join(folder, "crash-rank1.txt"), "w") as f:   # rank 1 SIGKILLed: only the header
        f.write(stacks.CRASH_HEADER.format(rank=1, pid=int(dead.stdout), host=socket.gethostname(), thread=1, elsewhere=""))
    killed = stacks.read_crash(folder, 1, 0.0)
    assert killed["killed"] and not stacks.alive(folder, 1, 0.0), killed
    assert "ended without a Python trace (SIGKILL" in stall_report.describe(killed)
    with watchdog.Watchdog(0, folder, rank=0, world_size=2, exit=False):
        kept = [n for n in os.listdir(folder) if n.startswith("crash-rank0.txt.")]
        assert len(kept) == 1 and "line 3 in f" in open(os.path.join(folder, kept[0])).read(), os.listdir(folder)
        assert stacks.read_crash(folder, 0, 0.0) is None   # this run's file: only its header
    no_faulthandler.enable()   # the user's own (or -X faulthandler): left where the user sent it
    with watchdog.Watchdog(0, folder, rank=0, world_size=2, exit=False):
        with open(os.path.join(folder, "crash-rank0.txt")) as f:   # the header only: it still tells who runs
            assert f.read().endswith(stacks.ELSEWHERE + "\n") and stacks.alive(folder, 0, 0.0)
    assert no_faulthandler.is_enabled() and not os.path.exists(os.path.join(folder, "crash-rank0.txt"))
    with open(os.path.join(folder, "crash-rank1.txt"), "w") as f:   # such a rank, gone
        f.write(stacks.CRASH_HEADER.format(rank=1, pid=int(dead.stdout), host=socket.gethostname(), thread=1,
                                           elsewhere=stacks.ELSEWHERE))
    assert "its stacks where faulthandler was sent" in stacks.read_crash(folder, 1, 0.0)["killed"]


def test_a_failure_report_that_cannot_be_written_is_printed_whole(tmp_path, monkeypatch, capsys):
    folder = str(tmp_path)
    with open(os.path.join(folder, "crash-rank1.txt"), "w") as f:
        f.write(stacks.CRASH_HEADER.format(rank=1, pid=12345, host="h", thread=1, elsewhere="") + "Fatal Python error: Aborted\n")

    def full(path, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(stall_report, "write_text", full)
    try:
        raise RuntimeError("[pair.cc:545] Read error [127.0.0.1]:1: Connection reset by peer")
    except RuntimeError as e:
        assert crash_report.broken(e) and not crash_report.broken(RuntimeError("gloo config wrong"))
        assert crash_report.report_failure(e, folder, 0, 2, watchdog.Progress(), 0.0, gather=0.1) is None
    err = capsys.readouterr().err
    assert "basetrainer failure report" in err and "rank 1 (pid 12345 on h): ended on a fatal signal (Aborted" in err
    assert "could not be written" in err and "differs: rank(s) [1]: aborted by gloo" in err, err
    assert os.listdir(folder) == ["crash-rank1.txt"]   # nothing half-written


WORKER_ABORT = textwrap.dedent("""
    import os, sys, torch
    sys.path.insert(0, {tests!r})
    from conftest import ToyTrainer, toy_cfg, blobs
    from basetrainer.engine.launch import launch

    class Aborting(torch.utils.data.Dataset):
        def __init__(self):
            self.data = blobs(64, 4, seed=0)
        def __len__(self):
            return len(self.data)
        def __getitem__(self, index):
            if os.environ.get("RANK") == "1" and index == 5 and torch.utils.data.get_worker_info() is not None:
                os.abort()   # LINE-W: a C extension failing in rank 1's DataLoader worker
            return self.data[index]

    class Trainer(ToyTrainer):
        def build_train_loader(self, cfg, **kwargs):
            return self.build_dataloader(Aborting(), cfg.batch_size, 1, phase="train")

    def main(work):
        Trainer(toy_cfg(num_epochs=1, batch_size=16, n_train=64, work_dir=work, distributed=True)).run()

    if __name__ == "__main__":
        launch(main, num_gpus_per_machine=2, distributed=True, args=(sys.argv[1],))
""")
worker_abort = script_fixture(WORKER_ABORT, "worker_abort.py")


@pytest.mark.slow
@pytest.mark.distributed
def test_a_data_worker_ending_on_a_fatal_signal_shows_its_stack_and_is_not_its_rank_crash(worker_abort, tmp_path):
    # the worker inherits faulthandler pointed at its rank's crash file: it writes to stderr instead,
    # and rank 1 (alive, then failing through Python) is not reported as crashed
    work = str(tmp_path / "work")
    done = run_script(worker_abort, work, timeout=180)
    assert done.returncode == 1, done.stderr[-3000:]   # rank 1 fails through Python (the worker's death or pipe)
    assert f'File "{worker_abort}", line {_line(worker_abort, "LINE-W")} in __getitem__' in done.stderr
    report = open(os.path.join(work, "log", stall_report.REPORT)).read()
    assert "ended on a fatal signal" not in report and "rank 1: no summary" in report, report
    assert not [n for n in os.listdir(os.path.join(work, "log")) if n.startswith("crash-")]


def _abort_or_write_late(index, folder):
    if index == 1:
        os.abort()   # as gloo does at a collective mismatch
    time.sleep(1.5)   # rank 0 fails in its collective, then writes the report
    open(os.path.join(folder, "reported"), "w").close()
    sys.exit(1)


@pytest.mark.distributed
def test_a_rank_ended_by_a_fatal_signal_leaves_the_others_time_to_write_the_report(tmp_path):
    from torch.multiprocessing.spawn import ProcessExitedException

    with pytest.raises(ProcessExitedException, match="process 1 terminated with signal SIGABRT"):
        spawn_mod.spawn(_abort_or_write_late, 2, (str(tmp_path),))
    assert os.path.exists(tmp_path / "reported")   # not stopped at once (within spawn.CRASH_GRACE)


@pytest.mark.slow
@pytest.mark.distributed
def test_one_process_with_a_stalled_callback_ends_with_the_report_and_exit_status_3(script, tmp_path):
    done, text, to_report, wall, pids, work = _stall(script, tmp_path, "single", 1, sleeper=0)
    _check_common(done, text, to_report, pids, work, 1)
    assert f"{script}:{_line(script, 'LINE-B')})" in text and "one process" in text, text
    assert "Sleeper.on_epoch_end" in text


@pytest.mark.slow
@pytest.mark.distributed
def test_a_data_worker_that_hangs_on_one_rank_is_named_with_the_sample_index_it_loads(script, tmp_path):
    done, text, to_report, wall, pids, work = _stall(script, tmp_path, "d", 2)
    _check_common(done, text, to_report, pids, work, 2)
    with open(os.path.join(work, "armed.used")) as f:
        index = int(f.read())
    rank1 = next(t for t in text.splitlines() if t.startswith("rank 1"))
    assert "waiting for a batch from the DataLoader" in rank1, text
    assert f"worker 0 (pid " in rank1 and "of rank 1: loading sample index(es)" in rank1, text
    assert f"[{index}, 1]" in rank1, text    # (index, epoch): the item the worker is stuck in
    assert f"{script}:{_line(script, 'LINE-D')})" in rank1, text
    assert "differs: rank(s) [1]" in text, text
    assert os.path.isfile(os.path.join(work, "log", "stall-rank1-worker0.txt"))


@pytest.mark.slow
@pytest.mark.distributed
def test_one_process_with_a_hung_data_worker_names_the_index_and_leaves_no_worker_behind(script, tmp_path):
    done, text, to_report, wall, pids, work = _stall(script, tmp_path, "single-d", 1, sleeper=0)
    _check_common(done, text, to_report, pids, work, 1)
    with open(os.path.join(work, "armed.used")) as f:
        index = int(f.read())
    summary = json.load(open(os.path.join(work, "log", "stall-rank0.json")))
    worker = summary["workers"][0]
    assert [index, 1] in worker["loading"], worker
    assert not processes.running(worker["pid"]), "the hung worker outlived its process"


# ------------------------------------------------------------------------------------ in process
def test_the_watchdog_reports_the_thread_that_stopped_progressing(tmp_path):
    folder = str(tmp_path / "log")
    with watchdog.Watchdog(0.3, folder, exit=False, gather=0.5) as dog:
        time.sleep(2.0)   # STALLED-HERE
        fired = dog.fired
    assert fired is not None
    assert fired["user"]["function"] == "test_the_watchdog_reports_the_thread_that_stopped_progressing"
    assert fired["user"]["line"] == _line(__file__, "STALLED-HERE")
    with open(os.path.join(folder, stall_report.REPORT)) as f:
        report = f.read()
    assert "one process" in report and "no progress for stall_timeout = 0.3 s" in report
    with open(os.path.join(folder, "stall-rank0.txt")) as f:
        assert "in test_the_watchdog_reports_the_thread_that_stopped_progressing" in f.read()


def test_progress_keeps_the_watchdog_quiet(tmp_path):
    with watchdog.Watchdog(0.5, str(tmp_path), exit=False) as dog:
        for _ in range(20):
            time.sleep(0.1)
            watchdog.PROGRESS.count += 1
        fired = dog.fired
    assert fired is None and not os.listdir(tmp_path)


def test_a_process_alone_is_not_stopped_by_another_process_trigger_in_its_folder(tmp_path):
    """A healthy run of one process was ended (exit 3, "rank 0 stops because rank 0 stalled") by
    the trigger a stalled evaluate() of the same work_dir wrote, or by a file of a skewed clock."""
    trigger = tmp_path / watchdog.TRIGGER
    trigger.write_text("0")
    later = time.time() + 120
    os.utime(trigger, (later, later))
    with watchdog.Watchdog(2.0, str(tmp_path), exit=False) as dog:
        for pause in (0.1, 1.0, 0.1):   # a step of 1 s: under stall_timeout, but the trigger is looked at
            time.sleep(pause)
            watchdog.PROGRESS.count += 1
        fired = dog.fired
    assert fired is None and sorted(os.listdir(tmp_path)) == [watchdog.TRIGGER]


class Threads(Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_batch_end(self, batch, logs=None):
        self.seen.append(sorted(t.name for t in threading.enumerate()))

    def on_test_summary(self, *args, **kwargs):
        self.on_batch_end(0)


@pytest.mark.parametrize("stall", [0, 30])
def test_stall_timeout_0_starts_no_thread_and_the_thread_ends_with_the_run(tmp_path, stall):
    seen = Threads()
    t = ToyTrainer(toy_cfg(num_epochs=1, n_train=32, n_test=16, work_dir=str(tmp_path), stall_timeout=stall),
                   callbacks=[seen])
    t.run()
    t.evaluate()
    t.predict(t.test_loader)
    # 2 steps, 1 test batch, evaluate()'s test batch
    watching = [names.count("basetrainer-stall-watchdog") for names in seen.seen]
    assert len(watching) == 2 + 1 + 1 and all(w == bool(stall) for w in watching), seen.seen
    assert "basetrainer-stall-watchdog" not in [t.name for t in threading.enumerate()]


def test_stall_timeout_is_a_config_key_with_a_default_and_refuses_a_bad_value():
    assert setup_config.engine_defaults().stall_timeout == watchdog.DEFAULT_STALL_TIMEOUT == 1800
    for bad in (-1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"config key 'stall_timeout' = .* must be >= 0 and finite"):
            setup_config.validate(setup_config.Config(stall_timeout=bad))
    with pytest.raises(TypeError, match="config key 'stall_timeout' = 'soon'"):
        setup_config.validate(setup_config.Config(stall_timeout="soon"))
    cfg = setup_config.Config(stall_timeout="5")   # YAML 1.1 may give a string
    setup_config.validate(cfg)
    assert cfg.stall_timeout == 5.0
    # a tracker call may take tracker_deadline: a shorter stall_timeout ended the run (exit 3) where the
    # tracker would have been switched off with a warning (hostile pass)
    with pytest.raises(ValueError, match="give stall_timeout more than tracker_deadline"):
        setup_config.validate(setup_config.Config(stall_timeout=3, tracker_deadline=6, loggers=["csv", "mlflow"]))
    setup_config.validate(setup_config.Config(stall_timeout=3, tracker_deadline=6, loggers=["csv"]))   # no tracker
    setup_config.validate(setup_config.Config(stall_timeout=0, tracker_deadline=6, loggers=["wandb"]))  # off


def test_the_process_group_timeout_follows_stall_timeout(caplog):
    cfg = setup_config.Config(stall_timeout=5)
    assert launch_mod._timeout(None, ("x", cfg)) == datetime.timedelta(seconds=5 + watchdog.GROUP_MARGIN)
    assert launch_mod._timeout(None, ()) == datetime.timedelta(seconds=1800 + watchdog.GROUP_MARGIN)
    assert launch_mod._timeout(None, (setup_config.Config(stall_timeout=0),)) == launch_mod.DEFAULT_TIMEOUT
    with caplog.at_level(logging.WARNING):
        assert launch_mod._timeout(10, (cfg,)) == datetime.timedelta(seconds=10)
    assert "shorter than stall_timeout" in caplog.text
    # an argparse namespace (the trainer takes one) and a number written as a string, as the trainer
    # reads them (hostile pass: the namespace's 3600 s gave a 31 min group timeout, "5" was refused)
    import argparse

    assert launch_mod._timeout(None, (argparse.Namespace(stall_timeout=3600),)) == \
        datetime.timedelta(seconds=3600 + watchdog.GROUP_MARGIN)
    assert launch_mod._timeout(None, ({"stall_timeout": "5"},)) == datetime.timedelta(seconds=5 + watchdog.GROUP_MARGIN)


def _summary(rank, seq, collective="", torch_collective="", user="loop", callback=""):
    return {"rank": rank, "pid": 1, "host": "h", "time": 0.0, "stall_timeout": 3, "seq": seq,
            "collective": collective, "torch_collective": torch_collective, "callback": callback,
            "user": {"file": "u.py", "line": 1, "function": user}, "library": None, "innermost": None}


def test_the_report_names_the_odd_rank_out_of_three_and_the_one_behind_of_two():
    three = {0: _summary(0, 7, "any_true"), 1: _summary(1, 6, user="cb"), 2: _summary(2, 7, "any_true")}
    assert stall_report.differs(three, 3).startswith("differs: rank(s) [1];")
    two = {0: _summary(0, 6, torch_collective="all_reduce", user="cb"), 1: _summary(1, 7, "any_true")}
    assert stall_report.differs(two, 2).startswith("differs: rank(s) [0]:")
    same = {r: _summary(r, 7, "any_true") for r in range(2)}
    assert stall_report.differs(same, 2).startswith("no rank differs")
    assert stall_report.differs({0: three[0]}, 2).startswith("differs: rank(s) [1] (no summary)")
    skipped = {0: {**_summary(0, 4, torch_collective="broadcast"), "batches": 7, "steps": 7},
               1: {**_summary(1, 5, "any_true"), "batches": 8, "steps": 7}}   # F1: the rank ahead skipped
    assert stall_report.differs(skipped, 2).startswith("differs: rank(s) [1]: finished train batches without")
    own_steps = {0: {**_summary(0, 4), "in_backward": True, "batches": 2, "steps": 0},   # an override that never calls
                 1: {**_summary(1, 4, user="sleep"), "batches": 2, "steps": 0}}  # the engine's step: no claim
    assert stall_report.differs(own_steps, 2).startswith("differs: rank(s) [1]:"), stall_report.differs(own_steps, 2)
    after_step = {0: {**_summary(0, 4, user="train_step"), "batches": 6, "steps": 7},   # asleep after super()
                  1: {**_summary(1, 5, "any_true"), "batches": 7, "steps": 7}}
    assert stall_report.differs(after_step, 2).startswith("differs: rank(s) [0]:")
    crashed = {0: {**_summary(0, None, "any_true"), "crashed": "Aborted"}, 1: _summary(1, 6, torch_collective="x")}
    assert stall_report.differs(crashed, 2).startswith("differs: rank(s) [1]: in a torch.distributed collective")
    crashed[1] = _summary(1, 6, "any_true")
    assert stall_report.differs(crashed, 2).startswith("differs: rank(s) [0]: aborted by gloo")


def test_the_watchdog_lets_a_checkpoint_write_of_the_stalled_thread_finish_before_it_exits(tmp_path, monkeypatch):
    from basetrainer.runtime import atomic

    path = str(tmp_path / "last.pth")
    real, alive = torch.save, []

    def slow_save(obj, f):   # the write takes longer than stall_timeout
        time.sleep(1.5)
        alive.append(dog.thread is not None and dog.thread.is_alive())   # the watchdog reported, and waits
        real(obj, f)

    monkeypatch.setattr(atomic.torch, "save", slow_save)
    with watchdog.Watchdog(0.3, str(tmp_path / "log"), exit=False, gather=0.2) as dog:
        started = time.monotonic()
        atomic.write_atomically({"epoch": 3}, path)
        written = time.monotonic() - started
        while dog.thread is not None and dog.thread.is_alive():
            time.sleep(0.05)
    # the report came during the write, and the watchdog waited for the write to end
    assert dog.fired is not None and written >= 1.5 and alive == [True]
    assert torch.load(path, weights_only=True) == {"epoch": 3}
