"""Hostile pass on issue 39's changes: defects found where the registry, seeding, writers and
strategies meet, each with the reproduction that found it."""
import logging
from typing import Any

import torch

from conftest import StopAt, ToyTrainer, toy_cfg
from basetrainer.callbacks.callbacks import Callback
from basetrainer.callbacks.losses_recorder import LossesRecorder
from basetrainer.callbacks.model_checkpoint import ModelCheckpoint


class Counts(Callback):
    """Counts steps; its state is the bare tensor (not a dict)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = torch.zeros(3)

    def on_batch_end(self, batch, logs=None):
        self.n += 1

    def state_dict(self) -> Any:
        return self.n.clone()

    def load_state_dict(self, state: Any) -> None:
        self.n = state.clone()


class Renamed(Counts):
    """Counts under another state key, as after a rename."""


class Stateless(Callback):
    def on_epoch_end(self, epoch, logs=None):
        pass


def _callbacks(folder: str, *extra: Any) -> list:
    return [LossesRecorder("loss"), ModelCheckpoint(model_dir=folder, indicator="loss", save_freq_steps=1,
                                                    async_save=False), *extra]


def test_a_tensor_state_resumes_under_a_new_key_and_a_removed_stateless_callback_is_not_named(tmp_path, caplog):
    """A callback whose state_dict returns a tensor, renamed before resume: the resume crashed
    with 'Boolean value of Tensor with more than one value is ambiguous' (the registry took
    bool(state_dict()) for 'has state'); a removed callback with no state was warned about as
    lost state."""
    folder = str(tmp_path / "model")
    try:
        ToyTrainer(toy_cfg(work_dir=str(tmp_path), num_epochs=2, n_train=48),
                   callbacks=_callbacks(folder, Counts(), Stateless(), StopAt(1, 1))).run()
    except RuntimeError as e:
        assert "stopped on purpose" in str(e)
    renamed = Renamed()
    caplog.set_level(logging.WARNING, logger="basetrainer.engine.registry")
    trainer = ToyTrainer(toy_cfg(work_dir=str(tmp_path), num_epochs=2, n_train=48, resume="auto"),
                         callbacks=_callbacks(folder, renamed))
    trainer.run()
    assert trainer.epoch == 1
    assert renamed.n.tolist() == [1.0, 1.0, 1.0]   # it started fresh: the last step of epoch 1 only
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "saved state of 'Counts' matches no callback" in warned
    assert "no saved state for callback(s) 'Renamed'" in warned
    assert "Stateless" not in warned and "StopAt" not in warned


def test_a_redirect_is_the_trackers_answer(monkeypatch):
    """A tracker's server that answers HEAD / with a redirect (a login page elsewhere, here a
    closed port) is reachable: the probe followed the redirect and said the server 'gave no
    answer' (Connection refused), naming the server's own address."""
    import http.server
    import socket
    import threading

    from basetrainer.callbacks import reachability

    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead_port = closed.getsockname()[1]
    closed.close()

    class Redirects(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{dead_port}/login")
            self.end_headers()

        do_GET = do_HEAD

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Redirects)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert reachability.probe(f"http://127.0.0.1:{server.server_port}/", 3) is None
    finally:
        server.shutdown()
        server.server_close()


class Histogram(Callback):
    """Keeps its state in numpy, as a user's callback may."""

    def __init__(self) -> None:
        super().__init__()
        self.hist = None

    def state_dict(self) -> Any:
        import numpy as np

        return {"hist": np.zeros(3), "best": np.float64(0.5)}


def test_a_callback_state_a_resume_cannot_load_is_refused_when_saved(tmp_path):
    """A callback whose state_dict holds numpy values was saved in every checkpoint of the run,
    and the resume then found none loadable ('no loadable checkpoint is left': weights_only
    refuses numpy): the whole run was lost. The first save refuses it now, naming the callback,
    the place, the type and the fix."""
    import pytest

    trainer = ToyTrainer(toy_cfg(work_dir=str(tmp_path), num_epochs=2, n_train=32),
                         callbacks=_callbacks(str(tmp_path / "model"), Histogram()))
    with pytest.raises(TypeError) as caught:
        trainer.run()
    message = str(caught.value)
    assert "callback state 'Histogram'" in message and "['hist'] is a numpy.ndarray" in message
    assert "Histogram.state_dict()" in message and "tolist()" in message
    assert trainer.epoch == 0   # refused at the first save (the end of the first epoch)


class KeyedByMethod(Callback):
    def state_key(self):   # meant as a property
        return "mine"

    def state_dict(self):
        return {"v": 1}


class KeyedByAttribute(Callback):
    state_key = "mine"


def test_a_state_key_written_as_a_method_is_refused(tmp_path):
    """state_key defined with 'def' and no @property: the state was saved under
    '<bound method ... at 0x7f...>', an address new in every run, so a resume never gave it back
    (two warnings with addresses, the state started fresh). Refused when the run is built."""
    import pytest

    with pytest.raises(TypeError) as caught:
        ToyTrainer(toy_cfg(work_dir=str(tmp_path)), callbacks=[KeyedByMethod()]).run()
    assert "KeyedByMethod.state_key is a method" in str(caught.value) and "@property" in str(caught.value)
    trainer = ToyTrainer(toy_cfg(work_dir=str(tmp_path), num_epochs=1), callbacks=[KeyedByAttribute()])
    trainer.run()
    assert trainer.epoch == 0


def test_predict_under_bf16_autocast_writes_npy_and_npz(tmp_path):
    """amp: bf16 makes the default predict_step's outputs bfloat16; predict(output='x.npy'/'.npz')
    refused them ('numpy has no dtype for: cast it ... in predict_step'), so the library's own
    default step could not be written in its default format (.pt, which took bfloat16, is gone).
    They are written as float32, value for value."""
    import numpy as np

    from conftest import blobs

    trainer = ToyTrainer(toy_cfg(work_dir=str(tmp_path), num_epochs=1, n_train=32, amp="bf16"))
    trainer.run()
    data = blobs(20, 4, seed=3)
    expected = trainer.predict(data)
    assert expected.dtype == torch.bfloat16
    npy = np.load(trainer.predict(data, output=str(tmp_path / "out.npy")))
    npz = np.load(trainer.predict(data, output=str(tmp_path / "out.npz")))
    assert npy.dtype == np.float32 and npy.shape == (20, 4)
    assert torch.equal(torch.from_numpy(npy), expected.float())
    assert torch.equal(torch.from_numpy(npz["output"]), expected.float())
