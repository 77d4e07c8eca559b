"""Start the web view: check the address and the token, print where it is, run uvicorn."""

from __future__ import annotations

import ipaddress
import re
import secrets
import socket
from collections.abc import Callable
from typing import Any

from ckpt.errors import CkptError, MissingDependencyError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
TOKEN = re.compile(r"[A-Za-z0-9._~-]{16,}")


class ServeError(CkptError):
    """``ckpt serve`` cannot start as asked."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` binds to this machine only (127.0.0.0/8, ::1): an address, or a name (``localhost``
    too: the hosts file says where it points) every address of which is loopback."""
    try:
        return ipaddress.ip_address(host.strip("[]").split("%")[0]).is_loopback
    except ValueError:
        try:  # a name: loopback only if every address it resolves to is
            addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
        except (OSError, UnicodeError):
            return False
        return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def resolve(host: str) -> tuple[socket.AddressFamily, str]:
    """(family, address): the one address ``host`` names, looked up once, which :func:`serve` checks and
    binds to. (Looked up twice, a name could point at loopback for the check and elsewhere for the bind.)
    Raises OSError where it names none."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        # ("" is every interface, as a bind takes it: AI_PASSIVE gives that address for no name)
        infos = socket.getaddrinfo(host.strip("[]") or None, 0, family, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except UnicodeError as e:  # (a name too long or malformed for IDNA)
        raise OSError(f"bad host name ({e})") from None
    return family, str(infos[0][4][0])


def check_access(host: str, token: str | None, address: str | None = None) -> None:
    """Binding beyond loopback needs a token: anyone who can reach the port could read every checkpoint.
    ``address``: the one ``host`` was resolved to and is bound (:func:`resolve`), checked in its place."""
    if token is not None and not TOKEN.fullmatch(token):
        # it travels in a URL and a cookie: URL-safe characters only, and long enough not to be guessed
        raise ServeError("--token must be at least 16 characters of letters, digits, '-', '_', '.' or '~'",
                         hint=f"for example --token {secrets.token_urlsafe(24)}")
    if not is_loopback(host if address is None else address) and token is None:
        shown = host if address is None or address == host else f"{host} ({address})" if host else address
        raise ServeError(f"binding to {shown} makes the store readable from the network: it needs --token",
                         hint=f"for example --token {secrets.token_urlsafe(24)} (or --host 127.0.0.1)")


def address(host: str, port: int, token: str | None) -> str:
    shown = f"[{host.strip('[]')}]" if ":" in host else host  # (--host [::1] is bound as ::1)
    return f"http://{shown}:{port}/" + (f"?token={token}" if token else "")


def serve(store: Any, host: str = "127.0.0.1", port: int = 8765, token: str | None = None,
          announce: Callable[[str], None] = print, local: Any = None) -> None:
    """Serve ``store`` read-only at ``host:port`` until interrupted (``local``: a run's local tier, shown beside it)."""
    try:
        family, bound = resolve(host)
    except OSError as e:  # no such name
        raise ServeError(f"cannot listen on {host}:{port}: {getattr(e, 'strerror', None) or e}",
                         hint="pick another --port or --host") from None
    check_access(host, token, bound)
    try:
        import uvicorn

        from ckpt_store.cli.web.app import create_app
    except ImportError as e:
        raise MissingDependencyError(f"ckpt serve needs {e.name}", hint="pip install 'ckpt-store[web]'") from None
    hosts = None if token else sorted({host.lower(), *LOOPBACK_NAMES})
    app = create_app(store, token=token, hosts=hosts, local=local)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, server_header=False)
    server = uvicorn.Server(config)
    try:
        # Bound here, not by uvicorn's Config.bind_socket, which logs a failure and exits 3 itself;
        # listening before the address is printed: it can be opened at once.
        sock = socket.create_server((bound, port), family=family, backlog=config.backlog)  # the address checked
    except (OSError, OverflowError) as e:  # in use, no such address or name; a port past 65535
        raise ServeError(f"cannot listen on {host}:{port}: {getattr(e, 'strerror', None) or e}",
                         hint="pick another --port or --host") from None
    port = sock.getsockname()[1]  # --port 0: the port the system chose, which is the one to open
    announce(f"ckpt serve: {address(host, port, token)}  (read-only view of {store.url}; Ctrl-C stops)")
    server.run(sockets=[sock])
