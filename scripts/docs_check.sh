#!/usr/bin/env bash
# Runs the commands of the user documentation, so that a renamed flag fails CI, not a reader.
#
# Convention: a fenced block opened with ```sh run (in README.md or docs/*.md) is run; one
# opened with plain ```sh is shown only (it needs a GPU, several hosts, SLURM or PyTorch, or
# takes minutes; the text around it says so). The blocks of one file run in order, each with
# `bash -euo pipefail`, in one temporary folder (so a later block sees the files an earlier
# one wrote), with `gems` on PATH. A block that fails stops the check with its file and line
# and the block's output.
#
#   scripts/docs_check.sh [FILE.md ...]    (default: README.md and docs/*.md)
#
# Environment: GEMS=path of the gems binary to run [default: cargo build --release, then
# target/release/gems].
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)

if [ -z "${GEMS:-}" ]; then
    cargo build --release --quiet --bin gems
    GEMS="$ROOT/target/release/gems"
fi
bin=$(mktemp -d)
ln -s "$(realpath "$GEMS")" "$bin/gems"
trap 'rm -rf "$bin"' EXIT

if [ "$#" -eq 0 ]; then
    set -- README.md docs/*.md
fi

for doc in "$@"; do
    work=$(mktemp -d)
    # One file per block: block-<line of its opening fence>.sh, in order.
    awk -v dir="$work" '
        /^```sh run[ \t]*$/ { out = sprintf("%s/block-%06d.sh", dir, NR); next }
        /^```/ && out { close(out); out = ""; next }
        out { print > out }
    ' "$doc"
    blocks=$(find "$work" -name 'block-*.sh' | sort)
    n=0
    for block in $blocks; do
        line=$((10#$(basename "$block" .sh | cut -d- -f2)))
        if ! (cd "$work" && PATH="$bin:$PATH" bash -euo pipefail "$block") >"$work/log" 2>&1; then
            tail -n 30 "$work/log" >&2
            printf 'ERROR: %s:%s: this block failed (above: its last output)\n' "$doc" "$line" >&2
            exit 1
        fi
        n=$((n + 1))
    done
    printf '   %s: %d blocks ran\n' "$doc" "$n"
    rm -rf "$work"
done
