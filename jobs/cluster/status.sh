#!/usr/bin/env bash
# Show the local SLURM cluster: daemons, nodes with their GPUs, partitions and the queue.
set -uo pipefail
if ! sinfo >/dev/null 2>&1; then echo "SLURM cluster: not reachable (run make cluster-up)"; exit 1; fi
echo "== nodes"; sinfo -N -o '%N %P %T %c %G'
echo "== partitions"; sinfo -o '%P %a %l %D %T'
echo "== queue"; squeue -o '%i %j %P %T %M %l %D %R'
