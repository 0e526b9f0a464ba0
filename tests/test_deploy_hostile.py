"""An export attacked: killed mid-conversion, run again into the same folder, out of disk space."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import ROOT

PY = sys.executable

SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from basetrainer.deploy import converters
    from basetrainer.deploy.export import export_model
    from test_deploy_export import images, small_net
    if {tool!r}:
        converters.pnnx_binary = lambda: {tool!r}
    report = export_model(small_net(), {formats!r}, out_dir={out!r}, input_size=[16, 16], check=images(8), runs=0,
                          name="m", strict=False)
    print([(r.format, r.status) for r in report.rows[1:]])
""")


def _script(tmp_path, out, formats, tool=""):
    path = tmp_path / "export.py"
    path.write_text(SCRIPT.format(tests=os.path.join(ROOT, "tests"), tool=tool, formats=formats, out=str(out)))
    return str(path)


@pytest.mark.distributed   # starts processes
def test_killed_mid_conversion_then_run_again(tmp_path):
    out = tmp_path / "out"
    started = tmp_path / "pnnx-started"
    tool = tmp_path / "slow-pnnx.sh"
    tool.write_text(f"#!/bin/sh\ntouch {started}\nsleep 60\n")
    tool.chmod(0o755)
    proc = subprocess.Popen([PY, _script(tmp_path, out, "onnx,ncnn", str(tool))], cwd=ROOT, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while not started.exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert started.exists(), proc.stderr.read().decode()[-2000:] if proc.poll() is not None else "no start"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    left = sorted(os.listdir(out))
    # onnx was done (checked, then moved into place); ncnn was not: nothing of it at its final paths
    assert len(left) == 2 and left[0].startswith(".export-tmp-") and left[1] == "m.onnx", left
    # run again into the same folder: the stale staging folder goes, the files land
    again = subprocess.run([PY, _script(tmp_path, out, "onnx,ncnn")], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "[('onnx', 'ok'), ('ncnn', 'ok')]" in again.stdout
    assert sorted(os.listdir(out)) == ["m.export.json", "m.export.md", "m.ncnn.bin", "m.ncnn.param", "m.onnx"]


def _tmpfs_reason():
    if os.geteuid() != 0:
        return "needs root to mount a tmpfs in a private mount namespace"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt && umount /mnt"],
                           capture_output=True, text=True)
    return None if probe.returncode == 0 else f"cannot mount a tmpfs here: {probe.stderr.strip()}"


@pytest.mark.distributed   # starts processes
def test_disk_full_leaves_nothing_at_the_final_path(tmp_path):
    reason = _tmpfs_reason()
    if reason:
        pytest.skip(reason)
    disk = tmp_path / "disk"
    disk.mkdir()
    script = tmp_path / "full.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        from basetrainer.deploy.export import export_model
        from basetrainer.models.build_models import get_models
        out = sys.argv[1]
        os.makedirs(out, exist_ok=True)
        open(os.path.join(out, "m.onnx"), "wb").write(b"the older export")
        try:   # resnet18's ONNX file is 45 MB; the disk holds 2 MB
            export_model(get_models("resnet18", [16, 16], 4), "onnx", out_dir=out, input_size=[16, 16], runs=0,
                         name="m", report_files=False)
        except Exception as e:
            print("ERROR", type(e).__name__, e)
        print(sorted(os.listdir(out)), open(os.path.join(out, "m.onnx"), "rb").read())
    """))
    proc = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=2m tmpfs {disk} && "
                           f"exec {PY} {script} {disk}/out"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ERROR ExportFailed export failed for onnx: not exported: DiskFullError: [Errno 28] no space left in" in proc.stdout
    assert "free space or pass another out_dir" in proc.stdout
    assert proc.stdout.strip().endswith("['m.onnx'] b'the older export'")     # no staging left, old file intact


FULL_DISK = textwrap.dedent("""
    import json, os, sys
    import torch
    from torch import nn
    from basetrainer.deploy.export import export_model

    disk, free_kb, formats = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    st = os.statvfs(disk)
    with open(os.path.join(disk, "filler"), "wb") as f:   # leave free_kb free
        f.write(b"\\0" * max(0, st.f_bavail * st.f_frsize - free_kb * 1024))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                          nn.Linear(256, 1000)).eval()   # 1.0 MB of weights
    out = os.path.join(disk, "out")
    report = export_model(model, formats, out_dir=out, input_size=[16, 16], check={check}, runs=0, name="m",
                          strict=False)
    print("RESULT " + json.dumps({{"rows": [[r.format, r.status, r.problems, r.files] for r in report.rows[1:]],
                                  "left": sorted(os.listdir(out)), "notes": report.notes}}))
""")


def _on_small_disk(tmp_path, script, *args, size="4m", timeout=300):
    """Run the Python ``script`` (its first argument: the disk) on a tmpfs of ``size`` mounted in a
    private mount namespace (gone with the process)."""
    reason = _tmpfs_reason()
    if reason:
        pytest.skip(reason)
    disk = tmp_path / "disk"
    disk.mkdir(exist_ok=True)
    path = tmp_path / "script.py"
    path.write_text(script)
    command = f"mount -t tmpfs -o size={size} tmpfs {disk} && exec {PY} {path} {disk} " + " ".join(map(str, args))
    proc = subprocess.run(["unshare", "-m", "sh", "-c", command], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONPATH=ROOT))
    found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and found, f"exit {proc.returncode}: {proc.stdout[-2000:]} {proc.stderr[-3000:]}"
    return str(disk), json.loads(found[0][len("RESULT "):]), proc


# (formats, KB free on the 4 MB disk, the formats that fit): the model's weights take 1.0 MB; the
# conversions took at most (measured on a 40 MB tmpfs) ONNX 1.0 MB, MNN and OpenVINO 1.0 MB more
# each (MNN: a temporary copy of the weights, then the file), NCNN 4.0 MB (pnnx's TorchScript input,
# its own files and NCNN's)
FILL_POINTS = [("onnx,mnn,openvino,ncnn", 0, []), ("onnx,mnn,openvino,ncnn", 600, []),
               ("onnx,mnn,openvino,ncnn", 1600, ["onnx"]), ("onnx,mnn,openvino,ncnn", 2600, ["onnx", "mnn"]),
               ("onnx,mnn,openvino,ncnn", 3700, ["onnx", "mnn", "openvino"]),
               ("onnx,mnn,openvino", 1600, ["onnx"]), ("onnx,openvino,mnn", 2600, ["onnx", "openvino"]),
               ("ncnn,onnx", 3000, ["onnx"])]


@pytest.mark.distributed   # starts processes
@pytest.mark.slow
@pytest.mark.parametrize("formats, free_kb, fit", FILL_POINTS)
def test_a_disk_that_fills_up_is_one_disk_full_error_per_format(tmp_path, formats, free_kb, fit):
    """Formats exported onto a 4 MB disk with ``free_kb`` free, for a model of 1 MB of weights:
    each format that does not fit is a DiskFullError in its row naming the out folder (not a
    SIGABRT of the process from NCNN, "Invalid model file" from MNN, "basic_ios::clear" from
    OpenVINO); those that fit are written, the formats after a failed one too (its files are
    removed at once); nothing else is left (no staging folder, no partial file)."""
    disk, result, _ = _on_small_disk(tmp_path, FULL_DISK.format(check=None), free_kb, formats)
    out = os.path.join(disk, "out")
    for fmt, status, problems, files in result["rows"]:
        if status != "ok":
            assert status == "error" and problems[0].startswith(
                f"DiskFullError: [Errno 28] no space left in {out}: writing the "), (fmt, problems)
            assert problems[0].endswith("free space or pass another out_dir"), problems
    assert [fmt for fmt, status, _, _ in result["rows"] if status == "ok"] == fit, result["rows"]
    written = sorted(os.path.basename(f) for _, status, _, files in result["rows"] if status == "ok" for f in files)
    reports = ["m.export.json", "m.export.md"]
    assert result["left"] == sorted(written + (reports if free_kb else [])), result
    if not free_kb:   # not even the report fits: the table is still returned, with a note why
        assert len(result["notes"]) == 1 and result["notes"][0].startswith(
            f"the report files were not written: no space left in {out}: writing m.export.json needs about ")


@pytest.mark.distributed   # starts processes
@pytest.mark.slow
def test_a_converter_killed_by_sigkill_is_named_and_the_others_go_on(tmp_path, monkeypatch):
    """pnnx and MNN's converter (child processes) die by SIGKILL (the OOM killer, a user), pnnx
    half-way through its .bin: each row says so, ONNX is written, nothing else is left."""
    from basetrainer.deploy import converters
    from basetrainer.deploy.export import ExportFailed, export_model
    from test_deploy_export import images, small_net

    pnnx = tmp_path / "pnnx"
    pnnx.write_text('#!/bin/sh\nfor a in "$@"; do case "$a" in ncnnbin=*) head -c 100000 /dev/zero > "${a#ncnnbin=}";; '
                    'esac; done\nkill -9 $$\n')
    pnnx.chmod(0o755)
    monkeypatch.setattr(converters, "pnnx_binary", lambda: str(pnnx))
    monkeypatch.setattr(converters, "mnn_converter",
                        lambda: [PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    out = tmp_path / "out"
    with pytest.raises(ExportFailed) as failed:
        export_model(small_net(), "onnx,mnn,ncnn", out_dir=str(out), input_size=[16, 16], check=images(8), runs=0,
                     name="m")
    rows = {r.format: (r.status, r.problems) for r in failed.value.report.rows[1:]}
    assert rows["onnx"] == ("ok", [])
    assert rows["mnn"][0] == "error" and rows["mnn"][1][0].startswith(
        "ExportError: MNN's converter was killed by SIGKILL (exit code -9)")
    assert rows["ncnn"][0] == "error" and rows["ncnn"][1][0].startswith(
        "ExportError: pnnx was killed by SIGKILL (exit code -9)")
    assert sorted(os.listdir(out)) == ["m.export.json", "m.export.md", "m.onnx"]


CLI_ON_FULL_DISK = textwrap.dedent("""
    import json, os, sys
    from basetrainer.deploy.__main__ import main

    disk, weights = sys.argv[1], sys.argv[2]
    out = os.path.join(disk, "out")
    code = main([weights, "--net-type", "resnet18", "--input-size", "16", "16", "--format", "onnx,mnn,ncnn",
                 "--out-dir", out, "--runs", "0"])
    print("RESULT " + json.dumps({"code": code, "left": sorted(os.listdir(out))}))
""")


@pytest.mark.distributed   # starts processes
@pytest.mark.slow
def test_command_line_on_a_disk_too_small_prints_the_table_and_exits_1(tmp_path):
    """resnet18 (45 MB of weights) onto a 4 MB disk: every row a DiskFullError naming the folder,
    the table printed, exit 1 (it was SIGABRT, exit 134, with ncnn)."""
    import torch

    from basetrainer.models.build_models import get_models

    weights = tmp_path / "w.pth"
    torch.save(get_models("resnet18", [16, 16], 4).state_dict(), str(weights))
    disk, result, proc = _on_small_disk(tmp_path, CLI_ON_FULL_DISK, weights)
    out = os.path.join(disk, "out")
    assert result == {"code": 1, "left": ["w.export.json", "w.export.md"]}
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| onnx |") or line.startswith("| mnn |")
            or line.startswith("| ncnn |")]
    assert len(rows) == 3 and all(f"| **error**: DiskFullError: [Errno 28] no space left in {out}: writing the " in r
                                  for r in rows), proc.stdout
    assert "error: export failed for onnx: not exported: DiskFullError" in proc.stderr


@pytest.mark.slow
def test_report_files_that_do_not_fit_still_give_the_table(tmp_path, monkeypatch):
    """The exports fit and the report after them does not: an ExportFailed holding the report
    (the command line prints its table, exit 1), with a note; the checked files stay written."""
    import errno

    from basetrainer.deploy import report as report_module
    from basetrainer.deploy.export import ExportFailed, export_model
    from basetrainer.runtime.atomic import DiskFullError
    from test_deploy_export import images, small_net

    def full(self, *args, **kwargs):
        raise DiskFullError(errno.ENOSPC, "no space left in out: writing m.export.json needs about 3 KB and 0 B is free")

    monkeypatch.setattr(report_module.ExportReport, "write", full)
    out = tmp_path / "out"
    with pytest.raises(ExportFailed, match=r"^export failed: the report files were not written: no space left in "
                                           r"out: writing m.export.json") as failed:
        export_model(small_net(), "onnx", out_dir=str(out), input_size=[16, 16], check=images(8), runs=0, name="m")
    report = failed.value.report
    assert [(r.format, r.status) for r in report.rows] == [("pytorch", "ok"), ("onnx", "ok")]
    assert report.notes == ["the report files were not written: no space left in out: writing m.export.json needs "
                            "about 3 KB and 0 B is free"]
    assert sorted(os.listdir(out)) == ["m.onnx"]
