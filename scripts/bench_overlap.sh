#!/usr/bin/env bash
# What overlapping the halo exchange with the interior's compute hides: the same spatial
# training with two gems binaries (OLD: gathers each convolution's halo, then computes; NEW:
# computes the interior while the halo travels), alternating runs. Prints each run's images/s
# and the seconds its ranks waited for halos (summed over ranks, per step), and the medians.
#
#   scripts/bench_overlap.sh OLD NEW [ROUNDS] [MODEL] [SIDE] [BATCH] [STEPS] [GRID]
#
# OLD and NEW are gems binaries that both count halo waits (commit bb9dfa7 or later; e.g.
# bb9dfa7 itself, built in a git worktree, for OLD), each built by `cargo build --release` (a
# `cargo test` build turns on the test-only NaN fill of fresh buffers, which costs time).
# Defaults: 5 rounds of resnet110v2 at 512², B = 1, 4 steps, 1x2 tiles.
set -euo pipefail
old=$1 new=$2 rounds=${3:-5} model=${4:-resnet110v2} side=${5:-512} batch=${6:-1} steps=${7:-4}
grid=${8:-1x2}
args=(train --model "$model" --image-size "$side" --batch-size "$batch" --steps "$steps"
    --warmup 1 --spatial "$grid")
# "images/s halo-wait-per-step" of one run: the closing line "done: N steps, M images in S s"
# and the per-rank table's halo column (the fifth).
measure() {
    "$1" "${args[@]}" | awk -v steps="$steps" '
        /^done:/ {rate = $4 / $7}
        /halo wait s/ {table = 1; next}
        table && $1 ~ /^[0-9]+$/ {halo += $5}
        END {printf "%.4f %.4f\n", rate, halo / steps}'
}
median() { sort -g | awk '{v[NR]=$1} END {print (NR%2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2)}'; }
o=() n=()
for ((i = 0; i < rounds; i++)); do
    o+=("$(measure "$old")")
    n+=("$(measure "$new")")
done
col() { printf '%s\n' "$@" | awk -v c="$col" '{print $c}'; }
printf '%s %s², B = %s, %s steps, %s tiles (%s cores), %s\n' "$model" "$side" "$batch" "$steps" \
    "$grid" "$(nproc)" "$(date -u '+%Y-%m-%d %H:%M UTC')"
for which in old new; do
    declare -n runs=${which:0:1}
    col=1 rates=$(col "${runs[@]}" | tr '\n' ' ')
    col=2 waits=$(col "${runs[@]}" | tr '\n' ' ')
    col=1 mr=$(col "${runs[@]}" | median)
    col=2 mw=$(col "${runs[@]}" | median)
    printf '%s  images/s: %s (median %s); halo wait s/step: %s (median %s)\n' \
        "$which" "$rates" "$mr" "$waits" "$mw"
    eval "m_${which}_rate=$mr m_${which}_wait=$mw"
done
awk -v a="$m_old_rate" -v b="$m_new_rate" -v wa="$m_old_wait" -v wb="$m_new_wait" 'BEGIN {
    printf "new/old images/s %.3f; halo wait hidden %.0f%% (%.3f -> %.3f s per step)\n",
        b / a, 100 * (1 - wb / wa), wa, wb }'
