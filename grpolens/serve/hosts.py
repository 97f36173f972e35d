"""Which ``Host`` a request may be addressed to: the defence against DNS rebinding.

A web page the user visits can point a name it controls (``evil.example.com``) at 127.0.0.1 and
then read the dashboard with the user's browser: the browser thinks it talks to
``evil.example.com``, the server sees a request from 127.0.0.1. What gives it away is the
``Host`` header, which the browser fills with the name the page used. So the server answers only
requests whose ``Host`` names it (as Jupyter and Datasette do), and refuses the rest with 403:

* listening on loopback (the default): ``localhost`` and loopback addresses only;
* listening on another address: also that address or name, this machine's names, and any IP
  address (a page cannot rebind an address: its origin is then the dashboard itself);
* ``--allow-host NAME`` (repeatable) adds a name, e.g. the one a reverse proxy forwards;
  ``--allow-host '*'`` turns the check off (for a proxy that checks names itself).

Only ``Host`` is read: ``X-Forwarded-Host`` and the like are set by whoever sends the request.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass, field
from typing import Iterable

from grpolens.errors import UserError

LOOPBACK_NAMES = frozenset({"localhost"})
WILDCARD_BINDS = frozenset({"0.0.0.0", "::", ""})
_NAME = re.compile(r"^[a-z0-9]([a-z0-9\-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9\-]{0,61}[a-z0-9])?)*$")


def _ip(host: str):
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` is reachable from this machine only."""
    host = host.strip("[]").lower()
    ip = _ip(host)
    return host in LOOPBACK_NAMES or (ip is not None and ip.is_loopback)


def host_name(header: str | None) -> str | None:
    """The name or address of a ``Host`` header, lower case, without port, brackets or a final
    dot (``[::1]:8050`` -> ``::1``); None when it is malformed."""
    if not header or len(header) > 300:
        return None
    h = header.strip().lower()
    if h.startswith("["):  # [v6]:port
        end = h.find("]")
        if end < 0 or (h[end + 1:] and not re.fullmatch(r":\d{1,5}", h[end + 1:])):
            return None
        return h[1:end] if _ip(h[1:end]) else None
    name, _, port = h.rpartition(":") if h.count(":") == 1 else (h, "", "")
    if port and not port.isdigit():
        return None
    name = name.rstrip(".") if name.endswith(".") and not name.endswith("..") else name
    return name if (_ip(name) or _NAME.match(name)) else None


def check_allow_host(name: str) -> str:
    """An ``--allow-host`` value: ``*``, a host name or an IP address (lower case)."""
    n = name.strip().lower()
    if n == "*":
        return n
    got = host_name(n)
    if got is None or got != n.strip("[]"):
        raise UserError(f"--allow-host {name!r}: give a host name (dash.example.com), an IP address or '*'")
    return got


@dataclass(frozen=True)
class HostPolicy:
    """The names a request's ``Host`` may carry; ``any_ip``: every IP address too."""

    names: frozenset[str]
    any_ip: bool = False
    anything: bool = False
    hint: str = field(default="", compare=False)

    def allows(self, header: str | None) -> bool:
        if self.anything:
            return True
        name = host_name(header)
        if name is None:
            return False
        ip = _ip(name)
        if ip is not None:
            return ip.is_loopback or self.any_ip or str(ip) in self.names
        return name in self.names


def _machine_names() -> set[str]:
    names = set()
    for get in (socket.gethostname, socket.getfqdn):
        try:
            n = get().lower().rstrip(".")
        except OSError:
            continue
        if n and _NAME.match(n):
            names.add(n)
    return names


def policy(bind: str = "127.0.0.1", allow: Iterable[str] = ()) -> HostPolicy:
    """The hosts a server listening on ``bind`` answers, plus the ``--allow-host`` names."""
    extra = [check_allow_host(a) for a in allow]
    if "*" in extra:
        return HostPolicy(frozenset(), anything=True)
    names = set(LOOPBACK_NAMES) | set(extra)
    if is_loopback(bind):
        return HostPolicy(frozenset(names), hint="the dashboard listens on loopback")
    if bind.lower() not in WILDCARD_BINDS:
        names.add(bind.strip("[]").lower())
    names |= _machine_names()
    return HostPolicy(frozenset(names), any_ip=True, hint=f"the dashboard listens on {bind}")


def install(server, pol: HostPolicy) -> None:
    """Refuse, on the Flask ``server``, every request whose ``Host`` the policy does not allow."""
    from flask import Response, request

    @server.before_request
    def check_host():
        header = request.environ.get("HTTP_HOST")
        if pol.allows(header):
            return None
        shown = (header or "")[:80].encode("ascii", "replace").decode()
        server.logger.warning("refused a request for Host %r (not this dashboard's name)", shown)
        return Response(f"403: this dashboard does not answer for Host {shown!r} ({pol.hint}); "
                        "serve it with --allow-host NAME to answer for NAME\n", status=403, mimetype="text/plain")
