#!/usr/bin/env python3
"""The table and JSON summary of scripts/gpu_check.

    gpu_check_summary.py OUT_DIR SECONDS

Reads what scripts/gpu_check left in OUT_DIR (steps.tsv, ctest-gpu.xml, ctest-gpu-tests.json,
bench_kernels_cuda.jsonl, bench_sync.jsonl, train_hf_*.jsonl), prints one table and writes
OUT_DIR/gpu_check.json. Exits 1 when a step or a test failed, or when train_hf.py's two
processes held different digests after a window.
"""
import json
import os
import sys
import xml.etree.ElementTree as ET


def read_steps(out):
    steps = []
    path = os.path.join(out, "steps.tsv")
    if os.path.exists(path):
        for line in open(path):
            name, status, seconds, note = (line.rstrip("\n").split("\t") + [""] * 4)[:4]
            steps.append({"step": name, "status": status, "seconds": int(seconds or 0),
                          "note": note})
    return steps


def test_groups(out):
    """Tests by group (their labels other than gpu): passed, failed, skipped and the names."""
    labels = {}
    try:
        for test in json.load(open(os.path.join(out, "ctest-gpu-tests.json"))).get("tests", []):
            for prop in test.get("properties", []):
                if prop.get("name") == "LABELS":
                    labels[test["name"]] = [v for v in prop["value"] if v != "gpu"]
    except (OSError, ValueError):
        pass
    groups = {}
    try:
        cases = ET.parse(os.path.join(out, "ctest-gpu.xml")).getroot().iter("testcase")
    except (OSError, ET.ParseError):
        cases = []
    for case in cases:
        name = case.get("name", "")
        group = "/".join(labels.get(name, [])) or "other"
        entry = groups.setdefault(group, {"passed": 0, "failed": 0, "skipped": 0,
                                          "failed_tests": [], "skip_reasons": set()})
        skipped = case.find("skipped")
        if case.find("failure") is not None or case.get("status") == "fail":
            entry["failed"] += 1
            entry["failed_tests"].append(name)
        elif skipped is not None or case.get("status") in ("notrun", "disabled"):
            entry["skipped"] += 1
            output = "".join(case.itertext())
            if "no CUDA device" in output:
                entry["skip_reasons"].add("no CUDA device")
        else:
            entry["passed"] += 1
    for entry in groups.values():
        entry["skip_reasons"] = sorted(entry["skip_reasons"])
    return groups


def bench_records(out, name="bench_kernels_cuda.jsonl"):
    records = []
    path = os.path.join(out, name)
    if os.path.exists(path):
        for line in open(path):
            try:
                records.append(json.loads(line))
            except ValueError:
                pass
    return records


def train_hf_runs(out):
    """examples/python/train_hf.py --json under the launcher ("[rank R] {...}" lines), per
    overlap setting: its windows, whether both ranks had one digest at every report, and the
    payload per worker against DiLoCo's."""
    runs = {}
    for overlap in ("blocking", "eager"):
        path = os.path.join(out, f"train_hf_{overlap}.jsonl")
        if not os.path.exists(path):
            continue
        by_rank = {}
        for line in open(path):
            prefix, _, rest = line.partition("] ")
            try:
                report = json.loads(rest)
            except ValueError:
                continue
            by_rank.setdefault(prefix, []).append(report)
        reports = list(by_rank.values())
        identical = len(reports) == 2 and len(reports[0]) == len(reports[1]) and all(
            a["digest"] == b["digest"] for a, b in zip(*reports))
        first = reports[0] if reports else []
        sent = [r for r in first if r["loss"] is not None]  # not complete_in_flight's report
        payload = sum(r["payload_bytes"] for r in sent)
        diloco = sum(r["diloco_bytes"] for r in sent)
        runs[overlap] = {"reports": len(first), "identical": identical,
                         "density": [r["density"] for r in first], "payload_bytes": payload,
                         "diloco_bytes": diloco,
                         "state_location": first[0]["state_location"] if first else None}
    return runs


def main():
    out, seconds = sys.argv[1], int(sys.argv[2])
    steps = read_steps(out)
    groups = test_groups(out)
    records = bench_records(out)
    lines = [f"GPU check ({seconds} s)", ""]
    lines.append(f"{'step':<24} {'status':<8} {'s':>5}  note")
    for s in steps:
        lines.append(f"{s['step']:<24} {s['status']:<8} {s['seconds']:>5}  {s['note']}")
    lines += ["", f"{'tests (label)':<24} {'passed':>6} {'failed':>6} {'skipped':>7}"]
    for group, g in sorted(groups.items()):
        why = f"  ({', '.join(g['skip_reasons'])})" if g["skip_reasons"] else ""
        lines.append(f"{group:<24} {g['passed']:>6} {g['failed']:>6} {g['skipped']:>7}{why}")
        for name in g["failed_tests"]:
            lines.append(f"  FAILED {name}")
    if not groups:
        lines.append("(no test results)")
    lines.append("")
    skipped = [r for r in records if r.get("record") == "skipped"]
    copy = next((r for r in records if r.get("record") == "copy"), None)
    if skipped:
        lines.append(f"benchmarks: skipped ({skipped[0].get('reason')})")
    elif copy:
        device = next((r for r in records if r.get("record") == "device"), {})
        lines.append(f"{device.get('device', '?')}, {device.get('elements', 0):.3g} parameters; "
                     f"device copy {copy['gbps']:.0f} GB/s (read + write)")
        lines.append(f"{'phase':<36} {'ms':>8} {'GB/s':>8} {'of copy':>8} {'x bound':>8}")
        for r in records:
            if r.get("record") != "phase" or r["mode"] != "device" or r["phase"] not in (
                    "gate", "apply", "window", "window_without_digests"):
                continue
            lines.append(f"{r['mode'] + ' ' + r['local_dtype'] + ' ' + r['phase']:<36} "
                         f"{1e3 * r['seconds']:>8.2f} {r.get('gbps', 0):>8.0f} "
                         f"{100 * r.get('of_copy', 0):>7.0f}% {r.get('x_bound', 0):>7.2f}x")
        for r in records:
            if r.get("record") == "phase" and r["mode"] == "host" and r["phase"] == "window":
                lines.append(f"{'host ' + r['local_dtype'] + ' window (staging)':<36} "
                             f"{1e3 * r['seconds']:>8.2f}")
        for r in records:
            if r.get("record") == "check":
                verdict = "MET" if r["pass"] else "NOT MET"
                lines.append(f"check {r['local_dtype']} {r['name']}: {r['value']:.2f} "
                             f"(target {r['target']}): {verdict}")
            elif r.get("record") == "compare":
                lines.append(f"{r['local_dtype']}: host window / device window "
                             f"{r['host_over_device_window']:.1f}x; digests "
                             f"{'identical' if r['identical'] else 'DIFFER'}")
    else:
        lines.append("benchmarks: no results")
    sync = bench_records(out, "bench_sync.jsonl")
    for r in sync:  # pulseloco_bench_sync, rank 0: two ranks sharing the GPU over loopback TCP
        phases = r.get("phase_seconds_max", {})
        lines.append(f"engine window, 2 ranks, {r.get('setup', r.get('label', '?'))}: "
                     f"{r.get('window_seconds', 0):.3f} s (gate {phases.get('gate', 0):.3f} s, "
                     f"exchange {r.get('exchange_seconds', 0):.3f} s, apply "
                     f"{phases.get('apply', 0):.3f} s); density {r.get('density', 0):.2%}; "
                     f"replicas {'identical' if r.get('replicas_identical') else 'DIFFER'}")
    hf = train_hf_runs(out)
    for overlap, run in hf.items():
        densities = ", ".join(f"{d:.2%}" for d in run["density"])
        lines.append(f"train_hf.py, 2 processes, {overlap}, state on {run['state_location']}: "
                     f"{run['reports']} reports, digests "
                     f"{'identical' if run['identical'] else 'DIFFER'}; density {densities}; "
                     f"payload per worker {run['payload_bytes']} B (DiLoCo "
                     f"{run['diloco_bytes'] / max(run['payload_bytes'], 1):.1f}x)")
    print("\n".join(lines))
    failed = any(s["status"] == "failed" for s in steps) or any(
        g["failed"] for g in groups.values()) or any(not r["identical"] for r in hf.values()) or any(
        not r.get("replicas_identical", False) for r in sync)
    summary = {"seconds": seconds, "failed": failed, "steps": steps, "tests": groups,
               "benchmarks": records, "sync": sync, "train_hf": hf}
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
