"""The process that runs checks for the kit (``python -m gpukit.child``), one after another.

    python -m gpukit.child RESULTS TMP DEVICE [--dry] NAME...

It appends one JSON line to RESULTS before each check (``{"start": name}``) and one with its
result after, so the kit can tell which check a timeout or a crash belongs to and start a new
child for the rest.
"""
import json
import os
import sys
import traceback
from typing import Any, Dict


def _write(path: str, record: Dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def main(argv: list) -> int:
    results, tmp, device = argv[:3]
    dry = "--dry" in argv
    names = [a for a in argv[3:] if a != "--dry"]
    try:
        import torch

        from gpukit import registry

        checks = registry.load_all()
    except Exception as e:   # basetrainer (or torch) does not import: every check says why
        reason = f"import failed: {type(e).__name__}: {e}"
        for name in names:
            _write(results, {"name": name, "kind": "check", "status": "fail", "figure": {}, "seconds": 0.0,
                             "reason": reason, "traceback": traceback.format_exc()[-4000:]})
        return 1
    ctx = registry.Context(torch.device(device), tmp, cpu_dry_run=dry)
    for name in names:
        _write(results, {"start": name})
        _write(results, registry.run_one(checks[name], ctx))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
