"""What the kit writes: the machine's line, and report.md / report.json of every check."""
import datetime
import importlib
import json
import os
import platform
import sys
import traceback
from typing import Any, Dict, List

from gpukit.registry import figure_text

PEERS = ("lightning", "accelerate", "onnxruntime", "sklearn", "torchmetrics", "timm", "pytest")


def machine() -> Dict[str, Any]:
    """Python, torch, CUDA, the GPU(s), whether basetrainer imports (and exactly why not), and
    the versions of the optional packages the checks use."""
    info: Dict[str, Any] = {"python": platform.python_version(), "date": datetime.date.today().isoformat(),
                            "host_cpus": os.cpu_count()}
    try:
        import torch

        info.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2 ** 30, 1)
    except Exception as e:
        info["torch"] = f"does not import: {type(e).__name__}: {e}"
    try:
        import torchvision

        info["torchvision"] = torchvision.__version__
    except Exception as e:
        info["torchvision"] = f"does not import: {type(e).__name__}: {e}"
    try:
        import basetrainer

        info["basetrainer"] = f"{basetrainer.__version__} from {os.path.dirname(basetrainer.__file__)}"
        info["basetrainer_ok"] = True
    except Exception as e:
        where = traceback.extract_tb(e.__traceback__)[-1]
        info["basetrainer"] = (f"does not import: {type(e).__name__}: {e} "
                               f"({os.path.relpath(where.filename)}:{where.lineno})")
        info["basetrainer_ok"] = False
    for name in PEERS:
        try:
            module = importlib.import_module(name)
            info[name] = getattr(module, "__version__", "?")
            if name == "onnxruntime":
                info["onnxruntime_providers"] = module.get_available_providers()
        except Exception as e:
            info[name] = f"missing ({type(e).__name__})"
    return info


def headline(info: Dict[str, Any], cpu: bool) -> str:
    gpu = ", ".join(info.get("gpus", [])) or "no CUDA device"
    line = (f"torch {info.get('torch')} (CUDA {info.get('cuda')}), {gpu}, Python {info['python']}, "
            f"{'CPU dry run' if cpu else 'GPU run'}, {info['date']}")
    if not info.get("basetrainer_ok"):
        return f"basetrainer {info['basetrainer']} | " + line
    return line


def write(out_dir: str, info: Dict[str, Any], results: List[Dict[str, Any]], cpu: bool, seconds: float) -> str:
    counts = {s: sum(r["status"] == s for r in results) for s in ("pass", "fail", "skip")}
    doc = {"headline": headline(info, cpu), "machine": info, "cpu_dry_run": cpu, "seconds": round(seconds, 1),
           "counts": counts, "checks": results}
    with open(os.path.join(out_dir, "report.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    lines = [doc["headline"], "", f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped "
             f"in {seconds:.0f} s (`{' '.join(sys.argv)}`)", "",
             "| check | kind | status | figure | seconds |", "|---|---|---|---|---|"]
    for r in results:
        text = figure_text(r.get("figure"))
        if r.get("reason"):
            text = (text + "; " if text else "") + r["reason"].replace("\n", " ")[:400]
        lines.append(f"| {r['name']} | {r['kind']} | {r['status']} | {text.replace('|', '/')} | {r['seconds']:.1f} |")
    lines += ["", "Machine: " + ", ".join(f"{k} {v}" for k, v in info.items() if k not in ("python", "date")), ""]
    with open(os.path.join(out_dir, "report.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    return doc["headline"]
