#!/usr/bin/env bash
# There (on the device machine, from the repository root): runs what bundle.sh built and
# writes every log under $OUT. Parts, in the order a 30-minute lease should spend them:
#   info     gems info, nvidia-smi
#   suite    the GPU suite (every op against the CPU, whole steps, offload bit-identity)
#   kernels  gems bench kernels: resnet110v2 at 1024² and resnet50 at 224², fp32 and tf32,
#            native kernels and cuDNN side by side (--conv both); bf16 and fp16 native
#   train    training images/s: resnet50 224² B=64 and resnet110v2 1024² at the largest batch
#            the GPU's memory holds, fp32 and tf32, native and cuDNN convolutions, bf16 and
#            fp16 native (mixed precision: cuDNN runs fp32/tf32 only here); and
#            resnet110v2 at 1024² fed from a whole-slide image (does the loader keep up?)
#   offload  gems bench offload: GEMS's offload study (4 models × 6 variants) and the host link
#   torch    scripts/torch_reference.py all (PyTorch on the same GPU; see scripts/gpu_session.md)
# Usage: scripts/gpu/run.sh info suite kernels ...   (no argument: all of them)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-/tmp/gems-out}
mkdir -p "$OUT"
export GEMS_CACHE_DIR=${GEMS_CACHE_DIR:-/tmp/gems-cache}
export RUST_BACKTRACE=1
G=device/gems
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(info suite kernels train offload torch)

step() { echo "=== $*" | tee -a "$OUT/steps.txt"; }

for part in "${parts[@]}"; do
    case $part in
    info)
        step info
        { $G info; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; } \
            2>&1 | tee "$OUT/info.txt"
        ;;
    suite)
        step suite
        device/cuda_ops --include-ignored --test-threads=1 2>&1 | tee "$OUT/suite.txt"
        ;;
    kernels)
        for p in fp32 tf32; do
            step "kernels resnet110v2 $p"
            $G bench kernels --device cuda --precision $p --conv both --model resnet110v2 \
                --image-size 1024 --batch 4 --json "$OUT/kernels-resnet110v2-$p.json" 2>&1 |
                tee -a "$OUT/kernels.txt"
            step "kernels resnet50 $p"
            $G bench kernels --device cuda --precision $p --conv both --model resnet50 \
                --image-size 224 --batch 64 --json "$OUT/kernels-resnet50-$p.json" 2>&1 |
                tee -a "$OUT/kernels.txt"
        done
        for p in bf16 fp16; do
            step "kernels resnet110v2 $p native"
            $G bench kernels --device cuda --precision $p --conv native --model resnet110v2 \
                --image-size 1024 --batch 4 --json "$OUT/kernels-resnet110v2-$p.json" 2>&1 |
                tee -a "$OUT/kernels.txt"
            step "kernels resnet50 $p native"
            $G bench kernels --device cuda --precision $p --conv native --model resnet50 \
                --image-size 224 --batch 64 --json "$OUT/kernels-resnet50-$p.json" 2>&1 |
                tee -a "$OUT/kernels.txt"
        done
        ;;
    train)
        for p in fp32 tf32; do
            for conv in native cudnn; do
                step "train resnet50 224 B=64 $p $conv"
                $G train --device cuda --precision $p --conv $conv --model resnet50 \
                    --image-size 224 --classes 10 --batch-size 64 --steps 30 --warmup 0 2>&1 |
                    tee -a "$OUT/train.txt"
                step "train resnet110v2 1024 largest batch $p $conv"
                $G train --device cuda --precision $p --conv $conv --model resnet110v2 \
                    --image-size 1024 --batch-size max --steps 10 --warmup 0 2>&1 |
                    tee -a "$OUT/train.txt"
            done
        done
        for p in bf16 fp16; do
            step "train resnet50 224 B=64 $p native"
            $G train --device cuda --precision $p --model resnet50 --image-size 224 \
                --classes 10 --batch-size 64 --steps 30 --warmup 0 2>&1 | tee -a "$OUT/train.txt"
            step "train resnet110v2 1024 largest batch $p native"
            $G train --device cuda --precision $p --model resnet110v2 --image-size 1024 \
                --batch-size max --steps 10 --warmup 0 2>&1 | tee -a "$OUT/train.txt"
        done
        step "train resnet110v2 1024 B=8 tf32 from slide tiles"
        slides=/tmp/gems-slides
        rm -rf "$slides" && mkdir -p "$slides"
        $G data make-slide --out "$slides/a.tiff" --width 16384 --height 16384 --classes 2 \
            --labels "$slides/labels.csv" 2>&1 | tee -a "$OUT/train.txt"
        $G train --device cuda --precision tf32 --model resnet110v2 --image-size 1024 \
            --data "slides:$slides" --labels "$slides/labels.csv" --augment --workers 14 \
            --prefetch 8 --batch-size 8 --steps 20 --warmup 0 2>&1 | tee -a "$OUT/train.txt"
        ;;
    offload)
        step offload
        $G bench offload --device cuda --json "$OUT/offload.json" 2>&1 | tee "$OUT/offload.txt"
        ;;
    torch)
        step torch
        PYTHONUNBUFFERED=1 python3 scripts/torch_reference.py all --budget-s 420 \
            --json "$OUT/torch.json" 2>&1 | tee "$OUT/torch.txt"
        ;;
    *)
        echo "unknown part '$part' (info suite kernels train offload torch)" >&2
        exit 2
        ;;
    esac
done
