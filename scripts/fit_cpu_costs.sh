#!/usr/bin/env bash
# Refreshes the default CPU cost model (src/plan/cpu_costs.json): calibrates a corpus of
# built-in models (`gems calibrate`: every op timed at a micro-batch as a step runs it, a split
# backward's B and W also apart, and the loss at each output) at 1 thread and at every core,
# then fits each op family's seconds per call, per image, per output plane, per FLOP and per
# byte (those beyond the cache apart), how its backward divides into B and W, and the loss's
# seconds (`gems fit-costs`), and last how much slower than those fits ranks computing at once
# on this CPU run (scripts/fit_at_once.py, from measured steps of two-rank pipelines). The
# corpus is calibrated ROUNDS times over (default 3) and the fit keeps each configuration's
# fastest round: a shared VM's speed moves by 10-40% from one minute to the next (its
# neighbours only add time), and its fastest round, the machine's own speed, holds from hour
# to hour. Run on a quiet machine after `cargo build --release`; takes about five and a half
# minutes a round on 2 cores, and two more for the pipelines. Check the result with
# scripts/bench_cost_model.py.
#
#   scripts/fit_cpu_costs.sh [OUT [PROFILES [ROUNDS]]]
#
# OUT defaults to src/plan/cpu_costs.json; PROFILES, a folder to keep the calibrations in
# (default: a temporary one).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
GEMS=target/release/gems
OUT=${1:-src/plan/cpu_costs.json}
if [ -n "${2:-}" ]; then
    DIR=$2
    mkdir -p "$DIR"
else
    DIR=$(mktemp -d)
    trap 'rm -rf "$DIR"' EXIT
fi

# model, side, micro-batch: small and large channel counts, every conv kernel and stride the
# models use, pools, upsampling and concatenation (U-Nets), fully connected layers; each model
# at two micro-batches, for how a kernel's time grows with the batch.
CORPUS=(
    "resnet20v2 32 32" "resnet20v2 32 8"
    "resnet56v2 64 8" "resnet56v2 64 2"
    "resnet110v2 128 2" "resnet110v2 128 4"
    "resnet50 224 4" "resnet50 224 1"
    "alexnet 224 8" "alexnet 224 32"
    "unet_d3_w16 128 2" "unet_d3_w16 128 1"
    "unet_resnet18 128 2" "unet_resnet18 128 4"
    "amoebanet_d 64 2" "amoebanet_d 64 1"
    "inception_v3 299 1" "inception_v3 299 2"
    "resnet50_gn 128 2" "resnet50_gn 128 4"
    "vgg19 64 4" "vgg19 64 16"
)
ROUNDS=${3:-3}
CORES=$(nproc)
for round in $(seq "$ROUNDS"); do
    for threads in $(printf '%s\n' 1 "$CORES" | sort -un); do
        for entry in "${CORPUS[@]}"; do
            read -r model side batch <<<"$entry"
            "$GEMS" --threads "$threads" calibrate --model "$model" --image-size "$side" \
                --batch-size "$batch" --repeats 5 \
                --out "$DIR/$threads-$model-$side-m$batch-$round.json"
        done
    done
done
"$GEMS" fit-costs --out "$OUT" "$DIR"/*.json
python3 scripts/fit_at_once.py "$OUT"
