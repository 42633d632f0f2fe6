"""A context manager that sets something up on entry and always tears it down,
and the way a child process is stopped."""

from __future__ import annotations

import subprocess
from typing import Self


def stop_process(proc: subprocess.Popen, *, kill: bool = False, grace: float = 10.0) -> None:
    """Stop `proc` (SIGTERM, or SIGKILL with `kill`) and reap it; one that does
    not exit within `grace` seconds is killed."""
    if kill:
        proc.kill()
    else:
        proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


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
