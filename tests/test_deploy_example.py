"""examples/deploy.py: train the example (pruned), export the best model, print the table with
what pruning bought."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT, make_image_folder


@pytest.mark.slow
@pytest.mark.distributed   # a script in a subprocess
def test_deploy_example_with_pruning(tmp_path):
    work = str(tmp_path / "run")
    train = make_image_folder(str(tmp_path / "train"), ["a", "b", "c", "d"], per_class=6, size=32)
    val = make_image_folder(str(tmp_path / "val"), ["a", "b", "c", "d"], per_class=3, size=32)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "deploy.py"), "--export", "onnx,ncnn",
                           "--export_runs", "2", "--gpu_id", "--num_epochs", "1", "--batch_size", "8",
                           "--input_size", "16", "16",
                           "--train_data", train, "--test_data", val, "--work_dir", work, "--use_prune",
                           "--sparsity", "0.5", "--no-progress"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "checked on 12 " in out                                # the validation images
    table = out[:out.index("The dense model")]
    assert "| onnx | ONNX Runtime | fp32 |" in table and "| ncnn | NCNN | fp32 |" in table and "**FAIL**" not in table
    assert "| format | precision | batch 1, ms (IQR) | vs eager | batch 37, ms per image (IQR) | vs eager |" in out
    summary = out[out.index("What pruning bought"):]
    rows = [line for line in summary.splitlines() if line.startswith("| pytorch") or line.startswith("| onnx")]
    assert len(rows) == 2
    for row in rows:            # sparsity 0.5 keeps about a quarter of the weights
        size = row.split("|")[2]
        assert "MB (2" in size, row
    exported = sorted(os.listdir(os.path.join(work, "export")))
    stem = next(n for n in exported if n.endswith(".onnx"))[:-len(".onnx")]
    assert [n for n in exported if n.endswith((".onnx", ".param", ".bin"))] == [
        stem + ext for ext in (".ncnn.bin", ".ncnn.param", ".onnx")]
    assert "deploy.json" in exported and "dense" in exported
