"""Channels: a name's newest complete version, and who waits for a newer one."""

from __future__ import annotations

from hoplite_gpu import messages as m

from .commands import Command, Reply
from .events import ChannelHead, ChannelPublish, NodeId
from .requests import Requests


class Channels:
    """channel name -> head version, and the heads asked before they existed."""

    def __init__(self, requests: Requests) -> None:
        self._requests = requests
        #: channel name -> newest complete version, and who waits for a newer one
        self.channels: dict[str, int] = {}
        self.channel_waiters: dict[str, dict[tuple[NodeId, int], int]] = {}  # -> newer_than

    def publish(self, ev: ChannelPublish, out: list[Command]) -> None:
        if ev.version > self.channels.get(ev.name, -1):
            self.channels[ev.name] = ev.version
        out.append(Reply(ev.node, ev.request, m.Done(ok=True, head=self.channels[ev.name])))
        head, still = self.channels[ev.name], {}
        for (node, request), newer_than in self.channel_waiters.pop(ev.name, {}).items():
            if head > newer_than:
                out.append(Reply(node, request, m.Head(head=head)))
            else:
                still[node, request] = newer_than
        if still:
            self.channel_waiters[ev.name] = still

    def head(self, ev: ChannelHead, out: list[Command]) -> None:
        head = self.channels.get(ev.name, -1)
        if head > ev.newer_than or not ev.wait:
            out.append(Reply(ev.node, ev.request, m.Head(head=head)))
        else:
            self.channel_waiters.setdefault(ev.name, {})[ev.node, ev.request] = ev.newer_than
            self._requests.wait(ev.node, ev.request, "channel", ev.name)

    def unqueue(self, request: tuple[NodeId, int], name: str) -> None:
        """`request`, waiting for a newer head of `name`, waits no more."""
        waiters = self.channel_waiters.get(name)
        if waiters is not None:
            waiters.pop(request, None)
            if not waiters:
                del self.channel_waiters[name]
