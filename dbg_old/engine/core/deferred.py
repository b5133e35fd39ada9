"""`Deferred`: a control call of the engine core that answers later."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Deferred:
    """A control call that answers later: `run()` once `ready()` (a release that lets running
    requests finish first)."""

    ready: Callable[[], bool]
    run: Callable[[], Any]
