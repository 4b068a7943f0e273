#!/usr/bin/env bash
# A local multi-host pod for tests and debugging: NUM_PROCESSES copies of COMMAND on this machine,
# each with DEVICES_PER_PROCESS CPU devices, joined into one JAX job over a free localhost port
# (CPU collectives over gloo).
#
#   scripts/local_pod.sh NUM_PROCESSES DEVICES_PER_PROCESS COMMAND...
#   scripts/local_pod.sh 2 2 python -m k3jax.train configs/base.yml steps=6
#
# Each copy gets `enable_distributed=true coordinator_address=localhost:PORT num_processes=N
# process_id=i` appended as key=value arguments; its output lines (stdout and stderr) are prefixed
# with "[i] ". SIGTERM / SIGINT to this script go to every process (as a TPU maintenance event or
# GKE does to every host). When a process dies (non-zero status) the others are sent SIGTERM and,
# if they are still running 45 s later (e.g. stuck in a collective with the dead one), SIGKILL.
# Exit status: 0 when every process exited 0, otherwise the first non-zero status seen
# (143 after a preemption save, 2 after a config error, 128+n for a process killed by signal n).
set -u
if [ $# -lt 3 ] || ! [[ $1 =~ ^[1-9][0-9]*$ && $2 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 NUM_PROCESSES DEVICES_PER_PROCESS COMMAND..." >&2
  exit 2
fi
n=$1 d=$2
shift 2
py=$(command -v python3 || command -v python)
port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
flags=$(printf '%s' "${XLA_FLAGS:-}" | sed -E 's/--xla_force_host_platform_device_count=[0-9]+//g')
export XLA_FLAGS="$flags --xla_force_host_platform_device_count=$d"
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
export JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo
export PYTHONUNBUFFERED=1

pids=()
for ((i = 0; i < n; i++)); do
  "$@" enable_distributed=true "coordinator_address=localhost:$port" "num_processes=$n" "process_id=$i" \
    > >(sed -u "s/^/[$i] /") 2>&1 &
  pids+=($!)
done

status=0
stopping=0
forward() {  # $1: signal name
  for p in "${pids[@]}"; do kill -s "$1" "$p" 2>/dev/null; done
}
trap 'forward TERM' TERM
trap 'forward INT' INT

running=("${pids[@]}")
deadline=0
while [ ${#running[@]} -gt 0 ]; do
  still=()
  for p in "${running[@]}"; do
    if kill -0 "$p" 2>/dev/null; then
      still+=("$p")
    else
      wait "$p"
      rc=$?
      if [ "$rc" -ne 0 ]; then
        [ "$status" -eq 0 ] && status=$rc
        if [ "$stopping" -eq 0 ]; then
          stopping=1
          deadline=$((SECONDS + 45))
          forward TERM
        fi
      fi
    fi
  done
  running=("${still[@]+"${still[@]}"}")
  if [ "$stopping" -eq 1 ] && [ ${#running[@]} -gt 0 ] && [ "$SECONDS" -ge "$deadline" ]; then
    echo "local_pod: processes ${running[*]} still running 45 s after one died; killing them" >&2
    for p in "${running[@]}"; do kill -s KILL "$p" 2>/dev/null; done
  fi
  [ ${#running[@]} -gt 0 ] && sleep 0.5
done
wait  # the output prefixers
exit "$status"
