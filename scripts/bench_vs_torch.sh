#!/bin/sh
# gems against PyTorch on this machine's CPU (scripts/bench_vs_torch.py says what it measures).
# Makes .venv-torch with PyTorch on first use: PyPI's Linux wheel is the CUDA build and pulls
# the nvidia packages (about 5.5 GB); it runs on the CPU all the same.
set -e
cd "$(dirname "$0")/.."
if ! .venv-torch/bin/python -c "import torch, torchvision" 2>/dev/null; then
    python3 -m venv .venv-torch
    .venv-torch/bin/pip install torch torchvision
fi
[ -x target/release/gems ] || cargo build --release
exec .venv-torch/bin/python scripts/bench_vs_torch.py "$@"
