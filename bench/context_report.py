#!/usr/bin/env python3
"""Tables of docs/benchmarks.md, "Context-coded messages", from the records of
scripts/bench_payload --context (bench/results/context-sizes.jsonl) and of
pulseloco_bench_context --parameters (bench/results/context-speed.jsonl).

    bench/context_report.py bench/results/context-sizes.jsonl bench/results/context-speed.jsonl
"""
import json
import sys


def records(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def generator_table(rows):
    by_config = {}
    for r in rows:
        if r.get("benchmark") != "payload":
            continue
        by_config.setdefault((r["lr"], r["H"]), {})[r["encoding"]] = r
    print("| lr | H | density | pulse B/entry (index + value) | context B/entry (index + value) "
          "| pulse / context | floor: H index given θ_g exponent + H value (context model) "
          "| H value (order-0 model) | H value (boundary model) |")
    print("|---:|---:|---:|---|---|---:|---|---:|---:|")
    for (lr, h), pair in sorted(by_config.items(), key=lambda kv: kv[1]["pulse"]["density"]):
        p, c = pair["pulse"], pair["context"]
        pb, cb = p["bytes_per_entry"], c["bytes_per_entry"]
        e = c.get("entropy_bytes_per_entry")
        floor = (f"{e['index_given_exponent']:.3f} + {e['value_context_model']:.3f} = "
                 f"{e['index_given_exponent'] + e['value_context_model']:.3f}") if e else "-"
        boundary = f"{e['value_boundary_model']:.3f}" if e else "-"
        order0 = f"{e['value_order0_model']:.3f}" if e else "-"
        print(f"| {lr:.0e} | {h} | {100 * p['density']:.3f}% | {pb['ours']:.3f} "
              f"({pb['ours_index']:.3f} + {pb['ours_values']:.3f}) | **{cb['ours']:.3f}** "
              f"({cb['ours_index']:.3f} + {cb['ours_values']:.3f}) | {pb['ours'] / cb['ours']:.3f} "
              f"| {floor} | {order0} | {boundary} |")


def table(rows, benchmark, header, align, cells):
    """A markdown table of the records of `benchmark`, one row of cells(record) each."""
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join(align) + "|")
    for r in rows:
        if r.get("benchmark") == benchmark:
            print("| " + " | ".join(cells(r)) + " |")


def trace_cells(r):
    p, c, h = r["pulse"], r["context"], r["entropy_bytes_per_entry"]
    return [r["label"], str(r["window"]), str(r["rank"]), f"{100 * r['density']:.3f}%",
            f"{p['index_bytes_per_entry']:.3f} + {p['value_bytes_per_entry']:.3f} = "
            f"{p['bytes_per_entry']:.3f}",
            f"{c['index_bytes_per_entry']:.3f} + {c['value_bytes_per_entry']:.3f} = "
            f"**{c['bytes_per_entry']:.3f}**",
            f"{r['ratio_pulse_over_context']:.3f}",
            f"{h['index_positions']:.3f} / {h['index_given_exponent']:.3f}",
            f"{h['value_context_model']:.3f}", f"{h['value_order0_model']:.3f}",
            f"{h['value_boundary_model']:.3f}"]


def speed_cells(r):
    p, c = r["pulse"], r["context"]
    pt, ct = p["encode_s"] + p["decode_s"], c["encode_s"] + c["decode_s"]
    return [r.get("locals", "fp32"), f"{r['parameters']:.0e}", str(r["threads"]),
            f"{100 * r['density']:.2f}%",
            f"{r['gate_s']:.4f}", f"{r['apply_s']:.4f}",
            f"{p['bytes_per_entry']:.3f}", f"{p['encode_s']:.4f} + {p['decode_s']:.4f}",
            f"{100 * p['codec_over_compute']:.1f}%", f"{c['bytes_per_entry']:.3f}",
            f"{c['encode_s']:.4f} + {c['decode_s']:.4f}",
            f"**{100 * c['codec_over_compute']:.1f}%**", f"{ct / pt:.2f}x",
            f"{100 * r['theta_read_over_compute']:.1f}%",
            f"{100 * (p['codec_over_compute'] + r['theta_read_over_compute']):.1f}%",
            break_even(r)]


def break_even(r):
    """The link speed below which the context encoding's smaller message saves more transfer time
    than its encode + decode costs beyond pulse's (per message, Mbit/s)."""
    p, c = r["pulse"], r["context"]
    saved_bits = 8 * (p["bytes_per_entry"] - c["bytes_per_entry"]) * r["entries"]
    extra_s = (c["encode_s"] + c["decode_s"]) - (p["encode_s"] + p["decode_s"])
    if saved_bits <= 0:
        return "never"
    return f"{saved_bits / extra_s / 1e6:.0f}" if extra_s > 0 else "always"


def trace_table(rows):
    table(rows, "context-trace",
          ["locals", "window", "rank", "density", "pulse: index + value = B/entry",
           "context: index + value = B/entry", "pulse / context",
           "H index: positions / given θ_g exponent", "H value (context model)",
           "H value (order-0 model)", "H value (boundary model)"],
          ["---", "---:", "---:", "---:", "---", "---", "---:", "---", "---:", "---:", "---:"],
          trace_cells)


def speed_table(rows):
    table(rows, "context-speed",
          ["locals", "parameters", "threads", "density", "gate s", "apply s", "pulse B/entry",
           "pulse: encode + decode s", "pulse / (gate + apply)", "context B/entry",
           "context: encode + decode s", "context / (gate + apply)", "context / pulse time",
           "one read of θ_g / (gate + apply)", "floor: pulse + one read of θ_g",
           "context pays below, Mbit/s"],
          ["---", "---:", "---:", "---:", "---:", "---:", "---:", "---", "---:", "---:", "---",
           "---:", "---:", "---:", "---:", "---:"],
          speed_cells)


def main():
    for path in sys.argv[1:]:
        rows = records(path)
        if any(r.get("benchmark") == "payload" for r in rows):
            generator_table(rows)
            print()
        if any(r.get("benchmark") == "context-trace" for r in rows):
            trace_table(rows)
            print()
        if any(r.get("benchmark") == "context-speed" for r in rows):
            speed_table(rows)
            print()


if __name__ == "__main__":
    main()
