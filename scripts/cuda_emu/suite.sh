#!/usr/bin/env bash
# Runs the GPU suite (tests/cuda_ops.rs, the tests marked "needs a CUDA device") against the
# emulated driver and cuBLAS of build.sh: the Rust CUDA backend, cudarc and the kernels' real
# sources run end to end on the CPU. cuDNN is not emulated, so its tests are skipped. Extra
# arguments go to the test binary (a test name, --exact, ...); GEMS_FEATURES (e.g. "--features
# mpi") to cargo, so that a build with those features is reused. Needs NVRTC (scripts/test.sh
# links it as target/nvrtc/libnvrtc.so) and g++.
#
# Not a GPU run: work runs as it is issued (no races between streams can show), and the
# arithmetic is emu.h's. What it does show: every launch's arguments, shapes and buffers,
# copies, pinned memory, events and the allocator, against the CPU backend.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
bash scripts/cuda_emu/build.sh "$root/target/cuda_emu"
export GEMS_CUDA_LIB_DIRS="$root/target/cuda_emu"
export LD_LIBRARY_PATH="$root/target/nvrtc${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export GEMS_CACHE_DIR="${GEMS_CACHE_DIR:-$root/target/cuda_emu/cache}"
# shellcheck disable=SC2086
cargo test --release ${GEMS_FEATURES:-} --test cuda_ops -- --ignored --skip cudnn "$@"
