"""DataLoader worker processes: ``run()`` ends the ones it started, on every path, and ranks
started by ``launch()`` start theirs as under torchrun.

Left to torch, a trainer's workers end when its iterator is freed. A trainer lives in a
reference cycle with its callbacks, so the garbage collector frees it, and it closes the
iterator's queues before the iterator: each worker then never gets its stop message and is
waited for 5 s (``launch()`` collects every rank's garbage before it leaves: 10 s more per DDP
run with 2 workers). An iterator whose worker raised is kept by the traceback the same way.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from conftest import ROOT, ToyTrainer, blobs, run_distributed, toy_cfg

PY = sys.executable


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _note_pid(folder):
    open(os.path.join(folder, str(os.getpid())), "w").close()


class _NotePid:
    def __init__(self, folder):
        self.folder = folder

    def __call__(self, worker_id):
        _note_pid(self.folder)


class _Failing(Dataset):
    """The blobs, but item ``bad`` raises (in whichever worker loads it)."""

    def __init__(self, bad):
        self.data, self.bad = blobs(64, 4, seed=0), bad

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        if i == self.bad:
            raise ValueError(f"item {i} is broken")
        return self.data[i]


class _Trainer(ToyTrainer):
    def build_train_loader(self, cfg, **kwargs):
        init = _NotePid(cfg.pids)
        if cfg.get("fail_at") is not None:   # a plain torch DataLoader (workers not persistent)
            return DataLoader(_Failing(cfg.fail_at), batch_size=cfg.batch_size, num_workers=cfg.num_workers,
                              worker_init_fn=init)
        return self.build_dataloader(blobs(64, 4, seed=0), cfg.batch_size, cfg.num_workers, phase="train",
                                     worker_init_fn=init, persistent_workers=cfg.get("persistent", True))


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads worker processes from /proc")
def test_run_ends_its_persistent_workers(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    t = _Trainer(toy_cfg(num_workers=2, pids=str(pids), n_test=16))
    assert t.train_loader.persistent_workers      # build_dataloader's default with workers
    history = t.run()
    started = [int(p) for p in os.listdir(pids)]
    assert len(started) == 2                      # persistent: started once for both epochs
    assert [p for p in started if _alive(p)] == []
    assert len(history.epochs) == 2


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads worker processes from /proc")
def test_a_run_that_fails_in_a_worker_ends_its_workers(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    t = _Trainer(toy_cfg(num_workers=2, pids=str(pids), n_test=16, fail_at=37, shuffle=False))
    with pytest.raises(ValueError, match="item 37 is broken") as raised:
        t.run()
    started = [int(p) for p in os.listdir(pids)]
    assert len(started) == 2
    # the traceback (held here) keeps the failed iterator; its workers are gone all the same
    assert raised.traceback is not None
    assert [p for p in started if _alive(p)] == []


LAUNCHED = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {tests!r})
    from conftest import ToyTrainer, blobs, toy_cfg
    from basetrainer.engine.launch import launch

    SEEN_BY_THE_RANK = []    # filled by the rank after the import: a forked worker sees it

    def note(worker_id):
        with open(os.path.join(os.environ["PIDS"], str(os.getpid())), "w") as f:
            f.write(str(len(SEEN_BY_THE_RANK)))

    class Trainer(ToyTrainer):
        def build_train_loader(self, cfg, **kwargs):
            return self.build_dataloader(blobs(64, 4, seed=0), cfg.batch_size, cfg.num_workers, phase="train",
                                         worker_init_fn=note)

    def main():
        SEEN_BY_THE_RANK.append(os.getpid())
        t = Trainer(toy_cfg(num_epochs=1, num_workers=2, n_test=16, distributed=True))
        t.run()

    if __name__ == "__main__":
        os.environ["PIDS"] = sys.argv[1]
        launch(main, num_gpus_per_machine=2, distributed=True)
""")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads worker processes from /proc")
def test_ranks_of_launch_fork_their_workers_as_under_torchrun(tmp_path):
    """A rank spawned by launch() inherited 'spawn' for its own children: every DataLoader
    worker imported torch and the script again (4 s a loader on this machine), unlike the same
    script under torchrun."""
    script = tmp_path / "launched.py"
    script.write_text(LAUNCHED.format(tests=os.path.join(ROOT, "tests")))
    pids = tmp_path / "pids"
    pids.mkdir()
    out = subprocess.run([PY, str(script), str(pids)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = {}
    for name in os.listdir(pids):
        with open(pids / name) as f:
            seen[int(name)] = f.read()
    assert len(seen) == 4                          # 2 ranks x 2 workers
    assert set(seen.values()) == {"1"}             # forked: the rank's memory as it was
    assert [p for p in seen if _alive(p)] == []


class _Wrapped:
    """A user's loader around a persistent DataLoader: iter() gives the DataLoader's own
    iterator, which the DataLoader reuses next epoch."""

    def __init__(self, loader):
        self.loader = loader

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        return iter(self.loader)


class _WrappedTrainer(ToyTrainer):
    def build_train_loader(self, cfg, **kwargs):
        return _Wrapped(DataLoader(blobs(64, 4, seed=0), batch_size=16, num_workers=2, persistent_workers=True))


def test_a_wrapped_persistent_loader_still_works_after_run(tmp_path):
    t = _WrappedTrainer(toy_cfg(num_workers=2, num_epochs=1))
    t.run()
    t.num_epochs = 2
    t.run()                                        # the wrapped DataLoader's iterator was left to it
    assert t.global_step == 8
    assert sum(len(y) for _, y in t.train_loader) == 64
    t.train_loader.loader._iterator._shutdown_workers()   # the wrapper's to end (not the garbage collector's)


def test_the_train_loader_pickles_during_a_run(tmp_path):
    import pickle

    from basetrainer.callbacks.callbacks import Callback

    sizes = []

    class Ship(Callback):   # e.g. a callback that sends the loader to another process
        def on_epoch_end(self, epoch, logs=None):
            sizes.append(len(pickle.dumps(self.trainer.train_loader)))

    pids = tmp_path / "pids"
    pids.mkdir()
    t = _Trainer(toy_cfg(num_workers=2, pids=str(pids), persistent=False), callbacks=[Ship()])
    t.run()
    assert len(sizes) == 2 and min(sizes) > 0


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads worker processes from /proc")
def test_workers_a_callback_starts_in_on_train_end_are_ended_too(tmp_path):
    from basetrainer.callbacks.callbacks import Callback

    class FinalPass(Callback):   # e.g. a last evaluation over the train data
        def on_train_end(self, logs=None):
            self.batches = sum(1 for _ in self.trainer.train_loader)

    pids = tmp_path / "pids"
    pids.mkdir()
    final = FinalPass()
    t = _Trainer(toy_cfg(num_workers=2, pids=str(pids), num_epochs=1), callbacks=[final])
    t.run()
    assert final.batches == 4
    started = [int(p) for p in os.listdir(pids)]
    assert len(started) == 2 and [p for p in started if _alive(p)] == []


_FORK_CHECK = textwrap.dedent('''
    import os, sys, threading, time
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from basetrainer.engine import preemption

    seen = []      # at each fork: the earlier iterators' feeder threads still alive
    earlier = []   # those threads (the synthetic one, then the real DataLoader's)
    os.register_at_fork(before=lambda: seen.append(sum(t.is_alive() for t in earlier)))

    class Ending:
        """An iterable whose iterator's feeder thread ends 0.5 s after it runs out, as a
        DataLoader iterator's feeders end after it has shut its workers down."""
        def __iter__(self):   # the thread starts with the iterator, as a DataLoader's feeders do
            done = threading.Event()
            feeder = threading.Thread(target=lambda: (done.wait(), time.sleep(0.5)), name="QueueFeederThread",
                                      daemon=True)
            feeder.start()
            earlier.append(feeder)

            def batches():
                yield from range(3)
                done.set()
            return batches()

    data = TensorDataset(torch.arange(24.0))
    for batch in preemption.start(Ending()):
        pass
    for batch in preemption.start(DataLoader(data, batch_size=4, num_workers=2)):
        pass
    earlier.extend(t for t in threading.enumerate() if t.name == "QueueFeederThread" and t not in earlier)
    for batch in preemption.start(DataLoader(data, batch_size=4, num_workers=2)):
        pass
    print(seen)
''')


def test_workers_are_not_forked_while_an_earlier_loaders_feeder_threads_end():
    """A thread ending while os.fork runs can leave the forked worker deadlocked at birth
    (CPython < 3.11.10, gh-112275; seen as predict()'s worker stuck in os.fork after evaluate()):
    start() joins the earlier iterators' feeder threads before the next loader forks."""
    out = subprocess.run([PY, "-c", _FORK_CHECK], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    # two forks for the first DataLoader (after the synthetic iterator), two for the second
    assert out.stdout.split("\n")[-2] == "[0, 0, 0, 0]", out.stdout


def _fork_after_collective(rank):
    import time

    import torch.distributed as dist

    from basetrainer.engine import preemption

    gaps, returned = [], []
    os.register_at_fork(before=lambda: gaps.append(time.monotonic() - returned[-1]) if returned else None)
    t = torch.ones(1)
    dist.all_reduce(t)
    returned.append(time.monotonic())
    for _ in preemption.start(DataLoader(torch.utils.data.TensorDataset(torch.arange(8.0)), batch_size=4,
                                         num_workers=2, multiprocessing_context="fork")):   # as under launch()
        pass
    return gaps


@pytest.mark.distributed
def test_in_a_process_group_workers_are_forked_after_the_backends_threads_had_time_to_finish(tmp_path):
    """gloo's threads may enter Python right after a collective returns, making a thread state
    without the GIL under the lock a fork must not copy held (gh-112275): start() releases the
    GIL for QUIET_S before it forks (seen: a rank's predict() worker hung at birth)."""
    from basetrainer.engine import preemption

    for gaps in run_distributed(_fork_after_collective, 2, tmp_path, timeout=120):
        assert len(gaps) == 2 and min(gaps) >= preemption.QUIET_S, gaps


def test_a_loader_still_being_read_does_not_hold_up_another_loaders_start():
    """evaluate() from a callback in the middle of an epoch: the train iterator's feeder threads
    live on, so start() must not wait for them (it waited its 2 s cap, then forgot them)."""
    import time

    from basetrainer.engine import preemption

    data = torch.utils.data.TensorDataset(torch.arange(64.0))
    reading = preemption.start(DataLoader(data, batch_size=4, num_workers=2))
    next(reading)
    begin = time.monotonic()
    for _ in preemption.start(DataLoader(data, batch_size=32, num_workers=1)):
        pass
    took = time.monotonic() - begin
    assert took < 1.5, took
    assert any(ref() is reading for ref, _, _ in preemption._threads)   # still watched, for when it ends
    del reading
