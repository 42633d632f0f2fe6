"""PNG plots of the JSON results under benchmarks/results/ (needs matplotlib,
from the `bench` extra)."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path


def plot_all(results: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    made = []
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        kind = data.get("benchmark", "")
        if kind in ("broadcast-emulated", "collectives-emulated"):
            ops = sorted({r.get("op", "broadcast") for r in data["rows"]})
            for op in ops:
                rows = [r for r in data["rows"] if r.get("op", "broadcast") == op]
                out = path.with_name(f"{path.stem}-{op}.png") if len(ops) > 1 else path.with_suffix(".png")
                made.append(_emulated({"rows": rows, "op": op}, out))
        elif kind == "broadcast-loopback":
            made.append(_loopback(data, path.with_suffix(".png")))
        elif kind == "allreduce-dynamic-emulated":
            made.append(_dynamic(data, path.with_suffix(".png")))
    return made


def _emulated(data: dict, out: Path) -> Path:
    import matplotlib.pyplot as plt

    by: dict[tuple[str, int], list[float]] = defaultdict(list)
    for r in data["rows"]:
        system = r["system"].split(" (")[0]
        by[(system, r["size_bytes"] >> 20)].append(r["ratio_to_bound"])
    fig, ax = _grouped_bars(by)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    hosts = data["rows"][0]["hosts"]
    gbit = data["rows"][0]["bandwidth_bps"] / 1e9
    ax.set_ylabel("time / (S/B)  (lower is better)")
    ax.set_title(f"{data.get('op', 'broadcast')} on {hosts} emulated hosts, {gbit:g} Gbit/s links")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _loopback(data: dict, out: Path) -> Path:
    import matplotlib.pyplot as plt

    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    labels = [f"{r['size_bytes'] >> 20} MiB" for r in rows]
    ax.bar(labels, [r["ratio_broadcast_to_p2p"] for r in rows], label="broadcast to 7")
    ax.axhline(rows[0]["receivers"], color="red", linestyle="--", linewidth=0.8,
               label="a star's ratio")
    ax.set_ylabel("broadcast time / point-to-point time")
    ax.set_title("loopback, one 2-core machine (CPU-bound)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _dynamic(data: dict, out: Path) -> Path:
    import matplotlib.pyplot as plt

    by: dict[tuple[str, int], list[float]] = defaultdict(list)
    for r in data["rows"]:
        by[(r["system"], r["size_bytes"] >> 20)].append(r["seconds_after_last_ready"])
    fig, ax = _grouped_bars(by)
    gap = data["rows"][0].get("gap_s", 0)
    ax.set_ylabel("seconds after the last input was ready")
    ax.set_title(f"allreduce, inputs ready {gap:g} s apart, {data['rows'][0]['hosts']} emulated hosts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _grouped_bars(by: dict[tuple[str, int], list[float]]):
    """One group of bars per size (MiB), one bar per system (medians); ours first."""
    import matplotlib.pyplot as plt

    systems = sorted({s for s, _ in by}, key=lambda s: (s != "hoplite-gpu", s))
    sizes = sorted({m for _, m in by})
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        xs = [j + i * width for j in range(len(sizes))]
        ax.bar(xs, [statistics.median(by[(system, m)]) for m in sizes], width, label=system)
    ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(sizes))],
                  [f"{m} MiB" for m in sizes])
    return fig, ax
