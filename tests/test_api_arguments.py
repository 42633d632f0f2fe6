"""What the API's calls make of arguments of the wrong kind: timeouts,
directory addresses and object names are taken or refused with the project's
own error. Each test fails on a confirmed bug."""

from __future__ import annotations

import numpy as np
import pytest

import hoplite_gpu as hg
from hoplite_gpu.config import check_timeout
from hoplite_gpu.ids import ObjectID


@pytest.fixture
def runtime_settings() -> dict:
    """The `local` runtime's settings here."""
    return {"chunk_size": 64 * 1024, "timeout_s": 20}


# --- deadlines given by the caller ------------------------------------------


@pytest.mark.parametrize("call", ["get", "reduced_inputs"])
def test_an_infinite_timeout_waits_or_is_refused_clearly(local, call):
    """`timeout=float("inf")` ("wait as long as it takes") passes the
    `timeout > 0` check, then overflows `Future.result(inf + 5)`: a raw
    OverflowError, while the call itself keeps running on the loop."""
    a, b = hg.put(np.ones(100_000)), hg.put(np.ones(100_000))
    try:
        if call == "get":
            value = hg.get(a, timeout=float("inf"))
            assert value.shape == (100_000,)
        else:
            target = hg.reduce([a, b])
            assert hg.get(target, timeout=10)[0] == 2.0
            assert set(hg.reduced_inputs(target, timeout=float("inf"))) == {a, b}
    except hg.HopliteError:
        pass  # refused clearly (InvalidArgument) is fine too


def test_a_timeout_of_the_wrong_type_is_invalid_argument(local):
    oid = hg.put(b"abc")
    with pytest.raises(hg.InvalidArgument):
        hg.get(oid, timeout="5")  # raw TypeError from `not timeout > 0`


@pytest.mark.parametrize("timeout", [np.float32(2.5), np.int64(30), np.int32(1)])
def test_timeouts_take_numpy_numbers(timeout):
    """`check_timeout` (every `timeout=` of get, the collectives, LocalCluster)
    tests `isinstance(timeout, int | float)`: a NumPy float32 or integer (a
    timeout computed from an array) is refused with "timeout must be a
    positive number of seconds ...; got np.int64(30)", a positive number."""
    assert check_timeout(timeout) == float(timeout)


# --- init ---------------------------------------------------------------------


@pytest.mark.parametrize("address", [1234, "127.0.0.1:99999"], ids=["not-a-str", "port-out-of-range"])
def test_a_malformed_directory_address_is_invalid_argument(address):
    """An int address dies with a raw AttributeError (`address.partition`); a
    port over 65535 is not checked and wraps modulo 65536 (99999 dials 34463,
    someone else's port)."""
    try:
        with pytest.raises(hg.InvalidArgument):
            hg.init(address, token="x", connect_timeout_s=1)
    finally:
        hg.shutdown()


def test_a_directory_host_name_that_cannot_be_encoded_is_a_hoplite_error():
    """`_resolve` (transports/tcp.py) tries the numeric form, then the
    resolver; a host no resolver can take (an empty label, as in a typo'd
    "tcp://.:5000", or a label over 63 characters) fails in the idna codec
    and the raw UnicodeError reaches `init` instead of ConnectionRefused /
    InvalidArgument."""
    for host in (".", "a" * 64):
        try:
            hg.init(f"tcp://{host}:5000", token="t", connect_timeout_s=2, timeout_s=3)
        except hg.HopliteError:
            continue
        except UnicodeError as exc:
            pytest.fail(f"init('tcp://{host[:8]}...:5000') raised a raw {exc!r}")
        else:  # pragma: no cover - nothing listens there
            hg.shutdown()
            pytest.fail("init connected to a directory that does not exist")


# --- object names -------------------------------------------------------------


def test_an_object_name_with_any_surrogate_gives_an_id_or_a_clear_error():
    """0aa67ed made names of arbitrary bytes work (`os.fsdecode` output: lone
    surrogates U+DC80-U+DCFF) by encoding with "surrogateescape"; any other
    lone surrogate, e.g. from a JSON "\\ud800", still escapes as a raw
    UnicodeEncodeError from ObjectID.from_name (and so from every
    collective and WeightChannel taking a name)."""
    try:
        oid = ObjectID.from_name("weights-\ud800")
    except hg.HopliteError:
        return  # refused with the project's own error: fine
    assert oid != ObjectID.from_name("weights-")
