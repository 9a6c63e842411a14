#!/usr/bin/env bash
# Throughput of `gems train` from two builds, alternating runs so that both see the same
# machine: single-device training and MAST over 2 local ranks (resnet20v2, 32², synthetic).
#
#   scripts/bench_runtime.sh OLD_GEMS NEW_GEMS [ROUNDS]
#
# Prints each run's images/s and, per configuration, the medians and their ratio (new/old).
set -euo pipefail
old=$1 new=$2 rounds=${3:-5}
configs=(
    "single|train --threads 2 --steps 40"
    "mast --split 2|train --threads 2 --steps 20 --scheme mast --split 2 --parts 2"
)
median() { sort -g | awk '{v[NR]=$1} END {print (NR%2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2)}'; }
for c in "${configs[@]}"; do
    name=${c%%|*} args=${c#*|}
    declare -a a=() b=()
    for ((i = 0; i < rounds; i++)); do
        # shellcheck disable=SC2086
        a+=("$("$old" $args | awk '/throughput/ {print $2}')")
        # shellcheck disable=SC2086
        b+=("$("$new" $args | awk '/throughput/ {print $2}')")
    done
    ma=$(printf '%s\n' "${a[@]}" | median) mb=$(printf '%s\n' "${b[@]}" | median)
    printf '%-16s old %s\n%-16s new %s\n' "$name" "${a[*]}" "" "${b[*]}"
    printf '%-16s median old %.1f, new %.1f images/s: new/old %.3f\n' "$name" "$ma" "$mb" "$(awk -v a="$ma" -v b="$mb" 'BEGIN {print b / a}')"
done
