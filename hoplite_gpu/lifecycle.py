"""A context manager that sets something up on entry and always tears it down."""

from __future__ import annotations

from typing import Self


class Closing:
    """`with X(...) as x:` runs `x._open()`, and `x.close()` on exit or when
    `_open` fails halfway (so nothing it made outlives a failed start).
    `close` must be safe to call on whatever `_open` managed to make."""

    def _open(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
