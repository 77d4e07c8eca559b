"""A checkpoint into memory: new tensors (:func:`load`), or decoded in place into a model's
own tensors (:func:`load_into`, :func:`fill`), every byte verified on the way."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ckpt.errors import ResourceLimitError, TensorMismatchError
from ckpt.format.dtypes import to_torch
from ckpt.format.entries import TensorEntry
from ckpt.format.manifest import Manifest
from ckpt.format.names import folder_names, name_selected
from ckpt.format.safetensors_header import check_layout
from ckpt.progress import NullProgress, Progress, reporting
from ckpt.store.limits import check_memory
from ckpt.transfer.pipeline import GetTask, fetch_chunk, get_chunks, into_tasks, spans
from ckpt_store.storage.errors import StoreFormatError

if TYPE_CHECKING:
    import torch

    from ckpt.store.store import Store


def select(m: Manifest, include: list[str] | None) -> list[TensorEntry]:
    """The tensors of ``m`` whose names match one of the ``include`` globs (all without), each
    entry named as :func:`load` names it (``FOLDER/NAME`` where folders share names: :func:`named_entries`)."""
    return [t for t in named_entries(m) if not include or name_selected(t.name, include)]


def check_headers(store: Store, m: Manifest, what: str, known: dict[str, bytes] | None = None, *,
                  files: set[str] | None = None, get: Callable[[list[GetTask]], None] | None = None) -> None:
    """Check every safetensors file's stored header against ``m``'s tensors
    (:func:`~ckpt.format.safetensors_header.check_layout`): the header chunks of all files are read, verified,
    in one parallel pass (``get(tasks)`` where given, as a restore from tiers reads), unless ``known``
    (chunk id -> decoded bytes already verified) has them. ``files``: only the files of these paths.
    A distributed (DCP) checkpoint's file is assembled from its shards instead: they must cover each
    tensor once, each the tensor entry it names (what a pull or a load of it checks)."""
    if m.source == "dcp":
        from ckpt.dcp.format import decode_layout

        entries = {t.name: t for t in m.tensors}
        for item in decode_layout(m.extra, what).tensors.values():
            for s in item.shards:
                e = entries.get(s.entry)
                if e is None or e.shape != s.sizes or e.dtype != item.dtype:
                    raise StoreFormatError(f"{what}: tensor {item.fqn}: shard {s.entry!r} is missing or does not match its entry")
        return
    tasks, check = _header_reads(m, files, known or {})
    if get is not None:
        get(tasks)
    elif len(tasks) == 1:  # (one read, as a checkpoint of one file needs: no pool of reading threads started for it)
        tasks[0].into[:] = fetch_chunk(store.objects, tasks[0].id, tasks[0].length, store.settings)[0]  # type: ignore[index]
    elif tasks:
        get_chunks(store.objects, tasks, store.settings, manifest=m)
    check(what)


def _header_reads(m: Manifest, files: set[str] | None, known: dict[str, bytes]) -> tuple[list[GetTask], Callable[[str], None]]:
    """The reads of the stored headers of ``m``'s safetensors files (those of ``files``, all without) not in
    ``known``, and what checks them once read (naming ``what``): :func:`check_headers`'s, or a load's
    among its tensors' reads (where a header travels in a bundle with them, it costs no request)."""
    heads = [(f, bytearray(f.head_size)) for f in m.files if f.kind == "safetensors" and (files is None or f.path in files)]
    tasks = []
    for f, buf in heads:
        view = memoryview(buf)
        for cid, n, pos in spans(f.chunks, f.head_size, m.chunk_size):
            if cid in known:
                view[pos : pos + n] = known[cid]
            else:
                tasks.append(GetTask(cid, n, into=view[pos : pos + n]))

    def check(what: str) -> None:
        for f, buf in heads:
            check_layout(bytes(buf), m, f, what)

    return tasks, check


def check_unique(entries: Iterable[TensorEntry], hint: str) -> None:
    """Refuse tensors of the same name (from two files of a directory checkpoint): one file
    or dict cannot hold both, and picking one silently would lose the other."""
    seen: dict[str, TensorEntry] = {}
    for t in entries:
        if t.name in seen:
            raise TensorMismatchError(f"tensor {t.name!r} appears in two files of this checkpoint "
                                      f"({seen[t.name].file} and {t.file})", hint=hint)
        seen[t.name] = t


def empty_tensor(entry: TensorEntry, **kwargs: Any) -> Any:
    """``torch.empty`` for ``entry``; an allocation failure is a :class:`ResourceLimitError`."""
    import torch

    try:
        return torch.empty(entry.shape, dtype=to_torch(entry.dtype), **kwargs)
    except RuntimeError as e:  # torch reports an out-of-memory allocation this way
        raise ResourceLimitError(f"cannot allocate tensor {entry.name!r} ({entry.nbytes:,} bytes): {str(e)[:200]}") from None


def named_entries(m: Manifest) -> list[TensorEntry]:
    """``m``'s tensors named as load and load_into name each: its name, or ``FOLDER/NAME`` where
    folders of the checkpoint share names (a diffusers pipeline: :func:`folder_names`)."""
    names = folder_names([(t.name, t.file) for t in m.tensors])
    return [t if k == t.name else replace(t, name=k) for k, t in zip(names, m.tensors)]


def load(store: Store, ref: str, *, include: list[str] | None = None, progress: Progress | None = None,
         structure: bool = False) -> Any:
    """See :meth:`Store.load`."""
    if structure and include:
        raise TensorMismatchError("structure=True gives the whole checkpoint as it was pushed; include= picks tensors by "
                                  "their flat names", hint="pass one of them")
    m = store.manifest(ref)
    tensors = load_manifest(store, m, include, progress, f"checkpoint {ref}")
    tree = m.structure(tensors, f"checkpoint {ref}") if structure else None
    return tensors if tree is None else tree


def load_manifest(store: Store, m: Manifest, include: list[str] | None, progress: Progress | None, what: str) -> dict[str, torch.Tensor]:
    """Every tensor of ``m`` (or those matching ``include``) as CPU tensors, by name."""
    if m.source == "dcp":  # a distributed checkpoint: whole tensors, consolidated from its shards
        from ckpt.dcp.consolidate import load_dcp

        return load_dcp(store, m, include, progress, what)
    chosen = select(m, include)
    check_unique(chosen, "use `ckpt pull`")
    check_memory(chosen, what)
    out = {t.name: empty_tensor(t) for t in chosen}
    fill(store, m, [(t, out[t.name]) for t in chosen], progress, what=what, fresh=True)
    return out


def load_into(store: Store, ref: str, target: Any, *, strict: bool = True, prefix: str = "", progress: Progress | None = None) -> None:
    """See :meth:`Store.load_into`."""
    live = _live_tensors(target)
    m = store.manifest(ref)
    if m.source == "dcp":  # a distributed checkpoint: whole tensors assembled from its shards
        from ckpt.dcp.consolidate import fill_dcp

        return fill_dcp(store, m, lambda stored: pair_names(live, stored, strict, prefix), progress, f"checkpoint {ref}")
    entries = named_entries(m)
    check_unique(entries, "load it with store.load(ref) and pick the tensors")
    by_name = {t.name: t for t in entries}
    paired = pair_names(live, by_name, strict, prefix)
    pairs = [(by_name[n], dst) for n, dst in paired.items()]
    _one_value_per_tensor(pairs)
    fill(store, m, pairs, progress, what=f"checkpoint {ref}")


def _one_value_per_tensor(pairs: list[tuple[TensorEntry, Any]]) -> None:
    """Refuse two different stored tensors bound for one target tensor (weights the target ties,
    as an embedding and lm_head, that the checkpoint holds untied): one would silently overwrite
    the other. Equal ones (a tied model's own checkpoint) load as one."""
    first: dict[tuple[Any, ...], TensorEntry] = {}
    for e, dst in pairs:
        key = _alias_key(dst)
        if key is None:
            continue
        other = first.setdefault(key, e)
        if other is not e and (other.chunks, other.dtype) != (e.chunks, e.dtype):
            raise TensorMismatchError(
                f"the checkpoint's {other.name!r} and {e.name!r} differ, but the target holds them in one tensor "
                "(tied weights): loading both would keep only one",
                hint="untie them in the target to load both (transformers: tie_word_embeddings=False), or load "
                "the one you want into it by itself")


def _live_tensors(target: Any) -> dict[str, torch.Tensor]:
    """The tensors ``load_into`` fills: a module's state dict, or a mapping of tensors; anything else
    (an optimizer, a list, a mapping holding other values) is a :class:`TensorMismatchError`."""
    import torch

    if isinstance(target, torch.nn.Module):
        live = dict(target.state_dict())
    elif isinstance(target, Mapping):
        live = dict(target)
    else:
        raise TensorMismatchError(f"load_into fills a torch.nn.Module or a dict of tensors, not a {type(target).__name__}",
                                  hint="for anything else (an optimizer...), read the tensors with store.load(ref) "
                                  "and hand them to its own load_state_dict")
    odd = [repr(k) for k in live if not isinstance(k, str)]
    if odd:
        raise TensorMismatchError(f"the target's keys {', '.join(odd[:5])}{' ...' if len(odd) > 5 else ''} are not "
                                  "strings: a checkpoint's tensors are named by strings", hint="name them by strings")
    return live


def pair_names(live: dict[str, Any], stored: Iterable[str], strict: bool, prefix: str = "") -> dict[str, Any]:
    """``live``'s tensors by the stored name each loads from (``prefix`` + its name), those the
    checkpoint has. ``strict``: the checkpoint's tensors under ``prefix`` and ``live`` must match
    one to one, else :class:`TensorMismatchError`, whose hint names the prefix that would match
    where one does (a Lightning checkpoint's ``state_dict.``, a pushed ``{"model": ...}``'s ``model.``).
    A tensor of ``live`` the checkpoint lacks but that is the same memory as one it holds (tied
    weights, which ``save_pretrained`` writes once) is not missing: it is filled through that one."""
    stored = set(stored)
    want = {prefix + k: v for k, v in live.items()}
    missing = sorted(set(want) - stored)
    if missing:  # a tied weight (lm_head sharing the embedding) is filled through the one the checkpoint has
        filled = {_alias_key(v) for n, v in want.items() if n in stored} - {None}
        missing = [n for n in missing if _alias_key(want[n]) not in filled]
    unexpected = sorted(n for n in stored - set(want) if n.startswith(prefix))
    paired = {n: t for n, t in want.items() if n in stored}
    if strict and (missing or unexpected):
        hints = [_where_they_are(live, stored, prefix) if missing else "",
                 "pass strict=False to load the common tensors" if paired else ""]
        raise TensorMismatchError(
            f"checkpoint and target differ: missing in checkpoint {missing[:10]}, not in target {unexpected[:10]}"
            + (" ..." if len(missing) > 10 or len(unexpected) > 10 else ""), hint="; or ".join(filter(None, hints)) or None)
    if want and not paired:  # strict=False that would load nothing: the model left as it was, silently
        raise TensorMismatchError(
            f"no tensor of the target is in the checkpoint{f' under {prefix!r}' if prefix else ''} (the target's "
            f"{sorted(want)[:3]}{' ...' if len(want) > 3 else ''}): nothing would be loaded",
            hint=_where_they_are(live, stored, prefix) or "check the ref and the target's names")
    return paired


def _where_they_are(live: dict[str, Any], stored: set[str], prefix: str) -> str:
    """A hint naming the prefix, or the wrapped model, under which the checkpoint holds ``live``'s
    names; '' where there is none."""
    guess = _prefix_that_matches(list(live), stored)
    if guess is not None and guess != prefix:
        return f"the checkpoint holds them under {guess!r}: pass prefix={guess!r}"
    return _unwrap_hint(list(live), stored)


def _alias_key(t: Any) -> tuple[Any, ...] | None:
    """What makes two tensors the same memory (tied weights: one Parameter under two names, as a
    Hugging Face model's ``lm_head.weight`` and embedding); None for one that holds no bytes."""
    try:
        if t.numel() == 0 or t.data_ptr() == 0:
            return None
        return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
    except (AttributeError, RuntimeError, TypeError):
        return None


# What wraps a model and prefixes its state dict's names: the target can be the model inside.
_WRAPPERS = {"_orig_mod.": "a torch.compile'd model", "module.": "a DistributedDataParallel (or DataParallel) model"}


def _unwrap_hint(names: list[str], stored: set[str]) -> str:
    """Where every one of ``names`` carries a wrapper's prefix and the checkpoint holds the names
    without it (under some prefix): how to load into the wrapped model instead; else ''."""
    for wrap, what in _WRAPPERS.items():
        if names and all(n.startswith(wrap) for n in names):
            inner = _prefix_that_matches([n[len(wrap):] for n in names], stored)
            if inner is not None:
                return f"the target is {what}: load into model.{wrap[:-1]}" + (f" with prefix={inner!r}" if inner else "")
    return ""


def _prefix_that_matches(names: list[str], stored: set[str]) -> str | None:
    """The shortest prefix under which ``stored`` holds every one of ``names``, if any."""
    if not names:
        return None
    first = min(names)
    found = sorted({s[: len(s) - len(first)] for s in stored if s.endswith(first)}, key=len)
    return next((p for p in found if all(p + n in stored for n in names)), None)


def fill(store: Store, m: Manifest, pairs: list[tuple[TensorEntry, torch.Tensor]], progress: Progress | None = None,
         get: Callable[[list[GetTask], Progress], None] | None = None, *, what: str = "checkpoint",
         checked: set[str] | None = None, fresh: bool = False) -> None:
    """Decode each entry's chunks into its destination tensor, in place, all in one parallel pass:
    the one way a stored tensor becomes a tensor (load, load_into, a pull to a torch file, the lazy
    reader, a snapshot's restore).

    Contiguous CPU tensors receive the bytes directly (from a remote store, a raw chunk's
    body is read off the socket into the tensor). Others (CUDA, strided) get them through
    host staging buffers (pinned for CUDA), at most ``settings.inflight_mb`` of them at a
    time (one tensor larger than that gets a buffer of its own size), each copied to its
    tensor while the next group is fetched. A shape or dtype mismatch is an error naming
    every offending tensor, raised before any write. So is a :class:`StoreFormatError` where the stored
    header of an entry's file does not give it the manifest's dtype, shape and place (:func:`check_headers`:
    a forged or damaged manifest's fp16 entry over fp32 bytes made a tensor of the right bytes and the
    wrong type, and only ``verify`` noticed); ``what`` names the checkpoint in it. Its header chunks are
    fetched first, in one parallel pass (a small request per file, none per tensor); ``fresh``: the
    destinations are new tensors, which a refusal discards: the headers are read in the same pass as
    they (no request of their own where a bundle holds them) and checked after. ``checked``: the files
    already checked by an earlier call (a reader's), updated.
    ``get(tasks, progress)`` fetches the chunks instead of ``store`` (several tiers, say).
    """

    import torch

    bad = [f"{e.name}: checkpoint {e.dtype}{list(e.shape)} vs target {d.dtype}{list(d.shape)}"
           if isinstance(d, torch.Tensor) else f"{e.name}: checkpoint {e.dtype}{list(e.shape)} vs target a {type(d).__name__}"
           for e, d in pairs if not isinstance(d, torch.Tensor) or tuple(d.shape) != e.shape or d.dtype != to_torch(e.dtype)]
    if bad:
        raise TensorMismatchError("shape or dtype mismatch: " + "; ".join(bad[:10]) + (" ..." if len(bad) > 10 else ""))

    def fetch(tasks: list[GetTask], p: Progress) -> None:
        if get is None:
            get_chunks(store.objects, tasks, store.settings, p, manifest=m)
        else:
            get(tasks, p)

    files = {e.file for e, _ in pairs} - (checked or set())
    if m.source == "dcp" or not fresh:  # before anything is written to a model's tensors
        check_headers(store, m, what, files=files, get=lambda tasks: fetch(tasks, NullProgress()))
        heads, check = [], None
    else:  # new tensors: the headers read with them, in the same pass, and checked before they are handed out
        heads, check = _header_reads(m, files, {})
    direct = []
    staged: list[tuple[TensorEntry, torch.Tensor]] = []
    for entry, dst in pairs:
        dst = dst.detach()
        if dst.device.type == "cpu" and dst.is_contiguous():
            direct.append((entry, dst))
        else:
            staged.append((entry, dst))
    total = sum(e.nbytes for e, _ in pairs) + sum(t.length for t in heads)
    with reporting(progress, "load", total) as p:
        if direct or heads:
            fetch(heads + into_tasks(m.chunk_size, direct), p)
        if staged:
            _fill_staged(store, m, staged, p, fetch)
    if check is not None:
        check(what)
    if checked is not None:
        checked |= files


def _aligned(n: int) -> int:
    """``n`` rounded up to 64 bytes: every staged tensor starts aligned for any dtype."""
    return (n + 63) & ~63


def _fill_staged(store: Store, m: Manifest, staged: list[tuple[TensorEntry, torch.Tensor]], progress: Progress,
                 fetch: Callable[[list[GetTask], Progress], None]) -> None:
    """Fill non-contiguous or device tensors through host buffers of at most ``inflight_mb`` per group
    (pinned where the tensors are on a GPU), so that memory stays bounded whatever the model's size."""
    import torch

    budget = store.settings.inflight_mb << 20
    groups: list[list[tuple[TensorEntry, torch.Tensor]]] = [[]]
    size = 0
    for entry, dst in staged:
        if groups[-1] and size + entry.nbytes > budget:
            groups.append([])
            size = 0
        groups[-1].append((entry, dst))
        size += entry.nbytes
    cuda = any(d.device.type == "cuda" for _, d in staged) and torch.cuda.is_available()
    # Two buffers: one is copied to the device while the other is filled.
    buffers: list[torch.Tensor | None] = [None, None]
    events: list[list[Any]] = [[], []]  # per buffer: an event on each device its last copies went to
    for k, group in enumerate(groups):
        need = sum(_aligned(e.nbytes) for e, _ in group)
        slot = k % 2
        for ev in events[slot]:
            ev.synchronize()  # its previous copies are done: the buffer can be reused
        buf = buffers[slot]
        if buf is None or buf.numel() < need:
            buf = buffers[slot] = torch.empty(max(need, 1), dtype=torch.uint8, pin_memory=cuda)
        tmps = []
        pos = 0
        for entry, dst in group:
            tmp = buf[pos : pos + entry.nbytes].view(dst.dtype).view(entry.shape) if entry.nbytes else torch.empty(
                entry.shape, dtype=dst.dtype)
            tmps.append(tmp)
            pos += _aligned(entry.nbytes)
        fetch(into_tasks(m.chunk_size, [(e, t) for (e, _), t in zip(group, tmps)]), progress)
        with torch.no_grad():
            for (_, dst), tmp in zip(group, tmps):
                dst.copy_(tmp, non_blocking=cuda and dst.device.type == "cuda")
        if cuda:  # (a model spread over GPUs: each device's stream has copies of its own to wait for)
            devices = {dst.device for _, dst in group if dst.device.type == "cuda"}
            events[slot] = [torch.cuda.current_stream(dev).record_event() for dev in devices]
    for ev in events[0] + events[1]:
        ev.synchronize()  # every device's copies done: the tensors hold the checkpoint on return
