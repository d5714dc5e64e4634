"""examples/raw_buffers with two ranks on loopback (torchrun-style variables): both exit 0 after
10 windows, rank 0 reports every window with identical replicas. Then the program alone: with no
launcher variables it trains as a group of one and warns so exactly once; with WORLD_SIZE=1 it
runs alone without the warning.

    raw_buffers_test.py PROGRAM
"""

import os
import subprocess
import sys

from ports import free_port

BOUND_SECONDS = 240
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
                      "PULSELOCO_RANK", "PULSELOCO_WORLD_SIZE", "PULSELOCO_MASTER_ADDR",
                      "PULSELOCO_MASTER_PORT", "PULSELOCO_PEERS", "PULSELOCO_RENDEZVOUS",
                      "PULSELOCO_TRANSPORT")
ALONE_WARNING = "trains as a group of one"



def run_alone(program: str, **variables: str) -> str:
    """Runs the program with no launcher variables but `variables`; returns its stderr."""
    env = {name: value for name, value in os.environ.items()
           if name not in LAUNCHER_VARIABLES and not name.startswith(("OMPI_", "PMI", "PMIX_"))}
    env.pop("PULSELOCO_LOG_LEVEL", None)
    env.update(variables)
    result = subprocess.run([program], env=env, capture_output=True, text=True,
                            timeout=BOUND_SECONDS)
    if result.returncode != 0:
        raise RuntimeError(f"alone ({variables}) exited with {result.returncode}:\n"
                           f"{result.stdout}{result.stderr}")
    return result.stderr


def check_alone(program: str) -> str:
    """'' when the group-of-one warning comes once by default and never with WORLD_SIZE=1."""
    warned = [line for line in run_alone(program).splitlines() if ALONE_WARNING in line]
    if len(warned) != 1 or "world size to 1" not in warned[0]:
        return f"with no launcher variables: expected one warning, got {warned}"
    explicit = run_alone(program, WORLD_SIZE="1")
    if ALONE_WARNING in explicit:
        return f"with WORLD_SIZE=1: an unexpected warning:\n{explicit}"
    return ""


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
    problem = check_alone(program)
    if problem:
        print(problem)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
