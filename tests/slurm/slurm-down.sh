#!/usr/bin/env bash
# Stop what tests/slurm/slurm-up.sh started, and nothing else.
#
#   tests/slurm/slurm-down.sh                  # every daemon slurm-up.sh started
#   tests/slurm/slurm-down.sh slurmd slurmctld # only these (of those it started)
#
# A daemon is stopped only when its marker $SLURM_LOCAL_STATE/<name>.started
# exists, names the pid in the daemon's pid file, and /proc/<pid>/comm is the
# daemon's name; daemons someone else started are left alone. Never kills by
# name. Idempotent: a rerun (or a run when nothing was started) does nothing.
#
# Before stopping a slurmctld it started, it cancels that cluster's queued and
# running jobs by job id, so no job processes outlive the cluster
# (SLURM_DOWN_KEEP_JOBS=1 skips this).
set -uo pipefail

STATE=${SLURM_LOCAL_STATE:-/run/slurm-local}
WANTED=" ${*:-slurmd slurmctld munged} "
for name in $WANTED; do
    case "$name" in slurmd|slurmctld|munged) ;; *) echo "slurm-down: unknown daemon '$name'" >&2; exit 2 ;; esac
done
wanted() { [[ "$WANTED" == *" $1 "* ]]; }
say() { echo "slurm-down: $*" >&2; }

# pid of our running daemon, or fail (marker missing, stale, or not that daemon)
our_pid() { # name pidfile
    local pid
    [ -f "$STATE/$1.started" ] && [ -f "$2" ] || return 1
    pid=$(cat "$STATE/$1.started")
    [ "$pid" = "$(cat "$2" 2>/dev/null)" ] || return 1
    [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = "$1" ] || return 1
    echo "$pid"
}

stop() { # name pidfile
    local pid i
    if pid=$(our_pid "$1" "$2"); then
        kill -TERM "$pid" 2>/dev/null || true
        for i in $(seq 1 150); do [ -d "/proc/$pid" ] || break; sleep 0.1; done
        if [ -d "/proc/$pid" ]; then
            say "$1 (pid $pid) ignored SIGTERM for 15 s; sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
        say "stopped $1 (pid $pid)"
    elif [ -f "$STATE/$1.started" ]; then
        say "$1: marker present but that process is gone or is not $1; not touching anything"
    fi
    rm -f "$STATE/$1.started"
}

if [ "${SLURM_DOWN_KEEP_JOBS:-0}" != 1 ] && wanted slurmctld && our_pid slurmctld "$STATE/slurmctld.pid" >/dev/null; then
    jobs=$(squeue -h -o %i --states=PENDING,RUNNING,CONFIGURING,COMPLETING,SUSPENDED 2>/dev/null | tr '\n' ' ')
    if [ -n "${jobs// /}" ]; then
        say "cancelling jobs $jobs"
        # shellcheck disable=SC2086
        scancel $jobs 2>/dev/null || true
        # let slurmd end the job steps before it is stopped itself
        for i in $(seq 1 30); do
            [ -z "$(squeue -h -o %i --states=RUNNING,COMPLETING 2>/dev/null)" ] && break
            sleep 0.5
        done
    fi
fi

wanted slurmd && stop slurmd "$STATE/slurmd.pid"
wanted slurmctld && stop slurmctld "$STATE/slurmctld.pid"
wanted munged && stop munged /run/munge/munged.pid
exit 0
