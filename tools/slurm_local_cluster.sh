#!/usr/bin/env bash
# Start (or reuse) a single-node Slurm cluster on this host, for tests and demos.
#
#   sudo tools/slurm_local_cluster.sh          # needs root and Debian's slurm-wlm + munge
#
# munged, slurmctld and slurmd run on this host; the node is declared with
# HPCPS_SLURM_CPUS CPUs (default 16) and SlurmdParameters=config_overrides, so
# a 2-core machine still accepts `-n 5`. Prints "ready" once the node is idle;
# exits non-zero with a reason otherwise.
set -euo pipefail
for cmd in munged slurmctld slurmd sinfo; do
  command -v "$cmd" >/dev/null || { echo "missing $cmd: apt-get install slurm-wlm munge" >&2; exit 3; }
done
[ "$(id -u)" = 0 ] || { echo "must run as root (slurmd and munged)" >&2; exit 3; }
host=$(hostname -s)
cpus=${HPCPS_SLURM_CPUS:-16}
conf=/etc/slurm/slurm.conf

mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge /var/log/slurm /var/spool/slurmctld /var/spool/slurmd
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
fi
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
chmod 400 /etc/munge/munge.key
pgrep -x munged >/dev/null || runuser -u munge -- munged || munged --force

if ! grep -q "^NodeName=$host " "$conf" 2>/dev/null; then
  cat > "$conf" <<CONF
ClusterName=hpcps-test
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=pmi2
KillWait=5
ReturnToService=2
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=$host CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
fi
# a step whose rank died is killed 5 s after its SIGTERM (Slurm's default waits 30 s): the restart tests' ranks,
# waiting for the dead one, cannot stop on the signal
if ! grep -q "^KillWait=" "$conf"; then
  echo "KillWait=5" >> "$conf"
  pgrep -x slurmctld >/dev/null && scontrol reconfigure >/dev/null 2>&1 || true
fi
pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd
for _ in $(seq 60); do
  state=$(sinfo -h -n "$host" -o %t 2>/dev/null || true)
  case "$state" in
    idle*|mix*|alloc*) echo ready; exit 0 ;;
    down*|drain*) scontrol update nodename="$host" state=resume >/dev/null 2>&1 || true ;;
  esac
  sleep 1
done
echo "slurm node $host not idle after 60 s (state: ${state:-unknown}); see /var/log/slurm/" >&2
exit 4
