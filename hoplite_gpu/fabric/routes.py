"""The middles flows take, as one append-only table of weighted link lists.

A route is what a flow crosses between its two host links: one middle (each
link weight 1) or, for a sprayed flow, every middle of a pair of leaves at
once, each link weighted by the share of the flow that crosses it. Flows that
take the same route share its row, so a fabric with a million flows holds one
row per distinct route, not per flow.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import numpy as np

#: The route of a flow between two hosts of one leaf: no links between them.
NO_ROUTE = -1


class RouteTable:
    """Rows of (link ids, weights), CSR style in arrays that grow by doubling,
    found again by the key they were made under."""

    def __init__(self, links: int) -> None:
        self.links = links
        self._ids: dict[Hashable, int] = {}
        self._ptr = np.zeros(1024, dtype=np.int64)
        self._link = np.zeros(4096, dtype=np.int64)
        self._weight = np.zeros(4096)
        self._rows = 0

    def __len__(self) -> int:
        return self._rows

    def get(self, key: Hashable, make: Callable[[], tuple[np.ndarray, np.ndarray]]) -> int:
        """The id of the route under `key`, made by `make() -> (links, weights)`
        the first time."""
        rid = self._ids.get(key)
        if rid is None:
            links, weights = make()
            rid = self._ids[key] = self._append(np.asarray(links, np.int64)[None, :],
                                                np.asarray(weights, np.float64)[None, :])
        return rid

    def paths(self, key: Hashable, middles: np.ndarray) -> np.ndarray:
        """Route ids of each middle (a row of `middles`, links weight 1), made
        together the first time `key` is asked for."""
        first = self._ids.get(key)
        if first is None:
            first = self._ids[key] = self._append(middles, np.ones(middles.shape))
        return np.arange(first, first + len(middles))

    def _append(self, links: np.ndarray, weights: np.ndarray) -> int:
        """Append equal-length rows; return the first one's id."""
        rows, width = links.shape
        end = int(self._ptr[self._rows]) + rows * width
        while self._rows + rows + 1 > len(self._ptr):
            self._ptr = np.concatenate((self._ptr, np.zeros(len(self._ptr), np.int64)))
        while end > len(self._link):
            self._link = np.concatenate((self._link, np.zeros(len(self._link), np.int64)))
            self._weight = np.concatenate((self._weight, np.zeros(len(self._weight))))
        start = int(self._ptr[self._rows])
        self._link[start:end] = links.reshape(-1)
        self._weight[start:end] = weights.reshape(-1)
        first = self._rows
        self._ptr[first + 1:first + rows + 1] = start + width * np.arange(1, rows + 1)
        self._rows += rows
        return first

    def flat(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(row pointers, link ids, weights) of every route (views, CSR style)."""
        end = int(self._ptr[self._rows])
        return self._ptr[:self._rows + 1], self._link[:end], self._weight[:end]

    def row(self, rid: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self._ptr[rid], self._ptr[rid + 1]
        return self._link[a:b], self._weight[a:b]

    def link_bytes(self, route_bytes: np.ndarray) -> np.ndarray:
        """Bytes per link when route r carried `route_bytes[r]` bytes."""
        ptr, link, weight = self.flat()
        per_entry = np.repeat(route_bytes[:self._rows], np.diff(ptr)) * weight
        return np.bincount(link, weights=per_entry, minlength=self.links)


def csr_rows(ptr: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Entry positions of `rows` of a CSR matrix with row pointers `ptr`, and the
    row (index into `rows`) each position came from; vectorised."""
    starts = ptr[rows]
    lengths = ptr[rows + 1] - starts
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    owner = np.repeat(np.arange(len(rows)), lengths)
    offsets = np.cumsum(lengths) - lengths
    positions = np.arange(total) + np.repeat(starts - offsets, lengths)
    return positions, owner
