#!/usr/bin/env bash
# Run every benchmark in --quick mode, one at a time (each compares two things on these cores).
# Fails if one exits non-zero or its last line is not `key=value ... status=ok`.
# Usage: bash scripts/bench_quick.sh [NAME ...]   (default: all of them)
set -uo pipefail
cd "$(dirname "$0")/.."
BENCHMARKS=(codecs data checkpoint transport rest tp mfu gpu swarm_vs_local fidelity scale expert_overhead recovery security adversary averaging diloco relay wan chaos)
[ $# -gt 0 ] && BENCHMARKS=("$@")
line_re='^[A-Za-z_][A-Za-z0-9_]*=[^ ]+( [A-Za-z_][A-Za-z0-9_]*=[^ ]+)* status=ok$'
failed=()
for name in "${BENCHMARKS[@]}"; do
  log=$(mktemp)
  started=$(date +%s)
  python "benchmarks/$name.py" --quick >"$log" 2>&1
  code=$?
  last=$(grep -v '^\s*$' "$log" | tail -n 1)
  echo "-- $name ($(( $(date +%s) - started )) s, exit $code): $last"
  if [ $code -ne 0 ] || ! [[ "$last" =~ $line_re ]]; then
    failed+=("$name")
    echo "---- $name output (last 40 lines):"
    tail -n 40 "$log"
  fi
  rm -f "$log"
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "benchmarks that failed or printed no final key=value line: ${failed[*]}"
  exit 1
fi
echo "all ${#BENCHMARKS[@]} benchmarks ran in quick mode"
