"""Whether settings leave the admin listener's cancel API open beyond loopback, and the WARNING
that says so at start and on a reload."""

from __future__ import annotations

import ipaddress
import logging

from sidecar.config.schema import Settings

# The package's name, as the WARNING has always been logged under.
log = logging.getLogger("sidecar.config")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name, or "" (every address)


def open_cancel_api(settings: Settings, port: int | None = None) -> str | None:
    """``HOST:PORT`` of an admin listener whose cancel API takes unauthenticated calls from
    beyond loopback (``admin.host`` not a loopback address, no ``admin.cancel_token``), else
    None. ``port``: the bound admin port, when known (``admin.port`` may be 0)."""
    admin = settings.admin
    if admin is None or admin.cancel_token is not None or _is_loopback(admin.host):
        return None
    return f"{admin.host}:{admin.port if port is None else port}"


def warn_open_cancel_api(new: Settings, running: Settings | None = None,
                         port: int | None = None) -> None:
    """Log a WARNING when ``new`` leaves the cancel API open beyond loopback (see
    :func:`open_cancel_api`): at start (``running`` None; ``port`` the bound admin port), and on
    a reload only when the file changed that compared with ``running`` (admin needs a restart)."""
    where = open_cancel_api(new, port)
    if where is None:
        return
    if running is None:
        log.warning("the cancel API on %s is open to anyone who can reach it; set "
                    "admin.cancel_token", where)
    elif where != open_cancel_api(running):
        log.warning("reload: after a restart (admin changes need one) the cancel API on %s will "
                    "be open to anyone who can reach it; set admin.cancel_token", where)
