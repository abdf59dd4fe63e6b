#!/usr/bin/env bash
# Bring up a real SLURM cluster on this one machine: NODES fake nodes with GPUS_PER_NODE fake GPUs
# each, in PSC-like partitions GPU-shared (default) and GPU (whole nodes). Installs SLURM and MUNGE
# when missing. Idempotent: a second run with the same shape leaves the running daemons alone.
# Usage (as root): NODES=2 GPUS_PER_NODE=2 jobs/cluster/up.sh
set -euo pipefail

NODES=${NODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-2}
CPUS_PER_NODE=${CPUS_PER_NODE:-4}
MEM_PER_NODE_MB=${MEM_PER_NODE_MB:-8000}
BASE_PORT=${BASE_PORT:-17001}
# Typed like Bridges-2 V100s, so `--gpus=v100-32:N` (jobs/*.sbatch defaults) and `--gres=gpu:N` both work.
GPU_TYPE=${GPU_TYPE:-v100-32}
STATE=/var/lib/gptpar-slurm
CONF_DIR=/etc/slurm

case "$NODES$GPUS_PER_NODE$CPUS_PER_NODE" in
  *[!0-9]*) echo "up.sh: NODES, GPUS_PER_NODE and CPUS_PER_NODE must be integers" >&2; exit 2 ;;
esac
if [ "$(id -u)" != 0 ]; then echo "up.sh: run as root (it installs packages and starts daemons)" >&2; exit 2; fi

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
   || ! command -v munged >/dev/null; then
  echo "installing SLURM and MUNGE"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
fi

# MUNGE authenticates every SLURM message; it needs a key and a running daemon.
mkdir -p /etc/munge /run/munge /var/log/munge /var/lib/munge
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
fi
chmod 0400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  munged --force
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
fi

# Node names resolve, so MASTER_ADDR taken from the node list works.
names=()
for i in $(seq 1 "$NODES"); do names+=("node$i"); done
for n in "${names[@]}"; do
  grep -qE "^127\.0\.0\.1[[:space:]].*\b$n\b" /etc/hosts || echo "127.0.0.1 $n" >>/etc/hosts
done

# Fake GPUs: slurmd accepts only character devices as GRES files.
mkdir -p "$STATE" /var/spool/slurmctld /var/log/slurm "$CONF_DIR"
for n in "${names[@]}"; do
  mkdir -p "$STATE/dev/$n"
  for g in $(seq 0 $((GPUS_PER_NODE - 1))); do
    [ -c "$STATE/dev/$n/nv$g" ] || mknod -m 666 "$STATE/dev/$n/nv$g" c 1 3
  done
done

host=$(hostname -s)
nodelist="node[1-$NODES]"
[ "$NODES" = 1 ] && nodelist=node1
conf=$(mktemp)
gres=$(mktemp)
{
  echo "# Written by gptpar jobs/cluster/up.sh: $NODES nodes x $GPUS_PER_NODE fake GPUs"
  echo "ClusterName=gptpar"
  echo "SlurmctldHost=$host(127.0.0.1)"
  echo "SlurmUser=root"
  echo "AuthType=auth/munge"
  echo "CryptoType=crypto/munge"
  echo "MpiDefault=none"
  echo "ProctrackType=proctrack/linuxproc"
  echo "TaskPlugin=task/none"
  echo "JobAcctGatherType=jobacct_gather/none"
  echo "AccountingStorageType=accounting_storage/none"
  echo "SelectType=select/cons_tres"
  echo "SelectTypeParameters=CR_Core"
  # The fake nodes share this machine's cores: trust the configured shape, not the hardware.
  echo "SlurmdParameters=config_overrides"
  echo "ReturnToService=2"
  echo "GresTypes=gpu"
  echo "JobRequeue=1"
  echo "MinJobAge=600"
  echo "KillWait=10"
  # Schedule every 2 s, and backfill (which starts a job that waits behind a bigger one) every 2 s rather than 30.
  echo "SchedulerParameters=sched_interval=2,bf_interval=2"
  echo "StateSaveLocation=/var/spool/slurmctld"
  echo "SlurmctldPidFile=/run/slurmctld.pid"
  echo "SlurmctldLogFile=/var/log/slurm/slurmctld.log"
  echo "SlurmdPidFile=/run/slurmd-%n.pid"
  echo "SlurmdSpoolDir=/var/spool/slurmd-%n"
  echo "SlurmdLogFile=/var/log/slurm/slurmd-%n.log"
  i=0
  for n in "${names[@]}"; do
    echo "NodeName=$n NodeHostname=$host NodeAddr=127.0.0.1 Port=$((BASE_PORT + i)) CPUs=$CPUS_PER_NODE" \
         "RealMemory=$MEM_PER_NODE_MB Gres=gpu:$GPU_TYPE:$GPUS_PER_NODE State=UNKNOWN"
    i=$((i + 1))
  done
  echo "PartitionName=GPU-shared Nodes=$nodelist Default=YES MaxTime=2-00:00:00 MaxNodes=1 State=UP"
  echo "PartitionName=GPU Nodes=$nodelist MaxTime=2-00:00:00 OverSubscribe=EXCLUSIVE State=UP"
} >"$conf"
for n in "${names[@]}"; do
  echo "NodeName=$n Name=gpu Type=$GPU_TYPE File=$STATE/dev/$n/nv[0-$((GPUS_PER_NODE - 1))]"
done >"$gres"

changed=0
cmp -s "$conf" "$CONF_DIR/slurm.conf" || changed=1
cmp -s "$gres" "$CONF_DIR/gres.conf" || changed=1
install -m 644 "$conf" "$CONF_DIR/slurm.conf"
install -m 644 "$gres" "$CONF_DIR/gres.conf"
rm -f "$conf" "$gres"

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
all_up=1
running /run/slurmctld.pid || all_up=0
for n in "${names[@]}"; do running "/run/slurmd-$n.pid" || all_up=0; done

if [ "$changed" = 1 ] || [ "$all_up" = 0 ]; then
  "$(dirname "$0")/down.sh" --quiet
  for n in "${names[@]}"; do mkdir -p "/var/spool/slurmd-$n"; done
  slurmctld
  for n in "${names[@]}"; do slurmd -N "$n"; done
fi

# Wait until every node is schedulable; a node left DOWN/DRAIN by an old run is resumed.
for _ in $(seq 60); do
  states=$(sinfo -h -N -p GPU-shared -o '%T' 2>/dev/null | sort -u | tr '\n' ' ')
  case "$states" in
    "idle "|"mixed "|"allocated "|"idle mixed "|"allocated idle "|"allocated mixed "|"allocated idle mixed ")
      echo "SLURM cluster up: $NODES node(s) x $GPUS_PER_NODE GPU(s), partitions GPU-shared, GPU"
      exit 0 ;;
    *down*|*drain*) scontrol update NodeName="$nodelist" State=RESUME 2>/dev/null || true ;;
  esac
  sleep 1
done
echo "up.sh: nodes did not become idle; sinfo says:" >&2
sinfo -N >&2 || true
tail -n 20 /var/log/slurm/slurmctld.log >&2 || true
exit 1
