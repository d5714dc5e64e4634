#!/usr/bin/env python3
"""Side-by-side table of pulseloco_train runs (the --json files of rank 0).

    scripts/compare_runs.py build/demo/pulse.json build/demo/diloco.json build/demo/ddp.json

Payload is what one worker contributes per window (its encoded message for pulse, the dense
fp32 tensor for diloco, H dense fp32 gradients for ddp). Losses are held-out losses of the
synchronised model; "loss @ window k" compares the runs at the last window they all reached.
"""
import json
import sys


def human(nbytes):
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def main(paths):
    runs = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            runs.append(json.load(f))
    if not runs:
        sys.exit("usage: compare_runs.py RUN.json [RUN.json ...]")
    common = min(len(r["windows"]) for r in runs)
    if common == 0:
        sys.exit("a run has no windows")
    reference = next((r for r in runs if r["mode"] == "pulse"), runs[0])
    ref_payload = sum(w["payload_bytes"] for w in reference["windows"]) / len(reference["windows"])

    print(f"model: {runs[0]['params']:,} parameters, {runs[0]['world_size']} workers, "
          f"H = {runs[0]['H']}")
    header = (f"{'mode':<8}{'windows':>8}{'payload/window/worker':>23}{'x pulse':>9}"
              f"{'density':>9}{'sync s/window':>15}{f'loss @ window {common - 1}':>19}"
              f"{'final loss':>12}  replicas")
    print(header)
    print("-" * len(header))
    for run in runs:
        windows = run["windows"]
        payload = sum(w["payload_bytes"] for w in windows) / len(windows)
        density = sum(w["density"] for w in windows) / len(windows)
        sync = sum(w["sync_seconds"] for w in windows) / len(windows)
        print(f"{run['mode']:<8}{len(windows):>8}{human(payload):>23}{payload / ref_payload:>8.1f}x"
              f"{100 * density:>8.2f}%{sync:>15.3f}{windows[common - 1]['loss']:>19.5f}"
              f"{run['final_loss']:>12.5f}  "
              f"{'identical' if run['replicas_identical'] else 'DIFFERED'}")
    pulse = reference["windows"]
    diloco_bytes = pulse[0]["diloco_bytes"]
    ddp_bytes = pulse[0]["ddp_bytes"]
    print(f"\nper window and worker, DiLoCo sends {human(diloco_bytes)} (4 B x parameters) and DDP "
          f"{human(ddp_bytes)} (H x 4 B x parameters); PULSELoCo sent {human(ref_payload)} on "
          f"average: {diloco_bytes / ref_payload:.1f}x less than DiLoCo, "
          f"{ddp_bytes / ref_payload:.1f}x less than DDP.")


if __name__ == "__main__":
    main(sys.argv[1:])
