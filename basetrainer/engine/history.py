"""What ``run()`` returns: the figures of every epoch."""
from typing import Any, Dict, List, Optional


class History:
    """Per-epoch figures of a run, Keras style.

    ``history.epochs`` is a list of dicts (one per finished epoch, with an ``"epoch"`` key),
    ``history.history`` maps each figure to its list of values, and ``history["test/Accuracy"]``
    is a shortcut for the latter. ``history.last`` is the final epoch's dict.
    """

    def __init__(self) -> None:
        self.epochs: List[Dict[str, Any]] = []

    def append(self, epoch: int, logs: Dict[str, Any]) -> None:
        row: Dict[str, Any] = {"epoch": epoch}
        for key, value in logs.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                row[key] = value
        self.epochs.append(row)

    @property
    def history(self) -> Dict[str, List[Any]]:
        keys: List[str] = []
        for row in self.epochs:
            keys += [k for k in row if k not in keys]
        return {k: [row.get(k) for row in self.epochs] for k in keys}

    @property
    def last(self) -> Optional[Dict[str, Any]]:
        return self.epochs[-1] if self.epochs else None

    def __getitem__(self, key: str) -> List[Any]:
        return [row.get(key) for row in self.epochs]

    def __len__(self) -> int:
        return len(self.epochs)

    def __repr__(self) -> str:
        return f"History({len(self.epochs)} epochs, last={self.last})"
