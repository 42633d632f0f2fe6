"""The directory's tunables that more than one part reads: one shared record,
so that a change (a test telling the directory of slower links) reaches every
part at once."""

from __future__ import annotations

from dataclasses import dataclass

from .reduce_plan import FOLD_STEP


@dataclass
class Settings:
    #: receivers one holder serves at once (0: "auto", the cost model's choice)
    max_receivers_per_sender: int = 1
    latency_s: float = 1e-4
    bytes_per_s: float = 1.25e9
    chunk_size: int = 4 << 20
    #: the pieces a host reduce step folds and hands on in (nodes fold in
    #: `reduce_plan.FOLD_STEP`s; a simulator passes its own chunk)
    fold_step: int = FOLD_STEP
    #: senders one pull may have at once: a receiver of an object of at
    #: least `multi_source_bytes` is given, besides its sender, complete
    #: copies that serve nobody (1: one sender per pull)
    max_sources: int = 1
    multi_source_bytes: int = 16 << 20
    #: stripes of an object of at least `multi_source_bytes` (stripes.py):
    #: 1 off, 2 always, 0 where the cost model says they beat one tree
    stripes: int = 1
    #: bytes a relay waits for before it passes them on (0: `chunk_size`):
    #: the broadcast model's unit of pipeline fill
    relay_bytes: int = 0

    @property
    def relay(self) -> int:
        return self.relay_bytes or self.chunk_size
