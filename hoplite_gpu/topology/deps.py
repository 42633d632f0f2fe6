"""The planners' optional dependencies (networkx, SciPy), imported on first
use so that importing the package needs the standard library alone."""

from __future__ import annotations

from types import ModuleType

from ..errors import HopliteError

_HINT = "pip install 'hoplite-gpu[plan]'"


class MissingDependency(HopliteError, ImportError):
    """A planner needs a package that is not installed."""


def networkx() -> ModuleType:
    try:
        import networkx as nx  # noqa: PLC0415 - optional
    except ImportError as exc:
        raise MissingDependency(f"topology graphs and tree packing need networkx: {_HINT} "
                                f"({exc})") from exc
    return nx


def scipy_optimize() -> ModuleType:
    try:
        from scipy import optimize  # noqa: PLC0415 - optional
    except ImportError as exc:
        raise MissingDependency(f"tree packing needs SciPy (the HiGHS LP and MILP solvers): "
                                f"{_HINT} ({exc})") from exc
    return optimize
