#!/usr/bin/env bash
# Here, without a GPU: runs scripts/gpu/run.sh as the device machine would, on what
# scripts/gpu/bundle.sh would carry (the release binary and the GPU suite, built by cargo and
# located from its report), with GEMS_GPU_DRY=1. Fails unless every step started and either
# finished or said "no GPU": a flag the binary no longer takes, a step that crashes, a missing
# binary or an unknown step name all fail here, long before a GPU machine runs it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
bin=$(mktemp -d)
out=$(mktemp -d)
trap 'rm -rf "$bin" "$out"' EXIT
scripts/gpu/bundle.sh --into "$bin" --no-strip >/dev/null
GEMS_GPU_DRY=1 GEMS_DEVICE_BIN="$bin" OUT="$out" scripts/gpu/run.sh
missing=()
for step in info suite sanitizer kernels offload mast; do
    grep -q "^$step: " "$out/summary.txt" || missing+=("$step")
done
bad=$(grep -E '^[a-z]+: ' "$out/summary.txt" |
    grep -vE '  ok$|no GPU \(it started and said so\)$|compute-sanitizer not found; skipped$' || true)
if [ ${#missing[@]} -gt 0 ] || [ -n "$bad" ]; then
    echo "ERROR: the GPU script's dry run: steps not reported: ${missing[*]:-none}; not clean:" >&2
    echo "${bad:-none}" >&2
    exit 1
fi
echo "the GPU script's dry run: every step started cleanly"
