#!/usr/bin/env python3
"""Checks that a bf16 state a patch receiver wrote (an anchor file: `pulseloco patch apply` or
`pulseloco patch subscribe --out`) is bf16 of a run's final fp32 weights (`pulseloco_train
--final-weights`), tensor by tensor, rounded to nearest even. Exits 1 naming the first tensor
that differs.

  compare_bf16_state.py STATE.safetensors FINAL.safetensors

Needs NumPy (the repository's .venv has it).
"""
import json
import sys

import numpy as np


def tensors(path):
    """{name: (dtype, shape, bytes)} of a safetensors file (BF16 included)."""
    data = open(path, "rb").read()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    body = data[8 + size:]
    return {name: (entry["dtype"], entry["shape"],
                   body[entry["data_offsets"][0]:entry["data_offsets"][1]])
            for name, entry in header.items() if name != "__metadata__"}, header


def bf16_of_f32(raw):
    bits = np.frombuffer(raw, dtype="<u4").astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2").tobytes()


def compare(state_path, final_path):
    """None when they match, else what differs."""
    state, header = tensors(state_path)
    # θ_g's names in a --final-weights file carry the prefix "global.".
    final = {name.removeprefix("global."): tensor
             for name, tensor in tensors(final_path)[0].items()}
    if set(state) != set(final):
        return f"tensors differ: {sorted(set(state) ^ set(final))[:5]}"
    for name, (dtype, shape, raw) in final.items():
        if dtype != "F32":
            return f"{name}: the final weights are {dtype}, expected F32"
        got = state[name]
        if got[0] != "BF16" or got[1] != shape or got[2] != bf16_of_f32(raw):
            return f"{name}: the state is not bf16 of the final weights"
    return None


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    problem = compare(sys.argv[1], sys.argv[2])
    if problem:
        print(f"{sys.argv[1]} does not match {sys.argv[2]}: {problem}", file=sys.stderr)
        return 1
    version = tensors(sys.argv[1])[1].get("__metadata__", {}).get("model_version", "?")
    print(f"{sys.argv[1]} (version {version}) is bf16 of {sys.argv[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
