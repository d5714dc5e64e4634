#!/bin/bash
# Runs one rank of an mpirun job pinned to a core chosen by its rank, so that a benchmark can be
# repeated with the same placement of ranks on cores (mpirun with --oversubscribe binds nothing,
# and the scheduler then places 4 ranks on 2 cores anew in every run).
#
# Why not mpirun's own --rankfile with --bind-to core:overload-allowed: a bound OpenMPI stops
# yielding the core while it polls, so two ranks on one core starve each other. Pinning from
# outside leaves OpenMPI in its oversubscribed mode, the mode the unpinned runs measure.
#
#   PULSELOCO_PIN_CORES="0 0 1 1" mpirun -np 4 ... -x PULSELOCO_PIN_CORES \
#     bench/pin_ranks.sh build/bin/pulseloco_bench_collectives ...
#
# PULSELOCO_PIN_CORES lists one core per rank (rank 0 first); the rank comes from
# OMPI_COMM_WORLD_RANK. Every thread of the rank (its I/O threads too) stays on that core.
set -euo pipefail
if [[ -z "${PULSELOCO_PIN_CORES:-}" || -z "${OMPI_COMM_WORLD_RANK:-}" ]]; then
  echo "pin_ranks.sh: set PULSELOCO_PIN_CORES (one core per rank) and run under mpirun" >&2
  exit 2
fi
read -r -a cores <<< "$PULSELOCO_PIN_CORES"
rank=$OMPI_COMM_WORLD_RANK
if (( rank >= ${#cores[@]} )); then
  echo "pin_ranks.sh: PULSELOCO_PIN_CORES='$PULSELOCO_PIN_CORES' names no core for rank $rank" >&2
  exit 2
fi
exec taskset -c "${cores[$rank]}" "$@"
