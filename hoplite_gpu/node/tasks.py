"""The tasks one part of a node owns: each runs beside the call that started
it, and none outlives its owner, which cancels and awaits them all as it
closes (a task group whose tasks may start at any time, from callbacks too)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class TaskSet:
    """Tasks started by one owner, cancelled and awaited together on close.
    Unlike `asyncio.TaskGroup`, a task's failure cancels none of the others
    (each is awaited by whoever waits on it, e.g. a pull's gets)."""

    def __init__(self) -> None:
        #: (a dict as an ordered set: tasks are cancelled in the order they started)
        self._tasks: dict[asyncio.Task, None] = {}

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks[task] = None
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task) -> None:
        self._tasks.pop(task, None)

    def __len__(self) -> int:
        return len(self._tasks)

    def cancel(self) -> list[asyncio.Task]:
        """Cancel every task; the tasks, for the owner to await (`wait`)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        return tasks

    @staticmethod
    async def wait(tasks: list[asyncio.Task]) -> None:
        """Await cancelled tasks to their end, whatever each ends with."""
        await asyncio.gather(*tasks, return_exceptions=True)
