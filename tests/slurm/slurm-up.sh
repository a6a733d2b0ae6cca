#!/usr/bin/env bash
# Bring up a single-node SLURM cluster (munged + slurmctld + slurmd) from
# Debian's packages (slurm-wlm, munge) on this machine, for the integration
# test tests/test_slurm_integration.py and for trying profiles/slurm-cpu by hand.
#
# Idempotent: a rerun while everything is up does nothing. Each daemon it
# starts is recorded in $SLURM_LOCAL_STATE/<name>.started (its pid), and
# tests/slurm/slurm-down.sh stops exactly those. Daemons already running that
# this script did not start are used as they are and never stopped.
#
# Needs root (it writes /etc/slurm/slurm.conf and starts daemons as the
# `munge` and `slurm` users) and no systemd. It never overwrites a
# slurm.conf it did not write.
#
# Settings (environment):
#   SLURM_PARTITION    partition name                      (default: main)
#   SLURM_MINJOBAGE    seconds finished jobs stay in squeue (default: 600;
#                      the slurm executor's `squeue` status command needs
#                      >= 3 x --slurm-init-seconds-before-status-checks)
#   SLURM_WAIT_S       seconds to wait for the node to be idle (default: 30)
#   SLURM_LOCAL_STATE  pid files and .started markers  (default: /run/slurm-local)
#
# Exit status: 0 up; 2 a prerequisite is missing (packages, root, a foreign
# slurm.conf): the reason is printed on stderr; 1 a daemon failed to start.
set -euo pipefail

PARTITION=${SLURM_PARTITION:-main}
MINJOBAGE=${SLURM_MINJOBAGE:-600}
WAIT_S=${SLURM_WAIT_S:-30}
STATE=${SLURM_LOCAL_STATE:-/run/slurm-local}
CONF=/etc/slurm/slurm.conf
MARKER="# Written by userdp tests/slurm/slurm-up.sh"
LOGDIR=/var/log/slurm

say() { echo "slurm-up: $*" >&2; }
missing() { say "SKIP: $*"; exit 2; }

# --- prerequisites ---------------------------------------------------------
for cmd in munged munge unmunge slurmctld slurmd sinfo sbatch squeue scontrol runuser; do
    command -v "$cmd" >/dev/null 2>&1 ||
        missing "'$cmd' not found: install the Debian packages (apt-get install slurm-wlm munge)"
done
[ "$(id -u)" -eq 0 ] || missing "must run as root (writes $CONF, starts munged/slurmctld/slurmd)"
id munge >/dev/null 2>&1 || missing "user 'munge' missing (the munge package creates it)"
id slurm >/dev/null 2>&1 || missing "user 'slurm' missing (the slurm-wlm packages create it)"
if [ -f "$CONF" ] && ! head -n1 "$CONF" | grep -qF "$MARKER"; then
    missing "$CONF exists and was not written by this script; not overwriting a site configuration"
fi
if [ "$MINJOBAGE" -lt 120 ]; then
    say "warning: SLURM_MINJOBAGE=$MINJOBAGE < 120: the slurm executor then ignores" \
        "'slurm-status-command: squeue' and falls back to sacct, which needs slurmdbd"
fi

mkdir -p "$STATE" "$LOGDIR" /var/lib/slurm/slurmctld /var/lib/slurm/slurmd /etc/slurm
chown slurm:slurm "$LOGDIR" /var/lib/slurm/slurmctld
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge

# pid of a running daemon from its pid file, if /proc says it is that daemon
running_pid() { # name pidfile
    local pid
    [ -f "$2" ] || return 1
    pid=$(cat "$2" 2>/dev/null) || return 1
    [ -n "$pid" ] && [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = "$1" ] || return 1
    echo "$pid"
}

# true when the .started marker names the running daemon (so we own it)
ours() { # name pidfile
    local pid
    pid=$(running_pid "$1" "$2") || return 1
    [ -f "$STATE/$1.started" ] && [ "$(cat "$STATE/$1.started")" = "$pid" ]
}

# wait for the pid file of a just-started daemon, then record it as ours
record_started() { # name pidfile
    local i pid
    for i in $(seq 1 50); do
        if pid=$(running_pid "$1" "$2"); then
            echo "$pid" >"$STATE/$1.started"
            say "started $1 (pid $pid)"
            return 0
        fi
        sleep 0.1
    done
    say "ERROR: $1 did not start; see its log:"
    tail -n 20 "$3" >&2 2>/dev/null || true
    exit 1
}

stop_ours() { # name pidfile
    local pid i
    pid=$(running_pid "$1" "$2") || { rm -f "$STATE/$1.started"; return 0; }
    kill -TERM "$pid"
    for i in $(seq 1 100); do [ -d "/proc/$pid" ] || break; sleep 0.1; done
    [ -d "/proc/$pid" ] && kill -KILL "$pid"
    rm -f "$STATE/$1.started"
    say "stopped $1 (pid $pid) to apply the new configuration"
}

# --- munge -----------------------------------------------------------------
if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
    say "created /etc/munge/munge.key"
fi
MUNGE_PID=/run/munge/munged.pid
if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    ours munged "$MUNGE_PID" || say "munged already running (not started here; left alone)"
else
    # the key is owned by munge, so munged runs as munge; --force: a stale
    # socket from an earlier run is no reason to refuse
    runuser -u munge -- munged --force
    record_started munged "$MUNGE_PID" /var/log/munge/munged.log
fi

# --- slurm.conf --------------------------------------------------------------
NODE=$(hostname -s)
MEM_KB=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo)
REAL_MB=$((MEM_KB / 1024 * 95 / 100))
# CPUs and topology as slurmd detects them; memory: 95 % of MemTotal
NODELINE=$(slurmd -C | head -n1 | sed -E "s/RealMemory=[0-9]+/RealMemory=$REAL_MB/")
NEW=$(mktemp)
cat >"$NEW" <<CONFEOF
$MARKER: a single-node test cluster. Rerun the script instead of editing.
ClusterName=userdp-local
SlurmctldHost=$NODE
SlurmUser=slurm
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$LOGDIR/slurmctld.log
SlurmdLogFile=$LOGDIR/slurmd.log
# no systemd and no cgroups here: track processes by parent pid, no task binding
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
# no slurmdbd: sacct cannot work (use the executor's squeue status command);
# finished jobs are still recorded in the job completion log
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$LOGDIR/jobcomp.log
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=2048
# finished jobs stay visible to squeue this long (the executor polls squeue)
MinJobAge=$MINJOBAGE
ReturnToService=2
SlurmctldTimeout=60
SlurmdTimeout=60
InactiveLimit=0
KillWait=10
Waittime=0
$NODELINE State=UNKNOWN
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONFEOF
CHANGED=0
if ! cmp -s "$NEW" "$CONF"; then
    install -m 0644 "$NEW" "$CONF"
    CHANGED=1
    say "wrote $CONF"
fi
rm -f "$NEW"

# --- slurmctld, slurmd ---------------------------------------------------------
start_daemon() { # name
    local name=$1 pidfile="$STATE/$1.pid"
    if running_pid "$name" "$pidfile" >/dev/null; then
        if ours "$name" "$pidfile"; then
            [ "$CHANGED" -eq 1 ] || return 0
            stop_ours "$name" "$pidfile"
        else
            [ "$CHANGED" -eq 0 ] || {
                say "ERROR: $name is running but was not started by this script; cannot apply the new $CONF"
                exit 1
            }
            say "$name already running (not started here; left alone)"
            return 0
        fi
    fi
    "$name"   # both daemonize
    record_started "$name" "$pidfile" "$LOGDIR/$name.log"
}
start_daemon slurmctld
start_daemon slurmd

# --- wait until the node takes jobs ----------------------------------------------
deadline=$((SECONDS + WAIT_S))
resumed=0
while :; do
    state=$(sinfo -h -n "$NODE" -o %T 2>/dev/null | head -n1 || true)
    case "$state" in
        idle|mixed|allocated|completing) say "node $NODE is $state; partition $PARTITION ready"; exit 0 ;;
        down*|drain*|drained*)
            if [ "$resumed" -eq 0 ]; then
                scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true
                resumed=1
            fi ;;
    esac
    if [ "$SECONDS" -ge "$deadline" ]; then
        say "ERROR: node $NODE not idle after ${WAIT_S}s (state: '${state:-none}'); logs: $LOGDIR/slurmctld.log, $LOGDIR/slurmd.log"
        tail -n 10 "$LOGDIR/slurmctld.log" "$LOGDIR/slurmd.log" >&2 2>/dev/null || true
        exit 1
    fi
    sleep 0.5
done
