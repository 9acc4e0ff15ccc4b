#!/usr/bin/env bash
# Run a command with a time limit; when it runs out, py-spy dump every Python process of the command's tree (where
# each one waits), then kill the tree. A diagnosis tool for hangs on the GPU machine.
#   bash bench/device/hang_probe.sh SECONDS PY_SPY COMMAND...      # exit status: the command's, or 124 at the limit
set -uo pipefail
limit=$1 spy=$2; shift 2
setsid "$@" &
pid=$!
for ((t = 0; t < limit; t++)); do
  kill -0 "$pid" 2>/dev/null || { wait "$pid"; exit $?; }
  sleep 1
done
echo "hang_probe: still running after ${limit} s; stacks:"
for p in $(pgrep -s "$pid" 2>/dev/null || pgrep -g "$pid"); do
  if grep -q python "/proc/$p/cmdline" 2>/dev/null; then
    echo "--- pid $p: $(tr '\0' ' ' < /proc/$p/cmdline | cut -c1-200)"
    timeout 30 "$spy" dump --pid "$p" 2>&1 | head -60
  fi
done
kill -TERM -- "-$pid" 2>/dev/null; sleep 3; kill -KILL -- "-$pid" 2>/dev/null
exit 124
