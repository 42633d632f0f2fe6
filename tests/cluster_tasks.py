"""Functions the tests send to LocalCluster workers (must be importable by name)."""

from __future__ import annotations

import concurrent.futures
import time
import zlib

import numpy as np

import hoplite_gpu as hg


def pattern(size: int, seed: int = 0) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(size), dtype=np.uint8)


def put_pattern(name: str, size: int, seed: int = 0) -> int:
    data = pattern(size, seed)
    hg.put(data, hg.ObjectID.from_name(name))
    return zlib.crc32(data)


def put_value(name: str, value) -> None:
    hg.put(value, hg.ObjectID.from_name(name))


def put_array(name: str, raw: bytes, descr, shape: tuple) -> None:
    """Rebuild the array here: pickling on the way in may normalise its byte order."""
    from numpy.lib.format import descr_to_dtype

    value = np.frombuffer(raw, dtype=descr_to_dtype(descr)).reshape(shape)
    hg.put(value, hg.ObjectID.from_name(name))


def object_info(name: str) -> dict:
    return hg.object_info(hg.ObjectID.from_name(name))


def put_after(name: str, size: int, delay: float) -> int:
    time.sleep(delay)
    return put_pattern(name, size)


def get_summary(name: str, timeout: float = 60.0) -> tuple[int, str, tuple, int]:
    value = hg.get(hg.ObjectID.from_name(name), timeout=timeout)
    return zlib.crc32(np.ascontiguousarray(value).view(np.uint8)), str(value.dtype), value.shape, value.nbytes


def get_value(name: str, timeout: float = 60.0):
    """The value, as (dtype.str, shape, raw bytes) for arrays: pickling back to
    the test process must not be what decides whether the dtype survived."""
    value = hg.get(hg.ObjectID.from_name(name), timeout=timeout)
    if isinstance(value, np.ndarray):
        return value.dtype.str, value.dtype.descr, value.shape, value.tobytes()
    return value


def get_error(name: str, timeout: float) -> str:
    try:
        hg.get(hg.ObjectID.from_name(name), timeout=timeout)
    except hg.HopliteError as exc:
        return type(exc).__name__
    return "no error"


def get_many(names: list[str], timeout: float = 60.0) -> dict[str, int]:
    """Get several objects at once from threads: many pulls in flight on one node."""
    def one(name: str) -> tuple[str, int]:
        value = hg.get(hg.ObjectID.from_name(name), timeout=timeout)
        return name, zlib.crc32(value)

    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        return dict(pool.map(one, names))


def delete(name: str) -> None:
    hg.delete(hg.ObjectID.from_name(name))


def node_id() -> str:
    return hg.node_id()
