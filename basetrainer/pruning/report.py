"""The human-readable pruning report: sizes before/after and the channels of every layer."""
import json
from pathlib import Path
from typing import Any, Dict, List, Union

from basetrainer.pruning.counter import ModelCost
from basetrainer.pruning.shapes import LayerSpec, channels_of
from basetrainer.runtime import atomic

REPORT_JSON = "prune_report.json"
REPORT_TXT = "prune_report.txt"


def _ratio(after: int, before: int) -> float:
    return round(after / before, 4) if before else 1.0


def build_report(before: ModelCost, after: ModelCost, shapes_before: Dict[str, LayerSpec],
                 shapes_after: Dict[str, LayerSpec], settings: Dict[str, Any]) -> Dict[str, Any]:
    """The report as plain data (what ``prune_report.json`` holds).

    Args:
        before: Cost of the dense model.
        after: Cost of the pruned model.
        shapes_before: :func:`~basetrainer.pruning.shapes.layer_shapes` of the dense model.
        shapes_after: The same for the pruned model.
        settings: The pruning settings to record (prune_type, sparsity, backend, input shape...).

    Returns:
        ``{"settings", "params", "macs", "layers"}``; ``params`` and ``macs`` hold ``before``,
        ``after`` and ``ratio`` (after / before); ``layers`` lists every recorded layer with its
        ``[in, out]`` channels before and after and whether it changed.
    """
    layers: List[Dict[str, Any]] = []
    for name, spec in shapes_before.items():
        new = shapes_after.get(name, spec)
        old_ch, new_ch = list(channels_of(spec)), list(channels_of(new))
        layers.append({"name": name, "type": spec["type"], "channels_before": old_ch,
                       "channels_after": new_ch, "pruned": old_ch != new_ch})
    return {
        "settings": dict(settings),
        "params": {"before": before.params, "after": after.params,
                   "ratio": _ratio(after.params, before.params)},
        "macs": {"before": before.macs, "after": after.macs,
                 "ratio": _ratio(after.macs, before.macs)},
        "layers": layers,
    }


def summary_line(report: Dict[str, Any]) -> str:
    """One line: parameters and MACs before -> after, with the ratios."""
    p, m = report["params"], report["macs"]
    changed = sum(layer["pruned"] for layer in report["layers"])
    return (f"params {p['before']:,} -> {p['after']:,} ({p['ratio']:.1%}), "
            f"MACs {m['before']:,} -> {m['after']:,} ({m['ratio']:.1%}), "
            f"{changed} of {len(report['layers'])} layers reshaped")


def format_report(report: Dict[str, Any]) -> str:
    """The report as a text table (what ``prune_report.txt`` holds)."""
    settings = ", ".join(f"{key}={value}" for key, value in report["settings"].items())
    lines = ["Structured pruning report", settings, summary_line(report), ""]
    width = max([len(layer["name"]) for layer in report["layers"]] + [5])
    lines.append(f"{'layer':<{width}}  {'type':<14}  {'in before->after':>18}  "
                 f"{'out before->after':>18}")
    for layer in report["layers"]:
        (in0, out0), (in1, out1) = layer["channels_before"], layer["channels_after"]
        mark = "" if layer["pruned"] else "  (unchanged)"
        lines.append(f"{layer['name']:<{width}}  {layer['type']:<14}  {f'{in0}->{in1}':>18}  "
                     f"{f'{out0}->{out1}':>18}{mark}")
    return "\n".join(lines) + "\n"


def write_report(report: Dict[str, Any], directory: Union[str, Path]) -> List[Path]:
    """Write ``prune_report.json`` and ``prune_report.txt`` into ``directory`` (created).

    Returns:
        The two paths written.
    """
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    json_path, txt_path = folder / REPORT_JSON, folder / REPORT_TXT
    atomic.write_atomically(json.dumps(report, indent=2) + "\n", str(json_path))
    atomic.write_atomically(format_report(report), str(txt_path))
    return [json_path, txt_path]
