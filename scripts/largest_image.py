#!/usr/bin/env python3
"""The largest image side (a multiple of --step) a model trains at batch 1 within 80 GB per GPU,
per scheme, from metered plans (gems plan). --model (default resnet110v2) and --step (default
32); other arguments go to every plan (e.g. --precision bf16, --classes 2)."""
import argparse, subprocess

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="resnet110v2")
parser.add_argument("--step", type=int, default=32, help="sides tried are multiples of this")
parser.add_argument("--schemes", default="single,mp,mast",
                    help="of single, mp, mast (P=4, 4 GPUs), sp (2x2 tiles, 4 GPUs), sp16 (4x4 tiles, 16 GPUs), "
                         "sp+mp (3x4 tiles + 4 stages, 16 GPUs), sp+mast (2x3 tiles at both ends of 6 stages, 16 GPUs)")
known, extra = parser.parse_known_args()
step = known.step

def fits(args, size):
    out = subprocess.run(["./target/release/gems", "plan", "--model", known.model, "--batch-size", "1", "--image-size", str(size), "--device-memory", "80GB"] + args + extra, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(out.stderr)
    return "exceeds" not in out.stdout

schemes = {
    "single": ([], 1),
    "mp": (["--scheme", "mp", "--split", "4"], 4),
    "mast": (["--scheme", "mast", "--split", "4"], 4),
    "sp": (["--spatial", "2x2"], 4),
    "sp16": (["--spatial", "4x4"], 16),
    "sp+mp": (["--scheme", "mp", "--split", "5", "--spatial", "3x4"], 16),
    "sp+mast": (["--scheme", "mast", "--split", "6", "--spatial", "2x3"], 16),
}
for name in known.schemes.split(","):
    args, gpus = schemes[name]
    hi = step
    while fits(args, hi * 2):
        hi *= 2
    lo, hi = hi, hi * 2
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if fits(args, mid): lo = mid
        else: hi = mid
    print(f"{known.model} {name} ({' '.join(args) or 'one device'}; {gpus} GPUs): largest side {lo} (multiple of {step})")
