"""examples/rl_weights.py end to end on a local Ray: a learner trains a torch
policy and publishes it every iteration, rollout actors serve each version
from a double buffer, one is killed mid-fetch and a new one joins and gets
the current version; the actors' loss falls as the versions come."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")
pytest.importorskip("torch")

from ray_local import local_ray  # noqa: E402

import hoplite_gpu as hg  # noqa: E402
import hoplite_gpu.ray as hray  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.slow  # a Ray session, a learner and four rollout actors: about 30 s
@pytest.mark.timeout(300)
def test_an_actor_killed_mid_fetch_is_replaced_and_the_policy_learns(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    old = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(EXAMPLES), old) if p))
    rl_weights = importlib.import_module("rl_weights")
    with local_ray("hoplite-example-rl", num_cpus=8):
        hray.start_directory()
        try:
            hray.join()
            res = rl_weights.run(3, 256 << 10, 4, kill=True)
        finally:
            hg.shutdown()
            hray.stop_directory()
    sys.modules.pop("rl_weights", None)
    assert res["actors"] == 3 and len(res["hoplite_s"]) == len(res["ray_s"]) == 4
    assert res["killed"]["iteration"] == 2 and res["killed"]["rejoined_at_version"] == 2
    assert 200 << 10 < res["size_bytes"] < 300 << 10
    assert res["loss"][-1] < res["loss"][0], f"the actors' loss did not fall: {res['loss']}"
