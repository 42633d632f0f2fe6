"""The state dict every system of `python -m benchmarks channel` moves: float32
tensors of mixed sizes (a few large ones, as embeddings and projections, and
many small ones, as norms and biases), the same names and shapes everywhere,
values that depend on the version, and its checksum."""

from __future__ import annotations

import zlib

import numpy as np

from .payload import plain_empty

KiB, MiB = 1 << 10, 1 << 20
SMALLEST = 4 * KiB
LARGEST = 64 * MiB


def mixed_sizes(total: int, largest: int = LARGEST, smallest: int = SMALLEST) -> list[int]:
    """Tensor sizes in bytes summing to `total` (a multiple of 4): level k has
    2^(k+1) tensors of largest / 4^k bytes (the first level's at most a quarter
    of the total), while a level fits in what is left; the rest is tensors of
    `smallest` bytes and one remainder. 256 MiB: 766 tensors, 4 KiB to 64 MiB."""
    if total < 4 or total % 4:
        raise ValueError(f"a state dict's size must be a positive multiple of 4; got {total}")
    sizes, size, count, left = [], min(largest, max(smallest, total // 4 // 4 * 4)), 2, total
    while size > smallest and count * size <= left:
        sizes += [size] * count
        left -= count * size
        size, count = max(smallest, size // 4 // 4 * 4), count * 2
    sizes += [smallest] * (left // smallest)
    if left % smallest:
        sizes.append(left % smallest)
    return sizes


def names(sizes: list[int]) -> list[str]:
    return [f"layer{i:04d}.{'weight' if n >= 64 * KiB else 'bias'}" for i, n in enumerate(sizes)]


def state_dict(sizes: list[int], version: int) -> dict[str, np.ndarray]:
    """Version `version`: tensor i holds (i * 7919 + j) % 65521 + version at
    element j, as float32 (exact), in plain pages (`payload.plain_empty`)."""
    out = {}
    for i, (name, n) in enumerate(zip(names(sizes), sizes, strict=True)):
        a = plain_empty(n // 4)
        a[:] = (np.arange(n // 4, dtype=np.int64) + i * 7919) % 65521 + version
        out[name] = a
    return out


def empty_like(sizes: list[int]) -> dict[str, np.ndarray]:
    """Arrays of the state dict's names and shapes, to receive into."""
    return {name: plain_empty(n // 4) for name, n in zip(names(sizes), sizes, strict=True)}


def crc(tensors) -> int:
    """CRC32 of every tensor's bytes, in order."""
    c = 0
    for t in tensors:
        if type(t).__module__.startswith("torch"):
            t = t.numpy()
        c = zlib.crc32(np.ascontiguousarray(t).view(np.uint8), c)
    return c
