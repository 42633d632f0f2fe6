"""``python -m benchmarks fuzz --seconds N [--target directory|data|decoders|all]``:
hostile bytes against the network-facing decoders, for a fixed time.

- ``directory``, ``data``: a real server on loopback in this process
  (`fuzz_peer.Served`), fed by ``--workers`` threads of hostile peers, each
  input on its own connection (`fuzz_inputs.random_case`: random maps,
  mutated and mistyped messages, deep nesting, truncated frames, lying and
  oversized lengths, tiny writes; before and after the handshake). A
  well-behaved client checks twice a second that the server still serves.
- ``decoders``: the decoders in process (`fuzz_decoders`), under atheris
  (coverage-guided) when it is installed, else our own mutation loop.

Reported per target: inputs tried, what they came to, crashes (an
exception a handler let out, a record logged at ERROR, a breach or an
unclear refusal), hangs (no answer and no close within the deadline),
the memory held per unauthenticated peer, and peak RSS. Each distinct crash
or hang is saved to ``benchmarks/results/fuzz-crashes/`` with its input;
``python -m benchmarks fuzz --replay FILE`` runs it again. The command
exits non-zero if anything was found.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import random
import resource
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from hoplite_gpu import messages as m
from hoplite_gpu.protocol import MAX_MESSAGE, SMALL_MESSAGE

from . import fuzz_decoders
from . import fuzz_inputs as fi
from . import fuzz_peer as fp
from .args import at_least, seconds

CRASHES = Path(__file__).resolve().parent / "results" / "fuzz-crashes"
#: Seconds a server has to refuse, close or answer one input (its handshake
#: deadline is 0.5 s and its node lease 1 s: `fuzz_peer.Served`).
DEADLINE = 5.0
#: Seconds between the well-behaved client's checks.
ALIVE_EVERY = 0.5
#: Unauthenticated peers opened at the end of a server target's run.
UNPROVEN_PEERS = 200


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=seconds(0.0, above=True), default=60.0,
                   help="the whole run's length, shared among the targets")
    p.add_argument("--target", choices=["directory", "data", "decoders", "all"], default="all")
    p.add_argument("--workers", type=at_least(1), default=4,
                   help="hostile peers at once, per server target")
    p.add_argument("--seed", type=int, default=None, help="the first worker's seed")
    p.add_argument("--engine", choices=["auto", "atheris", "mutation"], default="auto",
                   help="for the decoders: atheris where installed (auto), or our own loop")
    p.add_argument("--crashes", type=Path, default=CRASHES,
                   help="where crashes and hangs are saved")
    p.add_argument("--replay", type=Path, default=None,
                   help="run one saved crash or hang again instead (exit 1 if it still fails)")


def run(args: argparse.Namespace, console: Console) -> dict:
    if args.replay is not None:
        args.no_save = True
        return replay(args.replay, console)
    targets = ["directory", "data", "decoders"] if args.target == "all" else [args.target]
    seed = random.randrange(1 << 30) if args.seed is None else args.seed
    share = args.seconds / len(targets)
    rows = []
    for target in targets:
        console.print(f"fuzzing {target} for {share:.0f} s (seed {seed})")
        if target == "decoders":
            rows.append(decoders(share, args.engine, args.crashes, seed))
        else:
            rows.append(Campaign(target, args.workers, seed, args.crashes).run(share))
    _table(rows, console)
    found = sum(r["crashes"] + r["hangs"] for r in rows)
    console.print(f"{sum(r['inputs'] for r in rows)} inputs tried; "
                  + (f"{found} crashes or hangs, saved under {args.crashes}" if found
                     else "no crash, no hang"))
    return {"benchmark": "fuzz", "seed": seed, "rows": rows, "ok": found == 0}


def decoders(seconds_: float, engine: str, crashes: Path, seed: int) -> dict:
    use_atheris = engine == "atheris" or (engine == "auto" and fuzz_decoders.available())
    if engine == "atheris" and not fuzz_decoders.available():
        raise SystemExit("atheris is not installed (pip install atheris, or the fuzz extra)")
    t0 = time.monotonic()
    row = (fuzz_decoders.atheris_run(seconds_, crashes) if use_atheris
           else fuzz_decoders.mutation_run(seconds_, crashes, seed))
    took = time.monotonic() - t0
    if not (row["crashes"] or row["hangs"]):
        row.pop("log_tail", None)
    # (atheris: libFuzzer's own rate, over its fuzzing time, not the child's start)
    rate = row.pop("inputs_per_s", None) or round(row["inputs"] / took)
    return {"target": "decoders", "seconds": round(took, 1), "inputs_per_s": rate,
            "outcomes": {}, "peak_rss_mb": row.pop("peak_rss_mb", None) or _peak_rss_mb(),
            **row}


class Campaign:
    """Hostile peers against one server for a while: the counts, and what
    was found (each distinct crash or hang saved once)."""

    def __init__(self, kind: str, workers: int, seed: int, crashes: Path) -> None:
        self.kind, self.workers, self.seed, self.crashes_dir = kind, workers, seed, crashes
        self.lock = threading.Lock()
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.inputs = 0
        #: the case each recent connection carried, by its local port
        self.by_port: collections.OrderedDict[int, fi.Case] = collections.OrderedDict()
        self.recent: collections.deque[fi.Case] = collections.deque(maxlen=50)
        self.found: dict[str, int] = {}  # signature -> times seen
        self.crashes = self.hangs = 0
        self.unserved = ""

    def run(self, seconds_: float) -> dict:
        t0 = time.monotonic()
        with fp.Served(self.kind) as served:
            stop = threading.Event()
            threads = [threading.Thread(target=self._worker, args=(served, i, stop), daemon=True)
                       for i in range(self.workers)]
            for t in threads:
                t.start()
            end = t0 + seconds_
            while time.monotonic() < end and not self.unserved:
                time.sleep(min(ALIVE_EVERY, max(0.0, end - time.monotonic())))
                self._check(served)
            stop.set()
            for t in threads:
                t.join(DEADLINE + 5)
            self._check(served)
            took = time.monotonic() - t0
            with fp.Served(self.kind, handshake_s=30.0) as fresh:
                each, _ = fp.held_per_unproven_peer(fresh, UNPROVEN_PEERS, SMALL_MESSAGE)
        return {"target": self.kind, "engine": f"peers x{self.workers}",
                "seconds": round(took, 1), "inputs": self.inputs,
                "inputs_per_s": round(self.inputs / took), "outcomes": dict(self.outcomes),
                "crashes": self.crashes, "hangs": self.hangs, "unserved": self.unserved,
                "bytes_per_unauthenticated_peer": round(each), "peak_rss_mb": _peak_rss_mb()}

    def _worker(self, served: fp.Served, i: int, stop: threading.Event) -> None:
        rng = random.Random(self.seed * 1000 + i)
        corpora = {phase: fi.corpus_for(self.kind, phase, served.oid or fi.OID, served.size)
                   for phase in fi.PHASES[self.kind]}
        n = 0
        while not stop.is_set():
            phase = rng.choice(fi.PHASES[self.kind])
            limit = MAX_MESSAGE if phase == "node" else SMALL_MESSAGE
            case = fi.random_case(rng, self.kind, phase, limit, corpora[phase])
            n += 1
            outcome = run_case(served, case, node=f"fuzz-{i}-{n}")
            with self.lock:
                self.inputs += 1
                self.outcomes[f"{phase}: {outcome.kind}"] += 1
                self.by_port[outcome.port] = case
                while len(self.by_port) > 10000:
                    self.by_port.popitem(last=False)
                self.recent.append(case)
                if outcome.bad:
                    self._found(outcome.kind, f"{phase} {case.how}", [case], outcome.detail)

    def _check(self, served: fp.Served) -> None:
        """Whether a well-behaved client is served, and what the server let out."""
        try:
            if self.kind == "directory":
                fp.directory_alive(served.address, served.token, f"alive-{time.monotonic()}",
                                   DEADLINE)
            else:
                fp.data_alive(served.address, served.token, served.oid, served.data, DEADLINE)
        except (AssertionError, OSError) as exc:
            with self.lock:
                self.unserved = f"{type(exc).__name__}: {exc}"
                self._found("unserved", "a well-behaved client was not served",
                            list(self.recent), self.unserved)
        for crash in served.take_crashes():
            port = int(crash.peer.rpartition(":")[2]) if crash.peer else 0
            with self.lock:
                case = self.by_port.get(port)
                cases = [case] if case is not None else list(self.recent)
                last = crash.text.strip().splitlines()[-1]
                self._found("crash", f"{cases[-1].phase if cases else '?'} {last[:120]}",
                            cases, crash.text)

    def _found(self, kind: str, signature: str, cases: list[fi.Case], detail: str) -> None:
        if kind == "hang":
            self.hangs += 1
        else:
            self.crashes += 1
        key = f"{kind}: {signature}"
        self.found[key] = self.found.get(key, 0) + 1
        if self.found[key] > 1:
            return  # (saved once)
        self.crashes_dir.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha1(key.encode()).hexdigest()[:12]
        path = self.crashes_dir / f"{self.kind}-{kind}-{digest}.json"
        path.write_text(json.dumps({
            "target": self.kind, "kind": kind, "signature": signature, "detail": detail,
            "cases": [c.to_json() for c in cases],
            "replay": f"python -m benchmarks fuzz --replay {path}"}, indent=2))


def run_case(served: fp.Served, case: fi.Case, node: str) -> fp.Outcome:
    """One hostile input on its own connection to `served`."""
    if case.phase == "handshake":
        return fp.before_handshake(served.address, case.pieces, case.finish == "hold", DEADLINE)
    if case.target == "data":
        sentinel = m.Pull(oid=served.oid, offset=served.size - 1, end=served.size)
        return fp.data_request(served.address, served.token, case.pieces, case.finish, DEADLINE,
                               sentinel)
    return fp.after_handshake(served.address, served.token, case.pieces, case.finish, DEADLINE,
                              node=node if case.phase == "node" else None)


def replay(path: Path, console: Console) -> dict:
    """Run a saved crash or hang again, against a fresh server."""
    try:
        saved = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError):
        saved = {"target": "decoders"}  # (libFuzzer's own artifact: the raw input)
    if saved.get("target") == "decoders":
        still = fuzz_decoders.replay(path) != 0
        return {"benchmark": "fuzz-replay", "rows": [], "ok": not still}
    rows = []
    with fp.Served(saved["target"]) as served:
        for i, raw in enumerate(saved["cases"]):
            case = fi.Case.from_json(raw)
            outcome = run_case(served, case, node=f"replay-{i}")
            time.sleep(0.05)  # (a handler's exception is recorded as it ends)
            crashes = served.take_crashes()
            rows.append({"case": i, "how": f"{case.phase} {case.how}", "outcome": outcome.kind,
                         "detail": outcome.detail[:200], "crashes": [c.text for c in crashes]})
            console.print(f"case {i} ({case.phase} {case.how}): {outcome.kind}"
                          + "".join(f"\n{c.text}" for c in crashes))
    still = any(r["outcome"] in ("hang", "breach", "unclear") or r["crashes"] for r in rows)
    console.print("still fails" if still else "handled now")
    return {"benchmark": "fuzz-replay", "rows": rows, "ok": not still}


def _peak_rss_mb() -> float:
    """This process's peak resident memory (Linux reports KiB)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _table(rows: list[dict], console: Console) -> None:
    table = Table(title="fuzzing the network-facing decoders")
    for col in ("target", "engine", "s", "inputs", "per s", "crash", "hang", "B/peer*",
                "RSS MB"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["target"], r["engine"], f"{r['seconds']:g}", str(r["inputs"]),
                      str(r["inputs_per_s"]), str(r["crashes"]), str(r["hangs"]),
                      str(r.get("bytes_per_unauthenticated_peer", "")), str(r["peak_rss_mb"]))
    console.print(table)
    console.print("* memory held per unauthenticated peer (tracemalloc, "
                  f"{UNPROVEN_PEERS} peers each announcing a {SMALL_MESSAGE}-byte proof)")
    for r in rows:
        if r["outcomes"]:
            console.print(f"{r['target']}: " + ", ".join(
                f"{k} {v}" for k, v in sorted(r["outcomes"].items())))
