"""The typer application and what every command shares: the global options and the state they set,
opening the store they name, and printing a command's one result (commands: cli/main.py wires them)."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

from ckpt_store.cli.render import emit_json, err

app = typer.Typer(
    name="ckpt",
    help=(
        "Store PyTorch checkpoints once: chunked, deduplicated, compressed, verified.\n\n"
        "The store is --store URL, else $CKPT_STORE, else ~/.local/share/ckpt/store "
        "($XDG_DATA_HOME/ckpt/store). A URL is a local path, file://..., s3://BUCKET/PREFIX "
        "(credentials and endpoint from the AWS environment variables and config files, or "
        "--storage-option), memory://... or any fsspec URL.\n\n"
        "A REF is a name (minilm/legal), NAME@N (N versions back, see `ckpt log`), or a "
        "checkpoint id prefix (at least 4 hex digits).\n\n"
        "Quick start:  ckpt push model.safetensors minilm/base  |  ckpt ls  |  ckpt du  |  "
        "ckpt pull minilm/base out.safetensors"
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

# What the global options and the command line set for the command that runs (main() resets it).
state: dict[str, Any] = {"store": None, "options": None}

StoreOpt = Annotated[
    Optional[str],
    typer.Option("--store", "-s", metavar="URL", help="Store URL (default: $CKPT_STORE, else ~/.local/share/ckpt/store).", show_default=False),
]
OptionsOpt = Annotated[
    Optional[list[str]],
    typer.Option("--storage-option", metavar="KEY=VALUE", show_default=False,
                 help="fsspec/s3fs option for remote stores (repeatable), e.g. endpoint_url=http://host:9000, "
                      "profile=NAME, anon=true, config_kwargs.connect_timeout=5. Credentials are better left to the "
                      "AWS environment variables or config files, which are used by default."),
]
# Options for one store of a command that names two (copy's, push --to's, pull --from's), over --storage-option.
FromOptionOpt = Annotated[
    Optional[list[str]],
    typer.Option("--from-option", metavar="KEY=VALUE", show_default=False,
                 help="A storage option for the --from store only (repeatable), over --storage-option: "
                      "endpoint_url=..., profile=NAME."),
]
ToOptionOpt = Annotated[
    Optional[list[str]],
    typer.Option("--to-option", metavar="KEY=VALUE", show_default=False,
                 help="A storage option for the --to store only (repeatable), over --storage-option."),
]
# The global -o used to mean --storage-option; -o now means --output (merge, remix), and
# the old spelling still works for one release with a warning.
OldOptionsOpt = Annotated[Optional[list[str]], typer.Option("-o", hidden=True, show_default=False)]


def _json_requested(value: bool) -> bool:
    """--json was given: an error then prints {"error": MESSAGE} on stdout too (main)."""
    if value:
        state["json"] = True
    return value


JsonOpt = Annotated[bool, typer.Option("--json", callback=_json_requested,
                                       help='Machine-readable JSON on stdout; an error too, as {"error": MESSAGE}.')]


def parse_storage_options(pairs: list[str] | None, option: str = "--storage-option") -> dict[str, Any] | None:
    """``["a=1", "b.c=x"]`` -> ``{"a": 1, "b": {"c": "x"}}``: values are JSON when they parse, else strings
    (a later pair overrides an earlier one). ``option``: the option they came from, for errors."""
    import json

    if not pairs:
        return None
    opts: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            # Never echo the pair itself: it may hold a credential.
            raise typer.BadParameter("expected KEY=VALUE", param_hint=option)
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        node = opts
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise typer.BadParameter(f"{key}: {part} is both a value and a group", param_hint=option)
        if isinstance(node.get(leaf), dict):  # (a group given first, then a value in its place)
            raise typer.BadParameter(f"{key}: {key} is both a value and a group", param_hint=option)
        node[leaf] = value
    return opts


@app.callback()
def _main(store: StoreOpt = None, storage_option: OptionsOpt = None, old_storage_option: OldOptionsOpt = None,
          no_cache: Annotated[bool, typer.Option("--no-cache", help="Read remote stores without the local chunk cache "
                                                 "(~/.cache/ckpt, $XDG_CACHE_HOME/ckpt or $CKPT_CACHE_DIR; see `ckpt cache`).")] = False) -> None:
    if old_storage_option:
        err.print("warning: `ckpt -o KEY=VALUE` is deprecated, write `ckpt --storage-option KEY=VALUE` "
                  "(-o means --output, the name of what merge and remix make)")
    state["store"] = store
    state["option_pairs"] = (storage_option or []) + (old_storage_option or [])
    state["options"] = parse_storage_options(state["option_pairs"])
    state["no_cache"] = no_cache


def settings() -> Any:
    """ckpt's Settings from the environment, without the chunk cache under --no-cache."""
    from ckpt.settings import Settings

    return Settings.from_env(**({"cache": False} if state.get("no_cache") else {}))


def emit(result: Any, as_json: bool, render: Any, *args: Any) -> None:
    """Print a command's one result: as JSON with --json, else drawn by ``render`` (cli/views.py).
    A reader that left ends nothing here: the command goes on, and cli/main.py gives its exit status
    (141 only if it succeeds)."""
    if as_json:
        emit_document(result)
    else:
        render(result, *args)


def emit_document(doc: Any) -> None:
    """Print ``doc`` as --json's document (noted: an error after it adds no second document)."""
    state["json_written"] = True
    emit_json(doc)


_OPTION_FLAGS = ("--storage-option", "-o", "--from-option", "--to-option")


def _named(argv: list[str]) -> list[str]:
    """The words of a command line but the storage options' values (an endpoint_url=http://... names no store)."""
    words, skip = [], False
    for a in argv:
        if not skip and a not in _OPTION_FLAGS and not a.startswith(tuple(f"{f}=" for f in _OPTION_FLAGS)):
            words.append(a)
        skip = a in _OPTION_FLAGS
    return words


def open_store(create: bool = False, url: str | None = None, own: list[str] | None = None, flag: str = "") -> Any:
    """The store at ``url`` (None: --store), with --storage-option and then ``own``, the options
    given for this store alone (by ``flag``: copy's --from-option, say), which override them."""
    from ckpt.store.store import Store, is_local_url

    target = state["store"] if url is None else url  # (an empty --from "$UNSET" is no store, not the default one)
    options = state["options"]
    if own:
        if target != "" and is_local_url(target):  # ("" is refused by the open below: "empty store URL")
            raise typer.BadParameter(f"{target or 'the default store'} is a local folder: storage options are for "
                                     "remote stores (s3://BUCKET/PREFIX...)", param_hint=flag)
        options = parse_storage_options(state.get("option_pairs", []) + own, f"--storage-option or {flag}")
    elif options and is_local_url(target):
        # Options dropped in silence where s3:// was forgotten: the push would land in a local folder.
        argv = state.get("argv")
        if argv is not None and all(is_local_url(a) for a in _named(argv)):  # (no other store of the command is remote)
            raise typer.BadParameter(f"{target or 'the default store'} is a local folder, and every store this command "
                                     "names is: storage options are for remote stores (s3://BUCKET/PREFIX...)",
                                     param_hint="--storage-option")
    connect = Store.init if create else Store.open
    return connect(target, storage_options=options, settings=settings())


def only_with(url: str | None, own: list[str] | None, flag: str, option: str) -> None:
    """Refuse ``option`` (the options of the store at ``flag`` URL) without ``flag``: they would be dropped."""
    if own and url is None:
        raise typer.BadParameter(f"it gives options for the store at {flag} URL, and no {flag} is given "
                                 "(--storage-option is for --store)", param_hint=option)
