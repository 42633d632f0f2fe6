"""`python -m benchmarks tls` runs end to end on a tiny object: both
variants measured (TLS off, then on), every copy byte-identical, the ratio
and the JSON written; and arguments it cannot run refused."""

from __future__ import annotations

import json

import pytest

import benchmarks.__main__ as entry

pytest.importorskip("cryptography")


@pytest.mark.slow  # an end-to-end launch of the benchmark
@pytest.mark.timeout(90)
def test_the_tls_benchmark_measures_both_variants(monkeypatch, tmp_path):
    """(About 6 s: two clusters start, one per variant, as in a real run.)"""
    monkeypatch.setattr(entry, "RESULTS", tmp_path)
    assert entry.main(["tls", "--workers", "2", "--size", "64K", "--repeats", "1",
                       "--rounds", "1"]) == 0
    (saved,) = tmp_path.glob("tls-loopback-*.json")
    result = json.loads(saved.read_text())
    assert [row["tls"] for row in result["rows"]] == [False, True]
    assert all(row["byte_identical"] and row["size_bytes"] == 64 << 10
               and len(row["p2p_s"]) == len(row["broadcast_s"]) == 1 for row in result["rows"])
    assert [launch["tls"] for launch in result["launches"]] == [False, True]
    assert set(result["ratio_tls_to_plain"]) == {"p2p", "broadcast"}
    assert all(r > 0 for r in result["ratio_tls_to_plain"].values())


@pytest.mark.parametrize("argv", [["--workers", "1"], ["--size", "0"], ["--repeats", "0"],
                                  ["--rounds", "0"]])
def test_the_tls_benchmark_refuses_what_it_cannot_run(argv, monkeypatch, tmp_path):
    monkeypatch.setattr(entry, "RESULTS", tmp_path)
    with pytest.raises(SystemExit) as info:
        entry.main(["tls", *argv, "--no-save"])
    assert info.value.code not in (0, None)
    assert not list(tmp_path.iterdir())
