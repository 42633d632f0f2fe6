"""Rails: which of this node's addresses reaches which of a sender's.

A node with several NICs lists one address per NIC in `node_host`
(`10.0.0.5/24,10.1.0.5/24`); each is a *rail*: the address and its subnet
(the prefix given, else /24 for IPv4 and /64 for IPv6). A sender with
several rails is registered with all its data addresses, and the directory
names them with it (`Location.rails`). A pull spread over rails uses the
pairs (our address, their address) that share a subnet: those are the
NIC-to-NIC paths a rail-optimised fabric joins directly.

Pure: the standard library's `ipaddress` only, no I/O.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from hoplite_gpu.transports.base import split_address

#: The subnet of a rail whose prefix length `node_host` does not give.
DEFAULT_PREFIX = {4: 24, 6: 64}

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class Rail:
    """One of this node's rails: its address `host` (an IP, as bound) and
    the subnet it reaches directly."""

    host: str
    network: Network

    def reaches(self, address: str) -> bool:
        """Whether the data address `address` (scheme://host:port) lies on
        this rail's subnet (a name, not an IP, lies on none)."""
        try:
            ip = ipaddress.ip_address(split_address(address)[1])
        except ValueError:
            return False
        return ip.version == self.network.version and ip in self.network


def rails_of(addresses: Sequence[str], prefixes: Sequence[int | None]) -> tuple[Rail, ...]:
    """This node's rails: each of its data addresses (as its listeners
    bound them) with its prefix length from `node_host` (None: the
    default). An address that is a name, not an IP, is no rail."""
    rails = []
    for address, prefix in zip(addresses, prefixes, strict=True):
        host = split_address(address)[1]
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            continue
        bits = DEFAULT_PREFIX[ip.version] if prefix is None else prefix
        rails.append(Rail(str(ip), ipaddress.ip_network(f"{ip}/{bits}", strict=False)))
    return tuple(rails)


def pairs(rails: Sequence[Rail], theirs: Sequence[str]) -> list[tuple[str, str]]:
    """The (our host, their address) pairs that share a rail's subnet, for
    each of their addresses in turn, and for each the rails of ours that
    reach it in order: a pull spread over them round robin puts an equal
    share on each NIC. Empty where none is shared (a routed path)."""
    return [(rail.host, address) for address in theirs for rail in rails if rail.reaches(address)]
