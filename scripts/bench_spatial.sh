#!/usr/bin/env bash
# The cost of spatial parallelism's machinery on the CPU: the same training with each sample
# in 1x2 tiles on two local ranks (halo exchange, BN sums over the tiles, the boundary to the
# whole-value tail) against one rank, at the same batch and the same cores, alternating runs.
#
#   scripts/bench_spatial.sh [ROUNDS] [MODEL] [SIDE] [BATCH] [STEPS]
#
# Defaults: 5 rounds of resnet110v2 at 256², B = 2, 6 steps. Prints each run's images/s and the
# medians' ratio (tiles / one rank). Both runs use every core: one rank's kernels use them all,
# the two tile ranks share them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rounds=${1:-5} model=${2:-resnet110v2} side=${3:-256} batch=${4:-2} steps=${5:-6}
cargo build --release --quiet
gems=./target/release/gems
args=(train --model "$model" --image-size "$side" --batch-size "$batch" --steps "$steps" --warmup 1)
# images/s from the run's closing line: "done: N steps, M images in S s".
rate() { awk '/^done:/ {print $4 / $7}'; }
median() { sort -g | awk '{v[NR]=$1} END {print (NR%2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2)}'; }
one=() tiles=()
for ((i = 0; i < rounds; i++)); do
    one+=("$("$gems" "${args[@]}" | rate)")
    tiles+=("$("$gems" "${args[@]}" --spatial 1x2 | rate)")
done
m1=$(printf '%s\n' "${one[@]}" | median) m2=$(printf '%s\n' "${tiles[@]}" | median)
printf '%s %s², B = %s, %s steps (%s)\n' "$model" "$side" "$batch" "$steps" "$(nproc) cores"
printf 'one rank    %s images/s\n' "${one[*]}"
printf '1x2 tiles   %s images/s\n' "${tiles[*]}"
printf 'median one rank %.3f, 1x2 tiles %.3f images/s: tiles/one %.3f\n' "$m1" "$m2" \
    "$(awk -v a="$m1" -v b="$m2" 'BEGIN {print b / a}')"
