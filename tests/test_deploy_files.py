"""The staging folder's one way of telling a full disk from other failures (the real disk is in
test_deploy_hostile; here the evidence is planted: an errno, a converter's words, the free space)."""
import errno
import os

import pytest

from basetrainer.deploy import files
from basetrainer.runtime.atomic import DiskFullError


def _fail_in(stage, error, what="the mnn files", needed=0, keep=False):
    with pytest.raises(BaseException) as raised:
        with stage.attempt(what, needed, keep=keep) as part:
            with open(part.path("m.mnn"), "wb") as f:
                f.write(b"partial")
            raise error
    return raised.value


def test_an_enospc_behind_the_error_is_one_disk_full_error_naming_the_out_folder(tmp_path):
    out = str(tmp_path / "out")
    with files.staging(out) as stage:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", os.path.join(stage.folder, "x"))
        except OSError as e:
            cause = e
        try:   # torch's zip writer: a RuntimeError whose context is the OSError
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0") from cause
        except RuntimeError as e:
            error = _fail_in(stage, e, needed=2 ** 20)
        assert isinstance(error, DiskFullError) and error.errno == errno.ENOSPC
        assert str(error).startswith(f"[Errno 28] no space left in {out}: writing the mnn files filled the disk (")
        assert "the model's weights alone take 1.0 MB); free space or pass another out_dir" in str(error)
        assert os.listdir(stage.folder) == []   # the conversion's folder (and its partial file) went
    assert os.listdir(out) == []


def test_a_converters_words_and_a_full_disk_after_it_failed_count(tmp_path, monkeypatch):
    out = str(tmp_path / "out")
    with files.staging(out) as stage:
        said = _fail_in(stage, RuntimeError("pnnx failed (exit code 1): fwrite: No space left on device"))
        assert isinstance(said, DiskFullError)
        # MNN's converter writes a short file and reports success; the engine then says this
        monkeypatch.setattr(files, "free_bytes", lambda folder: 4096)
        invalid = _fail_in(stage, RuntimeError("Invalid model file, Check console log messages!"))
        assert isinstance(invalid, DiskFullError) and "writing the mnn files filled the disk" in str(invalid)


def test_a_short_write_counts_when_less_than_the_weights_is_free(tmp_path, monkeypatch):
    """torch's writer says "N requested and M written" (no errno) and removes its partial file."""
    stage = files.Staging(str(tmp_path / "out"))
    try:
        monkeypatch.setattr(files, "free_bytes", lambda folder: 3 * 2 ** 20)
        short = OSError("147456 requested and 137024 written")
        assert isinstance(_fail_in(stage, short, needed=40 * 2 ** 20), DiskFullError)
        assert _fail_in(stage, short, needed=2 ** 20) is short      # 3 MB free for 1 MB of weights: not the disk
    finally:
        stage.close()


def test_other_failures_pass_unchanged_and_leave_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "free_bytes", lambda folder: 10 * 2 ** 30)
    out = str(tmp_path / "out")
    stage = files.Staging(out)
    try:
        error = ValueError("unsupported operator GridSample")
        assert _fail_in(stage, error) is error
        assert os.listdir(stage.folder) == []
        with stage.attempt("the ONNX file", keep=True) as kept:
            open(kept.path("m.onnx"), "wb").write(b"onnx")
        with stage.attempt("the mnn files") as gone:
            open(gone.path("m.mnn"), "wb").write(b"mnn")
        assert os.listdir(stage.folder) == [os.path.basename(kept.folder)] and os.path.isfile(kept.path("m.onnx"))
    finally:
        stage.close()
    assert os.listdir(out) == []


def test_enospc_in_another_folder_names_that_folder(tmp_path):
    """A converter's temporary folder elsewhere (ONNX Runtime's quantizer writes into /tmp)."""
    stage = files.Staging(str(tmp_path / "out"))
    try:
        elsewhere = str(tmp_path / "tmp" / "ort.quant.x" / "augmented.onnx")
        error = _fail_in(stage, OSError(errno.ENOSPC, "No space left on device", elsewhere), "the onnx-int8 files")
        assert str(error).startswith(f"[Errno 28] no space left in {os.path.dirname(elsewhere)}: writing the "
                                     f"onnx-int8 files filled the disk (")
    finally:
        stage.close()
