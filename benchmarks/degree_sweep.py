"""`python -m benchmarks degree-sweep`: the reduce cost model's choice of tree
degree against the simulator.

For every cell of a grid (input size x number of inputs x link), the
simulator (`hoplite_gpu.simulator.ReduceSim`, which drives the real directory
state machine) runs the reduce once per degree d in 1 .. min(8, k - 1), the
degrees `choose_degree` picks among, with the degree forced (inside this
benchmark only: `choose_degree` is patched where the state machine imports it,
and restored after). Two schedules per cell: every input at once, and input i
ready at i * gap (gap = `--gap-factor` x S/B by default), where the time that
counts is the one from the last input to the result. Each row records the
model's degree (`reduce_plan.choose_degree`, which sees neither the gap nor
the simulation), the simulated best degree, both simulated times, their ratio
and the model's predicted time (`reduce_plan.tree_walk_time`, all at once).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from rich.table import Table

from hoplite_gpu.directory import reduce_plan
from hoplite_gpu.simulator import simulate_reduce

from .args import at_least, seconds

KiB, MiB = 1 << 10, 1 << 20
SIZES = ["64K", "1M", "16M", "256M"]
INPUTS = [8, 64, 512]
LINKS = ["1.25e9:1e-4", "1.25e8:1e-4"]  # bytes per second : latency in seconds
#: a choice within this factor of the simulated best counts as good
TOLERANCE = 1.05

ModelFn = Callable[[int, int, int, float, float, int], float]


def _size(text: str) -> int:
    """'64K', '16M', '1G' (binary units) or a number of bytes."""
    units = {"K": KiB, "M": MiB, "G": 1 << 30}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def _link(text: str) -> tuple[float, float]:
    bw, _, lat = text.partition(":")
    return float(bw), float(lat or 1e-4)


def _checked(parse: Callable[[str], Any]) -> Callable[[str], str]:
    """An argparse type that refuses what `parse` cannot read, or reads as
    zero or less, and keeps the text (`run` parses it again)."""
    def check(text: str) -> str:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"cannot read {text!r}") from None
        bw, lat = value if isinstance(value, tuple) else (value, 0)
        if not bw > 0 or not lat >= 0:
            raise argparse.ArgumentTypeError(f"must be more than 0 (a latency at least 0): {text!r}")
        return text
    return check


def _fmt_size(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


@contextlib.contextmanager
def forced_degree(d: int) -> Iterator[None]:
    """Make the directory build a d-ary tree whatever the model says."""
    from hoplite_gpu.directory import reduce_task  # (a reduce's first input picks the degree)

    original = reduce_task.choose_degree
    reduce_task.choose_degree = lambda *args, **kwargs: d
    try:
        yield
    finally:
        reduce_task.choose_degree = original


def candidates(k: int, max_degree: int = 8) -> list[int]:
    """The degrees `choose_degree` picks among (1 alone for k <= 2)."""
    return [1] if k <= 2 else list(range(1, min(max_degree, k - 1) + 1))


def model_choice(model: ModelFn, size: int, k: int, lat: float, bw: float, chunk: int,
                 max_degree: int = 8) -> int:
    """`choose_degree`'s rule (lowest modelled time, ties to the smaller d)
    with any model of the same signature as `reduce_time`."""
    return min(candidates(k, max_degree), key=lambda d: (model(size, k, d, lat, bw, chunk), d))


def sweep(sizes: list[int], inputs: list[int], links: list[tuple[float, float]], *,
          chunk: int = 4 * MiB, max_degree: int = 8, gap_factor: float = 2.0,
          proposals: dict[str, ModelFn] | None = None) -> list[dict]:
    """One row per (link, size, inputs, schedule); see the module's docstring.
    With `proposals` (name -> a model with `reduce_time`'s signature), each
    row also says which degree each would pick and its simulated time against
    the best (no extra simulation: every degree is simulated anyway)."""
    rows = []
    for bw, lat in links:
        for size in sizes:
            s_over_b = size / bw
            for k in inputs:
                degrees = candidates(k, max_degree)
                # (the piece a step hands on, as the directory and the simulator count it)
                unit = reduce_plan.fold_unit(size, chunk)
                chosen = reduce_plan.choose_degree(size, k, lat, bw, unit, max_degree)
                predicted = {d: reduce_plan.tree_walk_time(size, k, d, lat, bw, unit)
                             for d in degrees}
                for gap in (0.0, gap_factor * s_over_b):
                    sim = {}
                    for d in degrees:
                        with forced_degree(d):
                            r = simulate_reduce(k, size, bandwidth=bw, latency=lat, chunk=chunk,
                                                arrivals=[i * gap for i in range(k)])
                        if r.degree != d:
                            raise RuntimeError(f"asked for degree {d}, the directory built {r.degree}")
                        sim[d] = r.makespan - r.last_arrival
                    best = min(degrees, key=lambda d: (sim[d], d))
                    row = {"size_bytes": size, "inputs": k, "bytes_per_s": bw, "latency_s": lat,
                           "chunk_bytes": chunk, "unit_bytes": unit, "s_over_b_s": s_over_b,
                           "schedule": "all-at-once" if gap == 0 else "gap", "gap_s": gap,
                           "degrees": degrees,
                           "sim_s": [sim[d] for d in degrees],
                           "model_s": [predicted[d] for d in degrees],
                           "chosen_degree": chosen, "best_degree": best,
                           "chosen_sim_s": sim[chosen], "best_sim_s": sim[best],
                           "ratio_chosen_to_best": sim[chosen] / sim[best],
                           "model_chosen_s": predicted[chosen],
                           "ratio_model_to_sim": predicted[chosen] / sim[chosen]}
                    for name, model in (proposals or {}).items():
                        alt = model_choice(model, size, k, lat, bw, unit, max_degree)
                        row.setdefault("proposed", {})[name] = {
                            "degree": alt, "sim_s": sim[alt], "ratio_to_best": sim[alt] / sim[best]}
                    rows.append(row)
    return rows


def summarize(rows: list[dict], proposal: str | None = None) -> dict:
    """Cells whose degree is within 5 % of the best, and the worst ratio: of
    the runtime's model, or of one of the proposals."""
    ratios = [r["ratio_chosen_to_best"] if proposal is None
              else r["proposed"][proposal]["ratio_to_best"] for r in rows]
    worst = max(range(len(rows)), key=lambda i: ratios[i])
    w = rows[worst]
    return {"cells": len(rows), "within_5pct": sum(x <= TOLERANCE for x in ratios),
            "worst_ratio": ratios[worst],
            "worst_cell": {k: w[k] for k in ("size_bytes", "inputs", "bytes_per_s",
                                             "latency_s", "schedule")},
            "by_schedule": {s: sum(x <= TOLERANCE for x, r in zip(ratios, rows, strict=True)
                                   if r["schedule"] == s) for s in ("all-at-once", "gap")}}


def overcount_fixed_time(size: int, k: int, d: int, latency_s: float, bytes_per_s: float,
                         chunk: int) -> float:
    """An alternative (not the runtime's model): `reduce_time` without its
    overcount, the root hop's chunk time, already in d*S/B; so one chunk time
    of fill per level below the root."""
    c = min(chunk, size) if size else 1
    depth = reduce_plan.tree_depth(k, d)
    return d * size / bytes_per_s + depth * latency_s + (depth - 1) * d * c / bytes_per_s


#: the other models `--proposed` evaluates beside the runtime's: the closed
#: form the directory used before the walk, and that form without its overcount
PROPOSALS: dict[str, ModelFn] = {"closed-form": reduce_plan.reduce_time,
                                 "overcount": overcount_fixed_time}


def _summary_line(label: str, sm: dict) -> str:
    w = sm["worst_cell"]
    return (f"{label}: degree within 5 % of the simulated best in {sm['within_5pct']} of "
            f"{sm['cells']} cells (all at once {sm['by_schedule']['all-at-once']}, with gaps "
            f"{sm['by_schedule']['gap']}); worst ratio {sm['worst_ratio']:.3f} "
            f"({_fmt_size(w['size_bytes'])}, k={w['inputs']}, {w['bytes_per_s']:.3g} B/s, "
            f"{w['schedule']})")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", nargs="+", type=_checked(_size), default=SIZES,
                   help="bytes per input, binary units (64K, 16M); default %(default)s")
    p.add_argument("--inputs", type=at_least(2), nargs="+", default=INPUTS)
    p.add_argument("--links", nargs="+", type=_checked(_link), default=LINKS,
                   help="BYTES_PER_S:LATENCY_S per link setting; default %(default)s")
    p.add_argument("--chunk", type=_checked(_size), default="4M")
    p.add_argument("--max-degree", type=at_least(1), default=8)
    p.add_argument("--gap-factor", type=seconds(0.0, above=True), default=2.0,
                   help="inputs this many S/B apart in the second schedule")
    p.add_argument("--proposed", action="store_true",
                   help="also say what the other models (PROPOSALS: reduce_plan.reduce_time, "
                   "the closed form; the same without its overcount) would pick")


def run(args: argparse.Namespace, console) -> dict:
    sizes, links = [_size(x) for x in args.sizes], [_link(x) for x in args.links]
    chunk = _size(args.chunk)
    t0 = time.monotonic()
    rows = sweep(sizes, args.inputs, links, chunk=chunk, max_degree=args.max_degree,
                 gap_factor=args.gap_factor, proposals=PROPOSALS if args.proposed else None)
    wall = time.monotonic() - t0
    table = Table(title=f"reduce tree degree, model vs simulator: {_fmt_size(chunk)} chunks; "
                  f"times in ms, after the last input (gap = {args.gap_factor:g} x S/B)")
    cols = ["B/s, L", "size", "k", "inputs", "model d", "best d", "sim, model d",
            "sim, best d", "ratio", "model"]
    if args.proposed:
        cols += [f"{name} d, ratio" for name in PROPOSALS]
    for col in cols:
        table.add_column(col, justify="right")
    for r in rows:
        ratio = r["ratio_chosen_to_best"]
        cells = [f"{r['bytes_per_s']:.3g}, {r['latency_s'] * 1e6:g} us",
                 _fmt_size(r["size_bytes"]).replace(" ", ""), str(r["inputs"]),
                 "at once" if r["schedule"] == "all-at-once" else "gap",
                 str(r["chosen_degree"]), str(r["best_degree"]),
                 f"{r['chosen_sim_s'] * 1e3:.4g}", f"{r['best_sim_s'] * 1e3:.4g}",
                 ("[red]" if ratio > TOLERANCE else "") + f"{ratio:.3f}",
                 f"{r['model_chosen_s'] * 1e3:.4g}"]
        for name in PROPOSALS if args.proposed else ():
            alt = r["proposed"][name]
            cells.append(f"{alt['degree']}, {alt['ratio_to_best']:.3f}")
        table.add_row(*cells)
    console.print(table)
    summary = summarize(rows)
    console.print(_summary_line("model (reduce_plan.choose_degree)", summary) + f"; {wall:.1f} s")
    result = {"benchmark": "degree-sweep", "rows": rows, "summary": summary, "wall_s": wall}
    if args.proposed:
        result["proposed_summary"] = {name: summarize(rows, name) for name in PROPOSALS}
        for name, sm in result["proposed_summary"].items():
            console.print(_summary_line(f"proposed ({name})", sm))
    return result
