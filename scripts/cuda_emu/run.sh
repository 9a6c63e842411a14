#!/usr/bin/env bash
# Runs cuda/*.cu on the CPU under a small emulation of CUDA (emu.h: a block is blockDim.x
# threads with barriers) and compares every kernel with a reference: conv (f32, TF32, bf16;
# forward, backward-data, backward-filter), batchnorm and BN+ReLU, pools, loss, SGD (bit for
# bit), dropout masks, concat. Needs g++ with C++20. Not a GPU test: it checks indexing,
# tiling and reductions, not timing, memory coherence or the real tensor cores.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for t in conv_test ops_test; do
    g++ -std=c++20 -O1 -ffp-contract=off -I../../include -include emu.h -o "$out/$t" "$t.cpp" -lpthread
    "$out/$t"
done
