#!/usr/bin/env bash
# There (on the device machine, from the repository root, after scripts/gpu/bundle.sh here):
# one command that runs within 8 minutes on an H100 or H200 and compiles nothing but NVRTC's
# kernels. Steps, in order of value, each under its own time limit and all under one deadline:
#   info       gems info and nvidia-smi: the card, the driver, the libraries found
#   suite      the GPU suite: every op against the CPU, whole steps, offload bit-identity
#   sanitizer  compute-sanitizer memcheck (the f32 op tests) and racecheck (conv, batch norm)
#   kernels    gems bench kernels: resnet110v2 at 1024², native kernels and cuDNN side by side
#   offload    gems bench offload: GEMS's offload study (resnet50) in every copy mode
#   mast       one MAST step of resnet110v2 at 1024² (P=2, η=2, m=2, B=2, both ranks on the one
#              GPU: their metered peaks add up to about 50 GiB): the metered
#              plan's peak per rank and its predicted step (op times measured on the GPU at
#              first use), then the measured ones
#   orders     every pipeline order of resnet110v2 at 1024² (mp, P=2, m=4, B=4, both ranks on
#              the one GPU): bubble, peaks, predicted and measured step (gems plan --order all
#              --measure 3; its log is mast.txt's end)
# Results: at most 8 files directly under $OUT (summary.txt first; each log whole), and the
# summary on the screen. Without a GPU (or with GEMS_GPU_DRY=1) every step still starts, with
# short limits, and the summary says "no GPU" for those that need one: the test command runs
# it so, to keep the script working between runs on a GPU.
# Usage: scripts/gpu/run.sh [STEP ...]   (no argument: all of them)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-/tmp/gems-out}
mkdir -p "$OUT"
export GEMS_CACHE_DIR=${GEMS_CACHE_DIR:-/tmp/gems-cache}
export RUST_BACKTRACE=1
BIN=${GEMS_DEVICE_BIN:-device}
G=$BIN/gems
SUITE=$BIN/cuda_ops
TOTAL_S=${GEMS_GPU_BUDGET_S:-450}
start=$(date +%s)
summary=$OUT/summary.txt
: >"$summary"

gpu=1
if [ -n "${GEMS_GPU_DRY:-}" ] || ! nvidia-smi -L >/dev/null 2>&1; then
    gpu=0
fi
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)

note() { echo "$*" | tee -a "$summary"; }

# step NAME LIMIT_S LOG CMD...: runs CMD with its output appended to LOG, for at most LIMIT_S
# seconds (less when the deadline is nearer; 10 s without a GPU), and notes how it ended.
step() {
    local name=$1 limit=$2 log=$3
    shift 3
    local left=$((TOTAL_S - ($(date +%s) - start)))
    [ "$gpu" = 1 ] || limit=10
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -lt 5 ]; then
        note "$(printf '%-34s skipped: the %d s deadline is near' "$name" "$TOTAL_S")"
        return
    fi
    echo "=== $name: $*" >>"$log"
    local t0=$(date +%s) rc
    timeout -k 5 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    local took=$(($(date +%s) - t0)) how
    if [ $rc = 0 ]; then
        how=ok
    elif [ $rc = 124 ] || [ $rc = 137 ]; then
        how="stopped at its ${limit} s limit"
    elif [ "$gpu" = 0 ] && tail -n 40 "$log" | grep -qiE "no usable CUDA|no CUDA device|CUDA driver|cuda device"; then
        how="no GPU (it started and said so)"
    else
        how="failed (exit $rc): $(grep -E 'error|Error|panicked|FAILED' "$log" | tail -1 | cut -c1-120)"
    fi
    note "$(printf '%-34s %4d s  %s' "$name" "$took" "$how")"
}

# The last lines of LOG that match PATTERN, into the summary.
quote() { grep -E "$2" "$1" 2>/dev/null | tail -n "${3:-12}" | sed 's/^/    /' >>"$summary"; }

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(info suite sanitizer kernels offload mast orders)
note "gems GPU run, $(date -u +%FT%TZ), budget ${TOTAL_S} s, GPU: $([ $gpu = 1 ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo none)"
for s in "${steps[@]}"; do
    case $s in
    info)
        step "info: gems info" 30 "$OUT/suite.txt" $G info
        [ $gpu = 1 ] && nvidia-smi >>"$OUT/suite.txt" 2>&1
        quote "$OUT/suite.txt" '^(CUDA|  driver|  nvrtc|  cublas|  cudnn|GPUs|  cuda:|--device)' 10
        ;;
    suite)
        # Without a GPU, only that it starts: here it would run on the emulator, for minutes.
        if [ $gpu = 1 ]; then args=(--include-ignored --test-threads=4); else args=(--list); fi
        step "suite: GPU ops against the CPU" 170 "$OUT/suite.txt" $SUITE "${args[@]}"
        quote "$OUT/suite.txt" '^test result|FAILED|panicked' 12
        ;;
    sanitizer)
        if [ -z "$sanitizer" ]; then
            note "sanitizer: compute-sanitizer not found; skipped"
        else
            step "sanitizer: memcheck, f32 ops" 80 "$OUT/sanitizer.txt" \
                $sanitizer --tool memcheck --error-exitcode 3 $SUITE fp32_match --test-threads=1
            step "sanitizer: racecheck, conv + BN" 70 "$OUT/sanitizer.txt" \
                $sanitizer --tool racecheck --error-exitcode 3 $SUITE \
                conv_fp32_matches_cpu batchnorm_fp32_matches_cpu --test-threads=1
            quote "$OUT/sanitizer.txt" 'ERROR SUMMARY|RACECHECK SUMMARY|Invalid|Race reported' 10
        fi
        ;;
    kernels)
        step "kernels: resnet110v2 1024² fp32" 70 "$OUT/kernels.txt" \
            $G bench kernels --device cuda --precision fp32 --conv both --model resnet110v2 \
            --image-size 1024 --batch 4 --repeats 5 --json "$OUT/kernels.json"
        quote "$OUT/kernels.txt" 'TFLOP|GB/s|peak|total' 16
        ;;
    offload)
        step "offload: resnet50 224², copy modes" 60 "$OUT/offload.txt" \
            $G bench offload --device cuda --models resnet50 --images 64 --batch 16 \
            --json "$OUT/offload.json"
        quote "$OUT/offload.txt" 'resnet50|host link|GB/s' 12
        ;;
    mast)
        step "mast: metered plan, resnet110v2 1024²" 60 "$OUT/mast.txt" \
            $G plan --device cuda --model resnet110v2 --image-size 1024 --batch-size 2 \
            --scheme mast --split 2 --parts 2 --replicas 2
        step "mast: one measured step" 60 "$OUT/mast.txt" \
            $G train --device cuda --model resnet110v2 --image-size 1024 --batch-size 2 \
            --scheme mast --split 2 --parts 2 --replicas 2 --steps 2 --warmup 0
        quote "$OUT/mast.txt" 'rank [0-9]|peak memory|predicted|throughput|done:' 12
        ;;
    orders)
        step "orders: resnet110v2 1024², mp P=2" 90 "$OUT/mast.txt" \
            $G plan --device cuda --model resnet110v2 --image-size 1024 --batch-size 4 \
            --scheme mp --split 2 --parts 4 --order all --measure 3
        quote "$OUT/mast.txt" '^(orders|order|gpipe|1f1b|interleaved|zbh1|zbv)' 8
        ;;
    *)
        echo "unknown step '$s' (info suite sanitizer kernels offload mast orders)" >&2
        exit 2
        ;;
    esac
done
note "done in $(($(date +%s) - start)) s; logs: $(cd "$OUT" && ls | tr '\n' ' ')"
