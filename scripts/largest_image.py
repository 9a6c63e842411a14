#!/usr/bin/env python3
"""The largest image side (multiple of 32) resnet110v2 trains at batch 1 within 80 GB per GPU, per scheme, from metered plans (gems plan). Extra arguments go to every plan (e.g. --precision bf16)."""
import subprocess, sys
extra = sys.argv[1:]
def fits(args, size):
    out = subprocess.run(["./target/release/gems", "plan", "--model", "resnet110v2", "--batch-size", "1", "--image-size", str(size), "--device-memory", "80GB"] + args + extra, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(out.stderr)
    return "exceeds" not in out.stdout
for name, args in [("single", []), ("mp P=4", ["--scheme", "mp", "--split", "4"]), ("mast P=4", ["--scheme", "mast", "--split", "4"])]:
    lo, hi = 32, 32
    while fits(args, hi * 2):
        hi *= 2
    lo, hi = hi, hi * 2
    while hi - lo > 32:
        mid = (lo + hi) // 2 // 32 * 32
        if fits(args, mid): lo = mid
        else: hi = mid
    print(f"{name}: largest side {lo} (multiple of 32)")
