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
        made.extend(plot_file(path))
    sweep = _gap_sweep(results)
    if sweep is not None:
        made.append(sweep)
    return made


def plot_file(path: Path, console=None) -> list[Path]:
    """The plots of one saved result, beside it; none where matplotlib is
    missing (said on `console`, if given)."""
    try:
        import matplotlib
    except ImportError:
        if console is not None:
            console.print("no plot: matplotlib is missing (pip install matplotlib)")
        return []
    matplotlib.use("Agg")
    data = json.loads(path.read_text())
    kind = data.get("benchmark", "")
    made = []
    if kind == "rails":
        made.append(_rails(data, path.with_suffix(".png")))
    elif isinstance(data.get("summary"), list):  # the schema of benchmarks/README.md
        made.extend(_summary_plots(data, path))
    elif kind in ("broadcast-emulated", "collectives-emulated"):
        ops = sorted({r.get("op", "broadcast") for r in data["rows"]})
        for op in ops:
            rows = [r for r in data["rows"] if r.get("op", "broadcast") == op]
            out = path.with_name(f"{path.stem}-{op}.png") if len(ops) > 1 else path.with_suffix(".png")
            made.append(_emulated({"rows": rows, "op": op}, out))
    elif kind == "broadcast-loopback":
        made.append(_loopback(data, path.with_suffix(".png")))
    elif kind == "allreduce-dynamic-emulated":
        made.append(_dynamic(data, path.with_suffix(".png")))
    if kind == "leafspine":
        made.extend(_spine_links(data, path))
    if kind == "dgxmesh":
        made.append(dgxmesh_ratios(data, path.with_suffix(".png")))
    return made


def _gap_sweep(results: Path) -> Path | None:
    """Steady-state dynamic allreduces of one size and host count at several
    gaps (`emulated-dynamic-gap*.json`, one run per gap): seconds after the
    last input against the gap, with the two bounds of docs/cost-model.md:
    S/B for any schedule, and 2S/B - g for one that moves whole objects."""
    import matplotlib.pyplot as plt

    rows = []
    for path in sorted(results.glob("emulated-dynamic-gap*.json")):
        rows += [r for r in json.loads(path.read_text()).get("rows", [])
                 if r.get("op") == "allreduce-dynamic" and r.get("sync") and "gap_s" in r]
    if not rows:
        return None
    key = max({(r["hosts"], r["size_bytes"], r["bandwidth_bps"]) for r in rows},
              key=lambda k: sum((r["hosts"], r["size_bytes"], r["bandwidth_bps"]) == k for r in rows))
    rows = [r for r in rows if (r["hosts"], r["size_bytes"], r["bandwidth_bps"]) == key]
    gaps = sorted({r["gap_s"] for r in rows})
    if len(gaps) < 2:
        return None
    hosts, size, bps = key
    # the bounds at the links' measured rate where the runs measured it
    measured = [r["measured_link_bps"] for r in rows if r.get("measured_link_bps")]
    one = size * 8 / (statistics.median(measured) if measured else bps)
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for system in sorted({r["system"] for r in rows}, key=lambda s: (_ORDER + (s,)).index(s)):
        pts = sorted((r["gap_s"], r["seconds_after_last_ready"]) for r in rows if r["system"] == system)
        ax.plot([g for g, _ in pts], [t for _, t in pts], marker="o", label=system)
    grid = [gaps[0] + (gaps[-1] - gaps[0]) * i / 100 for i in range(101)]
    ax.plot(grid, [max(one, 2 * one - g) for g in grid], color="gray", linestyle="--",
            label="whole objects: max(S/B, 2S/B - g)")
    ax.axhline(one, color="black", linewidth=0.8, linestyle=":", label="any schedule: S/B")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("seconds between inputs becoming ready (g)")
    ax.set_ylabel("seconds after the last input")
    ax.set_title(f"allreduce of {_size(size)}, {hosts} emulated hosts, {bps / 1e9:g} Gbit/s")
    ax.legend(fontsize=8)
    return _save(fig, results / "dynamic-arrival-vs-gap.png")


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
    fig, ax = plt.subplots(figsize=(6, 3.4))
    labels = [f"{r['size_bytes'] >> 20} MiB" + {True: "\nshared memory", False: "\nTCP"}.get(
        r.get("shared_memory"), "") for r in rows]
    bars = ax.bar(labels, [r["ratio_broadcast_to_p2p"] for r in rows], label="broadcast to 7")
    ax.bar_label(bars, labels=[f"{r['broadcast_median_s'] * 1e3:.0f} ms" for r in rows],
                 fontsize=8)
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


_ORDER = ("hoplite-gpu", "star", "gloo", "openmpi", "openmpi-tuned", "hoplite-gpu-ucx",
          "hoplite-gpu-sliced", "hoplite-gpu-loop", "hoplite-gpu-whole",
          "hoplite-gpu-adaptive")


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _summary_plots(data: dict, path: Path) -> list[Path]:
    """Per op: time / lower bound for the large sizes; one figure of per-call
    latency for the small ones; the dynamic allreduce: seconds after the last input."""
    settings = data.get("settings", {})
    small = settings.get("latency_max_bytes", 1 << 20)
    entries = data["summary"]
    made = []
    ops = list(dict.fromkeys(e["op"] for e in entries))
    for op in ops:
        mine = [e for e in entries if e["op"] == op and (e["size_bytes"] > small or op == "allreduce-dynamic")]
        if not mine:
            continue
        dynamic = op == "allreduce-dynamic"
        key = "median_s" if dynamic else "ratio_to_bound"
        fig, ax = _bars(mine, lambda e: _size(e["size_bytes"]), key, scale=1.0 if dynamic else None)
        if dynamic:
            ax.set_ylabel("seconds after the last input was ready")
            ax.set_title(f"allreduce, inputs ready {settings.get('gap_s', 0):g} s apart, "
                         f"{mine[0]['hosts']} emulated hosts, {mine[0]['bandwidth_bps'] / 1e9:g} Gbit/s")
        else:
            ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
            ax.set_ylabel("time / lower bound  (lower is better)")
            ax.set_title(f"{op} on {mine[0]['hosts']} emulated hosts, "
                         f"{mine[0]['bandwidth_bps'] / 1e9:g} Gbit/s links")
        made.append(_save(fig, path.with_name(f"{path.stem}-{op}.png")))
    timed = [r for r in data.get("rows", []) if r.get("link_timeline")]
    if timed:
        made.append(_timeline(timed, path.with_name(f"{path.stem}-timeline.png")))
    lat = [e for e in entries if e["size_bytes"] <= small and e["op"] != "allreduce-dynamic"]
    if lat:
        fig, ax = _bars(lat, lambda e: f"{e['op']}\n{_size(e['size_bytes'])}", "median_s", scale=1e3)
        ax.set_yscale("log")
        ax.set_ylabel("per-call latency, ms (median; bars: p25-p75)")
        ax.set_title(f"small collectives on {lat[0]['hosts']} emulated hosts")
        made.append(_save(fig, path.with_name(f"{path.stem}-latency.png")))
    return made


def _spine_links(data: dict, path: Path) -> list[Path]:
    """Per op of an emulated leaf-spine run: the bytes each leaf-spine link
    carried (both directions), one panel per system, one bar per ECMP seed;
    dashed: every link's share were the bytes spread evenly."""
    import matplotlib.pyplot as plt

    made = []
    for op in dict.fromkeys(r["op"] for r in data["rows"]):
        rows = [r for r in data["rows"] if r["op"] == op]
        systems = list(dict.fromkeys(r["system"] for r in rows))
        links = sorted(rows[0]["spine_link_bytes"], key=lambda k: (not k.startswith("leaf"), k))
        seeds = sorted({r["seed"] for r in rows})
        width = 0.8 / len(seeds)
        fig, axes = plt.subplots(len(systems), 1, figsize=(max(6, 0.5 * len(links) + 2),
                                                           2.2 * len(systems) + 0.6),
                                 sharex=True, squeeze=False)
        for ax, system in zip(axes[:, 0], systems, strict=True):
            mine = [r for r in rows if r["system"] == system]
            for r in mine:
                k = seeds.index(r["seed"])
                ax.bar([j + k * width for j in range(len(links))],
                       [r["spine_link_bytes"][n] / 2**20 for n in links], width,
                       label=f"seed {r['seed']}")
            even = statistics.fmean(sum(r["spine_link_bytes"].values()) / len(links)
                                    for r in mine) / 2**20
            ax.axhline(even, color="black", linewidth=0.8, linestyle="--")
            ax.set_title(f"{system}: {op} {_size(mine[0]['size_bytes'])}", fontsize=9)
            ax.set_ylabel("MiB")
        axes[-1, 0].set_xticks([j + width * (len(seeds) - 1) / 2 for j in range(len(links))],
                               links, rotation=60, fontsize=7)
        axes[0, 0].legend(fontsize=7, ncol=len(seeds))
        made.append(_save(fig, path.with_name(f"{path.stem}-{op}-links.png")))
    return made


def _rails(data: dict, out: Path) -> Path:
    """An emulated k-rail run, one row of panels per op: each system's time
    over the k rails' bound (median; bars: min to max; dotted: one rail's
    bound), and the MiB each rail delivered in a launch (mean), stacked."""
    import matplotlib.pyplot as plt

    summary, settings = data["summary"], data["settings"]
    k = settings["cluster"]["rails"]
    ops = list(dict.fromkeys(e["op"] for e in summary))
    fig, axes = plt.subplots(len(ops), 2, figsize=(11, 3.4 * len(ops)), squeeze=False)
    for (left, right), op in zip(axes, ops, strict=True):
        mine = [e for e in summary if e["op"] == op]
        names = [e["system"] for e in mine]
        xs = range(len(mine))
        ratio = [e["ratio_to_bound"] for e in mine]
        spread = [[r - e["min_s"] / e["lower_bound_s"] for r, e in zip(ratio, mine, strict=True)],
                  [e["max_s"] / e["lower_bound_s"] - r for r, e in zip(ratio, mine, strict=True)]]
        left.bar(xs, ratio, yerr=spread, capsize=3, color=[f"C{j}" for j in xs])
        left.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        left.axhline(float(k), color="gray", linewidth=0.8, linestyle=":")
        left.set_xticks(list(xs), names, fontsize=8)
        left.set_ylabel(f"time / bound of {k} rails")
        left.set_title(f"{op} {_size(mine[0]['size_bytes'])}: dashed {k} rails' bound, dotted "
                       "one rail's", fontsize=9)
        bottom = [0.0] * len(mine)
        for r in range(k):
            mib = []
            for e in mine:
                rows = [w for w in data["rows"] if (w["op"], w["system"]) == (op, e["system"])]
                mib.append(statistics.fmean(w["rail_bytes_down"][r] for w in rows) / 2**20)
            right.bar(xs, mib, bottom=bottom, label=f"rail {r}")
            bottom = [b + m for b, m in zip(bottom, mib, strict=True)]
        right.set_xticks(list(xs), names, fontsize=8)
        right.set_ylabel("MiB delivered to the hosts")
        right.set_title(f"{op}: bytes per rail, per launch", fontsize=9)
        right.legend(fontsize=7)
    c = settings["cluster"]
    fig.suptitle(f"{c['hosts']} emulated hosts, {k} rails of {c['rail_bps'] / 1e6:g} Mbit/s, "
                 "a switch per rail", fontsize=10)
    return _save(fig, out)


def dgxmesh_ratios(data: dict, out: Path) -> Path:
    """An emulated-mesh run (`python -m benchmarks dgxmesh`): per op a panel,
    per member set a group of bars, one per system: time over the bound
    (S / R* for a broadcast, S over the plan's rate for an allreduce; dashed:
    the bound, dotted: 1.15 x it); error bars: p25-p75 of the calls."""
    import matplotlib.pyplot as plt

    entries = data["sets"]
    ops = list(dict.fromkeys(e["op"] for e in entries))
    groups = {op: list(dict.fromkeys(e["set"] for e in entries if e["op"] == op)) for op in ops}
    widths = [max(1.5, len(groups[op])) for op in ops]
    fig, axes = plt.subplots(1, len(ops), figsize=(1.5 * sum(widths) + 2.5 * len(ops), 4),
                             squeeze=False, gridspec_kw={"width_ratios": widths})
    for ax, op in zip(axes[0], ops, strict=True):
        mine = [e for e in entries if e["op"] == op]
        systems = list(dict.fromkeys(e["system"] for e in mine))
        width = 0.8 / len(systems)
        for k, system in enumerate(systems):
            xs, ys, lo, hi = [], [], [], []
            for j, g in enumerate(groups[op]):
                e = next((e for e in mine if (e["set"], e["system"]) == (g, system)), None)
                if e is not None:
                    xs.append(j + k * width)
                    ys.append(e["ratio_to_bound"])
                    lo.append(max(0.0, e["ratio_to_bound"] - e["p25_s"] / e["bound_s"]))
                    hi.append(max(0.0, e["p75_s"] / e["bound_s"] - e["ratio_to_bound"]))
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=system, color=f"C{k}")
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.axhline(1.15, color="black", linewidth=0.8, linestyle=":")
        ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(groups[op]))],
                      ["all" if g == "full" else g.replace(",", " ") for g in groups[op]])
        ax.set_xlabel("members (the first is the root)")
        bound = "S / R*" if op == "broadcast" else "S / the plan's rate"
        ax.set_ylabel(f"time / ({bound})  (lower is better)")
        ax.set_title(f"{op} of {_size(mine[0]['size_bytes'])}, emulated "
                     f"{data['settings']['topology']} mesh", fontsize=10)
        ax.legend(fontsize=8)
    return _save(fig, out)


def _timeline(rows: list[dict], out: Path) -> Path:
    """Each host's uplink use over the timed calls of a launch (`--timeline`),
    one panel per launch: where links idle, the schedule left time on the table."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 2.0 * len(rows) + 0.6), sharex=True,
                             squeeze=False)
    for ax, row in zip(axes[:, 0], rows, strict=True):
        series = row["link_timeline"]
        for host in range(row["hosts"]):
            ax.plot(series["t_s"], [u[host] for u in series["up"]], linewidth=0.7)
        for start, end in series["calls"]:
            ax.axvspan(start, end, color="0.92", zorder=0)
        for mark in series.get("marks", []):  # the last input ready (staggered inputs)
            ax.axvline(mark, color="black", linewidth=0.8, linestyle=":")
        use = ", ".join(f"{m:.0%}" for m in row.get("link_use_up_mean", []))
        ax.set_title(f"{row['system']}: {row['op']} {_size(row['size_bytes'])}, "
                     f"mean uplink use per call {use}", fontsize=9)
        ax.set_ylim(0, 1.1)
        ax.set_ylabel("uplink use")
    axes[-1, 0].set_xlabel(f"seconds (one line per host; shaded: timed calls; dotted: last "
                           f"input ready; "
                           f"{rows[0]['bandwidth_bps'] / 1e9:g} Gbit/s = 1)")
    return _save(fig, out)


def _bars(entries: list[dict], group, key: str, scale: float | None):
    """Grouped bars: one group per `group(entry)`, one bar per system, with the
    spread (p25-p75 of the calls) as error bars; `scale` None: ratios to the bound."""
    import matplotlib.pyplot as plt

    systems = sorted({e["system"] for e in entries}, key=lambda s: (_ORDER + (s,)).index(s))
    groups = list(dict.fromkeys(group(e) for e in sorted(entries, key=lambda e: e["size_bytes"])))
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(groups) + 3), 3.8))
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        xs, ys, lo, hi = [], [], [], []
        for j, g in enumerate(groups):
            e = next((e for e in entries if e["system"] == system and group(e) == g), None)
            if e is None:
                continue
            f = (1 / e["lower_bound_s"]) if scale is None else scale
            y = e[key] * (scale if scale is not None else 1)
            xs.append(j + i * width)
            ys.append(y)
            lo.append(max(0.0, y - e["p25_s"] * f))
            hi.append(max(0.0, e["p75_s"] * f - y))
        color = f"C{_ORDER.index(system)}" if system in _ORDER else None  # one colour per system
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=system, color=color)
    ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(groups))], groups)
    ax.legend(fontsize=8)
    return fig, ax


def _save(fig, out: Path) -> Path:
    import matplotlib.pyplot as plt

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
