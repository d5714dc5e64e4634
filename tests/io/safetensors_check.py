#!/usr/bin/env python3
"""Checks safetensors files with the standard `safetensors` package (PyPI), and writes a sample.

Used by the C++ tests to prove that files pulseloco writes open in the reference implementation,
and that files the reference writes open in pulseloco.

  safetensors_check.py check FILE EXPECTATION.json
      Opens FILE with safetensors.safe_open, safetensors.numpy.load_file and
      safetensors.deserialize, and compares it with the expectation:
        {
          "metadata": {"key": "value", ...},      # optional; exact match ({} = no metadata)
          "exact": true,                           # optional (default true): no other tensors
          "tensors": {
            "name": {
              "dtype": "F32", "shape": [2, 3],
              "sha256": "<hex of the raw little-endian bytes>",   # optional
              "values": [1.0, 2.0, ...]             # optional, flattened; BF16 as uint16 bits
            }, ...
          }
        }
      BF16 has no numpy dtype: its bytes come from safetensors.deserialize and are compared as
      a numpy uint16 view. Exit status 0 when everything matches; 1 with one line per mismatch.

  safetensors_check.py write FILE EXPECTATION.json
      Writes a sample file with safetensors.numpy.save_file (several dtypes, a scalar, an empty
      tensor, metadata) and the expectation describing it, for a reader under test to verify.
"""

import hashlib
import json
import sys

import numpy as np
import safetensors
import safetensors.numpy
from safetensors import safe_open

# safetensors dtype name -> numpy dtype (BF16 and F8 have none).
NUMPY_DTYPES = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "I16": np.int16, "U16": np.uint16,
    "F16": np.float16, "I32": np.int32, "U32": np.uint32, "F32": np.float32,
    "F64": np.float64, "I64": np.int64, "U64": np.uint64,
}
# How to view raw bytes of a dtype without a numpy equivalent.
RAW_VIEWS = {"BF16": np.uint16, "F8_E4M3": np.uint8, "F8_E5M2": np.uint8}


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check(path: str, expectation_path: str) -> int:
    with open(expectation_path, encoding="utf-8") as f:
        expected = json.load(f)
    expected_tensors = expected["tensors"]
    errors = []

    def error(message):
        errors.append(message)

    # 1. The lazy reader: names, metadata, dtypes, shapes.
    with safe_open(path, framework="np") as f:
        names = set(f.keys())
        if expected.get("exact", True) and names != set(expected_tensors):
            error(f"tensor names {sorted(names)} != expected {sorted(expected_tensors)}")
        if "metadata" in expected:
            metadata = f.metadata() or {}
            if metadata != expected["metadata"]:
                error(f"metadata {metadata} != expected {expected['metadata']}")
        for name, want in expected_tensors.items():
            if name not in names:
                error(f"{name}: missing")
                continue
            tensor_slice = f.get_slice(name)
            if tensor_slice.get_dtype() != want["dtype"]:
                error(f"{name}: dtype {tensor_slice.get_dtype()} != {want['dtype']}")
            if list(tensor_slice.get_shape()) != list(want["shape"]):
                error(f"{name}: shape {tensor_slice.get_shape()} != {want['shape']}")
            if want["dtype"] in NUMPY_DTYPES:
                array = f.get_tensor(name)
                check_array(name, array, want, error)

    # 2. The eager numpy loader, when every dtype has a numpy equivalent.
    if all(t["dtype"] in NUMPY_DTYPES for t in expected_tensors.values()):
        loaded = safetensors.numpy.load_file(path)
        for name, want in expected_tensors.items():
            if name in loaded:
                check_array(name, loaded[name], want, error)

    # 3. The raw deserializer: exact bytes of every tensor, BF16 included.
    with open(path, "rb") as f:
        raw = dict(safetensors.deserialize(f.read()))
    for name, want in expected_tensors.items():
        if name not in raw:
            continue
        entry = raw[name]
        if entry["dtype"].upper() != want["dtype"]:
            error(f"{name}: deserialize dtype {entry['dtype']} != {want['dtype']}")
        data = bytes(entry["data"])
        if "sha256" in want and sha256_hex(data) != want["sha256"]:
            error(f"{name}: sha256 of the bytes {sha256_hex(data)} != {want['sha256']}")
        if want["dtype"] in RAW_VIEWS:
            view = np.frombuffer(data, dtype=np.dtype(RAW_VIEWS[want["dtype"]]).newbyteorder("<"))
            view = view.reshape(want["shape"])
            check_values(name, view, want, error)

    for message in errors:
        print(f"safetensors_check: {path}: {message}", file=sys.stderr)
    if not errors:
        print(f"safetensors_check: {path}: {len(expected_tensors)} tensors match")
    return 1 if errors else 0


def check_array(name, array, want, error):
    expected_dtype = np.dtype(NUMPY_DTYPES[want["dtype"]])
    if array.dtype != expected_dtype:
        error(f"{name}: numpy dtype {array.dtype} != {expected_dtype}")
    if list(array.shape) != list(want["shape"]):
        error(f"{name}: numpy shape {list(array.shape)} != {want['shape']}")
    if "sha256" in want:
        digest = sha256_hex(np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes())
        if digest != want["sha256"]:
            error(f"{name}: sha256 of the numpy array {digest} != {want['sha256']}")
    check_values(name, array, want, error)


def check_values(name, array, want, error):
    if "values" not in want:
        return
    got = array.reshape(-1).tolist()
    if len(got) != len(want["values"]) or any(
            not (a == b or (a != a and b != b)) for a, b in zip(got, want["values"])):
        error(f"{name}: values {got[:8]}... != expected {want['values'][:8]}...")


def write_sample(path: str, expectation_path: str) -> int:
    rng = np.random.default_rng(20260427)
    tensors = {
        "embed.weight": rng.standard_normal((7, 5), dtype=np.float32),
        "steps": np.array([0, -1, 2**40, -(2**62)], dtype=np.int64),
        "mask": np.array([0, 1, 255, 7, 9], dtype=np.uint8),
        "scale": np.array(0.5, dtype=np.float64),          # a scalar (shape [])
        "empty": np.zeros((0, 3), dtype=np.float32),       # zero elements
        "half": np.array([1.5, -2.0, 65504.0], dtype=np.float16),
        "index": np.arange(6, dtype=np.int32).reshape(2, 3) - 3,
        "flags": np.array([True, False, True]),
    }
    metadata = {"format": "pulseloco-interop-sample", "writer": "safetensors.numpy.save_file"}
    safetensors.numpy.save_file(tensors, path, metadata=metadata)
    expectation = {
        "metadata": metadata,
        "tensors": {
            name: {
                "dtype": next(k for k, v in NUMPY_DTYPES.items() if np.dtype(v) == array.dtype),
                "shape": list(array.shape),
                "sha256": sha256_hex(np.ascontiguousarray(array).tobytes()),
                "values": [v.item() if hasattr(v, "item") else v for v in array.reshape(-1)],
            }
            for name, array in tensors.items()
        },
    }
    with open(expectation_path, "w", encoding="utf-8") as f:
        json.dump(expectation, f, indent=1)
    print(f"safetensors_check: wrote {path} with safetensors {safetensors.__version__}")
    return 0


def main(argv):
    if len(argv) != 4 or argv[1] not in ("check", "write"):
        print(__doc__, file=sys.stderr)
        return 2
    return check(argv[2], argv[3]) if argv[1] == "check" else write_sample(argv[2], argv[3])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
