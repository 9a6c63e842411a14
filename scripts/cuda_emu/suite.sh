#!/usr/bin/env bash
# Runs the GPU suite (tests/cuda_ops.rs, the tests marked "needs a CUDA device") against the
# emulated driver and cuBLAS of build.sh: the Rust CUDA backend, cudarc and the kernels' real
# sources run end to end on the CPU. cuDNN is not emulated, so its tests are skipped. Extra
# arguments go to the test binary (a test name, --exact, ...); GEMS_FEATURES (e.g. "--features
# mpi") to cargo, so that a build with those features is reused. Needs NVRTC (scripts/test.sh
# links it as target/nvrtc/libnvrtc.so) and g++. EMU_SANITIZE=address runs it under
# AddressSanitizer: a kernel reading or writing outside a device buffer is reported.
#
# Not a GPU run: work runs as it is issued (no races between streams can show), and the
# arithmetic is emu.h's. What it does show: every launch's arguments, shapes and buffers,
# copies, pinned memory, events and the allocator, against the CPU backend.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
emu="$root/target/cuda_emu${EMU_SANITIZE:+_$EMU_SANITIZE}"
bash scripts/cuda_emu/build.sh "$emu"
export GEMS_CUDA_LIB_DIRS="$emu"
export LD_LIBRARY_PATH="$root/target/nvrtc${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export GEMS_CACHE_DIR="${GEMS_CACHE_DIR:-$root/target/cuda_emu/cache}"
filter=(--ignored --skip cudnn "$@")
if [[ -z "${EMU_SANITIZE:-}" ]]; then
    # shellcheck disable=SC2086
    exec cargo test --release ${GEMS_FEATURES:-} --test cuda_ops -- "${filter[@]}"
fi
if [[ "$EMU_SANITIZE" != address ]]; then
    echo "EMU_SANITIZE=$EMU_SANITIZE: only address is supported" >&2
    exit 2
fi
# The sanitizer's runtime is preloaded into the test binary only, not into cargo.
# shellcheck disable=SC2086
bin=$(cargo test --release ${GEMS_FEATURES:-} --test cuda_ops --no-run 2>&1 |
    grep -o 'target/release/deps/cuda_ops-[0-9a-f]*' | tail -n1)
exec env ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0:detect_stack_use_after_return=0}" \
    LD_PRELOAD="$(g++ -print-file-name=libasan.so)" "$root/$bin" "${filter[@]}"
