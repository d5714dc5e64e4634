#!/usr/bin/python3
"""Tables (Markdown, on stdout) and a plot (PNG) of pulseloco_bench_patches's JSON records.

    bench/patches_report.py RECORDS.jsonl [--plot OUT.png]

Table 1: bytes per published version of each format, the density and the ratios to the compact
patch, one row per version. Table 2: publish, extract and apply times of each run's last
version (median [min-max] over the repeats, ms; and the model's elements per second at the
median). The plot (matplotlib, Debian's python3-matplotlib) shows each format's bytes per version
against the density, as a fraction of the anchor, and the gap_delta / compact ratio.
"""
import json
import sys

FORMATS = [("trl_raw_i32", "TRL delta, raw I32", "#1f77b4", "--"),
           ("trl_gap_delta", "TRL delta, gap_delta", "#2ca02c", "-."),
           ("compact", "compact patch (ours)", "#d62728", "-")]
MARKERS = {"example": "o", "qwen-synthetic": "s"}


def load(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def runs(records):
    """Records grouped by (source, model, lr), in file order."""
    out = {}
    for r in records:
        out.setdefault((r["source"], r["model"], r["lr"]), []).append(r)
    return out


def mb(x):
    return f"{x / 1e6:.3f}"


def sizes_table(records):
    print("| source | model | lr | version | density | anchor MB | TRL raw I32 MB | "
          "TRL gap_delta MB | compact MB | gap_delta / compact | raw / compact | "
          "anchor / compact |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in records:
        b, q = r["bytes"], r["ratio_over_compact"]
        anchor = " (+anchor)" if r["anchor_published"] else ""
        print(f"| {r['source']} | {r['model']} | {r['lr']:.0e} | {r['version']}{anchor} | "
              f"{100 * r['density']:.2f}% | {mb(b['anchor'])} | {mb(b['trl_raw_i32'])} | "
              f"{mb(b['trl_gap_delta'])} | {mb(b['compact'])} | **{q['trl_gap_delta']:.2f}x** | "
              f"{q['trl_raw_i32']:.2f}x | {q['anchor']:.1f}x |")


def cell(s):
    return (f"{1e3 * s['median']:.1f} [{1e3 * s['min']:.1f}-{1e3 * s['max']:.1f}] "
            f"({s['gelem_per_s']:.2f})")


def times_table(records):
    print("| source | model | lr | version | publish | extract | apply compact | "
          "apply TRL gap_delta | apply TRL raw I32 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for (source, model, lr), rows in runs(records).items():
        r = rows[-1]
        s = r["seconds"]
        anchor = " (+anchor)" if r["anchor_published"] else ""
        print(f"| {source} | {model} | {lr:.0e} | {r['version']}{anchor} | {cell(s['publish'])} | "
              f"{cell(s['extract'])} | {cell(s['apply_compact'])} | "
              f"{cell(s['apply_trl_gap_delta'])} | {cell(s['apply_trl_raw_i32'])} |")


def plot(records, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    for key, label, colour, style in FORMATS:
        for source, marker in MARKERS.items():
            rows = sorted((r for r in records if r["source"] == source), key=lambda r: r["density"])
            if not rows:
                continue
            left.plot([r["density"] for r in rows],
                      [r["bytes"][key] / r["bytes"]["anchor"] for r in rows], style,
                      marker=marker, color=colour, label=f"{label}, {source}", linewidth=1.5,
                      markersize=5)
    left.axhline(1.0, color="black", linewidth=1, label="anchor (every element, bf16)")
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("density (changed bf16 elements / all)")
    left.set_ylabel("bytes per version / anchor bytes")
    left.set_title("Bytes per published version", fontsize=10)
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=7, loc="lower right")
    for (source, model, lr), rows in runs(records).items():
        right.plot([r["density"] for r in rows],
                   [r["ratio_over_compact"]["trl_gap_delta"] for r in rows],
                   marker=MARKERS.get(source, "o"), linewidth=1, label=f"{model}, lr {lr:.0e}")
    right.axhline(2.5, color="black", linestyle=":", linewidth=1, label="2.5x")
    right.set_xscale("log")
    right.set_xlabel("density (changed bf16 elements / all)")
    right.set_ylabel("TRL gap_delta bytes / compact bytes")
    right.set_title("How much smaller the compact patch is", fontsize=10)
    right.grid(True, which="both", alpha=0.3)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv):
    if not argv or argv[0].startswith("-"):
        sys.exit(__doc__)
    records = [r for r in load(argv[0]) if r.get("benchmark") == "patches"]
    if not records:
        sys.exit(f"{argv[0]}: no pulseloco_bench_patches records")
    sizes_table(records)
    print()
    times_table(records)
    if "--plot" in argv:
        plot(records, argv[argv.index("--plot") + 1])


if __name__ == "__main__":
    main(sys.argv[1:])
