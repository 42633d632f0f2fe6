"""A flow-level simulator of CLOS fabrics (docs/fabric.md).

`topology` builds fat-trees and leaf-spines and their equal-cost paths;
`routing` lays flows on them (ECMP, ideal spraying, Ethereal); `maxmin` and
`engine` share links max-min fairly from event to event; `network` drives
both with messages and timers; `ops` and `hoplite_ops` are the collectives;
`bounds` what no schedule beats; `run.simulate` plays one op; `cli` is
`hoplite-gpu simulate --fabric`. NumPy only (no sockets, no clocks).
"""
