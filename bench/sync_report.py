#!/usr/bin/python3
"""Tables (Markdown, on stdout) and plot (PNG) of the end-to-end sync benchmark from the JSON
records of pulseloco_bench_sync (scripts/bench_sync_netns --json > bench/results/sync-netns-tbf.jsonl).

    bench/sync_report.py [RECORDS.jsonl] [--plot FILE] [--no-plots]

The plot (matplotlib, Debian's python3-matplotlib; default docs/sync-link-rate.png) shows the
window time of every run against the link rate, split into exchange and compute, with the
bandwidth bound of each run as a black bar.
"""
import json
import sys

COLOURS = {"pulse": ["#d62728", "#ff9896", "#8c564b"], "diloco": ["#1f77b4"], "ddp": ["#7f7f7f"]}


def human(b):
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:.0f} B"


def run_name(r):
    if r["mode"] == "pulse":
        return f"pulse, {100 * r['target_density']:.2f}% fired"
    if r["mode"] == "ddp":
        return f"ddp, H = {r['H']}"
    return r["mode"]


def main(argv):
    plot = "docs/sync-link-rate.png"
    if "--plot" in argv:
        i = argv.index("--plot")
        plot = argv[i + 1]
        del argv[i:i + 2]
    draw = "--no-plots" not in argv
    argv = [a for a in argv if a != "--no-plots"]
    path = argv[0] if argv else "bench/results/sync-netns-tbf.jsonl"
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip().startswith("{")]
    records = [r for r in records if r.get("benchmark") == "sync"]
    order = {"pulse": 0, "diloco": 1, "ddp": 2}
    records.sort(key=lambda r: (r["link_mbit"], order[r["mode"]], r["target_density"]))
    rates = sorted({r["link_mbit"] for r in records})

    print("| link | run | measured density | window (s) | exchange (s) | compute (s) "
          "| wire received | bound (s) | window / bound | exchange / bound | goodput (Mbit/s) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in records:
        window = r["window_seconds"]
        exchange = r["exchange_seconds"]
        density = f"{100 * r['density']:.3f}%" if r["mode"] == "pulse" else "dense"
        print(f"| {r['link_mbit']:g} Mbit/s | {run_name(r)} | {density} | {window:.2f} | "
              f"{exchange:.2f} | {window - exchange:.2f} | {human(r['wire_bytes_received_max'])} "
              f"| {r.get('bound_seconds', 0):.2f} | {r.get('ratio_window_to_bound', 0):.2f} | "
              f"{r.get('ratio_exchange_to_bound', 0):.2f} | {r.get('goodput_mbit', 0):.1f} |")
    print()
    print("| link | pulse run | diloco / pulse, window | diloco / pulse, exchange | "
          "ddp / pulse, window |")
    print("|---|---|---:|---:|---:|")
    for rate in rates:
        at = [r for r in records if r["link_mbit"] == rate]
        diloco = next((r for r in at if r["mode"] == "diloco"), None)
        ddp = next((r for r in at if r["mode"] == "ddp"), None)
        for p in (r for r in at if r["mode"] == "pulse"):
            cells = [
                f"{diloco['window_seconds'] / p['window_seconds']:.1f}x" if diloco else "-",
                f"{diloco['exchange_seconds'] / p['exchange_seconds']:.1f}x"
                if diloco else "-",
                f"{ddp['window_seconds'] / p['window_seconds']:.1f}x (H = {ddp['H']})"
                if ddp else "-",
            ]
            print(f"| {rate:g} Mbit/s | {run_name(p)} | " + " | ".join(cells) + " |")

    if not draw or not records:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = []
    for r in records:
        if run_name(r) not in names:
            names.append(run_name(r))
    colour = {}
    for r in records:
        used = sum(1 for n in colour if n.startswith(r["mode"]))
        colour.setdefault(run_name(r), COLOURS[r["mode"]][min(used, len(COLOURS[r["mode"]]) - 1)])
    fig, ax = plt.subplots(figsize=(9, 5.5))
    width = 0.8 / len(names)
    for i, rate in enumerate(rates):
        for k, name in enumerate(names):
            r = next((x for x in records if x["link_mbit"] == rate and run_name(x) == name), None)
            if r is None:
                continue
            x = i + (k - (len(names) - 1) / 2) * width
            exchange = r["exchange_seconds"]
            compute = max(r["window_seconds"] - exchange, 0)
            ax.bar(x, exchange, width * 0.9, color=colour[name],
                   label=f"{name}: exchange" if i == 0 else None)
            ax.bar(x, compute, width * 0.9, bottom=exchange, color=colour[name], alpha=0.35,
                   hatch="//", label=f"{name}: compute" if i == 0 else None)
            if "bound_seconds" in r:
                ax.plot([x - width * 0.45, x + width * 0.45], [r["bound_seconds"]] * 2, "k-",
                        linewidth=2.5,
                        label="bandwidth bound" if (i == 0 and k == 0) else None)
            ax.annotate(f"{r['window_seconds']:.2f} s", (x, r["window_seconds"]),
                        textcoords="offset points", xytext=(0, 3), ha="center", fontsize=7)
    ax.set_xticks(range(len(rates)))
    ax.set_xticklabels([f"{rate:g} Mbit/s links (tbf)" for rate in rates])
    ax.set_yscale("log")
    ax.set_ylabel("seconds per window (slowest rank)")
    first = records[0]
    ax.set_title(f"One sync window, {first['ranks']} ranks in network namespaces, "
                 f"{first['parameters'] / 1e6:.0f}M fp32 parameters (2-core machine)", fontsize=10)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper right", ncol=2)
    fig.tight_layout()
    fig.savefig(plot, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main(sys.argv[1:])
