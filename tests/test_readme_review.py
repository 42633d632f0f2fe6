"""README.md (and docs/*.md) read as a newcomer would: claims the code does
not keep. Each test quotes the doc line and checks what it says."""

from __future__ import annotations

import pathlib
import re
import threading
import time
import tomllib

import numpy as np
from in_process import local_mode

import hoplite_gpu as hg
from hoplite_gpu import collectives

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_readme_names_every_dependency_the_demo_installs():
    """README "make demo" paragraph: "The demo installs only the package and
    its three dependencies (NumPy, msgpack, rich)". pyproject.toml's
    [project].dependencies has four: ml_dtypes too (bfloat16), so a user who
    vets or pre-installs the demo's dependencies from the README (an offline
    or locked-down machine) misses one and `import hoplite_gpu` fails."""
    readme = (ROOT / "README.md").read_text()
    claim = re.search(r"its (\w+) dependencies \(([^)]*)\)", readme)
    assert claim, "the README no longer lists the demo's dependencies"
    named = {n.strip().lower().replace("-", "_") for n in re.split(r",|\band\b", claim[2])
             if n.strip()}
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    actual = {re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].lower().replace("-", "_") for d in deps}
    assert named == actual, (
        f"README says the demo installs {claim[1]} dependencies ({claim[2]}); "
        f"pyproject.toml declares {sorted(actual)}")


def test_a_second_broadcast_under_one_name_gives_every_rank_the_first_calls_value():
    """docs/api.md "Collectives": "A name serves one call: objects are immutable, so
    a second call under the same name returns the first call's objects until
    `collectives.delete` frees them". Non-roots do get the first call's
    value, but the root returns the value it was just given
    (collectives.broadcast returns `value` after a put that, for an id this
    node already holds, keeps the old bytes), so the two ranks of one
    broadcast silently return different arrays."""
    with local_mode():
        for step in range(2):
            mine = np.arange(4) + 100 * step
            at_root = collectives.broadcast(mine, name="readme-bcast", rank=0, size=2, timeout=10)
            at_other = collectives.broadcast(None, name="readme-bcast", rank=1, size=2,
                                             timeout=10)
        assert np.array_equal(at_other, np.arange(4)), "a non-root got a new value"
        assert np.array_equal(at_root, at_other), (
            f"second broadcast under one name: the root returned {at_root}, the other rank "
            f"{at_other}; docs/api.md says both get the first call's objects")


def test_a_get_waiting_for_an_id_not_put_yet_keeps_waiting_through_its_delete():
    """docs/api.md, the `delete(object_id)` row: gets waiting on the object's
    copies get `ObjectNotFound`, but "a get waiting for an id not put yet
    keeps waiting: deleting an id that does not exist changes nothing" (a
    writer that deletes an id before putting it anew must not fail its
    readers). The API table used to promise every waiter `ObjectNotFound`."""
    outcome: dict[str, object] = {}
    with local_mode():
        oid = hg.ObjectID.random()

        def waiter() -> None:
            try:
                outcome["value"] = hg.get(oid, timeout=6)
            except Exception as exc:  # noqa: BLE001 (what the waiter sees)
                outcome["error"] = exc

        thread = threading.Thread(target=waiter, daemon=True)
        thread.start()
        time.sleep(0.5)  # the get's locate is at the directory
        hg.delete(oid)
        time.sleep(0.3)
        hg.put(np.arange(5, dtype=np.int64), oid)
        thread.join(timeout=10)
    assert not thread.is_alive(), "the get did not end"
    assert "error" not in outcome, outcome
    np.testing.assert_array_equal(outcome["value"], np.arange(5))
