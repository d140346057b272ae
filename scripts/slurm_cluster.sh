#!/usr/bin/env bash
# A real two-node Slurm cluster on this one machine, for the `slurm` test tier and CI (docs/hpc.md, "A local Slurm
# cluster for tests").   Usage: scripts/slurm_cluster.sh start|stop|status [DIR]   (DIR: $MILES_SLURM_DIR or
# /tmp/miles-slurm; ports from $MILES_SLURM_PORT, default 16817: slurmctld on it, the nodes on the next two).
#
# `start` installs Debian's slurm-wlm (and libpmix2) when missing, writes DIR/slurm.conf, starts slurmctld and two
# slurmd (fake nodes n1, n2 on 127.0.0.1) by hand (no systemd), waits for both nodes idle and prints the line the
# caller must run:  export SLURM_CONF=DIR/slurm.conf PATH=DIR/bin:$PATH   (DIR/bin holds a `sacct` stand-in: there is
# no accounting daemon). Nothing is exported globally; /etc/slurm is never read or written.
# `stop` cancels this cluster's jobs and ends the three daemons by the PIDs recorded in DIR (never by name: other
# clusters may run here), then removes DIR except DIR/log. `status` prints sinfo and exits 1 when not running.
set -euo pipefail

CMD="${1:-}"
DIR="${2:-${MILES_SLURM_DIR:-/tmp/miles-slurm}}"
PORT="${MILES_SLURM_PORT:-16817}"
NODES=(n1 n2)
START_TIMEOUT_S="${MILES_SLURM_START_TIMEOUT_S:-30}"

die() { echo "slurm_cluster: $*" >&2; exit 1; }
case "$CMD" in start | stop | status) ;; *) die "usage: $0 start|stop|status [DIR]" ;; esac
[ "$CMD" != start ] || mkdir -p "$DIR"
DIR="$(cd "$DIR" 2>/dev/null && pwd || echo "$DIR")"
CONF="$DIR/slurm.conf"
export SLURM_CONF="$CONF"  # for the commands below only; the caller's environment is not touched

# A recorded PID counts only while it is still the daemon we started on this DIR's config (PIDs get reused).
alive() {
  local pid
  pid="$(cat "$DIR/pids/$1" 2>/dev/null)" || return 1
  [ -n "$pid" ] && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "-f $CONF" && echo "$pid"
}
running() { alive slurmctld >/dev/null && alive n1 >/dev/null && alive n2 >/dev/null && sinfo -h >/dev/null 2>&1; }
log_tails() {
  local f
  for f in "$DIR"/log/*; do [ -f "$f" ] && { echo "--- $f"; tail -n 20 "$f"; }; done >&2
}
idle_nodes() { sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 == "idle" {print $1}' | sort -u | tr '\n' ' '; }

stop() {
  if alive slurmctld >/dev/null; then
    # Jobs first: their slurmstepd outlive slurmd by design, so end them while the cluster can still do it.
    squeue -h -o %i 2>/dev/null | xargs -r scancel 2>/dev/null || true
    for _ in $(seq 1 40); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.25; done
  fi
  local name pid pids=()
  for name in "${NODES[@]}" slurmctld; do
    pid="$(alive "$name")" && { kill -TERM "$pid" 2>/dev/null || true; pids+=("$pid"); }
  done
  for _ in $(seq 1 40); do
    local left=()
    for pid in "${pids[@]}"; do [ -d "/proc/$pid" ] && left+=("$pid"); done
    [ "${#left[@]}" = 0 ] && break
    pids=("${left[@]}")
    sleep 0.25
  done
  for pid in "${pids[@]}"; do [ -d "/proc/$pid" ] && kill -KILL "$pid" 2>/dev/null || true; done
  # Job processes that escaped their step (proctrack/linuxproc follows parent PIDs, so a child whose parent died
  # first is lost), found by the SLURM_CONF that slurmstepd puts in every task's environment, with a SLURM_JOB_ID;
  # never this script or its callers.
  local p env keep=" $$ " q=$$
  while q="$(awk '/^PPid:/ {print $2}' "/proc/$q/status" 2>/dev/null)" && [ "${q:-0}" -gt 1 ]; do keep+="$q "; done
  for p in /proc/[0-9]*; do
    [[ $keep == *" ${p#/proc/} "* ]] && continue
    env="$( { tr '\0' '\n' <"$p/environ"; } 2>/dev/null)" || continue
    grep -qxF "SLURM_CONF=$CONF" <<<"$env" && grep -q '^SLURM_JOB_ID=' <<<"$env" && kill -KILL "${p#/proc/}" 2>/dev/null
  done
  rm -rf "$DIR/pids" "$DIR/run" "$DIR/state" "$DIR/spool" "$DIR/tmp" "$DIR/bin" "$DIR/slurm.conf"
}

# slurm-wlm, and libpmix-dev for `srun --mpi=pmix`: Slurm's pmix plugin dlopens the unversioned
# pmix2/lib/libpmix.so, which only the -dev package ships (libpmix2 alone: "can not load PMIx library"; CI used to
# get it with libopenmpi-dev). slurmd loads the library once, when it starts, so installing it later leaves pmix
# steps failing until the cluster is restarted.
install_slurm() {
  local pkgs=()
  command -v slurmctld >/dev/null || pkgs+=(slurm-wlm)
  compgen -G '/usr/lib/*/pmix2/lib/libpmix.so' >/dev/null || pkgs+=(libpmix-dev)
  [ "${#pkgs[@]}" = 0 ] && return
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || die "missing: apt-get install ${pkgs[*]}"
  echo "slurm_cluster: installing ${pkgs[*]} ..." >&2
  apt-get update -qq
  # The packages' postinst would start daemons through systemd; there is none here, and we start our own anyway.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
}

write_conf() {
  local n i=0 cpus=4 mem=4096
  cat >"$CONF" <<EOF
# Written by scripts/slurm_cluster.sh: two fake nodes on 127.0.0.1 (a heterogeneous job needs two nodes).
ClusterName=miles
SlurmctldHost=localhost
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
# No munge: this cluster only ever talks to itself.
AuthType=auth/none
CredType=cred/none
MpiDefault=none
# Quiets "Configured MailProg is invalid" (Debian ships no mail program).
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Het jobs are started only by the backfill scheduler: run it every second, not every 30.
SchedulerParameters=bf_interval=1
# Each slurmd claims the CPUs/memory below, not what it finds on the (smaller) machine.
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=3
# Finished jobs stay in scontrol (and so in the sacct stand-in) for 10 minutes.
MinJobAge=600
StateSaveLocation=$DIR/state
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdSpoolDir=$DIR/spool/%n
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmdLogFile=$DIR/log/slurmd-%n.log
# Per node: pmix keeps its sockets under TmpFS, and two fake nodes sharing one directory collide.
TmpFS=$DIR/tmp/%n
EOF
  for n in "${NODES[@]}"; do
    i=$((i + 1))
    echo "NodeName=$n NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((PORT + i))" \
      "CPUs=$cpus RealMemory=$mem State=UNKNOWN" >>"$CONF"
    mkdir -p "$DIR/spool/$n" "$DIR/tmp/$n"
  done
  echo "PartitionName=debug Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP" >>"$CONF"
}

# sacct without accounting exits 1; this answers its common queries (submitit: `sacct -o JobID,State,NodeList
# --parsable2 -j ID ...`) from `scontrol show job -o`, which knows every job for MinJobAge after it ends.
write_sacct() {
  mkdir -p "$DIR/bin"
  cat >"$DIR/bin/sacct" <<'EOF'
#!/usr/bin/env python3
"""sacct stand-in (scripts/slurm_cluster.sh): job records from `scontrol show job -o`, one line per job, array
task (ID_i, pending ones ID_[a-b]) and het component (ID+k); no step lines. Options: -o/--format, -j/--jobs,
-P/--parsable2, -p/--parsable, -n/--noheader; others are accepted and ignored. Unknown jobs print nothing."""
from __future__ import annotations

import re
import subprocess
import sys

# sacct field (any case) -> (its column header, the scontrol key it comes from; JobID is composed in job_id()).
COLUMNS = {f.lower(): (f, key) for f, key in [
    ("JobID", ""), ("JobIDRaw", "JobId"), ("JobName", "JobName"), ("State", "JobState"), ("NodeList", "NodeList"),
    ("ExitCode", "ExitCode"), ("Partition", "Partition"), ("Submit", "SubmitTime"), ("Start", "StartTime"),
    ("End", "EndTime"), ("Elapsed", "RunTime"), ("AllocCPUS", "NumCPUs"), ("NNodes", "NumNodes"),
    ("Reason", "Reason"), ("User", "UserId"), ("WorkDir", "WorkDir"), ("Timelimit", "TimeLimit"),
]}


def records(job: str | None) -> list[dict[str, str]]:
    cmd = ["scontrol", "show", "job", "-o"] + ([job] if job else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    out = []
    for line in proc.stdout.splitlines() if proc.returncode == 0 else []:
        keys = list(re.finditer(r"(?:^| )([A-Za-z:/_]+)=", line))
        rec = {m.group(1): line[m.end():(keys[i + 1].start() if i + 1 < len(keys) else len(line))].strip()
               for i, m in enumerate(keys)}
        if "JobId" in rec:
            out.append(rec)
    return out


def job_id(rec: dict[str, str]) -> str:
    if rec.get("ArrayJobId") and rec.get("ArrayTaskId"):
        task = rec["ArrayTaskId"]
        return f"{rec['ArrayJobId']}_{task}" if task.isdigit() else f"{rec['ArrayJobId']}_[{task}]"
    if rec.get("HetJobId") and rec.get("HetJobOffset"):
        return f"{rec['HetJobId']}+{rec['HetJobOffset']}"
    return rec["JobId"]


def value(rec: dict[str, str], field: str) -> str:
    if field == "jobid":
        return job_id(rec)
    v = rec.get(COLUMNS.get(field, ("", ""))[1], "")
    if field == "nodelist" and v in ("", "(null)"):
        return "None assigned"
    if field == "user":
        return v.split("(")[0]
    return "" if v in ("(null)", "Unknown") else v


def main(argv: list[str]) -> int:
    fields = ["jobid", "jobname", "partition", "alloccpus", "state", "exitcode"]  # sacct's default
    jobs, sep, end, header = [], "|", "", True
    i = 0
    while i < len(argv):
        a = argv[i]
        name, _, inline = a.partition("=")
        if name in ("-o", "--format", "-j", "--jobs") and not inline:
            i += 1
            inline = argv[i] if i < len(argv) else ""
        if name in ("-o", "--format"):
            fields = [f.split("%")[0].lower() for f in inline.split(",") if f]
        elif name in ("-j", "--jobs"):
            jobs += [j for j in inline.split(",") if j]
        elif a in ("-P", "--parsable2"):
            sep, end = "|", ""
        elif a in ("-p", "--parsable"):
            sep, end = "|", "|"
        elif a in ("-n", "--noheader"):
            header = False
        i += 1
    if header:
        print(sep.join(COLUMNS.get(f, (f, ""))[0] for f in fields) + end)
    seen = set()
    for job in jobs or [None]:
        for rec in records(job):
            key = job_id(rec)
            if key not in seen:
                seen.add(key)
                print(sep.join(value(rec, f) for f in fields) + end)
    return 0


sys.exit(main(sys.argv[1:]))
EOF
  chmod +x "$DIR/bin/sacct"
}

start_daemon() {  # NAME COMMAND...: a daemon in the foreground (-D) of its own session; its PID goes to DIR/pids
  local name="$1"; shift
  setsid "$@" -D -f "$CONF" </dev/null >>"$DIR/log/$name.out" 2>&1 &
  echo $! >"$DIR/pids/$name"
}

start() {
  if running; then
    echo "slurm_cluster: already running in $DIR (nodes: $(idle_nodes))" >&2
  else
    [ "$(id -u)" = 0 ] || die "slurmd must run as root (run this as root)"
    install_slurm
    stop  # whatever a crashed start left behind in DIR
    local p
    for p in $PORT $((PORT + 1)) $((PORT + 2)); do
      ! (: <"/dev/tcp/127.0.0.1/$p") 2>/dev/null || die "port $p is in use: set MILES_SLURM_PORT to a free range"
    done
    mkdir -p "$DIR"/{pids,state,run,log}
    local f
    for f in "$DIR"/log/*; do [ -f "$f" ] && : >"$f"; done  # this run's logs only
    write_conf
    write_sacct
    start_daemon slurmctld slurmctld
    for n in "${NODES[@]}"; do start_daemon "$n" slurmd -N "$n"; done
    local deadline=$((SECONDS + START_TIMEOUT_S))
    until [ "$(idle_nodes)" = "n1 n2 " ]; do
      local name
      for name in slurmctld "${NODES[@]}"; do
        alive "$name" >/dev/null || { log_tails; stop; die "$name exited during start-up (logs above, in $DIR/log)"; }
      done
      if [ "$SECONDS" -ge "$deadline" ]; then
        sinfo -N >&2 || true
        log_tails
        stop
        die "nodes not idle after ${START_TIMEOUT_S}s (sinfo and logs above, in $DIR/log)"
      fi
      sleep 0.1
    done
    echo "slurm_cluster: started in $DIR (slurmctld port $PORT; nodes n1, n2 idle)" >&2
  fi
  echo "export SLURM_CONF=$CONF PATH=$DIR/bin:\$PATH"
}

case "$CMD" in
  start) start ;;
  stop) stop; echo "slurm_cluster: stopped ($DIR)" >&2 ;;
  status)
    running || { echo "slurm_cluster: not running in $DIR" >&2; exit 1; }
    sinfo
    ;;
esac
