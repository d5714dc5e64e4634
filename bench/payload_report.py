#!/usr/bin/python3
"""Tables (Markdown, on stdout) and plots (PNG) of the payload study from the JSON records of
pulseloco_bench_payload (scripts/bench_payload writes bench/results/payload.jsonl).

    bench/payload_report.py [RECORDS.jsonl] [--plots DIR] [--no-plots]

Plots (matplotlib, Debian's python3-matplotlib): DIR/payload-model-size.png (payload per worker
per window against model size, the five formats) and DIR/payload-lr-H.png (payload against the
inner learning rate and H, on the real traces and on the Qwen2.5-0.5B generator). DIR defaults
to docs/.
"""
import json
import os
import sys

FORMATS = [  # (key in "bytes", label, colour, style)
    ("ddp", "DDP (H x 4 B x params)", "#7f7f7f", ":"),
    ("diloco", "DiLoCo (4 B x params)", "#1f77b4", "--"),
    ("authors_12B", "PULSELoCo, authors' format (12 B/entry)", "#ff7f0e", "-."),
    ("int32_fp32", "PULSELoCo, int32 + fp32 (8 B/entry)", "#9467bd", "-."),
    ("ours", "PULSELoCo, ours (measured codec)", "#d62728", "-"),
]


def human(b):
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:.0f} B"


def load(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def last_windows(records, source):
    """The last window of every (model, lr, H, signal) run of one source."""
    runs = {}
    for r in records:
        if r["source"] != source:
            continue
        key = (r["model"], r["lr"], r["H"], r.get("generator", {}).get("signal"))
        if key not in runs or r["window"] > runs[key]["window"]:
            runs[key] = r
    return sorted(runs.values(), key=lambda r: (r["parameters"], r["lr"], r["H"]))


def table(rows, title):
    print(f"\n### {title}\n")
    print("| model | params | lr | H | window | density | DDP | DiLoCo | 12 B/entry (authors) "
          "| 8 B/entry | **ours** | ours B/entry | 12 B / ours | DiLoCo / ours |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        b = r["bytes"]
        print(f"| {r['model']} | {r['parameters'] / 1e9:.3f}B | {r['lr']:g} | {r['H']} | "
              f"{r['window']} | {100 * r['density']:.3f}% | {human(b['ddp'])} | "
              f"{human(b['diloco'])} | {human(b['authors_12B'])} | {human(b['int32_fp32'])} | "
              f"**{human(b['ours'])}** | {r['bytes_per_entry']['ours']:.3f} | "
              f"{r['ratio']['authors_over_ours']:.2f}x | {r['ratio']['diloco_over_ours']:.1f}x |")


def plot_model_size(records, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = last_windows(records, "qwen-synthetic")
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(8, 5.2))
    x = [r["parameters"] for r in rows]
    for key, label, colour, style in FORMATS:
        y = [r["bytes"][key] for r in rows]
        ax.plot(x, y, style, marker="o", color=colour, label=label, linewidth=2)
    for r in rows:
        ax.annotate(f"{r['model'].replace('Qwen2.5-', '')}\n{100 * r['density']:.2f}% fired\n"
                    f"{r['bytes_per_entry']['ours']:.2f} B/entry",
                    (r["parameters"], r["bytes"]["ours"]), textcoords="offset points",
                    xytext=(0, -38), ha="center", fontsize=8, color="#d62728")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters (Qwen2.5 shapes, layer by layer)")
    ax.set_ylabel("payload per worker per window (bytes)")
    g = rows[0].get("generator", {})
    ax.set_title(f"Payload against model size (synthetic AdamW generator, lr {rows[0]['lr']:g}, "
                 f"H = {rows[0]['H']}, signal {g.get('signal', 0):.2g})", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_ylim(bottom=min(r["bytes"]["ours"] for r in rows) / 5)
    ax.margins(x=0.1)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_lr_h(records, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [("trace", "training example (5.0M params), real traces, 2 workers"),
              ("qwen-sweep", "Qwen2.5-0.5B shapes, synthetic generator, 1 worker")]
    panels = [(s, t) for s, t in panels if last_windows(records, s)]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 5), squeeze=False)
    colours = {1: "#2ca02c", 8: "#d62728", 32: "#9467bd"}
    for ax, (source, title) in zip(axes[0], panels):
        rows = last_windows(records, source)
        for H in sorted({r["H"] for r in rows}):
            sel = sorted((r for r in rows if r["H"] == H), key=lambda r: r["lr"])
            lrs = [r["lr"] for r in sel]
            ax.plot(lrs, [r["bytes"]["ours"] for r in sel], "-o", color=colours.get(H),
                    label=f"ours, H = {H}", linewidth=2)
            ax.plot(lrs, [r["bytes"]["authors_12B"] for r in sel], "-.", marker="^",
                    color=colours.get(H), alpha=0.6, label=f"authors' 12 B/entry, H = {H}")
            for r in sel:
                ax.annotate(f"{100 * r['density']:.1f}%", (r["lr"], r["bytes"]["ours"]),
                            textcoords="offset points", xytext=(4, -12), fontsize=7,
                            color=colours.get(H))
        diloco = rows[0]["bytes"]["diloco"]
        ax.axhline(diloco, color="#1f77b4", linestyle="--", label="DiLoCo (4 B x params)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylim(bottom=min(r["bytes"]["ours"] for r in rows) / 8)
        ax.margins(x=0.08)
        ax.set_xlabel("inner AdamW learning rate")
        ax.set_ylabel("payload per worker per window (bytes)")
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("Payload against learning rate and H (labels: fraction of elements sent)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv):
    plots = "docs"
    if "--plots" in argv:
        i = argv.index("--plots")
        plots = argv[i + 1]
        del argv[i:i + 2]
    draw = "--no-plots" not in argv
    argv = [a for a in argv if a != "--no-plots"]
    path = argv[0] if argv else "bench/results/payload.jsonl"
    records = load(path)
    titles = {"trace": "Real traces: the training example, last traced window, mean of 2 workers",
              "qwen-synthetic": "Qwen2.5 shapes, synthetic generator (defaults)",
              "qwen-sweep": "Qwen2.5-0.5B, generator over lr and H",
              "qwen-signal": "Qwen2.5-0.5B, generator at other gradient signal weights",
              "qwen-windows": "Qwen2.5-0.5B, generator over 4 windows (residual carried)"}
    for source, title in titles.items():
        if source == "qwen-windows":
            rows = sorted((r for r in records if r["source"] == source), key=lambda r: r["window"])
        else:
            rows = last_windows(records, source)
        if rows:
            table(rows, title)
    ratios = [rank["ratio_authors_over_ours"] for r in records for rank in r["ranks"]
              if rank["entries"] > 0]
    if ratios:
        print(f"\nours vs the authors' 12-byte format, every message: {min(ratios):.2f}x to "
              f"{max(ratios):.2f}x smaller ({len(ratios)} messages)")
    if draw:
        os.makedirs(plots, exist_ok=True)
        plot_model_size(records, os.path.join(plots, "payload-model-size.png"))
        plot_lr_h(records, os.path.join(plots, "payload-lr-H.png"))


if __name__ == "__main__":
    main(sys.argv[1:])
