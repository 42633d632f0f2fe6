"""Checks every emulated harness (benchmarks/emulated.py, leafspine.py,
rails.py, dgxmesh.py) shares: its network namespaces, gone after an error
inside its run, and those of a killed run swept while live ones stay."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from benchmarks.emulated import EmulationUnavailable, _alive


def namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def ours(harness: Any) -> list[str]:
    """The namespaces of `harness` (named by its `prefix`)."""
    return [ns for ns in namespaces() if ns.startswith(harness.prefix)]


def dead_tag(top: int = 99998) -> int:
    """A process id no process has now: the tag of a killed run."""
    return next(t for t in range(top, 0, -1) if not _alive(t))


def check_an_error_inside_the_run_tears_it_down(harness: Any, count: int) -> None:
    """`harness` entered builds its `count` namespaces; an error inside its
    `with` block leaves none (skipped where namespaces cannot be made)."""
    try:
        with pytest.raises(ZeroDivisionError), harness:
            assert len(ours(harness)) == count
            raise ZeroDivisionError("an error in the run")
    except EmulationUnavailable as exc:
        pytest.skip(str(exc))
    assert not ours(harness)


def check_a_killed_runs_namespaces_are_swept(sweep: Callable[[], list[str]],
                                            stale: Sequence[str], live: str) -> None:
    """Namespaces named `stale` (a killed run's) and `live` (this process's)
    are made; `sweep` removes exactly the stale ones and keeps the live one."""
    made = []
    try:
        for name in (*stale, live):
            r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
            if r.returncode:
                pytest.skip(f"cannot create network namespaces here: {r.stderr.strip()}")
            made.append(name)
        assert sorted(sweep()) == sorted(stale)
        left = namespaces()
        assert not set(stale) & set(left) and live in left
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
