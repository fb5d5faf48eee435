#!/usr/bin/env bash
# A single-node Slurm on this machine, for the tests of the cluster executor (docs/cluster.md).
#   scripts/slurm_local.sh start    install slurm-wlm and munge with apt-get when missing (as root),
#                                   then start munged, slurmctld and slurmd; returns once the node
#                                   takes jobs (sbatch, squeue, ... then work in any shell)
#   scripts/slurm_local.sh stop     cancel every job, stop the three daemons, remove the folder
#   scripts/slurm_local.sh status   whether it runs
# Everything (munge key, slurm.conf, state, spool, logs, pid files) lives in one folder,
# $ARITHLIB_SLURM_DIR (default /tmp/arithlib-slurm). The clients find slurm.conf through
# /etc/slurm/slurm.conf, linked to that folder's copy when the machine has none of its own
# (else export SLURM_CONF=$ARITHLIB_SLURM_DIR/slurm.conf). One node, named after
# `hostname -s`, with every core and 90 % of the memory; one partition, "local" (the default).
# No cgroups, no accounting database: process groups track the jobs, and finished jobs stay
# visible to squeue/scontrol for an hour (MinJobAge).
set -euo pipefail
DIR="${ARITHLIB_SLURM_DIR:-/tmp/arithlib-slurm}"
CONF="$DIR/slurm.conf"
ETC=/etc/slurm/slurm.conf
export SLURM_CONF="$CONF"

say() { echo "[slurm_local] $*"; }
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
running() { alive "$DIR/slurmctld.pid" && alive "$DIR/slurmd.pid" && alive "$DIR/munged.pid"; }

install_packages() {
    local missing=()
    command -v munged >/dev/null 2>&1 || missing+=(munge)
    { command -v slurmctld >/dev/null 2>&1 && command -v slurmd >/dev/null 2>&1 && command -v sbatch >/dev/null 2>&1; } \
        || missing+=(slurm-wlm)
    [ "${#missing[@]}" -eq 0 ] && return 0
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        say "ERROR: ${missing[*]} not installed, and installing needs root and apt-get (Debian/Ubuntu)" >&2
        exit 2
    fi
    say "installing ${missing[*]} (apt-get)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >"${TMPDIR:-/tmp}/slurm_local_apt.log" 2>&1 || {
        apt-get update -q >/dev/null 2>&1 || true
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >"${TMPDIR:-/tmp}/slurm_local_apt.log" 2>&1
    } || { say "ERROR: apt-get install ${missing[*]} failed (see ${TMPDIR:-/tmp}/slurm_local_apt.log)" >&2; exit 1; }
}

write_conf() {
    local host cpus mem
    host="$(hostname -s)"
    cpus="$(nproc)"
    mem="$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)"
    cat >"$CONF" <<EOF
ClusterName=arithlib-local
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge.socket
SlurmctldPort=${ARITHLIB_SLURMCTLD_PORT:-6817}
SlurmdPort=${ARITHLIB_SLURMD_PORT:-6818}
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=5
MinJobAge=3600
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
}

start() {
    if running; then say "already running ($CONF)"; return 0; fi
    install_packages
    stop_daemons
    rm -rf "$DIR"
    mkdir -p "$DIR/state" "$DIR/spool"
    write_conf
    if [ ! -e "$ETC" ] || [ "$(readlink "$ETC" 2>/dev/null)" = "$CONF" ]; then
        mkdir -p "$(dirname "$ETC")"
        ln -sfn "$CONF" "$ETC"
    fi
    dd if=/dev/urandom of="$DIR/munge.key" bs=1k count=1 status=none
    chmod 400 "$DIR/munge.key"
    munged --force --key-file="$DIR/munge.key" --socket="$DIR/munge.socket" --pid-file="$DIR/munged.pid" \
        --log-file="$DIR/munged.log" --seed-file="$DIR/munged.seed"
    slurmctld -f "$CONF"
    slurmd -f "$CONF"
    for _ in $(seq 1 60); do
        if sinfo -h -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
            say "running: node $(hostname -s), partition local ($CONF)"
            return 0
        fi
        sleep 0.5
    done
    say "ERROR: the node did not come up in 30 s (logs in $DIR); stopping" >&2
    stop
    exit 1
}

stop_daemons() {
    local f pid
    for f in slurmd slurmctld munged; do
        alive "$DIR/$f.pid" || continue
        pid="$(cat "$DIR/$f.pid")"
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
        kill -9 "$pid" 2>/dev/null || true
    done
}

stop() {
    if alive "$DIR/slurmctld.pid"; then
        scancel --full --quiet --user "$(id -un)" 2>/dev/null || true
        for _ in $(seq 1 60); do  # a cancelled job's processes end before its node is idle again
            [ -z "$(squeue -h -t RUNNING,COMPLETING -o %i 2>/dev/null)" ] && break
            sleep 0.5
        done
    fi
    stop_daemons
    [ "$(readlink "$ETC" 2>/dev/null)" = "$CONF" ] && rm -f "$ETC"
    rm -rf "$DIR"
    say "stopped"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) if running; then say "running ($CONF)"; else say "not running"; exit 1; fi ;;
    *) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
