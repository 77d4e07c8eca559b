"""The plan of a merge, made from manifests alone before any tensor is read: which tensors are
reused as they are, which are merged, which averaged (see :mod:`ckpt.merging.combine`), and the
inputs a merge refuses (tensors stored as shards, folders of several models)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpt.errors import InvalidMergeError, TensorMismatchError
from ckpt.format.entries import TensorEntry
from ckpt.merging.methods import MergeMethod

if TYPE_CHECKING:
    from ckpt.store.reader import CheckpointReader

FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ")


@dataclass(frozen=True)
class Step:
    """One output tensor of a merge, and how it is obtained: reused, merged or averaged."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    reuse: tuple[CheckpointReader, TensorEntry] | None  # take these chunks (or bytes) as they are
    average: tuple[CheckpointReader, ...] | None = None  # compute the plain average of these inputs
    # the inputs are cut at other chunk sizes: their chunk ids cannot say whether they are equal,
    # so their bytes are compared when read (:func:`_inputs_themselves`)
    cut_otherwise: bool = False


def plan_steps(method: MergeMethod, params: Mapping[str, Any], readers: list[CheckpointReader],
               base: CheckpointReader | None, missing: str, labels: list[str], base_label: str | None,
               new_tensors: str = "error") -> list[Step]:
    """One step per output tensor, from the manifests; every mismatch is reported before any read."""
    names: list[str] = []
    seen: set[str] = set()
    for r in readers + ([base] if base is not None and missing == "base" else []):
        for n in r.keys():
            if n not in seen:
                seen.add(n)
                names.append(n)
    problems: list[str] = []
    fillable, new = [], []  # tensors --fill-from-base could supply; tensors the base cannot
    steps: list[Step] = []
    identity = method.identity(params)
    compared = readers + ([base] if method.needs_base and base is not None else [])  # must line up
    one_cut = len({r.manifest.chunk_size for r in compared}) == 1  # chunk ids are comparable
    for name in names:
        lacking = [lab for lab, r in zip(labels + [f"{base_label} (base)"], compared) if name not in r]
        if lacking:
            in_base = base is not None and name in base
            if missing == "base" and in_base:
                e = base.info(name)  # type: ignore[union-attr]
                held = [e] + [r.info(name) for r in readers if name in r]  # the inputs that have it must agree
                if len({(h.dtype, h.shape) for h in held}) > 1:
                    problems.append(f"{name} differs in dtype/shape: " + ", ".join(f"{h.dtype}{list(h.shape)}" for h in held))
                    continue
                steps.append(Step(name, e.dtype, e.shape, e.nbytes, (base, e)))
            elif new_tensors == "average" and not in_base:
                step = _average_step(name, [r for r in readers if name in r], one_cut, problems)
                if step is not None:
                    steps.append(step)
            else:
                (new if base is not None and not in_base else fillable).append(name)
                problems.append(f"{name} is missing from {', '.join(lacking)}")
            continue
        entries = [r.info(name) for r in compared]
        if len({(e.dtype, e.shape) for e in entries}) > 1:
            problems.append(f"{name} differs in dtype/shape: " + ", ".join(f"{e.dtype}{list(e.shape)}" for e in entries))
            continue
        first = entries[0]
        same = one_cut and len({e.chunks for e in entries}) == 1
        if same and (identity or first.dtype not in FLOAT_DTYPES):
            steps.append(Step(name, first.dtype, first.shape, first.nbytes, (readers[0], first)))
        elif first.dtype not in FLOAT_DTYPES and one_cut:
            problems.append(cannot_merge(name, first.dtype))
        else:
            steps.append(Step(name, first.dtype, first.shape, first.nbytes, None, cut_otherwise=not one_cut))
    if problems:
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        hints = []
        if fillable:
            hints.append("pass --fill-from-base (missing=\"base\") with --base to take tensors some inputs lack from the base")
        if new:
            hints.append(f"the base has no {new[0]}" + (f" (nor {len(new) - 1} more)" if len(new) > 1 else "")
                         + ": pass --new-tensors average (new_tensors=\"average\") to average such tensors over the inputs that have them")
        raise InvalidMergeError("inputs do not line up: " + "; ".join(problems[:8]) + more, hint="; ".join(hints) or None)
    return steps


def _average_step(name: str, holders: list[CheckpointReader], one_cut: bool, problems: list[str]) -> Step | None:
    """The step for a tensor the base lacks: the plain average of ``holders`` (unread if they agree bit for bit)."""
    entries = [r.info(name) for r in holders]
    first = entries[0]
    if len({(e.dtype, e.shape) for e in entries}) > 1:
        problems.append(f"{name} differs in dtype/shape: " + ", ".join(f"{e.dtype}{list(e.shape)}" for e in entries))
        return None
    if one_cut and len({e.chunks for e in entries}) == 1:
        return Step(name, first.dtype, first.shape, first.nbytes, (holders[0], first), tuple(holders))
    if first.dtype not in FLOAT_DTYPES and one_cut:
        problems.append(cannot_merge(name, first.dtype))
        return None
    return Step(name, first.dtype, first.shape, first.nbytes, None, tuple(holders), cut_otherwise=not one_cut)


def cannot_merge(name: str, dtype: str) -> str:
    """The error text for a tensor that is not floating point and differs between the inputs."""
    return f"{name} is {dtype} and differs between inputs: only floating-point tensors can be merged"


def check_whole_tensors(ref: str, reader: CheckpointReader) -> None:
    """Refuse a distributed (DCP) checkpoint that stores a tensor as several shards: its entries are
    the shards, and merging shard by shard is not merging the tensors (ties and dare trim by magnitude,
    slerp interpolates by angle, each over the whole tensor), nor is the result the model's layout."""
    from ckpt.dcp.format import DCP_SOURCE, decode_layout

    m = reader.manifest
    if m.source != DCP_SOURCE:
        return
    split = [t.fqn for t in decode_layout(m.extra, f"checkpoint {ref}").tensors.values() if [s.sizes for s in t.shards] != [t.size]]
    if split:
        raise InvalidMergeError(f"{ref} is a distributed (DCP) checkpoint that stores {split[0]!r}"
                                f"{f' and {len(split) - 1} more' if len(split) > 1 else ''} as shards: merge combines whole tensors",
                                hint=f"consolidate it first (ckpt pull {ref} model.safetensors; ckpt push model.safetensors NAME) "
                                "and merge that")


def check_one_model(ref: str, reader: CheckpointReader) -> None:
    """Refuse a folder of several models (a diffusers pipeline's unet/, text_encoder/, vae/): merge
    pairs tensors by name and writes one model.safetensors, so names two files share would be lost,
    and weights from several folders would land in one file beside configs left without theirs.
    Say how to merge the components one by one."""
    def refuse(why: str, part: str) -> TensorMismatchError:
        return TensorMismatchError(
            f"{ref}: {why}: it holds several models (a diffusers pipeline?), and merge combines the tensors of one model",
            hint=f"merge each model on its own: push its folder from every input (ckpt push PIPELINE/{part} "
            f"NAME/{part}; `ckpt pull {ref} DIR` writes a stored one back) and merge those refs")

    seen: dict[str, str] = {}
    for t in reader.manifest.tensors:
        if seen.setdefault(t.name, t.file) != t.file:
            raise refuse(f"tensor {t.name!r} appears in two files ({seen[t.name]} and {t.file})",
                         t.file.rpartition("/")[0] or "FOLDER")
    folders = sorted({f.path.rpartition("/")[0] for f in reader.manifest.files if f.kind == "safetensors"})
    if len(folders) > 1:
        shown = ", ".join(f"{d}/" if d else "./" for d in folders[:4]) + (" ..." if len(folders) > 4 else "")
        raise refuse(f"its weights are in {len(folders)} folders ({shown})", folders[-1] or "FOLDER")
