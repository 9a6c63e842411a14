#!/usr/bin/env bash
# Here (with the Rust toolchain): builds what scripts/gpu/run.sh runs on the device machine,
# which needs no Rust, into device/ (ignored by git; copy it there with the checkout):
#   device/gems       the binary (release, default features: no emulator, no poisoned storage)
#   device/cuda_ops   the GPU suite (tests/cuda_ops.rs)
# Both are located from cargo's own report (so CARGO_TARGET_DIR and friends are honoured) and
# stripped: about 15 MiB together.
# Usage: scripts/gpu/bundle.sh [--into DIR] [--no-strip]   (scripts/gpu/dry_run.sh uses both)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
into=device
strip=1
while [ $# -gt 0 ]; do
    case $1 in
    --into) into=$2; shift 2 ;;
    --no-strip) strip=0; shift ;;
    *) echo "usage: scripts/gpu/bundle.sh [--into DIR] [--no-strip]" >&2; exit 2 ;;
    esac
done

# The path of the executable cargo built for target $1 (cargo's JSON messages on stdin).
executable() {
    python3 -c '
import json, sys
name = sys.argv[1]
paths = [m["executable"] for m in map(json.loads, sys.stdin)
         if m.get("reason") == "compiler-artifact" and m.get("executable")
         and m["target"]["name"] == name]
print(paths[-1] if paths else "")' "$1"
}

mkdir -p "$into"
# The binary first: the test build below turns on the test features (cuda-emu, poison) for
# the crate, and cargo's target/release/gems is then that build.
gems=$(cargo build --release --bin gems --message-format=json-render-diagnostics | executable gems)
[ -x "$gems" ] || { echo "ERROR: cargo reported no gems binary" >&2; exit 1; }
cp "$gems" "$into/gems"
suite=$(cargo test --release --test cuda_ops --no-run --message-format=json-render-diagnostics |
    executable cuda_ops)
[ -x "$suite" ] || { echo "ERROR: cargo reported no cuda_ops test binary" >&2; exit 1; }
cp "$suite" "$into/cuda_ops"
[ $strip = 1 ] && strip "$into/gems" "$into/cuda_ops"
ls -la "$into"
