#!/usr/bin/env python3
"""How far the default CPU cost model's predicted step is from the measured one, for every
pipeline order: for a few models and schemes, each order the scheme runs is planned and
trained a few steps on local ranks (`gems plan --order ORDER --measure STEPS`, a process of
its own), and the predicted and measured steps are printed with their error against the 10%
the model is held to.

A shared VM's step times move by 10-40% from one minute to the next, with the machine
otherwise idle: its neighbours take memory bandwidth and cache, which only adds time. Each
order is measured in --rounds rounds; every round visits every order of every run once, in a
shuffled sequence, so an order's rounds lie minutes apart. The fastest round is the machine's
own speed, the one the model is fitted to (`gems fit-costs` keeps the fastest calibration of
each configuration) and the one this checks; the rounds' median is printed beside it. Each
measurement trains about --seconds of steps after the first (at least 3): the shorter a
measurement, the likelier a round finds the machine undisturbed throughout.

    scripts/bench_cost_model.py [--rounds 10] [--seconds 2] [--threads N]

Run from the repository root after `cargo build --release`, on a quiet machine (a busy core
slows a step more than the ops it was fitted to); about 25 minutes on 2 cores. Exits 1 when an
error exceeds the limit.
"""

import argparse
import math
import os
import random
import re
import statistics
import subprocess
import sys

GEMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "target", "release", "gems")
LIMIT = 0.10

# (model, side, batch, scheme flags, orders to measure; None: every order the scheme runs).
# Single devices, at sizes inside the calibrated corpus and at 4 and 16 times the pixels of its
# largest resnet110v2 (256² and 512², where the model extrapolates), and pipelines on two local
# ranks. One device with one micro-batch runs every order alike but for a split backward, so
# 1F1B and ZB-H1 stand for the orders at the large sizes.
FUSED_AND_SPLIT = ("1f1b", "zbh1")
RUNS = [
    ("resnet110v2", 128, 4, ["--scheme", "single"], None),
    ("resnet110v2", 256, 2, ["--scheme", "single"], FUSED_AND_SPLIT),
    ("resnet110v2", 512, 1, ["--scheme", "single"], FUSED_AND_SPLIT),
    ("resnet50", 224, 8, ["--scheme", "single"], FUSED_AND_SPLIT),
    ("resnet110v2", 128, 8, ["--scheme", "mp", "--split", "2", "--parts", "4"], None),
    ("resnet56v2", 64, 16, ["--scheme", "mp", "--split", "2", "--parts", "4"], None),
    ("unet_d3_w16", 128, 4, ["--scheme", "mp", "--split", "2", "--parts", "4"], None),
    ("resnet110v2", 128, 8, ["--scheme", "mast", "--split", "2", "--parts", "2"], None),
]

ORDER_ROW = re.compile(r"^(\S+)\s+[\d.]+%\s+[\d.]+ s\s+([\d.]+) s")
PREDICTED = re.compile(r"^predicted step ([\d.]+) s")
MEASURED = re.compile(r"^measured step ([\d.]+) s")


def gems(threads, model, side, batch, flags, *more):
    cmd = [GEMS, "--threads", str(threads), "plan", "--model", model, "--image-size", str(side),
           "--batch-size", str(batch), *flags, *more]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()


def first(pattern, lines):
    return next(float(m.group(1)) for m in map(pattern.match, lines) if m)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=10)
    # The first steps of a small model are slow (the loader and the memory pools filling):
    # two seconds of its steps keep them out of the median.
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    a = p.parse_args()

    # Every order each run's scheme can run, with its predicted step and its steps to train.
    units = []
    for model, side, batch, flags, orders in RUNS:
        name = f"{model} {side}² B={batch} {' '.join(flags[1:])}"
        for line in gems(a.threads, model, side, batch, flags, "--order", "all"):
            m = ORDER_ROW.match(line)
            if m and (orders is None or m.group(1) in orders):
                predicted = float(m.group(2))
                steps = 1 + max(3, math.ceil(a.seconds / predicted))
                units.append((name, m.group(1), (model, side, batch, flags), predicted, steps))

    measured = {(u[0], u[1]): [] for u in units}
    for seed in range(a.rounds):
        for name, order, run, predicted, steps in random.Random(seed).sample(units, len(units)):
            out = gems(a.threads, *run, "--order", order, "--measure", str(steps))
            if abs(first(PREDICTED, out) - predicted) > 5e-4:
                sys.exit(f"{name} {order}: the plan's prediction moved between calls")
            measured[(name, order)].append(first(MEASURED, out))

    print(f"{'run':<46} {'order':<12} {'predicted':>10} {'fastest':>10} {'error':>7}   "
          f"{'median':>8} {'slowest':>8}")
    worst = 0.0
    for name, order, _, predicted, _ in units:
        times = measured[(name, order)]
        error = predicted / min(times) - 1.0
        worst = max(worst, abs(error))
        print(f"{name:<46} {order:<12} {predicted:>8.3f} s {min(times):>8.3f} s "
              f"{100 * error:>+6.1f}%   {statistics.median(times):>6.3f} s {max(times):>6.3f} s")
    verdict = "within" if worst <= LIMIT else "OVER"
    print(f"largest error {100 * worst:.1f}%: {verdict} the {100 * LIMIT:.0f}% limit "
          f"({a.threads} threads, {a.rounds} rounds)")
    sys.exit(0 if worst <= LIMIT else 1)


if __name__ == "__main__":
    main()
