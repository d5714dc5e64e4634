"""examples/raw_buffers with two ranks on loopback (torchrun-style variables): both exit 0 after
10 windows, rank 0 reports every window with identical replicas.

    raw_buffers_test.py PROGRAM
"""

import os
import socket
import subprocess
import sys

BOUND_SECONDS = 240


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> int:
    program = sys.argv[1]
    port = str(free_port())
    ranks = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, PULSELOCO_LISTEN_ADDR="127.0.0.1")
        ranks.append(subprocess.Popen([program], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outputs = [rank.communicate(timeout=BOUND_SECONDS) for rank in ranks]
    for rank, (process, (out, err)) in enumerate(zip(ranks, outputs)):
        if process.returncode != 0:
            print(f"rank {rank} exited with {process.returncode}:\n{out}{err}")
            return 1
    lines = [line for line in outputs[0][0].splitlines() if line.startswith("window ")]
    expected = [f"window {w}:" for w in range(10)]
    if [line.split(" squared")[0] for line in lines] != expected or not all(
            line.endswith("replicas identical") for line in lines):
        print(f"rank 0's window lines are not windows 0..9 with identical replicas:\n"
              f"{outputs[0][0]}")
        return 1
    print(outputs[0][0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
