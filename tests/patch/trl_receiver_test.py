#!/usr/bin/env python3
"""A TRL-style receiver, written from the layout of TRL's delta weight sync alone, loads our files.

The publisher program (tests/patch/publish_run.cpp) writes a deterministic multi-version run
with each index encoding. This receiver knows nothing of pulseloco: it reads the safetensors keys
(`{name}.idx`, `{name}.val`, full tensors in anchors), their dtypes (the gap width is the index
dtype) and TRL's `__metadata__` keys, and from every anchor it replays the deltas after it. Every
version's reconstruction must be byte-identical to the publisher's bf16 state
(`expected/step_NNNNNN.safetensors`, cast independently of the publisher).

  trl_receiver_test.py --publisher PATH --work DIR
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

VERSIONS = 12
ANCHOR_EVERY = 5


def version_of(path: Path) -> int:
    match = re.fullmatch(r"step_(\d{6,})\.safetensors", path.name)
    assert match, f"unexpected file name {path.name}"
    return int(match.group(1))


def bf16_bits(path: Path, key: str) -> np.ndarray:
    """A BF16 tensor's bit patterns (NumPy has no bfloat16; torch reads it)."""
    with safe_open(str(path), framework="pt") as f:
        tensor = f.get_tensor(key)
    assert tensor.dtype == torch.bfloat16, f"{path.name}:{key} is {tensor.dtype}, not BF16"
    return tensor.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)


def parse_metadata(meta: dict[str, str]) -> dict:
    """TRL's PatchMetadata.from_metadata_dict: its keys, its conversions."""
    return {
        "format": meta["format"],
        "version": meta["version"],
        "sparse": meta["sparse"] == "True",
        "model_version": int(meta["model_version"]),
        "num_changed_params": int(meta["num_changed_params"]),
        "total_changed_elements": int(meta["total_changed_elements"]),
        "total_elements": int(meta["total_elements"]),
        "sparsity": float(meta["sparsity"]),
        "encoding": meta["encoding"],
    }


def load_anchor(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    with safe_open(str(path), framework="pt") as f:
        meta = parse_metadata(f.metadata())
        keys = list(f.keys())
    assert meta["format"] == "sparse_weight_patch" and meta["version"] == "1"
    assert not meta["sparse"]
    state = {key: bf16_bits(path, key).copy() for key in keys}
    assert meta["total_elements"] == sum(v.size for v in state.values())
    return state, meta


def decode_idx(raw: np.ndarray, encoding: str) -> np.ndarray:
    if encoding == "raw":
        assert raw.dtype == np.int32, raw.dtype
        return raw.astype(np.int64)
    assert encoding == "gap_delta", encoding
    assert raw.dtype in (np.uint16, np.uint32), raw.dtype  # the dtype is the width
    return np.cumsum(raw.astype(np.int64) + 1) - 1


def apply_delta(state: dict[str, np.ndarray], path: Path, index_dtypes: set) -> dict:
    with safe_open(str(path), framework="np") as f:
        meta = parse_metadata(f.metadata())
        keys = list(f.keys())
        names = sorted({k[: -len(".val")] for k in keys if k.endswith(".val")})
        assert meta["sparse"] and meta["format"] == "sparse_weight_patch"
        changed = 0
        for name in names:
            raw = f.get_tensor(f"{name}.idx")
            index_dtypes.add((name, raw.dtype.name))
            idx = decode_idx(raw, meta["encoding"])
            values = bf16_bits(path, f"{name}.val")
            assert idx.shape == values.shape
            state[name][idx] = values  # patch semantics: overwrite
            changed += idx.size
    assert meta["num_changed_params"] == len(names)
    assert meta["total_changed_elements"] == changed
    assert meta["total_elements"] == sum(v.size for v in state.values())
    expected_sparsity = 1.0 - changed / meta["total_elements"]
    assert abs(meta["sparsity"] - expected_sparsity) < 1e-12
    return meta


def check_run(directory: Path, encoding: str) -> None:
    anchors = {version_of(p): p for p in (directory / "anchors").glob("*.safetensors")}
    deltas = {version_of(p): p for p in (directory / "deltas").glob("*.safetensors")}
    expected = {version_of(p): p for p in (directory / "expected").glob("*.safetensors")}
    assert sorted(expected) == list(range(1, VERSIONS + 1))
    assert sorted(deltas) == list(range(2, VERSIONS + 1))
    assert 1 in anchors and len(anchors) >= VERSIONS // ANCHOR_EVERY

    expected_state = {v: load_anchor(p)[0] for v, p in expected.items()}
    index_dtypes: set = set()
    for start, anchor_path in sorted(anchors.items()):
        state, meta = load_anchor(anchor_path)
        assert meta["model_version"] == start
        for name, bits in expected_state[start].items():
            assert np.array_equal(state[name], bits), f"anchor {start}: {name} differs"
        for version in range(start + 1, VERSIONS + 1):
            meta = apply_delta(state, deltas[version], index_dtypes)
            assert meta["model_version"] == version and meta["encoding"] == encoding
            assert state.keys() == expected_state[version].keys()
            for name, bits in expected_state[version].items():
                assert state[name].tobytes() == bits.tobytes(), (
                    f"{encoding}: from anchor {start}, version {version}: {name} differs")
        print(f"{encoding}: anchor {start} + deltas reconstruct versions {start}..{VERSIONS}")

    sparse = "lm_head.sparse.weight"
    if encoding == "raw":
        assert {dtype for _, dtype in index_dtypes} == {"int32"}, index_dtypes
    else:
        assert (sparse, "uint32") in index_dtypes, index_dtypes  # gaps above 65535
        dense = {dtype for name, dtype in index_dtypes if name != sparse}
        assert dense == {"uint16"}, index_dtypes


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--publisher", required=True)
    parser.add_argument("--work", required=True)
    args = parser.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    for encoding in ("raw", "gap_delta"):
        directory = work / encoding
        subprocess.run([args.publisher, str(directory), encoding, str(VERSIONS), str(ANCHOR_EVERY)],
                       check=True, timeout=120)
        check_run(directory, encoding)
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
