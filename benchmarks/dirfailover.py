"""`python -m benchmarks dirfailover`: the directory in use SIGKILLed during a
broadcast and during a reduce, nodes moving to a standby directory, beside
the same operations without a kill.

Two `hoplite-gpu directory` processes and the workers of a LocalCluster
(`standbys=1`: every node is given both addresses), all on loopback, with
shared memory off so that every byte crosses TCP. The harness process is a
node too: it reads `object_info` to choose the moment of the kill.

- Broadcast: worker 0 puts `--size` bytes, `--receivers` workers get it at
  once (the directory builds a chain). In the kill round the harness kills
  the directory in use once the receivers hold `--kill-at` of their bytes
  together (nodes report progress every 0.1 s, so the share seen lags);
  the round without a kill polls the same way.
- Reduce: `--inputs` workers each put an input of `--reduce-size` bytes,
  worker 0 reduces them (sum) and gets the result. Reduce steps report no
  progress to the directory, so the kill round is timed: the harness kills
  the directory `--kill-at` of the way through the time the same reduce
  took without a kill just before.

Each kill round records whether the kill came before the operation ended
(`killed_mid_operation`): an operation too small to outlast the harness's
view of it is killed after its end and says so.

Each copy is checked after the timing: every receiver's against the origin's
bytes, the reduce's result against the exact sum (inputs are small integers
in float32, `payload.py`). A round's time: the broadcast's from the first
receiver's start to the last one's end, the reduce's from the call to the
end of its get. The time to move over: from the kill to the last node
(every worker and the harness) registered with the standby, read from each
node's record of its registrations (wall clock, one host). After each kill
the killed directory is started again on its port and is the standby of the
next kill round. Rounds take turns (broadcast, broadcast killed, reduce,
reduce killed), after one untimed warm-up of each operation.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from .args import at_least, seconds, size

MiB = 1 << 20


# ---------------------------------------------------------- in workers ---
def put_input(name: str, rank: int, nbytes: int) -> None:
    """Put rank `rank`'s input (`payload.make_input`) as `name`."""
    import hoplite_gpu as hg

    from . import payload

    hg.put(payload.make_input(rank, nbytes), hg.ObjectID.from_name(name))


def check_copy(op: str, world: int, name: str, nbytes: int, rank: int) -> bool:
    """Whether this node's copy of `name` is exactly what `op` must give."""
    import hoplite_gpu as hg

    from . import payload

    value = hg.get(hg.ObjectID.from_name(name), timeout=600)
    return payload.check(op, world, value, nbytes, rank)[0]


def registrations() -> list[tuple[str, float]]:
    """(directory address, wall time) of each of this node's registrations."""
    import hoplite_gpu as hg

    return list(hg.runtime().node.registrations)


# ------------------------------------------------------------- harness ---
def _share_of_broadcast(oid, nbytes: int, receivers: int) -> float:
    """The share of their bytes the receivers hold, as the directory last heard."""
    import hoplite_gpu as hg

    held = sum(h["nbytes"] for h in hg.object_info(oid)["holders"] if not h["origin"])
    return held / (nbytes * receivers)


def _wait_for(share: Callable[[], float], at: float) -> float:
    """Poll `share()` until it reaches `at`; returns the share seen."""
    deadline = time.monotonic() + 300
    while True:
        seen = share()
        if seen >= at:
            return seen
        if time.monotonic() > deadline:
            raise TimeoutError(f"the operation was {seen:.0%} of the way after 300 s")
        time.sleep(0.005)


def _move_over(c, standby: str, killed: float) -> tuple[float, list[float]]:
    """Seconds from the kill to the last node registered with `standby`, and
    each node's (the workers', then the harness's)."""
    import hoplite_gpu as hg

    deadline = time.monotonic() + 60
    while True:
        nodes = [c.run(w, registrations) for w in range(c.num_workers)]
        nodes.append(list(hg.runtime().node.registrations))
        moved = [min((t for a, t in regs if a == standby and t >= killed), default=None)
                 for regs in nodes]
        if all(t is not None for t in moved):
            each = [t - killed for t in moved]
            return max(each), each
        if time.monotonic() > deadline:
            raise TimeoutError(f"{moved.count(None)} nodes had not registered with the "
                               f"standby {standby} 60 s after the kill")
        time.sleep(0.05)


class _Run:
    """One cluster and its two directories; which one the nodes use."""

    def __init__(self, c, args: argparse.Namespace) -> None:
        self.c, self.args = c, args
        self.in_use = 0

    def _watch(self, share: Callable[[], float], kill: bool) -> dict | None:
        """Wait until `share()` reaches `--kill-at`, then (`kill`) kill the
        directory in use. A round without the kill watches all the same,
        so that both carry the harness's polling."""
        seen = _wait_for(share, self.args.kill_at)
        if not kill:
            return None
        killed = time.time()
        self.c.kill_directory(self.in_use)
        return {"killed": killed, "seen": seen, "which": self.in_use}

    def _moved(self, kill: dict, end: float) -> dict:
        """After the operation (its end at wall time `end`): the time to move
        over, then the killed directory started again, the standby of the
        next kill."""
        c = self.c
        self.in_use = 1 - kill["which"]
        total, each = _move_over(c, c.directory_addresses[self.in_use], kill["killed"])
        c.restart_directory(kill["which"])
        return {"killed_at_share": kill["seen"], "killed_mid_operation": kill["killed"] < end,
                "move_over_s": total, "node_move_over_s": each}

    def broadcast(self, tag: str, kill: bool) -> dict:
        import hoplite_gpu as hg

        from . import tasks

        c, n, receivers = self.c, self.args.size, range(1, self.args.receivers + 1)
        name = f"dirfailover/b/{tag}"
        c.run(0, put_input, name, 0, n)
        start_at = time.time() + 0.2
        for w in receivers:
            c.submit(w, tasks.get_at, name, start_at)
        oid = hg.ObjectID.from_name(name)
        killing = self._watch(lambda: _share_of_broadcast(oid, n, len(receivers)), kill)
        times = [c.result(w, 600) for w in receivers]
        out = {"seconds": max(b for _, b in times) - min(a for a, _ in times),
               "byte_identical": all(c.run(w, check_copy, "broadcast", len(receivers) + 1,
                                           name, n, w) for w in receivers)}
        if killing is not None:
            out.update(self._moved(killing, max(b for _, b in times)))
        c.run(0, tasks.delete_all, [name])
        return out

    def reduce(self, tag: str, kill_after: float | None) -> dict:
        """A reduce; with `kill_after` (seconds: the no-kill round's time),
        the directory killed `--kill-at` of that time after its start."""
        from . import tasks

        c, n, k = self.c, self.args.reduce_size, self.args.inputs
        names = [f"dirfailover/r/{tag}/{r}" for r in range(k)]
        target = f"dirfailover/r/{tag}/sum"
        c.map(put_input, [(names[r], r, n) for r in range(k)])
        start_at = time.time() + 0.2
        c.submit(0, tasks.reduce_get, names, target, start_at)
        killing = None
        if kill_after is not None:
            killing = self._watch(lambda: (time.time() - start_at) / kill_after, True)
        start, end = c.result(0, 600)
        out = {"seconds": end - start,
               "byte_identical": c.run(0, check_copy, "reduce", k, target, n, 0)}
        if killing is not None:
            out.update(self._moved(killing, end))
        c.run(0, tasks.delete_all, [*names, target])
        return out


def _summary(rounds: list[dict], killed: list[dict]) -> dict:
    med = statistics.median
    ok, bad = [r["seconds"] for r in rounds], [r["seconds"] for r in killed]
    moves = [r["move_over_s"] for r in killed]
    return {"no_kill_s": ok, "with_kill_s": bad,
            "no_kill_median_s": med(ok), "with_kill_median_s": med(bad),
            "ratio_kill_to_no_kill": med(bad) / med(ok),
            "killed_at_share": [r["killed_at_share"] for r in killed],
            "killed_mid_operation": [r["killed_mid_operation"] for r in killed],
            "move_over_s": moves, "move_over_median_s": med(moves),
            "move_over_max_s": max(moves),
            "node_move_over_s": [r["node_move_over_s"] for r in killed],
            "byte_identical": all(r["byte_identical"] for r in rounds + killed)}


def run(args: argparse.Namespace, console) -> dict:
    from rich.table import Table

    import hoplite_gpu as hg
    from hoplite_gpu.cluster import LocalCluster

    if args.inputs > args.receivers + 1:
        raise SystemExit(f"--inputs {args.inputs} needs as many workers: at most "
                         f"--receivers + 1 = {args.receivers + 1}")
    workers = args.receivers + 1
    settings = {"shared_memory": False, "log_level": "ERROR"}  # (each move: a warning a node)
    got: dict[str, dict[str, list[dict]]] = {op: {"ok": [], "killed": []}
                                             for op in ("broadcast", "reduce")}
    with LocalCluster(workers, standbys=1, **settings) as c:
        hg.init(c.address, token=c.token, **settings)
        try:
            bench = _Run(c, args)
            bench.broadcast("warm", False)  # (buffer pools, connections: untimed)
            bench.reduce("warm", None)
            for r in range(args.repeats):
                for op in ("broadcast", "reduce"):
                    if op == "broadcast":
                        ok, killed = bench.broadcast(f"{r}", False), bench.broadcast(f"{r}k", True)
                    else:
                        ok = bench.reduce(f"{r}", None)
                        killed = bench.reduce(f"{r}k", ok["seconds"])
                    got[op]["ok"].append(ok)
                    got[op]["killed"].append(killed)
                    console.print(
                        f"[{r + 1}/{args.repeats}] {op}: {ok['seconds'] * 1e3:.0f} ms; directory "
                        f"killed at {killed['killed_at_share']:.0%}: "
                        f"{killed['seconds'] * 1e3:.0f} ms, every node moved over in "
                        f"{killed['move_over_s'] * 1e3:.1f} ms"
                        + ("" if killed["killed_mid_operation"] else " (killed after its end)")
                        + ("" if ok["byte_identical"] and killed["byte_identical"]
                           else "  [red]COPIES DIFFER[/red]"))
        finally:
            hg.shutdown()
    rows = [{"op": op, "size_bytes": args.size if op == "broadcast" else args.reduce_size,
             "receivers" if op == "broadcast" else "inputs":
                 args.receivers if op == "broadcast" else args.inputs,
             "nodes": workers + 1, "kill_at": args.kill_at, "repeats": args.repeats,
             "shared_memory": False, **_summary(got[op]["ok"], got[op]["killed"])}
            for op in ("broadcast", "reduce")]
    table = Table(title=f"the directory in use SIGKILLed midway, {workers + 1} nodes and 2 "
                        "directories on loopback (TCP): medians")
    for col in ("operation", "no kill", "killed", "ratio", "killed at", "midway",
                "move over: median, max", "ok"):
        table.add_column(col, justify="right")
    for row in rows:
        what = (f"broadcast {row['size_bytes'] / MiB:g} MiB x {row['receivers']}"
                if row["op"] == "broadcast"
                else f"reduce {row['inputs']} x {row['size_bytes'] / MiB:g} MiB")
        table.add_row(what, f"{row['no_kill_median_s'] * 1e3:.0f} ms",
                      f"{row['with_kill_median_s'] * 1e3:.0f} ms",
                      f"{row['ratio_kill_to_no_kill']:.2f} x",
                      f"{statistics.median(row['killed_at_share']):.0%}"
                      + (" bytes" if row["op"] == "broadcast" else " time"),
                      f"{sum(row['killed_mid_operation'])} of {row['repeats']}",
                      f"{row['move_over_median_s'] * 1e3:.1f}, "
                      f"{row['move_over_max_s'] * 1e3:.1f} ms",
                      "yes" if row["byte_identical"] else "NO")
    console.print(table)
    return {"benchmark": "dirfailover-loopback", "rows": rows, "settings": settings,
            "byte_identical": all(r["byte_identical"] for r in rows)}


def _share(text: str) -> float:
    value = seconds(0.0)(text)
    if value > 1.0:
        raise argparse.ArgumentTypeError(f"a share of the bytes, at most 1; got {text}")
    return value


def _float32s(text: str) -> int:
    """A size in bytes that is a whole number of float32 elements."""
    value = size(text)
    if value % 4:
        raise argparse.ArgumentTypeError(f"a multiple of 4 bytes (float32); got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--receivers", type=at_least(1), default=6)
    p.add_argument("--size", type=_float32s, default=256 * MiB,
                   help="bytes broadcast (e.g. 256M; a multiple of 4: float32)")
    p.add_argument("--inputs", type=at_least(2), default=7,
                   help="reduce inputs, one per worker (at most --receivers + 1)")
    p.add_argument("--reduce-size", type=_float32s, default=64 * MiB,
                   help="bytes per reduce input (a multiple of 4: float32)")
    p.add_argument("--repeats", type=at_least(1), default=3)
    p.add_argument("--kill-at", type=_share, default=0.5,
                   help="when the directory is killed: the share of their bytes the "
                        "receivers hold (broadcast), of the no-kill time (reduce)")
