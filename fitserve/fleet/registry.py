"""The routers this process built, by deployment name (the ingress lists replicas through them).

NOTE: a module of its own: Ray Serve pickles the router's module by value, so a registry kept
there would be a copy the ingress never sees; this one is imported by reference on both sides.
Weak values: a router Serve drops is not kept alive.
"""

from __future__ import annotations

import weakref
from typing import Any

_ROUTERS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def register_router(deployment: str, router: Any) -> None:
    _ROUTERS[deployment] = router


def router_of(deployment: str) -> Any | None:
    """The FleetRouter this process built for ``deployment`` (None before its first request)."""
    return _ROUTERS.get(deployment)
