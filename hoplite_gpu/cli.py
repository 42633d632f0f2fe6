"""The hoplite-gpu command line: directory, demo, calibrate, simulate, info, topology, bench."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import selectors
import signal
import sys
import threading
from typing import Any

from .config import Config, format_size, parse_size
from .errors import ConfigError, HopliteError


def _directory(args: argparse.Namespace) -> int:
    from .auth import new_token
    from .directory.server import DirectoryServer
    from .tls import load

    config = Config.from_env()
    tls = load(config)  # (bad TLS files: refused here, before we listen)
    token = args.token or config.token
    if not token:
        token = new_token()
        print(f"no --token or HOPLITE_TOKEN given; generated token: {token}", flush=True)
    logging.basicConfig(level=(args.log_level or config.log_level).upper(),
                        format="%(asctime)s %(name)s %(message)s")
    stdin = None
    if args.until_stdin_closes:
        # A stdin that is closed, or that epoll cannot watch (/dev/null, a
        # regular file), can never tell us it ended: refused before we serve.
        try:
            stdin = sys.stdin.fileno() if sys.stdin is not None else None
            if stdin is not None:
                with selectors.DefaultSelector() as watch:
                    watch.register(stdin, selectors.EVENT_READ)
        except (OSError, ValueError) as exc:
            stdin = None
            reason = exc
        else:
            reason = "it is closed" if stdin is None else None
        if stdin is None:
            raise ConfigError(f"--until-stdin-closes needs a standard input that can be "
                              f"watched, a pipe or a terminal ({reason})")

    async def serve() -> None:
        server = DirectoryServer(token, host=args.host, port=args.port, tls=tls,
                                 **config.directory_settings())
        address = await server.start()
        print(f"hoplite-gpu directory listening on {address}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if stdin is not None:
            # (the parent that started us holds our stdin: its end, however it
            # came, is ours too, so no directory outlives a killed parent)
            loop.add_reader(stdin, lambda: os.read(stdin, 4096) or stop.set())
        await stop.wait()
        await server.close()

    asyncio.run(serve())
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(num_workers=args.workers, size=_parse_size(args.size), repeats=args.repeats,
                    chunk_size=_parse_size(args.chunk_size) if args.chunk_size else None)


def _calibrate(args: argparse.Namespace) -> int:
    from .calibrate import calibrate

    print("measuring gets between two local worker processes over the transport "
          "(loopback, shared memory off) ...", flush=True)
    res = calibrate(large=_parse_size(args.size), repeats=args.repeats)
    print(f"small get {res['small_get_s'] * 1e3:.2f} ms, large get {res['large_get_s'] * 1e3:.1f} ms")
    print("cost-model settings for this machine (export them, or pass them to init):")
    print(f"HOPLITE_LINK_LATENCY_S={res['link_latency_s']:.3g}")
    print(f"HOPLITE_LINK_BYTES_PER_S={res['link_bytes_per_s']:.3g}")
    return 0


#: Most chunk transfers (chunks x receivers) `simulate` replays per schedule:
#: some 30,000 a second on one core, seven broadcast schedules per run.
MAX_SIM_HOPS = 1 << 20


def _simulate(args: argparse.Namespace) -> int:
    from .simulator import MAX_SIM_CHUNKS

    size, chunk = _parse_size(args.size), _parse_size(args.chunk)
    if -(-size // chunk) > MAX_SIM_CHUNKS:
        raise SystemExit(f"hoplite-gpu simulate: {format_size(size)} in {format_size(chunk)} chunks "
                         f"is {-(-size // chunk)} chunks; at most {MAX_SIM_CHUNKS} are simulated. "
                         "Use a larger --chunk")
    if args.op == "reduce":
        return _simulate_reduce(args, size, chunk)
    return _simulate_broadcast(args, size, chunk)


def _simulate_broadcast(args: argparse.Namespace, size: int, chunk: int) -> int:
    """The schedule of the settings in force, then for comparison every
    single tree (fan-outs 1, 2, 4, all, and the cost model's) and two
    stripes always."""
    from .directory.reduce_plan import STRIPES, stripe_piece
    from .simulator import simulate_broadcast

    bw, n = float(args.bandwidth), args.receivers
    config = Config.from_env()  # (the settings in force)
    # (a striped pull moves in pieces, the smallest for the deepest trees)
    piece = min(chunk, stripe_piece(size, n + 1, STRIPES, chunk))
    hops = -(-size // piece) * n
    if hops > MAX_SIM_HOPS:
        raise SystemExit(f"hoplite-gpu simulate: {-(-size // piece)} chunks to {n} "
                         f"receivers is {hops} chunk transfers per schedule; at most "
                         f"{MAX_SIM_HOPS} are simulated (about 30 s each, seven schedules). "
                         "Use a larger --chunk or fewer --receivers")
    spread = args.arrival_spread
    arrivals = [i * spread / max(1, n - 1) for i in range(n)] if spread else None
    bound = size / bw
    if not args.json:
        print(f"simulated broadcast of {format_size(size)} to {n} receivers"
              + (f" arriving over {spread:g} s" if spread else "")
              + f", {bw / 1e9:.2f} GB/s links, {args.latency * 1e6:.3g} us latency, "
              f"{format_size(chunk)} chunks (the real directory state machine decides)")
    default = (config.max_receivers_per_sender, config.stripes)
    others = [(fanout, 1) for fanout in sorted({0, 1, 2, 4, n})] + [(default[0], STRIPES)]
    schedules = []
    for fanout, stripes in [default, *(s for s in others if s != default)]:
        r = simulate_broadcast(n, size, bandwidth=bw, latency=args.latency, chunk=chunk,
                               max_receivers_per_sender=fanout, arrivals=arrivals,
                               stripes=stripes, multi_source_bytes=config.multi_source_bytes)
        label = "auto" if fanout == 0 else str(fanout)
        striped = {0: "auto", 1: "off"}.get(stripes, str(stripes))
        schedules.append({"max_receivers_per_sender": label, "stripes": striped,
                          "seconds": r.makespan, "ratio_to_bound": r.makespan / bound,
                          "depth": r.depth(), "after_asking_s": r.after_asking,
                          "after_asking_ratio": r.after_asking / bound,
                          "after_last_ask_s": r.after_last_ask,
                          "after_last_ask_ratio": r.after_last_ask / bound})
        if not args.json:
            mark = "  (the settings in force)" if (fanout, stripes) == default else ""
            waits = (f", {r.after_asking / bound:.3f} x S/B the longest from a locate, "
                     f"{r.after_last_ask / bound:.3f} x from the last") if spread else ""
            print(f"  max_receivers_per_sender={label:<5s} stripes={striped:<4s} time "
                  f"{r.makespan * 1e3:9.1f} ms = {r.makespan / bound:7.3f} x S/B{waits}, "
                  f"tree depth {r.depth()}{mark}")
    if args.json:
        print(json.dumps({"op": "broadcast", "receivers": n, "size_bytes": size,
                          "chunk_bytes": chunk, "bandwidth_bytes_per_s": bw,
                          "latency_s": args.latency, "arrival_spread_s": spread,
                          **schedules[0], "bound_s": bound, "schedules": schedules}))
    return 0


def _simulate_reduce(args: argparse.Namespace, size: int, chunk: int) -> int:
    """Two schedules: every input at once, and (with --gap) one input every gap
    seconds; the directory picks the tree's degree in both."""
    from .directory.reduce_plan import fold_unit
    from .simulator import simulate_reduce

    bw, k = float(args.bandwidth), args.inputs
    if size % 4:
        raise SystemExit(f"hoplite-gpu simulate: --op reduce sums float32 arrays; "
                         f"--size must be a multiple of 4 bytes, got {size}")
    if not args.gap * k < float("inf"):
        raise SystemExit(f"hoplite-gpu simulate: --gap {args.gap:g} for {k} inputs puts the last "
                         "input past any time a float holds")
    # A step folds and hands on pieces of `fold_unit(size, chunk)`: what is simulated.
    unit = fold_unit(size, chunk)
    pieces = -(-size // unit)
    hops = pieces * k
    if hops > MAX_SIM_HOPS:
        # (some 80,000 chunk transfers a second on one core)
        raise SystemExit(f"hoplite-gpu simulate: {pieces} pieces of {format_size(unit)} from "
                         f"each of {k} inputs is {hops} chunk transfers per schedule; at most "
                         f"{MAX_SIM_HOPS} are simulated (about 15 s each, two schedules). "
                         "Use fewer --inputs, or a larger --chunk (a step folds an input in "
                         "pieces of at most --chunk and at most an eighth of it, down to 256 KiB)")
    if not args.json:
        print(f"simulated reduce (sum) of {k} float32 inputs of {format_size(size)}, "
              f"{bw / 1e9:.2f} GB/s links, {args.latency * 1e6:.3g} us latency, "
              f"{format_size(unit)} pieces (fold step {format_size(chunk)}; the real directory "
              "state machine decides)")
    schedules = []
    for gap in sorted({0.0, args.gap}):
        r = simulate_reduce(k, size, bandwidth=bw, latency=args.latency, chunk=chunk,
                            arrivals=[i * gap for i in range(k)])
        schedules.append({"gap_s": gap, "seconds": r.makespan,
                          "after_last_input_s": r.makespan - r.last_arrival,
                          "ratio_to_bound": r.after_last, "degree": r.degree, "depth": r.depth})
        if args.json:
            continue
        label = "all at once" if gap == 0 else f"{gap:g} s apart"
        model = f" (model {_duration(r.model)})" if gap == 0 else ""
        print(f"  inputs {label:<14s} time {_duration(r.makespan)}{model}, after the last input "
              f"{_duration(r.makespan - r.last_arrival)} = {r.after_last:.3f} x S/B; "
              f"degree {r.degree}, depth {r.depth}")
    if args.json:
        print(json.dumps({"op": "reduce", "inputs": k, "size_bytes": size, "chunk_bytes": chunk,
                          "bandwidth_bytes_per_s": bw, "latency_s": args.latency,
                          **schedules[-1], "bound_s": size / bw, "schedules": schedules}))
    return 0


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.2f} s"


def _info(args: argparse.Namespace) -> int:
    import numpy

    from . import __version__
    from .transports import _KNOWN, get_backend

    print(f"hoplite-gpu {__version__} on Python {platform.python_version()}, NumPy {numpy.__version__}")
    config = Config.from_env()
    print(f"config: {config}")
    for scheme in sorted(_KNOWN):
        try:
            get_backend(scheme)
        except HopliteError as exc:
            print(f"transport {scheme}: not usable ({exc})")
            continue
        detail = ""
        if scheme == "ucx":
            from .transports.ucx import describe

            detail = f" ({describe()})"
        print(f"transport {scheme}: usable{detail}")
    print(f"shared memory between nodes of this host: {_shared_memory_summary(config)}")
    try:
        import cupy  # noqa: F401
    except ImportError:
        print("cupy: not installed (device arrays need pip install 'hoplite-gpu[gpu]')")
    else:
        from .gpu import cuda_available

        print("cupy: installed" + ("" if cuda_available() else
                                   ", but it sees no CUDA device: device arrays are not usable"))
    print(_gpu_summary())
    return 0


def _shared_memory_summary(config: Config) -> str:
    from .node import shm

    if not config.shared_memory:
        return "off (HOPLITE_SHARED_MEMORY=0): every byte goes over the transport"
    if not shm.usable():
        return "not available on this platform (Linux only): every byte goes over the transport"
    buf = shm.shared_buffer(1 << 20)
    if buf is None:
        return "not usable here (no memfd, or no file descriptors left): bytes go over the transport"
    fd = os.dup(shm.shared_map(buf).fd)
    kept = shm.map_kept(fd, 1 << 20)
    if kept is None:
        return ("usable, but receivers copy (cannot reopen a passed descriptor through "
                "/proc/self/fd, or lock it)")
    return "usable (receivers keep read-only mappings of complete copies)"


def _gpu_summary() -> str:
    from .gpu import discover

    return "\n".join(discover().lines())


def _parse_size(text: str) -> int:
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None


def _positive_size(text: str) -> str:
    """An argparse type: a size of at least one byte (kept as text)."""
    try:
        ok = parse_size(text) > 0
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not ok:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte; got {text!r}")
    return text


def _positive(kind: type, what: str, *, zero: bool = False):
    """An argparse type: a positive (finite) `kind`, `what` naming it; with
    `zero`, 0 too."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if not (0 <= value if zero else 0 < value) or not value < float("inf"):
            raise argparse.ArgumentTypeError(
                f"must be {'zero or more' if zero else 'positive'} and finite; got {text!r}")
        return value
    return parse


_at_least_one = _positive(int, "a whole number")


def _port(text: str) -> int:
    """An argparse type: a TCP port number, 0 (any free one) to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be from 0 (any free port) to 65535; got {port}")
    return port


def _simulate_parser(sub: Any) -> None:
    """`hoplite-gpu simulate`'s flags (a fabric's, with `--fabric`, are
    `fabric/cli.py`'s: `main` hands those over before parsing)."""
    s = sub.add_parser("simulate", help="simulate a broadcast or a reduce at any scale with the "
                                         "real scheduler")
    s.add_argument("--op", choices=["broadcast", "reduce"], default="broadcast",
                   help="what to simulate (default broadcast)")
    s.add_argument("--receivers", type=_at_least_one, default=1000,
                   help="broadcast: receivers (default 1000)")
    s.add_argument("--inputs", type=_at_least_one, default=1000,
                   help="reduce: inputs, one per node (default 1000)")
    s.add_argument("--gap", type=_positive(float, "a number of seconds", zero=True), default=0.0,
                   help="reduce: also simulate inputs arriving this many seconds apart "
                        "(default 0: only all at once)")
    s.add_argument("--size", type=_positive_size, default="256MiB",
                   help="object (or each input) size (default 256MiB)")
    s.add_argument("--bandwidth", type=_positive(float, "a number (e.g. 1.25e9)"), default=1.25e9,
                   help="bytes/s per link direction (default 1.25e9)")
    s.add_argument("--latency", type=_positive(float, "a number of seconds", zero=True),
                   default=1e-4, help="seconds per message and hop (default 1e-4)")
    s.add_argument("--chunk", type=_positive_size, default="4MiB",
                   help="pipeline chunk size (default 4MiB)")
    s.add_argument("--arrival-spread", type=_positive(float, "a number of seconds", zero=True),
                   default=0.0, help="broadcast: receivers arrive evenly over this many "
                                     "seconds (default 0: all at once)")
    s.add_argument("--json", action="store_true",
                   help="print one JSON object: the schedule of the settings in force "
                        "(`seconds`, `bound_s` = S/B, `ratio_to_bound`; broadcast: also "
                        "`after_asking_s`, the longest any receiver took from its locate, "
                        "and `after_last_ask_s`, from the last locate) and every other one")
    s.set_defaults(func=_simulate)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hoplite-gpu", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("directory", help="run the directory service (the control plane)")
    d.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback)")
    d.add_argument("--port", type=_port, default=7777, help="port (0 picks a free one; default 7777)")
    d.add_argument("--token", default=None, help="cluster token (default: $HOPLITE_TOKEN, else generated)")
    d.add_argument("--log-level", default=None, type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                   help="default $HOPLITE_LOG_LEVEL, else WARNING")
    d.add_argument("--until-stdin-closes", action="store_true",
                   help="also stop when standard input ends (for a parent that starts it)")
    d.set_defaults(func=_directory)

    m = sub.add_parser("demo", help="broadcast a large array across a local cluster and show the tree")
    m.add_argument("--workers", type=int, default=8, help="worker processes (1 sender + N-1 receivers)")
    m.add_argument("--size", type=_positive_size, default="256MiB",
                   help="array size (default 256MiB)")
    m.add_argument("--repeats", type=_at_least_one, default=1,
                   help="broadcasts to time (median reported)")
    m.add_argument("--chunk-size", type=_positive_size, default=None,
                   help="pipeline chunk size (default from config)")
    m.set_defaults(func=_demo)

    c = sub.add_parser("calibrate", help="measure latency and bandwidth for the reduce cost model")
    c.add_argument("--size", type=_positive_size, default="64MiB",
                   help="large transfer size (default 64MiB)")
    c.add_argument("--repeats", type=_at_least_one, default=5,
                   help="timed gets of each size (default 5)")
    c.set_defaults(func=_calibrate)

    _simulate_parser(sub)

    i = sub.add_parser("info", help="show versions, configuration, transports and GPUs")
    i.set_defaults(func=_info)

    from .topology_cli import add_parser as add_topology_parser

    add_topology_parser(sub)

    b = sub.add_parser("bench", add_help=False,
                       help="run the benchmarks of a source checkout (python -m benchmarks ...; "
                            "default: broadcast); 'bench --help' lists them")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(func=_bench)
    return p


def _bench(args: argparse.Namespace) -> int:
    """`python -m benchmarks` of the source tree in the current directory: the
    benchmarks (and their baselines) are not part of the installed package."""
    here = os.getcwd()
    if os.path.isfile(os.path.join(here, "benchmarks", "__main__.py")) and here not in sys.path:
        sys.path.insert(0, here)
    try:
        from benchmarks.__main__ import main as bench_main  # noqa: PLC0415
    except ImportError as exc:
        print("hoplite-gpu: error: 'bench' runs the benchmarks of a source checkout, which are "
              "not installed with the package; run it in the repository's top directory "
              f"(or 'make bench' there) ({exc})", file=sys.stderr)
        return 2
    return bench_main(args.rest or ["broadcast"])


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # (so a `kill` cleans up as Ctrl-C does: clusters closed)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["simulate"] and any(a == "--fabric" or a.startswith("--fabric=")
                                        for a in argv[1:]):
        from .fabric.cli import main as fabric_main  # (a fabric has flags of its own)

        return fabric_main(argv[1:])
    if argv[:1] == ["bench"]:  # (its options are the benchmarks', --help included)
        args = argparse.Namespace(rest=argv[1:], func=_bench, command="bench")
    else:
        args = build_parser().parse_args(argv)
    if threading.current_thread() is threading.main_thread() and args.command != "directory":
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        return args.func(args)
    except HopliteError as exc:
        print(f"hoplite-gpu: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `hoplite-gpu simulate | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
