#!/usr/bin/env bash
# Runs every fuzz target for SECONDS each (default 60) with its seed corpus,
# without a sanitizer (stable toolchain). Findings land in fuzz/artifacts/.
# CI runs this briefly; for a long campaign: fuzz/run-all.sh 3600
set -euo pipefail
cd "$(dirname "$0")"
secs=${1:-60}
command -v cargo-fuzz >/dev/null || cargo install --locked cargo-fuzz
work=${FUZZ_WORK:-target/fuzz-corpus}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for target in snapshot_state snapshot_manifest control_request guest_frames virtio_block virtio_vsock virtio_net; do
    # New inputs go to the work corpus; the checked-in seeds are read only.
    mkdir -p "$work/$target"
    echo "== fuzz $target for ${secs}s"
    rc=0
    cargo fuzz run "$target" -O --sanitizer none "$work/$target" "corpus/$target" -- \
        -max_total_time="$secs" -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1 \
        >"$log" 2>&1 || rc=$?
    grep -E 'stat::number_of_executed_units|stat::new_units_added' "$log" || true
    findings=$(find "artifacts/$target" -maxdepth 1 -type f \
        \( -name 'crash-*' -o -name 'oom-*' -o -name 'timeout-*' -o -name 'leak-*' \) 2>/dev/null | head -n 1)
    if ((rc != 0)) || [[ -n $findings ]]; then
        tail -n 40 "$log" >&2
        echo "fuzz $target failed (exit $rc): a build error, or a finding in fuzz/artifacts/$target" >&2
        exit 1
    fi
done
