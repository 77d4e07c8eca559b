"""Which snapshots of a run to keep: the last K, every multiple of M, the best N by a metric.

Pure: :meth:`Retention.keep` takes steps and their metrics and returns the steps to keep.

>>> Retention(last=2, every=100).keep([50, 100, 150, 200, 250], {})
[100, 200, 250]
>>> Retention(best=KeepBest("loss", "min")).keep([1, 2, 3], {1: {"loss": 0.5}, 2: {"loss": 0.2}, 3: {"loss": 0.9}})
[2, 3]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckpt._deprecation import deprecated


def count_setting(name: str, value: Any) -> int | None:
    """A retention or schedule setting: None, or an int >= 1 (a bool is not a count)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 or None, not {value!r}")
    return value


@dataclass(frozen=True)
class KeepBest:
    """Keep the ``count`` snapshots with the lowest (``mode="min"``) or highest (``"max"``)
    value of ``metric`` (as given to ``maybe_save(..., metrics=...)``)."""

    metric: str
    mode: str = "min"
    count: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError(f"keep_best's metric must be a non-empty name, not {self.metric!r}")
        if self.mode not in ("min", "max"):
            raise ValueError(f"keep_best's mode must be 'min' or 'max', not {self.mode!r}")
        count_setting("keep_best's count", self.count)

    @classmethod
    def coerce(cls, value: Any) -> KeepBest | None:
        """``value`` as a KeepBest; the older ``(metric, mode[, count])`` tuple still works, with a warning."""
        if value is None or isinstance(value, KeepBest):
            return value
        if isinstance(value, (tuple, list)) and len(value) in (2, 3):
            deprecated("keep_best=(metric, mode, count)", "ckpt.KeepBest(metric, mode, count)", stacklevel=5)
            return cls(*value)
        raise ValueError(f"keep_best must be ckpt.KeepBest(metric, 'min' | 'max', count), not {value!r}")


@dataclass(frozen=True)
class Retention:
    """Keep the last ``last`` snapshots, every one whose step is a multiple of ``every``, and the
    ``best`` ones. The one ``RUN/latest`` names is always kept. All None: keep everything."""

    last: int | None = None
    every: int | None = None
    best: KeepBest | None = None

    def __post_init__(self) -> None:
        count_setting("keep_last", self.last)
        count_setting("keep_every", self.every)

    @property
    def keeps_all(self) -> bool:
        return self.last is None and self.every is None and self.best is None

    def keep(self, steps: Sequence[int], metrics: Mapping[int, Mapping[str, float]], latest: int | None = None,
             ) -> list[int]:
        """The steps of ``steps`` to keep, ascending (``metrics``: each step's metrics, where known).

        ``latest``: the step ``RUN/latest`` names. Steps after it are of a timeline the run left (it
        went back to an earlier snapshot and saved from there): they are kept, and the rules apply
        to the steps up to it, so that the last ones are the run's newest, not the abandoned ones.

        >>> Retention(last=2).keep([4, 6, 8, 10, 12], {}, latest=6)
        [4, 6, 8, 10, 12]
        >>> Retention(last=1).keep([4, 6, 8, 10, 12], {}, latest=8)
        [8, 10, 12]
        """
        steps = sorted(steps)
        if self.keeps_all:
            return steps
        left = [s for s in steps if latest is not None and s > latest]
        steps = steps[: len(steps) - len(left)]
        keep = set(steps[-self.last:]) if self.last else set()
        if self.every:
            keep |= {s for s in steps if s % self.every == 0}
        if self.best:
            name = self.best.metric
            scored = sorted((metrics[s][name], s) for s in steps if name in metrics.get(s, {}))
            if self.best.mode == "max":
                scored.reverse()
            keep |= {s for _, s in scored[: self.best.count]}
        if steps:
            keep.add(steps[-1])
        return sorted(keep | set(left))
