#!/usr/bin/env python3
"""Plots held-out loss per window of two or more pulseloco_train --json runs as an SVG (no
plotting library needed) and prints the table behind it.

    bench/plot_loss_parity.py [--bf16-weights] PULSE.json DILOCO.json [MORE.json ...] OUT.svg

--bf16-weights plots the held-out loss of the weights rounded to bf16 (what a bf16-compute
model sees) instead of the fp32 weights.

Losses are placed by the outer steps applied: with overlapped windows (pulseloco_train
--overlap delayed|eager) a boundary applies the window before it, the first applies none, and
the last window is applied after the loop (the run's `final_loss`; fp32 weights only).
"""
import json
import sys

COLOURS = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd"]


def label(run):
    overlap = run.get("overlap", "blocking")
    return run["mode"] if overlap == "blocking" else f"{run['mode']} {overlap}"


def main(argv):
    bf16 = "--bf16-weights" in argv
    argv = [a for a in argv if a != "--bf16-weights"]
    if len(argv) < 3:
        sys.exit(__doc__)
    *paths, out = argv
    initial_key, key = (("initial_loss_bf16_weights", "loss_bf16_weights") if bf16
                        else ("initial_loss", "loss"))
    runs = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            run = json.load(f)
        applied = [w for w in run["windows"] if w.get("applied_window", w["window"]) is not None]
        losses = [run[initial_key]] + [w[key] for w in applied]
        if run.get("windows_applied", len(applied)) > len(applied) and not bf16:
            losses.append(run["final_loss"])  # the window completed after the last boundary
        runs.append((run, losses))

    # Table: loss after each window, and the relative difference of each run to the last one.
    reference = runs[-1][1]
    header = ["window"] + [label(r) for r, _ in runs] + [
        f"{label(r)} vs {label(runs[-1][0])}" for r, _ in runs[:-1]]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    length = min(len(l) for _, l in runs)
    for i in range(length):
        row = ["start" if i == 0 else str(i - 1)] + [f"{l[i]:.5f}" for _, l in runs]
        row += [f"{(l[i] - reference[i]) / reference[i] * 100:+.3f}%" for _, l in runs[:-1]]
        print("| " + " | ".join(row) + " |")

    # SVG line chart.
    width, height, left, right, top, bottom = 720, 420, 70, 20, 40, 50
    lo = min(min(l) for _, l in runs)
    hi = max(max(l) for _, l in runs)
    pad = (hi - lo) * 0.05 or 0.01
    lo, hi = lo - pad, hi + pad
    n = max(len(l) for _, l in runs) - 1

    def x(i):
        return left + (width - left - right) * (i / max(n, 1))

    def y(v):
        return top + (height - top - bottom) * (1 - (v - lo) / (hi - lo))

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="12">',
             f'<rect width="{width}" height="{height}" fill="white"/>']
    first = runs[0][0]
    parts.append(f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="14">'
                 f'Held-out loss{" (weights rounded to bf16)" if bf16 else ""}: '
                 f'{first["world_size"]} workers, H = {first["H"]}, '
                 f'inner lr {first["lr"]:g}, seed {first["seed"]}</text>')
    for k in range(6):  # y grid and labels
        v = lo + (hi - lo) * k / 5
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
                     'stroke="#ddd"/>')
        parts.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.4f}</text>')
    step = max(1, n // 10)
    for i in range(0, n + 1, step):  # x labels: 0 = before post-training, i = after window i-1
        parts.append(f'<text x="{x(i):.1f}" y="{height - bottom + 18}" text-anchor="middle">'
                     f'{i}</text>')
    parts.append(f'<text x="{width / 2}" y="{height - 10}" text-anchor="middle">'
                 'windows applied</text>')
    parts.append(f'<line x1="{left}" x2="{left}" y1="{top}" y2="{height - bottom}" stroke="black"/>')
    parts.append(f'<line x1="{left}" x2="{width - right}" y1="{height - bottom}" '
                 f'y2="{height - bottom}" stroke="black"/>')
    for k, (run, losses) in enumerate(runs):
        colour = COLOURS[k % len(COLOURS)]
        points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(losses))
        dash = ' stroke-dasharray="6,4"' if k > 0 else ""
        parts.append(f'<polyline points="{points}" fill="none" stroke="{colour}" '
                     f'stroke-width="2"{dash}/>')
        parts.append(f'<text x="{width - right - 210}" y="{top + 20 + 18 * k}" fill="{colour}">'
                     f'{label(run)} (final {losses[-1]:.5f})</text>')
    parts.append("</svg>")
    with open(out, "w", encoding="utf-8") as f:
        f.write("\n".join(parts) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
