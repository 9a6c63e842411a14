#!/usr/bin/env python3
"""Fits how much slower ranks sharing this CPU compute than the fits alone predict (a fit's
`at_once`): several two-rank pipelines of corpus models, none of the runs
scripts/bench_cost_model.py checks, are trained a few steps on local ranks (`gems plan
--measure`, the fastest of --rounds rounds in a shuffled sequence, as the benchmark measures
them), and `at_once` is set where the predicted steps are, in geometric mean, the measured
ones. Each of two ranks computing at once is priced at the one-thread fit times `at_once`;
what that leaves out (the cache, memory bandwidth, the pool's hand-offs and the heap they
share) is what `at_once` carries.

    scripts/fit_at_once.py FITS [--rounds 5] [--seconds 2]

FITS is a file `gems fit-costs` wrote (scripts/fit_cpu_costs.sh calls this on its result):
its fit at every core gets the fitted `at_once`. Run from the repository root after `cargo
build --release`, on a quiet machine; about two minutes on 2 cores.
"""

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile

from bench_cost_model import GEMS, MEASURED, PREDICTED, first

MP = ["--scheme", "mp", "--split", "2", "--parts", "4"]
# (model, side, batch, scheme flags): pipelines and a MAST pair, small and large channel
# counts, a U-Net, a searched cell and group norm.
RUNS = [
    ("resnet20v2", 32, 64, MP),
    ("unet_resnet18", 128, 8, MP),
    ("resnet50_gn", 128, 8, MP),
    ("amoebanet_d", 64, 4, MP),
    ("resnet56v2", 64, 16, ["--scheme", "mast", "--split", "2", "--parts", "2"]),
]


def gems(fits, threads, run, *more):
    model, side, batch, flags = run
    cmd = [GEMS, "--threads", str(threads), "--cpu-costs", fits, "plan", "--model", model,
           "--image-size", str(side), "--batch-size", str(batch), *flags, "--order", "1f1b",
           *more]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("fits")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=2.0)
    a = p.parse_args()
    threads = os.cpu_count()
    with open(a.fits) as f:
        fits = json.load(f)
    alone = [f for f in fits if f["threads"] == threads]
    if not alone or not any(f["threads"] == 1 for f in fits):
        sys.exit(f"{a.fits}: no fit at 1 thread and at {threads}, the two this prices")

    with tempfile.TemporaryDirectory() as tmp:
        trial = os.path.join(tmp, "fits.json")

        def predicted(at_once):
            for f in alone:
                f["at_once"] = at_once
            with open(trial, "w") as out:
                json.dump(fits, out)
            return [first(PREDICTED, gems(trial, threads, run)) for run in RUNS]

        guess = predicted(1.0)
        steps = [1 + max(3, math.ceil(a.seconds / t)) for t in guess]
        fastest = [math.inf] * len(RUNS)
        for seed in range(a.rounds):
            for i in random.Random(seed).sample(range(len(RUNS)), len(RUNS)):
                out = gems(trial, threads, RUNS[i], "--measure", str(steps[i]))
                fastest[i] = min(fastest[i], first(MEASURED, out))

        # The predictions grow with at_once: bisect for a geometric mean error of zero.
        def bias(at_once):
            return sum(math.log(t / m) for t, m in zip(predicted(at_once), fastest)) / len(RUNS)

        low, high = 0.5, 3.0
        if bias(low) > 0 or bias(high) < 0:
            sys.exit(f"no at_once in [{low}, {high}] meets the measured steps {fastest}")
        while high - low > 0.002:
            mid = (low + high) / 2
            low, high = (mid, high) if bias(mid) < 0 else (low, mid)
        at_once = round((low + high) / 2, 3)
        final = predicted(at_once)

    with open(a.fits, "w") as out:
        json.dump(fits, out, indent=2)
        out.write("\n")
    for (model, side, batch, flags), t, m in zip(RUNS, final, fastest):
        print(f"  {model:<14} {side:>4}² B={batch:<3} {flags[1]:<5} predicted {t:.3f} s, "
              f"measured {m:.3f} s ({100 * (t / m - 1):+.1f}%)")
    print(f"at_once {at_once} at {threads} threads; wrote {a.fits}")


if __name__ == "__main__":
    main()
