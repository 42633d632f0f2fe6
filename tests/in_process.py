"""A directory and nodes on one event loop in the test process: a test can
step in exactly where a caller would give up, or hold an answer back."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from hoplite_gpu.config import Config


def run_nodes(configs: list[Config], body: Callable[..., Awaitable[Any]],
              bound: float = 60.0) -> None:
    """Run `body(directory, *nodes)`, one node per config, within `bound`
    seconds; the nodes and the directory are always closed afterwards."""
    from hoplite_gpu.directory.server import DirectoryServer
    from hoplite_gpu.node.node import Node

    async def main() -> None:
        directory = DirectoryServer("tok")
        address = await directory.start()
        nodes = [Node(config, "tok", address) for config in configs]
        try:
            for node in nodes:
                await node.start()
            await asyncio.wait_for(body(directory, *nodes), bound)
        finally:
            for node in reversed(nodes):
                await node.close()
            await directory.close()

    asyncio.run(main())
