"""The pure parts import with the standard library alone, and the package stays cheap."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# -I -S: no site-packages, no user site, no PYTHON* variables: only the standard
# library and the repository's own hoplite_gpu folder are importable.
BARE = [sys.executable, "-I", "-S", "-c"]


def _bare(code: str) -> subprocess.CompletedProcess:
    prelude = f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
    return subprocess.run(BARE + [prelude + code], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("module", [
    "hoplite_gpu", "hoplite_gpu.directory", "hoplite_gpu.directory.state",
    "hoplite_gpu.directory.reduce_plan", "hoplite_gpu.simulator", "hoplite_gpu.messages",
    "hoplite_gpu.topology", "hoplite_gpu.trees", "hoplite_gpu.topology_cli",
])
def test_pure_modules_import_with_the_standard_library_alone(module):
    r = _bare(f"import {module}; print('ok')")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_the_simulator_runs_with_the_standard_library_alone():
    r = _bare(
        "from hoplite_gpu.simulator import simulate_broadcast; "
        "print(simulate_broadcast(receivers=7, size=1 << 20).makespan > 0)"
    )
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr


def test_typed_messages_build_and_compare_with_the_standard_library_alone():
    r = _bare(
        "from hoplite_gpu import messages as m; "
        "a = m.Put(rid=1, oid=b'o' * 20, size=3, layout={}, print_=b'p'); "
        "assert a == m.Put(rid=1, oid=b'o' * 20, size=3, layout={}, print_=b'p'); "
        "assert a.inline is None and m.op(a) == 'put' and m.with_rid(a, 7).rid == 7; "
        "assert m.Complete(oid=b'o' * 20).size == -1 and m.Complete(oid=b'o' * 20).own is False; "
        "print(m.msgspec is None)"
    )
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr


def test_topologies_read_and_plans_split_with_the_standard_library_alone():
    """Reading a topology and splitting a plan's bytes need no networkx or
    SciPy; packing says which package it lacks."""
    r = _bare(
        "from hoplite_gpu.topology import fixture; "
        "from hoplite_gpu.trees import Tree, TreePlan, pack; "
        "t = fixture('dgx1v'); assert t.capacity(0, 3) == 50; "
        "p = TreePlan(root=0, members=(0, 1), flow='broadcast', bound=2.0, upper=2.0, "
        "packed=2.0, rate=2.0, trees=(Tree(1.0, ((0, 1),), ((0, 1),)),) * 2); "
        "assert p.split(5) == [(0, 3), (3, 5)]\n"
        "try:\n    pack(t, 0)\nexcept ImportError as exc:\n    print(exc)"
    )
    assert r.returncode == 0, r.stderr
    assert "need networkx: pip install 'hoplite-gpu[plan]'" in r.stdout


def test_importing_the_planners_loads_no_solver():
    r = subprocess.run(
        [sys.executable, "-c",
         "import sys, hoplite_gpu.topology, hoplite_gpu.trees, hoplite_gpu.cli; "
         "print(sorted(m for m in ('networkx', 'scipy', 'numpy', 'matplotlib') "
         "if m in sys.modules))"],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_importing_the_package_loads_no_runtime():
    r = subprocess.run(
        [sys.executable, "-c",
         "import sys, hoplite_gpu; "
         "print(sorted(m for m in ('numpy', 'msgpack', 'hoplite_gpu.api', 'hoplite_gpu.node.node') "
         "if m in sys.modules))"],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_the_api_names_load_on_first_use():
    import hoplite_gpu as hg
    from hoplite_gpu import api

    assert hg.put is api.put and hg.init is api.init
    assert "get_async" in dir(hg)
    with pytest.raises(AttributeError, match="no attribute 'nonesuch'"):
        hg.nonesuch  # noqa: B018


def test_the_runtime_function_is_not_shadowed_by_the_runtime_module():
    """Regression: with the API loaded lazily, importing the module
    `hoplite_gpu.runtime` first (as `from hoplite_gpu.runtime import Runtime`
    does) bound the module over the function, and `hg.runtime()` raised
    "'module' object is not callable"."""
    r = subprocess.run(
        [sys.executable, "-c",
         "from hoplite_gpu.runtime import Runtime; import hoplite_gpu as hg; "
         "import hoplite_gpu.api as api; print(hg.runtime is api.runtime)"],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stdout + r.stderr


def test_the_package_pickles_by_reference():
    """Regression: the package's own module type could not be pickled, so Ray
    failed to send any task function that names `hoplite_gpu`."""
    import pickle

    import hoplite_gpu

    assert pickle.loads(pickle.dumps(hoplite_gpu)) is hoplite_gpu


def test_the_stand_in_structs_have_msgspecs_fields_defaults_and_tags():
    """Every message class built on plain_struct (no msgspec) has the same
    fields, in order, the same defaults and the same tag as with msgspec: the
    node's messages, the directory's pushes and replies, and the structures
    inside them."""
    import json

    import msgspec

    from hoplite_gpu import messages as m

    listing = (
        "import json; from hoplite_gpu import messages as m; "
        "print(json.dumps({c.__name__: [m.op(c), list(c.__struct_fields__), "
        "{k: repr(v) for k, v in c.__struct_defaults__.items()}] "
        "for c in m.Message.__subclasses__() + m.Request.__subclasses__() + m.Body.__subclasses__()"
        " + [m.Body, m.StepChild, m.Source, m.HolderInfo, m.Manifest, m.PackPart,"
        " m.PackedTensor, m.TreeMember, m.Challenge, m.Proof, m.Verdict]"
        " if c is not m.Request}))"
    )
    r = _bare(listing)
    assert r.returncode == 0, r.stderr
    bare = json.loads(r.stdout)
    classes = [c for c in m.Message.__subclasses__() + m.Request.__subclasses__()
               + m.Body.__subclasses__()
               + [m.Body, m.StepChild, m.Source, m.HolderInfo, m.Manifest, m.PackPart,
                  m.PackedTensor, m.TreeMember, m.Challenge, m.Proof, m.Verdict]
               if c is not m.Request]
    assert {"Done", "Failure", "Location", "ReduceStep", "Located", "Registered"} <= {
        c.__name__ for c in classes}
    assert set(bare) == {c.__name__ for c in classes}
    for c in classes:
        fields = msgspec.structs.fields(c)
        # (msgspec keeps an empty list default as a factory; the stand-in as the list)
        defaults = {f.name: repr(f.default if f.default is not msgspec.NODEFAULT
                                 else f.default_factory())
                    for f in fields if (f.default, f.default_factory) != (msgspec.NODEFAULT,) * 2}
        assert bare[c.__name__] == [m.op(c), [f.name for f in fields], defaults], c.__name__
