"""The reason a node's parts give for a copy, a pull or a get that must ask again."""

from __future__ import annotations

from hoplite_gpu.errors import HopliteError


class Retry(HopliteError):
    """Internal: ask again (the object is being rebuilt elsewhere, or the pull a
    get waited on ran to the deadline of a less patient get)."""
