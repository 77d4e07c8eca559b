"""Remixing past fine-tunes ("Mashup Learning"): the starting point of a new fine-tune.

Score every past fine-tune on a small sample of the new task, keep the best ``k``,
average them (a ``linear`` merge), and start the new fine-tune from the average
instead of from the base. The score is the caller's: ``score_fn(state_dict) -> float``
(accuracy, or loss with ``higher_is_better=False``, on a few hundred examples).
The averaged checkpoint is stored like any merge; its lineage holds the scores and
the choice.

>>> import torch, ckpt
>>> store = ckpt.Store.init("memory://remix-doctest")
>>> for i, v in enumerate([1.0, 5.0, 3.0]):
...     _ = store.push({"w": torch.full((2,), v)}, f"ft/{i}")
>>> cid = ckpt.remix(["ft/0", "ft/1", "ft/2"], lambda sd: float(sd["w"][0]), k=2, name="new/start", store=store)
>>> store.load("new/start")["w"].tolist()
[4.0, 4.0]
>>> store.manifest("new/start").lineage["merge"]["remix"]["chosen"]
['ft/1', 'ft/2']
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ckpt.errors import InvalidMergeError
from ckpt.merging.calls import positionals
from ckpt_store.storage.refs import validate_ref_name

if TYPE_CHECKING:
    import torch

    from ckpt.progress import Progress
    from ckpt.store.store import Store

log = logging.getLogger(__name__)

WEIGHTINGS = ("equal", "proportional")
# A scores file larger than this is not one (a model named by mistake, /dev/zero): refused
# after reading this much, never read whole into memory.
MAX_SCORES_BYTES = 16 << 20


def _check(k: int, weights: str, candidates: int) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise InvalidMergeError(f"k must be a positive integer, got {k!r}")
    if weights not in WEIGHTINGS:
        raise InvalidMergeError(f"weights must be one of {', '.join(WEIGHTINGS)}, got {weights!r}")
    if candidates == 0:
        raise InvalidMergeError("no candidates to remix")


def read_scores(path: str | os.PathLike[str]) -> dict[str, float]:
    """The scores in a JSON file: ``{"REF": score, ...}`` or ``[{"ref": REF, "score": score}, ...]``.

    A ref given twice (a repeated key or list entry) is refused: which score would count
    is a guess, so no score silently replaces another. Scores are checked by :func:`choose`.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "s.json"
    >>> _ = p.write_text('{"ft/a": 0.5, "ft/a": 0.9}')
    >>> read_scores(p)
    Traceback (most recent call last):
    ...
    ckpt.errors.InvalidMergeError: ... ft/a is given 2 times ...
    """

    def no_repeats(pairs: list[tuple[str, object]]) -> dict[str, object]:
        return _unique(pairs, path, "key")

    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SCORES_BYTES + 1)
        if len(data) > MAX_SCORES_BYTES:
            raise InvalidMergeError(f"{os.fspath(path)}: more than {MAX_SCORES_BYTES >> 20} MiB, too large to be "
                                    "a scores file", hint='give a JSON file like {"REF": score, ...}')
        obj = json.loads(data.decode("utf-8"), object_pairs_hook=no_repeats)
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: arrays nested past Python's stack
        raise InvalidMergeError(f"{os.fspath(path)}: cannot read scores ({e})") from None
    if isinstance(obj, list):
        try:
            obj = _unique([(row["ref"], row["score"]) for row in obj], path, "entry")
        except (TypeError, KeyError):
            raise InvalidMergeError(f'{os.fspath(path)}: a list of scores needs {{"ref": ..., "score": ...}} objects') from None
    if not isinstance(obj, dict):
        raise InvalidMergeError(f"{os.fspath(path)}: expected a JSON object mapping refs to scores")
    for ref in obj:
        if not isinstance(ref, str):
            raise InvalidMergeError(f"{os.fspath(path)}: ref {ref!r} is not a string")
    return obj  # type: ignore[return-value]


def _unique(pairs: list[tuple[object, object]], path: str | os.PathLike[str], what: str) -> dict[object, object]:
    out: dict[object, object] = {}
    for k, v in pairs:
        if k in out:
            n = sum(1 for k2, _ in pairs if k2 == k)
            raise InvalidMergeError(f"{os.fspath(path)}: {k} is given {n} times (a repeated {what}); give each ref one score")
        out[k] = v
    return out


def _distinct_checkpoints(store: Store, refs: Sequence[str]) -> dict[str, str]:
    """Each ref's checkpoint id. Refuse two refs naming one checkpoint: averaging it twice
    would silently double its weight."""
    seen: dict[str, str] = {}
    for ref in refs:
        cid = store.resolve(ref)
        if cid in seen:
            same = "given twice" if seen[cid] == ref else f"and {seen[cid]} name the same checkpoint ({cid[:12]})"
            raise InvalidMergeError(f"remix candidates: {ref} {same}", hint="list each checkpoint once")
        seen[cid] = ref
    return {ref: cid for cid, ref in seen.items()}


def _float(s: float) -> float:
    """``s`` as a float: inf for an integer past any float (a JSON scores file may hold 10**400)."""
    try:
        return float(s)
    except OverflowError:
        return math.inf


def choose(scores: Mapping[str, float], k: int = 2, *, weights: str = "equal",
           higher_is_better: bool = True) -> tuple[list[str], list[float]]:
    """The best ``k`` candidates (ties keep the candidates' order) and their merge weights.

    ``equal`` weighs them alike; ``proportional`` weighs each by its score (by 1/score
    when lower is better), which needs positive scores.

    >>> choose({"a": 0.5, "b": 0.9, "c": 0.7}, 2)
    (['b', 'c'], [1.0, 1.0])
    >>> choose({"a": 2.0, "b": 1.0, "c": 4.0}, 2, weights="proportional", higher_is_better=False)
    (['b', 'a'], [1.0, 0.5])
    """
    _check(k, weights, len(scores))
    for ref, s in scores.items():
        if not isinstance(s, (int, float)) or isinstance(s, bool) or not math.isfinite(_float(s)):
            raise InvalidMergeError(f"score of {ref} is {s!r}, not a finite number")
    order = {ref: i for i, ref in enumerate(scores)}
    ranked = sorted(scores, key=lambda r: (-scores[r] if higher_is_better else scores[r], order[r]))
    chosen = ranked[:k]
    if weights == "equal":
        return chosen, [1.0] * len(chosen)
    if any(scores[r] <= 0 for r in chosen):
        raise InvalidMergeError("proportional weights need positive scores",
                                hint="use weights='equal', or a score where larger is better and above 0")
    ws = [float(scores[r]) if higher_is_better else 1.0 / scores[r] for r in chosen]
    if not all(math.isfinite(w) for w in ws):
        raise InvalidMergeError("a score is too close to 0 for proportional weights (1/score is not a finite number)",
                                hint="use weights='equal'")
    return chosen, ws


def remix_scores(scores: Mapping[str, float], k: int = 2, *legacy: int, store: Store | None = None, weights: str = "equal",
                 higher_is_better: bool = True, name: str | None = None, message: str | None = None,
                 progress: Progress | None = None, _scored: Mapping[str, str] | None = None) -> str:
    """Average the best ``k`` of the scored refs into a new checkpoint ``name``; returns its id.

    ``_scored``: the checkpoint id each ref named when it was scored; those are averaged,
    whatever the refs name by now."""
    from ckpt.merging.combine import merge

    (scores, k), store = positionals("remix_scores", (scores, k, *legacy), (None, 2), store)
    if name is not None:
        validate_ref_name(name)
    chosen, ws = choose(scores, k, weights=weights, higher_is_better=higher_is_better)
    ids = _distinct_checkpoints(store, list(scores)) if _scored is None else dict(_scored)
    if len(chosen) < k:
        log.warning("remix: %d candidates for k=%d; averaging all of them", len(chosen), k)
    note = {"k": k, "weights": weights, "higher_is_better": higher_is_better, "chosen": chosen,
            "scores": {ref: float(s) for ref, s in scores.items()}}
    return merge(chosen, "linear", name=name, store=store, params={"weights": ws}, message=message,
                 progress=progress, _remix=note, _pinned=[ids[ref] for ref in chosen]).id


def remix(candidates: Sequence[str], score_fn: Callable[[dict[str, torch.Tensor]], float], k: int = 2,
          *legacy: Any, store: Store | None = None, weights: str = "equal", higher_is_better: bool = True,
          name: str | None = None, message: str | None = None, progress: Progress | None = None) -> str:
    """Score each candidate with ``score_fn(state_dict)``, average the best ``k``; returns the new checkpoint id.

    Candidates are loaded one at a time (so memory holds one model plus what
    ``score_fn`` uses). The average is stored as ``name`` (or only by id when None)
    with lineage ``merge.method = "linear"`` and ``merge.remix`` holding every score.
    Raises :class:`InvalidMergeError` for a bad ``k``/``weights`` or a score that is
    not a finite number, before any merge work.
    """
    (candidates, score_fn, k, weights, higher_is_better), store = positionals(
        "remix", (candidates, score_fn, k, *legacy), (None, None, 2, weights, higher_is_better), store)
    if name is not None:
        validate_ref_name(name)
    _check(k, weights, len(candidates))  # before any (expensive) scoring
    ids = _distinct_checkpoints(store, candidates)  # scored and averaged by id: a ref may move meanwhile
    scores: dict[str, float] = {}
    for ref in candidates:
        sd = store.load(ids[ref])
        raw = score_fn(sd)
        del sd
        try:
            scores[ref] = float(raw)
        except (TypeError, ValueError):
            raise InvalidMergeError(f"score_fn returned {raw!r} for {ref}, not a number") from None
        except OverflowError:  # an integer past any float
            raise InvalidMergeError(f"score_fn returned a number too large for a float for {ref}, not a finite number") from None
        log.info("remix: %s scores %s", ref, scores[ref])
    return remix_scores(scores, k, store=store, weights=weights, higher_is_better=higher_is_better, name=name,
                        message=message, progress=progress, _scored=ids)
