"""A Python rank of the mixed C++/Python group test (tests/python/test_mixed_group.py): the same
parameters and per-step updates as tests/python/mixed_worker.cpp, through pulseloco.Synchronizer
and a group formed from the environment.

    python mixed_worker.py --mode pulse --windows 4 -H 2 --fp32 5000 --bf16 3001 [--numpy]

Prints one line per window: "window W digest HEX identical 0|1". --numpy passes the fp32 tensor
as a NumPy array (the buffer protocol) instead of a torch.Tensor (DLPack).

The updates are exact in both languages: a small integer times a power of two, added in float32
(NumPy's IEEE addition, as C++'s), then for bf16 rounded to nearest even on the bits, as
float_to_bf16_bits does.
"""

import argparse

import numpy as np
import torch

import pulseloco


def to_bf16_bits(values: np.ndarray) -> np.ndarray:
    bits = values.astype(np.float32).view(np.uint32)
    return ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def scaled(integers: np.ndarray, power: int) -> np.ndarray:
    return integers.astype(np.float32) * np.float32(2.0**power)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="pulse")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("-H", type=int, default=2, dest="steps")
    parser.add_argument("--fp32", type=int, default=5000)
    parser.add_argument("--bf16", type=int, default=3001)
    parser.add_argument("--timeout-ms", type=int, default=30_000)
    parser.add_argument("--numpy", action="store_true")
    args = parser.parse_args()

    i_w = np.arange(args.fp32, dtype=np.int64)
    i_h = np.arange(args.bf16, dtype=np.int64)
    w_values = scaled((i_w * 37) % 101 - 50, -8)
    h = torch.from_numpy(to_bf16_bits(scaled((i_h * 53) % 61 - 30, -6)).view(np.int16))
    h = h.view(torch.bfloat16)
    w = w_values if args.numpy else torch.from_numpy(w_values)
    # Zero-copy views of the same memory, for the updates.
    w_np = w_values
    h_bits = h.view(torch.int16).numpy().view(np.uint16)

    sync = pulseloco.Synchronizer({"w": w, "h": h}, mode=args.mode, inner_steps=args.steps,
                                  chunk_elements=2048, bucket_elements=4096, threads=1,
                                  timeout=args.timeout_ms / 1000)
    rank = sync.rank
    step = 0
    while sync.committed_windows < args.windows:
        w_np += scaled((rank * 131 + step * 31 + i_w * 7) % 17 - 8, -15)
        h_bits[:] = to_bf16_bits(from_bf16_bits(h_bits) +
                                 scaled((rank * 29 + step * 13 + i_h * 11) % 23 - 11, -9))
        step += 1
        report = sync.after_optimizer_step()
        if report is not None:
            print(f"window {report.window} digest {report.digest} "
                  f"identical {int(report.replicas_identical)}", flush=True)
    sync.close()


if __name__ == "__main__":
    main()
