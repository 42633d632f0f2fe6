"""`python -m benchmarks compare --base REV -- BENCHMARK ARGS...`: one benchmark run
on two commits of this repository side by side, in one run, interleaved.

Each commit is laid out from git (`git archive`, so uncommitted changes never
leak into either side) in a temporary folder, and the benchmark runs there as a
child `python -m benchmarks BENCHMARK ARGS...`, with that folder first on the
import path, so each side imports its own `hoplite_gpu`, `kernels` and
`transports`. The rounds alternate the order (base, head, then head, base ...)
so a drift of the machine over the run falls on both sides alike. For every
row both sides measured, it prints the median of each side and head / base.

Rows and the time that counts in each:
- `emulated`: (op, size, system) -> each launch's `seconds` (its median call);
- `directory-scale`: (event) -> `seconds_per_unit` at n and at 10 n;
- `broadcast`: (size, shared memory) -> `broadcast_median_s` and `p2p_median_s`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.table import Table

from .args import at_least

REPO = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def _lay_out(rev: str, into: Path) -> Path:
    """The tree of `rev` under `into`, importable as `hoplite_gpu` (whose
    `kernels` and `transports` subpackages live at the top, as pyproject maps them)."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    for sub in ("kernels", "transports"):
        link = into / "hoplite_gpu" / sub
        if not link.exists():
            link.symlink_to(Path("..") / sub)
    return into


def _rows(result: dict) -> dict[str, list[float]]:
    """Name -> the seconds of each of its rows in a saved result this module
    knows (a launch of `emulated` per row: `--repeats 2` gives two)."""
    name, out = result.get("benchmark", ""), {}

    def add(key: str, value: float) -> None:
        out.setdefault(key, []).append(value)

    for r in result.get("rows", []):
        if "op" in r and "seconds" in r and r.get("seconds"):
            add(f"{r['op']} {r['size_bytes'] >> 20 or r['size_bytes']}"
                f"{' MiB' if r['size_bytes'] >> 20 else ' B'} {r['system']}", r["seconds"])
        elif name == "directory-scale":
            add(f"{r['event']} (n={r['n']:,})", r["seconds_per_unit"])
            add(f"{r['event']} (n={r['n_large']:,})", r["seconds_per_unit_large"])
        elif "broadcast_median_s" in r:
            where = f"{r['size_bytes'] >> 20} MiB, shm {'on' if r['shared_memory'] else 'off'}"
            add(f"broadcast {where}", r["broadcast_median_s"])
            add(f"p2p {where}", r["p2p_median_s"])
    return out


def _run_once(tree: Path, bench: list[str], timeout: float) -> dict[str, list[float]]:
    results = tree / "benchmarks" / "results"
    shutil.rmtree(results, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-m", "benchmarks", *bench], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=timeout)
    saved = sorted(results.glob("*.json"), key=lambda p: p.stat().st_mtime)
    if proc.returncode not in (0, 1) or not saved:
        raise RuntimeError(f"`python -m benchmarks {' '.join(bench)}` in {tree.name} failed "
                           f"(exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return _rows(json.loads(saved[-1].read_text()))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", required=True, help="the commit to compare against (e.g. a tag)")
    p.add_argument("--head", default="HEAD", help="the commit to measure (default HEAD)")
    p.add_argument("--rounds", type=at_least(1), default=3,
                   help="runs of the benchmark on each side, alternating the order (each "
                        "run's every sample counts: a launch of emulated, a round of the rest)")
    p.add_argument("--timeout", type=at_least(1), default=1800, help="seconds per run at most")
    p.add_argument("bench", nargs=argparse.REMAINDER,
                   help="after --: the benchmark and its arguments")


def run(args: argparse.Namespace, console) -> dict:
    bench = [a for a in args.bench if a != "--"]
    if not bench:
        raise SystemExit("compare: name the benchmark after --, e.g. -- directory-scale")
    revs = {"base": _git("rev-parse", args.base), "head": _git("rev-parse", args.head)}
    samples: dict[str, dict[str, list[float]]] = {"base": {}, "head": {}}
    with tempfile.TemporaryDirectory(prefix="hoplite-compare-") as tmp:
        trees = {side: _lay_out(rev, Path(tmp) / side) for side, rev in revs.items()}
        for i in range(args.rounds):
            order = ("base", "head") if i % 2 == 0 else ("head", "base")
            for side in order:
                console.print(f"round {i + 1}/{args.rounds}: {side} ({revs[side][:10]})")
                got = _run_once(trees[side], bench, args.timeout)
                for key, values in got.items():
                    samples[side].setdefault(key, []).extend(values)
    rows = []
    table = Table(title=f"{' '.join(bench)}: head {revs['head'][:10]} against base "
                  f"{revs['base'][:10]}, {args.rounds} rounds each: medians, then the best")
    for col in ("row", "base", "head", "head / base", "best: base", "head", "head / base"):
        table.add_column(col, justify="left" if col == "row" else "right")
    for key, base in samples["base"].items():
        head = samples["head"].get(key)
        if not head:
            continue
        b, h = statistics.median(base), statistics.median(head)
        # (the least time of each side too: for a CPU-bound micro-benchmark a
        # busier moment of the machine only ever adds time)
        bb, hb = min(base), min(head)
        rows.append({"row": key, "base_s": base, "head_s": head, "base_median_s": b,
                     "head_median_s": h, "ratio": h / b, "base_best_s": bb,
                     "head_best_s": hb, "ratio_best": hb / bb})
        table.add_row(key, _fmt(b), _fmt(h), f"{h / b:.3f}", _fmt(bb), _fmt(hb),
                      f"{hb / bb:.3f}")
    console.print(table)
    return {"benchmark": "compare", "file_stem": f"compare-{bench[0]}", "base": revs["base"],
            "head": revs["head"], "bench": bench, "rounds": args.rounds, "rows": rows}


def _fmt(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.2f} us"
