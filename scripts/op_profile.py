#!/usr/bin/env python3
"""Where a training step's time goes on this machine, by op family: runs `gems calibrate`
(every node's forward and backward timed at the run's micro-batch) and `gems models --graph`
(what each node is), and prints seconds and shares per family (convolutions by kernel size).

    scripts/op_profile.py --model resnet50 --image-size 224 --batch-size 8 [--threads 2]

Run from the repository root after `cargo build --release`.
"""

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile

GEMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "target", "release", "gems")


def family(desc):
    """`conv 3x3/2 ->128` → `conv 3x3 stride 2`, `batchnorm+relu` stays, `maxpool …` → `maxpool`."""
    m = re.match(r"conv (\d+x\d+)(/\d+)?", desc)
    if m:
        return f"conv {m.group(1)}" + (f" stride {m.group(2)[1:]}" if m.group(2) else "")
    return desc.split()[0]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--image-size", type=int, required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    common = ["--threads", str(a.threads), "--model", a.model, "--image-size", str(a.image_size)]
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([GEMS, "calibrate", *common, "--batch-size", str(a.batch_size),
                        "--out", out.name], check=True, stdout=subprocess.DEVNULL)
        cal = json.load(open(out.name))
    graph = subprocess.run([GEMS, "models", "--graph", a.model, "--image-size", str(a.image_size),
                            "--threads", str(a.threads)],
                           check=True, capture_output=True, text=True).stdout
    kinds = {}
    for line in graph.splitlines():
        m = re.match(r"n(\d+) \S+ = (.*?)\(", line)
        if m:
            kinds[int(m.group(1))] = family(m.group(2))
    totals = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for i, (f, b) in enumerate(zip(cal["forward"], cal["backward"])):
        t = totals[kinds.get(i, "?")]
        t[0] += f
        t[1] += b
        t[2] += 1
    step = sum(f + b for f, b, _ in totals.values())
    print(f"{a.model} {a.image_size}² micro-batch {cal['micro_batch']}, {a.threads} threads: "
          f"{step:.3f} s of ops per step (data {cal['data']:.3f} s, optimizer {cal['optimizer']:.3f} s)")
    print(f"{'family':<22} {'nodes':>5} {'forward s':>10} {'backward s':>11} {'share':>6}")
    for k, (f, b, n) in sorted(totals.items(), key=lambda kv: -(kv[1][0] + kv[1][1])):
        print(f"{k:<22} {n:>5} {f:>10.4f} {b:>11.4f} {100 * (f + b) / step:>5.1f}%")


if __name__ == "__main__":
    main()
