#!/usr/bin/env bash
# GPU check for a machine with an NVIDIA GPU: a recorded allocator trace replayed through the
# caching-allocator simulation vs the real reserved/allocated peaks, the estimate vs the same, the
# probe vs an exhaustive real search, a planned run with verification, and the assumptions only a
# GPU shows (memory outside the allocator, the GPU presets). Finishes in under 5 minutes.
#
#   bash bench/gpu_check.sh                 # log: $OUT/gpu_check.log if $OUT is set, else bench/gpu_check.log
#   PYTHON=/path/to/python bash bench/gpu_check.sh
#   bash bench/gpu_check.sh --cpu-selftest  # the same checks on the CPU device (no GPU needed)
#
# Needs only torch and this project installed (pip install -e .). Without a GPU it says so,
# names what it skipped, and exits 0. Exit 1: a check failed (or torch/autotune missing).
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
cd "$root"

py="${PYTHON:-}"
if [ -z "$py" ]; then
    if [ -x "$root/.venv/bin/python" ]; then py="$root/.venv/bin/python"
    else py="$(command -v python3 || command -v python || true)"; fi
fi
if [ -z "$py" ]; then echo "gpu_check: no python found (set PYTHON=...)"; exit 1; fi

if [ -n "${OUT:-}" ]; then log="$OUT/gpu_check.log"; else log="$here/gpu_check.log"; fi
mkdir -p "$(dirname "$log")"

if ! "$py" -c "import torch, autotune" 2>/dev/null; then
    echo "gpu_check: $py cannot import torch and autotune: pip install torch, then pip install -e . in $root" | tee "$log"
    exit 1
fi

limit="${GPU_CHECK_SECONDS:-280}"  # the Python part keeps its own, shorter deadline (270 s)
if command -v timeout >/dev/null; then
    timeout --kill-after=10 "$limit" "$py" "$here/gpu_check.py" --log "$log" "$@"
    rc=$?
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "gpu_check: stopped after $limit s (time limit); what ran is in $log" | tee -a "$log"
    fi
else
    "$py" "$here/gpu_check.py" --log "$log" "$@"
    rc=$?
fi
exit "$rc"
