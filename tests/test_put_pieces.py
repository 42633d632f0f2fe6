"""`Node.put_pieces`: one host object laid out from pieces at offsets (a
weight channel's version), each copied once into the store's own buffer."""

from __future__ import annotations

import numpy as np
import pytest
from in_process import run_nodes

import hoplite_gpu as hg
from hoplite_gpu.config import Config
from hoplite_gpu.node.pool import host_buffer

MiB = 1 << 20


def _pieces(rng: np.random.Generator) -> tuple[int, list[tuple[int, memoryview]], np.ndarray]:
    """Pieces with gaps between them (and an empty one), and the bytes they lay out."""
    sizes, offsets, at = [3 * MiB + 5, 0, 17, 2 * MiB], [], 0
    for n in sizes:
        at = -(-at // 64) * 64 + 64
        offsets.append(at)
        at += n
    nbytes = at + 100
    expected = np.zeros(nbytes, np.uint8)
    pieces = []
    for offset, n in zip(offsets, sizes, strict=True):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        expected[offset:offset + n] = data
        pieces.append((offset, memoryview(data)))
    return nbytes, pieces, expected


@pytest.mark.parametrize("small", [False, True], ids=["large", "inline"])
def test_a_put_of_pieces_is_the_bytes_they_lay_out_everywhere(small):
    cfg = Config(shared_memory=False, timeout_s=10, chunk_size=MiB)
    oid = hg.ObjectID.from_name(f"pieces-{small}")

    async def body(directory, putter, reader):
        nbytes, pieces, expected = _pieces(np.random.default_rng(1))
        if small:
            nbytes, pieces = 1000, [(8, memoryview(np.arange(100, dtype=np.uint8))),
                                    (512, memoryview(np.full(7, 9, np.uint8)))]
            expected = np.zeros(1000, np.uint8)
            expected[8:108], expected[512:519] = np.arange(100), 9
        # (a reused store buffer holds old bytes: the gaps must still be zero)
        old = host_buffer(nbytes)
        old[:] = 0xEE
        assert small or putter.store.pool.release(old)
        del old
        assert await putter.put_pieces(oid, nbytes, pieces) == oid
        got = await reader.get(oid, 10)
        assert got.dtype == np.uint8 and got.shape == (nbytes,)
        assert small or putter.store.pool.hits == 1  # (the 0xEE buffer was the one filled)
        np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(await putter.get(oid, 10), expected)
        info = await reader.query(oid)
        assert info["size"] == nbytes and all(h["complete"] for h in info["holders"])

    run_nodes([cfg, cfg], body, bound=30)


def test_pieces_that_overlap_are_refused_and_leave_nothing_behind():
    cfg = Config(shared_memory=False, timeout_s=10)
    oid = hg.ObjectID.from_name("pieces-overlap")

    async def body(directory, putter):
        a = memoryview(np.ones(MiB, np.uint8))
        with pytest.raises(hg.InvalidArgument, match="overlaps"):
            await putter.put_pieces(oid, 3 * MiB, [(0, a), (MiB // 2, a)])
        with pytest.raises(hg.InvalidArgument, match="ends past"):
            await putter.put_pieces(oid, 3 * MiB, [(0, a), (2 * MiB + 1, a)])
        assert putter.store.get(oid) is None and putter.store.held == 0
        with pytest.raises(hg.ObjectNotFound):
            await putter.query(oid)
        # the id is still free for a put that is right
        await putter.put_pieces(oid, 3 * MiB, [(0, a), (2 * MiB, a)])
        with pytest.raises(hg.ObjectExists):
            await putter.put_pieces(oid, 3 * MiB, [(0, a)])

    run_nodes([cfg], body, bound=30)


def test_a_put_of_pieces_is_registered_first_and_read_while_it_is_copied():
    """As `put`: the directory has the object before its bytes are in, so a
    reader streams its front while the putter copies the rest (a weight
    channel's head moves then, and its readers start at once)."""
    import asyncio

    cfg = Config(shared_memory=False, timeout_s=10, chunk_size=256 << 10)
    oid = hg.ObjectID.from_name("pieces-streamed")

    async def body(directory, putter, reader):
        nbytes, pieces, expected = _pieces(np.random.default_rng(2))
        seen, gets = [], []

        def registered() -> None:
            seen.append(putter.store.get(oid).ready)
            gets.append(asyncio.ensure_future(reader.get(oid, 10)))

        await putter.put_pieces(oid, nbytes, pieces, registered=registered)
        assert seen == [0]
        np.testing.assert_array_equal(await gets[0], expected)

    run_nodes([cfg, cfg], body, bound=30)
