"""A hostile pass over the issue 28 fixes and the export/eval features: what broke, kept as tests."""
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading

import pytest

from basetrainer.callbacks.losses_recorder import LossesRecorder
from basetrainer.callbacks.model_checkpoint import ModelCheckpoint
from basetrainer.engine import resume as resume_mod
from basetrainer.runtime import run_folder
from tests.conftest import ToyTrainer, toy_cfg


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def _http_server(answer):
    """A server on 127.0.0.1 that hands each connection to ``answer(conn, stop)`` in a thread;
    yields its URI, and stops (``stop`` set, socket closed) when the block ends."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(conn, stop), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        server.close()


def _run_child(code, timeout):
    """Run ``python -c code``; killed after ``timeout`` s. Returns (stdout, stderr, process)."""
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
    return out, err, child


class _CheckpointedToy(ToyTrainer):
    def build_callbacks(self, cfg, **kwargs):
        return [LossesRecorder("loss"), ModelCheckpoint(self.model, self.optimizer,
                                                        model_dir=os.path.join(cfg.work_dir, "model"),
                                                        indicator="loss", mode="min")]


@pytest.mark.distributed   # starts two processes
def test_two_runs_started_together_do_not_both_claim_the_folder(tmp_path, monkeypatch):
    """Two processes whose run() starts in the same instant into one empty work_dir both passed
    the liveness check before either wrote its marker, and both trained into the folder (seen
    once in six real two-process starts). Here the other process claims the folder right after
    this run's check: this run must be refused, naming it, and leave its marker in place."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        folder = str(tmp_path / "model")
        real_remove = resume_mod.atomic.remove_stale_temps

        def other_claims_meanwhile(path):   # runs after this run's liveness check, before its marker
            if path and os.path.abspath(path) == os.path.abspath(folder):
                os.makedirs(folder, exist_ok=True)
                with open(os.path.join(folder, run_folder.MARKER), "w") as f:
                    json.dump({"run_id": "other-run", "started": "now", "pid": other.pid,
                               "host": __import__("socket").gethostname(),
                               "pid_started": run_folder._started_at(other.pid)}, f)
            return real_remove(path)

        monkeypatch.setattr(resume_mod.atomic, "remove_stale_temps", other_claims_meanwhile)
        trainer = _CheckpointedToy(toy_cfg(work_dir=str(tmp_path), num_epochs=1))
        with pytest.raises(RuntimeError, match=f"process {other.pid}"):
            trainer.run()
        assert run_folder.read_marker(folder)["run_id"] == "other-run"
        assert not os.path.exists(os.path.join(folder, "last.pth"))
    finally:
        other.kill()
        other.wait()


_TRICKLE_CHILD = r"""
import sys, logging
sys.path.insert(0, {root!r} + "/tests")
logging.basicConfig(level=logging.WARNING)
from toys import ToyTrainer, toy_cfg
from basetrainer.callbacks.log_history import LogHistory
from basetrainer.callbacks.losses_recorder import LossesRecorder
from basetrainer.callbacks.mlflow_logger import MLflowLogger

class T(ToyTrainer):
    def build_callbacks(self, cfg, **kwargs):
        return [LossesRecorder("loss"), LogHistory(cfg.work_dir + "/log", log_freq=2, is_main_process=True),
                MLflowLogger(uri={uri!r}, timeout=1)]

T(toy_cfg(work_dir={work_dir!r}, num_epochs=1)).run()
print("TRAINED")
"""


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="a tracking server that answers the probe, then sends its answers a byte at a "
                                       "time, stalls on_train_begin without end: MLflow's timeout bounds each read, "
                                       "not the request (seen: 12 min, and timeout's SIGTERM was not honoured)")
def test_a_trickling_mlflow_server_costs_seconds_not_forever(tmp_path):
    """A server that answers the reachability probe's HEAD at once, then drips one byte of every
    other answer each 0.5 s. The run must warn and train within a bounded time (here 60 s for
    timeout=1 s; the slowest dead-server case, accept-and-never-answer, costs about 2 timeouts)."""
    import time

    pytest.importorskip("mlflow")

    def answer(conn, stop):
        with conn:
            try:
                first = conn.recv(65536).split(b"\r\n", 1)[0]
                if first.startswith(b"HEAD / "):
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                    return
                for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 100000:
                    if stop.is_set():
                        return
                    conn.sendall(bytes([byte]))
                    time.sleep(0.5)
            except OSError:
                pass

    with _http_server(answer) as uri:
        code = _TRICKLE_CHILD.format(root=ROOT, uri=uri, work_dir=str(tmp_path / "run"))
        out, err, child = _run_child(code, timeout=60)
    assert child.returncode == 0 and "TRAINED" in out, err[-2000:]
    assert "MLflowLogger" in err and "training goes on" in err


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 256 KB tmpfs (needs root, as the disk-full tests do)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield str(mount)
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_full_disk_during_onnx_export_names_the_out_dir_not_the_staging_folder(tiny_tmpfs):
    """The DiskFullError of a full disk during the ONNX export named the hidden staging folder
    (/out/.export-tmp-<host>-<pid>-xxxx), which is removed before the user reads the message; it
    must name the folder the user gave (out_dir)."""
    pytest.importorskip("onnx")
    import torch
    from torch import nn

    from basetrainer.deploy import files
    from basetrainer.deploy.onnx_format import write_onnx
    from basetrainer.runtime.atomic import DiskFullError

    out_dir = os.path.join(tiny_tmpfs, "out")
    model = nn.Sequential(nn.Conv2d(3, 64, 3), nn.Flatten(), nn.LazyLinear(256)).eval()
    model(torch.zeros(1, 3, 8, 8))   # about 900 KB of weights: more than the disk holds
    with pytest.raises(DiskFullError) as raised:
        with files.staging(out_dir) as stage:   # the staging folder tells a full disk from other failures
            write_onnx(model, stage.path("m.onnx"), (1, 3, 8, 8), exporter="torchscript")
    assert f"no space left in {out_dir}: " in str(raised.value)
    assert ".export-tmp-" not in str(raised.value)
    assert os.listdir(out_dir) == []   # nothing at the final path, the staging folder gone


def test_a_metric_whose_update_needs_a_keyword_argument_is_refused_when_built():
    """``update(self, preds, *, target)``: the recorder passed the outputs alone and the first
    step failed inside the metric with a bare "update() missing 1 required keyword-only
    argument: 'target'", naming neither the recorder nor a fix."""
    torch = pytest.importorskip("torch")
    torchmetrics = pytest.importorskip("torchmetrics")
    from basetrainer.metric.metric_recorder import MetricRecorder

    class KeywordTarget(torchmetrics.Metric):
        def __init__(self):
            super().__init__()
            self.add_state("hits", torch.tensor(0.0), dist_reduce_fx="sum")

        def update(self, preds, *, target):
            self.hits += (preds.argmax(1) == target).sum()

        def compute(self):
            return self.hits

    with pytest.raises(TypeError, match=r"MetricRecorder 'hits'.*KeywordTarget\.update.*\btarget\b.*FunctionRecorder"):
        MetricRecorder(KeywordTarget(), "hits")


_WANDB_CHILD = r"""
import os, sys, logging
sys.path.insert(0, {root!r} + "/tests")
os.environ["WANDB_BASE_URL"] = {uri!r}
os.environ["WANDB_API_KEY"] = "x" * 40
logging.basicConfig(level=logging.WARNING)
from toys import ToyTrainer, toy_cfg
from basetrainer.callbacks.log_history import LogHistory
from basetrainer.callbacks.losses_recorder import LossesRecorder
from basetrainer.callbacks.wandb_logger import WandbLogger

class T(ToyTrainer):
    def build_callbacks(self, cfg, **kwargs):
        return [LossesRecorder("loss"), LogHistory(cfg.work_dir + "/log", log_freq=2, is_main_process=True),
                WandbLogger(timeout=2)]

T(toy_cfg(work_dir={work_dir!r}, num_epochs=1)).run()
print("TRAINED")
"""


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="a W&B server that answers the probe's HEAD / but never answers its API "
                                       "costs wandb.init's init_timeout (90 s; 108 s measured) before the warning; "
                                       "MLflow's bounded requests give 10 s for the same server")
def test_a_wandb_server_that_answers_only_the_probe_costs_seconds(tmp_path):
    import time

    pytest.importorskip("wandb")

    def answer(conn, stop):
        with conn:
            try:
                if conn.recv(65536).startswith(b"HEAD / "):
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                    return
                stop.wait(120)   # the API: accepted, never answered
            except OSError:
                pass

    with _http_server(answer) as uri:
        code = _WANDB_CHILD.format(root=ROOT, uri=uri, work_dir=str(tmp_path / "run"))
        started = time.monotonic()
        out, err, child = _run_child(code, timeout=45)   # imports and a 1-epoch toy run take ~10 s here
    assert child.returncode == 0 and "TRAINED" in out, f"after {time.monotonic() - started:.0f} s: {err[-2000:]}"
    assert "WandbLogger" in err and "training goes on" in err
