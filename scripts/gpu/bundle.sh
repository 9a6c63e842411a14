#!/usr/bin/env bash
# Here (with the Rust toolchain): builds what a GPU session runs on the device machine, which
# has no Rust, into device/ (ignored by git; pass it in the device tool's `carry`):
#   device/gems       the binary (stripped)
#   device/cuda_ops   the GPU suite (tests/cuda_ops.rs, stripped)
# Stripped, both fit the tool's 64 MiB carry limit with room to spare.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
cargo build --release
suite=$(cargo test --release --test cuda_ops --no-run 2>&1 |
    sed -n 's/.*Executable tests\/cuda_ops.rs (\(.*\))/\1/p' | tail -1)
[ -x "$suite" ] || { echo "ERROR: no cuda_ops test binary" >&2; exit 1; }
mkdir -p device
cp target/release/gems device/gems
cp "$suite" device/cuda_ops
strip device/gems device/cuda_ops
ls -la device
