#!/usr/bin/env bash
# Runs cuda/*.cu on the CPU under a small emulation of CUDA (emu.h: a block is blockDim.x
# threads with barriers) and compares every kernel with a reference: conv (f32, TF32, bf16,
# f16; forward, backward-data, backward-filter), batchnorm and BN+ReLU, pools, loss, SGD (bit
# for bit, with grad_scale), dropout masks, concat (ops_test: f32), and every f32, bf16 and
# f16 stamp of the non-conv kernels, the casts and the non-finite check (ops16_test). Needs
# g++ with C++20 (and _Float16). Not a GPU test: it checks indexing, tiling and reductions,
# not timing, memory coherence or the real tensor cores.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for t in conv_test ops_test ops16_test; do
    g++ -std=c++20 -O1 -ffp-contract=off -I../../include -include emu.h -o "$out/$t" "$t.cpp" -lpthread
    "$out/$t"
done
