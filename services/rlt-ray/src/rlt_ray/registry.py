"""The request routers living in this process, by engine deployment name.

Ray Serve ships a router class by value (cloudpickle), so the router's own module is a copy
in the process that runs it; what that process's ingress must reach (reports, a live policy
switch) is registered here, in a module imported by name.
"""

from __future__ import annotations

import threading

_ROUTERS: dict[str, object] = {}
_LOCK = threading.Lock()


def register(name: str, router: object) -> None:
    with _LOCK:
        _ROUTERS[name] = router


def routers() -> list:
    with _LOCK:
        return list(_ROUTERS.values())


def find(name: str):
    """The router of the deployment `name` in this process, or None (its handle has not
    been used yet)."""
    with _LOCK:
        return _ROUTERS.get(name)
