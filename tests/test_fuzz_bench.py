"""The fuzz harness (`python -m benchmarks fuzz`, benchmarks/fuzz.py): it
counts what it tried, finds a crash that is there, saves it with a
reproducer that replays, and exits non-zero then. Short runs only."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import fuzz, fuzz_decoders
from benchmarks import fuzz_inputs as fi
from hoplite_gpu import messages as m

ROOT = Path(__file__).resolve().parents[1]


def _fuzz(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks", "fuzz", "--no-save", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=90)


@pytest.mark.slow  # an end-to-end launch of the benchmark
def test_a_short_run_of_every_target_reports_what_it_tried(tmp_path):
    proc = _fuzz("--seconds", "1.5", "--workers", "2", "--engine", "mutation", "--seed", "7",
                 "--crashes", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no crash, no hang" in proc.stdout, proc.stdout
    tried = int(proc.stdout.split(" inputs tried")[0].split()[-1])
    assert tried > 100, proc.stdout
    assert list(tmp_path.iterdir()) == []


def test_a_crash_in_a_server_is_found_saved_and_replayed(tmp_path, monkeypatch):
    """A decoder that fails on pulls that ask for bare messages (a bug put
    here on purpose): the campaign counts it, saves the input once, and the
    reproducer replays it against a fresh server."""
    real = m.decode_pull

    def broken(peer, body):
        msg = real(peer, body)
        if isinstance(msg, m.Pull) and msg.bare is not None:
            raise RuntimeError("planted bug")
        return msg

    monkeypatch.setattr(m, "decode_pull", broken)
    row = fuzz.Campaign("data", 2, 11, tmp_path).run(3.0)
    assert row["crashes"] > 0 and row["inputs"] > 0, row
    saved = sorted(tmp_path.glob("data-crash-*.json"))
    assert saved, list(tmp_path.iterdir())
    report = [json.loads(p.read_text()) for p in saved]
    assert any("planted bug" in r["detail"] for r in report), report
    planted = next(p for p, r in zip(saved, report, strict=True) if "planted bug" in r["detail"])
    console = fuzz.Console(file=io.StringIO())
    assert fuzz.replay(planted, console)["ok"] is False
    monkeypatch.setattr(m, "decode_pull", real)
    assert fuzz.replay(planted, console)["ok"] is True


def test_the_decoders_loop_saves_what_escapes_and_the_replay_reads_it(tmp_path, monkeypatch):
    """Our own mutation loop (atheris absent or not chosen) over the decoder
    targets, with one target made to fail on purpose."""
    def fails(data: bytes) -> None:
        raise ValueError("planted")

    monkeypatch.setitem(fuzz_decoders.TARGETS, "ack", (fails, ()))
    result = fuzz_decoders.mutation_run(1.0, tmp_path, seed=3)
    assert result["inputs"] > 100 and result["crashes"] > 0, result
    saved = next(tmp_path.glob("decoders-ack-crash-*.json"))
    assert fuzz_decoders.replay(saved) == 1
    monkeypatch.undo()
    assert fuzz_decoders.replay(saved) == 0


def test_cases_survive_their_json_form():
    case = fi.Case("directory", "node", [b"\x00\x01", b""], "ping", "typed/session")
    assert fi.Case.from_json(json.loads(json.dumps(case.to_json()))) == case
