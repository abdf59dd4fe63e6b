#!/usr/bin/env bash
# Stop the local SLURM cluster started by up.sh (slurmd of every node, then slurmctld).
# Stops only the daemons whose pid files up.sh's slurm.conf names; safe when nothing runs.
set -uo pipefail
quiet=0; [ "${1:-}" = --quiet ] && quiet=1

stop() {  # stop the process in pid file $1, waiting for it to exit
  local pid
  [ -f "$1" ] || return 0
  pid=$(cat "$1")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null
  fi
  rm -f "$1"
}
for f in /run/slurmd-*.pid; do [ -e "$f" ] && stop "$f"; done
stop /run/slurmctld.pid
[ "$quiet" = 1 ] || echo "SLURM cluster down"
