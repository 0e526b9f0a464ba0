"""The export run's results as a markdown table and as JSON (both written atomically)."""
import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from basetrainer.runtime import atomic


@dataclass
class Row:
    """One line of the table: eager PyTorch (the reference) or one format."""
    format: str
    runtime: str
    precision: str
    bound: str = ""
    files: List[str] = field(default_factory=list)
    size_bytes: Optional[int] = None
    parity: Optional[Dict[str, Any]] = None
    latency: Dict[str, Dict[str, Any]] = field(default_factory=dict)   # "batch 1" / "batch N" -> Latency.as_dict()
    status: str = "ok"            # ok | FAIL (outside its bound) | error (no export)
    problems: List[str] = field(default_factory=list)


@dataclass
class ExportReport:
    """Everything one export run measured; ``ok`` when every format passed."""
    source: str
    input_shape: List[int]
    checked_on: str
    rows: List[Row] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    # not saved: the check images and, for timing, eager PyTorch and each passing export's engine
    inputs: Any = field(default=None, repr=False)
    runners: Dict[str, Any] = field(default_factory=dict, repr=False)
    timing: Dict[str, Any] = field(default_factory=dict)   # threads, runs, warmup of the latency figures

    @property
    def ok(self) -> bool:
        return all(row.status == "ok" for row in self.rows)

    @property
    def failed(self) -> List[Row]:
        return [row for row in self.rows if row.status != "ok"]

    def as_dict(self) -> Dict[str, Any]:
        return {"source": self.source, "input_shape": self.input_shape, "checked_on": self.checked_on, "ok": self.ok,
                "rows": [row.__dict__ for row in self.rows], "notes": self.notes, "timing": self.timing}

    def to_markdown(self) -> str:
        """The checks' table, then the latency table (:meth:`latency_markdown`). ``max Δ / scale``
        is the largest difference relative to the output's scale (the bound's measure; with
        several outputs, the output furthest off is named). ``top-1 agree`` and ``accuracy`` are
        columns only when the model has class-score outputs and labels."""
        parities = [row.parity or {} for row in self.rows]
        several = any(len(p.get("outputs") or []) > 1 for p in parities)
        columns = [("max abs Δ", lambda p: _num(p.get("max_abs"))),
                   ("max Δ / scale", lambda p: _relative(p, several))]
        if any(p.get("agreement") is not None for p in parities):
            columns.append(("top-1 agree", lambda p: _pct(p.get("agreement"))))
        if any(p.get("accuracy") is not None for p in parities):
            columns.append(("accuracy", lambda p: _pct(p.get("accuracy"))))
        columns.append(("batch 1 vs N Δ", lambda p: _num(p.get("batch_max_abs"))))
        head = (["format", "runtime", "precision", "file", "size"] + [name for name, _ in columns]
                + ["status"])
        lines = [f"Export of {self.source}, input {tuple(self.input_shape)}, checked on {self.checked_on}", "",
                 "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for row, p in zip(self.rows, parities):
            cells = [row.format, row.runtime, row.precision, ", ".join(os.path.basename(f) for f in row.files) or "-",
                     _size(row.size_bytes)] + [cell(p) for _, cell in columns]
            cells.append(row.status if row.status == "ok" else f"**{row.status}**: {'; '.join(row.problems)}")
            lines.append("| " + " | ".join(cells) + " |")
        bounds = sorted({(row.precision, row.bound) for row in self.rows if row.bound})
        if bounds:
            lines += ["", "Bounds: " + "; ".join(f"{prec}: {text}" for prec, text in bounds)]
        timed = self.latency_markdown()
        lines += ["", timed.rstrip("\n")] if timed else []
        lines += ([""] + [f"Note: {note}" for note in self.notes]) if self.notes else []
        return "\n".join(lines) + "\n"

    def latency_markdown(self) -> str:
        """Latency of eager PyTorch and each timed export, on one line each: the median ms per call
        at batch 1 and per image at the larger batch, with the interquartile range, and how many
        times faster than eager (eager's median over the row's; above 1 is faster). Titled with
        the threads and runs; empty when nothing was timed."""
        eager = next((row for row in self.rows if row.format == "pytorch"), None)
        if eager is None or not eager.latency:
            return ""
        keys = sorted(eager.latency, key=lambda k: eager.latency[k]["batch"])
        head = ["format", "precision"]
        for k in keys:
            n = eager.latency[k]["batch"]
            head += [f"batch {n}, ms{' per image' if n > 1 else ''} (IQR)", "vs eager"]
        t = self.timing
        threads = t.get("threads", "?")
        runs = t.get("runs", "?")
        lines = [f"Latency on the CPU, {threads} thread{'' if threads == 1 else 's'}: median of {runs} timed "
                 f"run{'' if runs == 1 else 's'} after {t.get('warmup', '?')} warm-up rounds, interleaved with eager "
                 f"PyTorch", "",
                 "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for row in self.rows:
            cells = [row.format, row.precision]
            for k in keys:
                lat = row.latency.get(k)
                if not lat:
                    cells += [f"not timed ({row.status})", "-"]
                    continue
                n = max(1, lat["batch"])
                spread = f" ({_ms(lat['q1_ms'] / n)}–{_ms(lat['q3_ms'] / n)})" if lat["runs"] > 1 else ""
                cells += [f"{_ms(lat['median_ms'] / n)}{spread}",
                          f"{eager.latency[k]['median_ms'] / lat['median_ms']:.2f}×"]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n"

    def write(self, json_path: str, markdown_path: Optional[str] = None) -> List[str]:
        """Write the JSON (and the markdown table) atomically; return the paths."""
        written = [atomic.write_atomically(json.dumps(self.as_dict(), indent=2, default=str) + "\n", json_path)]
        if markdown_path:
            written.append(atomic.write_atomically(self.to_markdown(), markdown_path))
        return written


def _num(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2g}"


def _relative(parity: Dict[str, Any], several: bool) -> str:
    if parity.get("rel") is None:
        return "-"
    return f"{parity['rel']:.2g}" + (f" ({parity['worst_output']})" if several and parity.get("worst_output") else "")


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2%}"


def _size(n: Optional[int]) -> str:
    return "-" if n is None else atomic.human(n)


def _ms(value: float) -> str:
    """Three significant digits without an exponent: 0.0826, 9.46, 52.2, 1059."""
    return f"{value:.0f}" if value >= 100 else f"{value:#.3g}"
