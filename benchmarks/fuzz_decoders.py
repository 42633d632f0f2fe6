"""The decoders a peer's bytes reach, fuzzed in process: each target takes
bytes and either returns what its caller expects or raises one of the
errors its caller handles (`ALLOWED`); anything else is a crash.

Run by `python -m benchmarks fuzz --target decoders`: under atheris
(coverage-guided, libFuzzer's mutations) when it is installed, in a child
process (``python -m benchmarks.fuzz_decoders``), else by a mutation loop
of our own over the same targets and seeds. Coverage guidance sees the
Python code of these decoders (messages, auth, protocol, wire); msgspec's
C decoder is not instrumented, so there it is random mutation all the same.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import re
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hoplite_gpu import errors
from hoplite_gpu import messages as m
from hoplite_gpu.auth import check_verdict, client_answer, server_handshake
from hoplite_gpu.directory.wire import raise_for_error
from hoplite_gpu.protocol import SMALL_MESSAGE, _Framer
from hoplite_gpu.transports.base import BytesOnly

from . import fuzz_inputs as fi

PEER = "fuzz-peer"
TOKEN = "fuzz-token"


class _Bytes(BytesOnly):
    """A stream that yields `data` (in pieces of the given sizes) and then ends."""

    def __init__(self, data: bytes, pieces: list[int]) -> None:
        self.peer = PEER
        self._data, self._pieces, self._at = data, pieces, 0

    async def send(self, *buffers: Any) -> None:
        return None

    async def recv_into(self, buffer: memoryview) -> None:
        n = len(buffer)
        if self._at + n > len(self._data):
            raise errors.TransportClosed("the fuzz input ended")
        buffer[:] = self._data[self._at:self._at + n]
        self._at += n

    async def recv_some(self, buffer: memoryview) -> int:
        if self._at >= len(self._data):
            raise errors.TransportClosed("the fuzz input ended")
        n = min(len(buffer), len(self._data) - self._at,
                self._pieces.pop() if self._pieces else len(self._data))
        buffer[:n] = self._data[self._at:self._at + n]
        self._at += n
        return n

    async def close(self) -> None:
        return None

    @property
    def closed(self) -> bool:
        return self._at >= len(self._data)


def _typed(decoded: Any) -> None:
    if not isinstance(decoded, m.Message | m.Invalid):
        raise AssertionError(f"a decoder returned {type(decoded).__name__}")


def _framer(data: bytes) -> None:
    """The control connections' framer, fed `data` in pieces its first byte
    chooses; every message it hands over must decode or be refused."""
    rng = random.Random(data[:1])
    out: list[Any] = []
    framer = _Framer(_Bytes(b"", []), out.append, 64, m.decode_to_directory)
    body, at = data[1:], 0
    while at < len(body):
        space = framer.space()
        n = min(len(space), rng.randint(1, 32), len(body) - at)
        space[:n] = body[at:at + n]
        at += n
        framer.received(n)
    for msg in out:
        _typed(msg)


_LOOP: asyncio.AbstractEventLoop | None = None


def _handshake(data: bytes) -> None:
    """The accepting side of the handshake, reading `data` as the peer's proof."""
    global _LOOP
    if _LOOP is None:
        _LOOP = asyncio.new_event_loop()
    _LOOP.run_until_complete(server_handshake(_Bytes(data, []), TOKEN, 1.0))
    raise AssertionError("a handshake succeeded without the token")


def _reply(data: bytes) -> None:
    kinds = list(m.REPLIES)
    raw = m.decode_map(PEER, data[1:])
    m.read_reply(kinds[data[0] % len(kinds)] if data else kinds[0], raw)


#: target -> (what it runs on the bytes, the errors its caller handles)
TARGETS: dict[str, tuple[Callable[[bytes], Any], tuple[type[BaseException], ...]]] = {
    "to_directory": (lambda d: _typed(m.decode_to_directory(PEER, d)), (errors.ProtocolError,)),
    "hello": (lambda d: _typed(m.decode_hello(PEER, d)), (errors.ProtocolError,)),
    "pull": (lambda d: _typed(m.decode_pull(PEER, d)), (errors.ProtocolError,)),
    "ack": (lambda d: _typed(m.decode_ack(PEER, d)), (errors.ProtocolError,)),
    "map": (lambda d: m.decode_map(PEER, d), (errors.ProtocolError,)),
    "manifest": (lambda d: m.decode_manifest("a manifest", d), (errors.ProtocolError,)),
    "reply": (_reply, (errors.ProtocolError,)),
    "push": (lambda d: m.read_push(m.decode_map(PEER, d)), (errors.ProtocolError,)),
    "challenge": (lambda d: client_answer(m.decode_map(PEER, d), TOKEN, PEER),
                  (errors.ProtocolError,)),
    "verdict": (lambda d: check_verdict(m.decode_map(PEER, d), TOKEN, b"s" * 32, b"c" * 32,
                                        PEER), (errors.ProtocolError, errors.AuthenticationFailed)),
    "error_frame": (lambda d: raise_for_error(m.decode_map(PEER, d)), (errors.HopliteError,)),
    "framer": (_framer, (errors.ProtocolError,)),
    "handshake": (lambda d: _handshake(fi.frame(d[:SMALL_MESSAGE])), (errors.HopliteError,)),
}
NAMES = sorted(TARGETS)


def one_input(data: bytes) -> None:
    """The fuzz entry point: the first byte picks the target, the rest is its input."""
    if not data:
        return
    fn, allowed = TARGETS[NAMES[data[0] % len(NAMES)]]
    try:
        fn(data[1:])
    except allowed:
        pass


def seeds() -> list[bytes]:
    """Valid inputs for each target, prefixed by the byte that picks it."""
    bodies = fi.encoded(fi.directory_corpus() + fi.hello_corpus() + fi.pull_corpus()
                        + fi.handshake_corpus() + [m.Copied(), m.Kept()])
    bodies += [m.encode(m.Challenge(hello="hoplite-gpu", version=11, nonce=b"n" * 32)),
               m.encode(m.Verdict(ok=True, mac=b"m" * 32)),
               m.encode(m.Failure(error="ObjectNotFound", message="gone")),
               m.encode(m.Manifest(version=1, parts=[m.PackPart(nbytes=4, device=False)],
                                   tensors=[m.PackedTensor(key="a", kind="numpy", dtype="<f4",
                                                           shape=[1], nbytes=4, part=0,
                                                           offset=0)])),
               m.encode(m.Drop(oid=fi.OID, reason="x", retry=False))]
    # Nested just short of msgspec's recursion limit: a few inserted bytes
    # take it over.
    bodies += [fi.deep_bytes(950, None), fi.deep_bytes(950)]
    out = []
    for i, name in enumerate(NAMES):
        for body in bodies:
            if name == "framer":
                body = b"\x07" + fi.frame(body) * 2
            elif name == "reply":
                body = bytes([i]) + body
            out.append(bytes([i]) + body)
    return out


# ------------------------------------------------------------- our own loop ---
class _Slow(Exception):
    pass


#: whether an input is running under the alarm: an alarm that fires once
#: it ended (as its timer is disarmed) is ignored, not raised from there
_armed = [False]


def _alarm(signum: int, frame: Any) -> None:
    if _armed[0]:
        _armed[0] = False
        raise _Slow()


def mutation_run(seconds: float, crashes: Path, seed: int, hang_s: float = 2.0) -> dict:
    """Mutate the seeds for `seconds`; each input that raises what its
    target's caller does not handle, or runs over `hang_s`, is saved."""
    rng = random.Random(seed)
    pool = seeds()
    tried = found = hangs = 0
    deadline = time.monotonic() + seconds
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        while time.monotonic() < deadline:
            base = rng.choice(pool)
            r = rng.random()
            if r < 0.9:
                data = base[:1] + fi.mutate(base[1:], fi.random_edits(rng))
            elif r < 0.97:
                data = bytes([rng.randrange(len(NAMES))]) + fi.encode_any(fi.random_map(rng))
            else:
                data = base[:1] + fi.random_body(rng, "deep", [])
            tried += 1
            _armed[0] = True
            signal.setitimer(signal.ITIMER_REAL, hang_s)
            try:
                one_input(data)
                _armed[0] = False
            except _Slow:
                hangs += 1
                save(crashes, "hang", data, f"over {hang_s:g}s")
            except Exception:  # noqa: BLE001 - what we are here to find
                _armed[0] = False
                found += 1
                save(crashes, "crash", data, traceback.format_exc())
            finally:
                _armed[0] = False
                signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.signal(signal.SIGALRM, old)
    return {"engine": "mutation", "inputs": tried, "crashes": found, "hangs": hangs}


def save(crashes: Path, kind: str, data: bytes, why: str) -> Path:
    crashes.mkdir(parents=True, exist_ok=True)
    name = NAMES[data[0] % len(NAMES)] if data else "none"
    path = crashes / f"decoders-{name}-{kind}-{hashlib.sha1(data).hexdigest()[:12]}.json"
    path.write_text(json.dumps({"target": "decoders", "kind": kind, "decoder": name,
                                "input": data.hex(), "why": why,
                                "replay": f"python -m benchmarks.fuzz_decoders --replay {path}"},
                               indent=2))
    return path


# ----------------------------------------------------------------- atheris ---
def atheris_run(seconds: float, crashes: Path) -> dict:
    """Run atheris on `one_input` in a child process for `seconds`; what it
    tried, found and used, read from libFuzzer's own lines."""
    import subprocess
    import tempfile

    crashes.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as corpus:
        for i, data in enumerate(seeds()):
            Path(corpus, f"seed-{i}").write_bytes(data)
        cmd = [sys.executable, "-c", _ATHERIS_CHILD,
               f"-max_total_time={max(1, int(seconds))}", "-timeout=5", "-rss_limit_mb=2048",
               f"-artifact_prefix={crashes}/decoders-", "-print_final_stats=1", corpus]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120,
                              cwd=Path(__file__).resolve().parent.parent)
    log = proc.stderr
    stats = {k: int(v) for k, v in re.findall(r"^stat::(\w+):\s+(\d+)$", log, re.M)}
    return {"engine": "atheris", "inputs": stats.get("number_of_executed_units", 0),
            "inputs_per_s": stats.get("average_exec_per_sec", 0),
            "peak_rss_mb": stats.get("peak_rss_mb"), "exit_code": proc.returncode,
            "crashes": int(proc.returncode != 0 and "ERROR: libFuzzer: timeout" not in log),
            "hangs": int("ERROR: libFuzzer: timeout" in log), "log_tail": log[-2000:]}


def available() -> bool:
    try:
        import atheris  # noqa: F401
    except ImportError:
        return False
    return True


def replay(path: Path) -> int:
    """Run a saved input (a JSON reproducer, or libFuzzer's raw artifact) once."""
    raw = path.read_bytes()
    try:
        data = bytes.fromhex(json.loads(raw)["input"])
    except (ValueError, KeyError, UnicodeDecodeError):
        data = raw
    name = NAMES[data[0] % len(NAMES)] if data else "none"
    try:
        one_input(data)
    except Exception:  # noqa: BLE001
        print(f"{name}: still crashes\n{traceback.format_exc()}")
        return 1
    print(f"{name}: handled")
    return 0


#: The atheris child: our modules are imported under its instrumentation
#: (only ours: instrumenting every loaded module takes longer than a short run).
_ATHERIS_CHILD = """
import sys
import atheris
with atheris.instrument_imports(include=["hoplite_gpu", "benchmarks"]):
    from benchmarks.fuzz_decoders import one_input
atheris.Setup(sys.argv, one_input)
atheris.Fuzz()
"""


def _main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fuzz_decoders")
    p.add_argument("--replay", type=Path, required=True)
    return replay(p.parse_args(argv).replay)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
