#!/usr/bin/env bash
# The GPU suite on the emulated driver under AddressSanitizer, like compute-sanitizer's
# memcheck: a kernel, copy or memset reading or writing outside a host allocation is reported.
# build.rs builds the driver, cuBLAS and the plain kernels with it (GEMS_EMU_SANITIZE=address);
# its runtime is preloaded into the test binary only, not into cargo. Arguments go to the test
# binary (e.g. --skip resnet). The next plain cargo test rebuilds the libraries without it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
bin=$(GEMS_EMU_SANITIZE=address cargo test --release --test cuda_ops --no-run 2>&1 |
    sed -n 's/.*Executable tests\/cuda_ops.rs (\(.*\))/\1/p' | tail -n1)
exec env ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0:detect_stack_use_after_return=0}" \
    LD_PRELOAD="$(g++ -print-file-name=libasan.so)" "$bin" "$@"
