#!/usr/bin/env python3
"""gems's CPU backend against PyTorch (eager and torch.compile) on this machine, side by side.

    scripts/bench_vs_torch.sh train            # four training runs: resnet110v2, resnet50, resnet20v2
    scripts/bench_vs_torch.sh convs            # per-shape conv GFLOP/s, resnet110v2 at 256², B = 1
    scripts/bench_vs_torch.sh convs --model resnet50 --side 224 --batch 8   # another model's
    scripts/bench_vs_torch.sh scaling          # resnet110v2, B = 1, step time from 128² to 1024²
    scripts/bench_vs_torch.sh all --json out.json

(bench_vs_torch.sh makes the virtual environment with PyTorch on first use and runs this file
with it; run it from the repository root after `cargo build --release`.)

Same model (scripts/torch_reference.py rebuilds gems's models and checks their parameter
counts), same sizes, f32, SGD momentum 0.9 with weight decay 5e-4, softmax cross-entropy,
synthetic data, the same threads (gems `--threads T`, torch.set_num_threads(T)). Every
measurement runs in its own process, the runs alternating (gems, eager, compile, then eager,
gems, ...: each round starts one runner later) so a change of load on a shared machine hits
all of them alike; a step time is the median of the timed steps after warm-up, and the table
shows the median over rounds. Peak memory is each process's peak resident set (getrusage of
that child).
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
GEMS = os.path.join(HERE, "..", "target", "release", "gems")

# (model, image side, batch, warm-up steps, timed steps): the training comparisons.
TRAIN = [
    ("resnet110v2", 256, 2, 2, 4),
    ("resnet110v2", 512, 1, 1, 3),
    ("resnet50", 224, 8, 2, 5),
    ("resnet20v2", 32, 32, 5, 20),
]
SIDES = [128, 256, 512, 1024]


def run_child(cmd):
    """Runs `cmd`; returns (stdout, peak RSS in bytes) of that process alone."""
    with tempfile.TemporaryFile("w+") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(p.pid, 0)
        out.seek(0)
        text = out.read()
    if status != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{text[-2000:]}")
    return text, usage.ru_maxrss * 1024


def gems_train(model, side, batch, warmup, steps, threads, gems=GEMS):
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as m:
        cmd = [gems, "train", "--device", "cpu", "--threads", str(threads), "--model", model,
               "--image-size", str(side), "--batch-size", str(batch),
               "--steps", str(warmup + steps), "--warmup", "0", "--metrics", m.name]
        _, rss = run_child(cmd)
        times = [json.loads(line)["seconds"] for line in open(m.name)]
    return statistics.median(times[warmup:]), rss


def torch_train(mode, model, side, batch, warmup, steps, threads):
    cmd = [sys.executable, __file__, "_torch_worker", "--mode", mode, "--model", model,
           "--side", str(side), "--batch", str(batch), "--warmup", str(warmup),
           "--steps", str(steps), "--threads", str(threads)]
    text, rss = run_child(cmd)
    return json.loads(text.strip().splitlines()[-1])["step_s"], rss


def torch_worker(a):
    """One torch training run in this process: prints the median step time as JSON."""
    import torch
    sys.path.insert(0, HERE)
    from torch_reference import make_trainer

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    step, inputs, _ = make_trainer(a.model, 10, "fp32", False, torch.device("cpu"))
    warmup = a.warmup
    if a.mode == "compile":
        step = torch.compile(step)
        # The first step compiles, the second recompiles (the optimizer's state now exists).
        warmup = max(warmup, 3)
    x, y = inputs(a.batch, a.side)
    times = []
    for _ in range(warmup + a.steps):
        t = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - t)
    print(json.dumps({"step_s": statistics.median(times[warmup:])}))


def rounds_of(runners, rounds, once=()):
    """{name: (median step s, max peak RSS)} over `rounds` alternating rounds of `runners`
    (those named in `once` only in the first: torch.compile spends minutes compiling). Each
    round starts one runner later than the one before, so no runner always runs first or
    always follows the same one (the first run after another model's has been the slowest,
    by up to a fifth for the same binary)."""
    got = {name: ([], []) for name, _ in runners}
    for i in range(rounds):
        this_round = [(n, r) for n, r in runners if i == 0 or n not in once]
        shift = i % len(this_round)
        for name, run in this_round[shift:] + this_round[:shift]:
            try:
                s, rss = run()
            except RuntimeError as e:
                print(f"  {name}: {e}", file=sys.stderr)
                continue
            got[name][0].append(s)
            got[name][1].append(rss)
    return {n: (statistics.median(s), max(r)) for n, (s, r) in got.items() if s}


def train(a, report):
    rows = []
    print("| run | gems step | eager | compile | gems / eager | gems / compile "
          "| peak RSS gems / eager | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for model, side, batch, warmup, steps in TRAIN:
        if a.only and model not in a.only:
            continue
        runners = [("gems", lambda: gems_train(model, side, batch, warmup, steps, a.threads))]
        if a.gems_before:
            runners.append(("gems before", lambda: gems_train(
                model, side, batch, warmup, steps, a.threads, a.gems_before)))
        for mode in ["eager", "compile"]:
            if mode not in a.skip:
                runners.append((mode, lambda mode=mode: torch_train(
                    mode, model, side, batch, warmup, steps, a.threads)))
        r = rounds_of(runners, a.rounds, once=() if a.compile_every_round else ("compile",))
        row = {"model": model, "side": side, "batch": batch,
               **{f"{k}_step_s": v[0] for k, v in r.items()},
               **{f"{k}_images_per_s": batch / v[0] for k, v in r.items()},
               **{f"{k}_peak_rss": v[1] for k, v in r.items()}}
        rows.append(row)

        def ratio(k):  # gems's images/s over k's
            return f"{r[k][0] / r['gems'][0]:.2f}×" if k in r and "gems" in r else "–"

        def step(k):
            return f"{r[k][0]:.3f} s" if k in r else "–"

        rss = (f"{r['gems'][1] / 2**30:.2f} / {r['eager'][1] / 2**30:.2f} GiB",
               f"{r['gems'][1] / r['eager'][1]:.2f}") if "eager" in r else ("–", "–")
        print(f"| {model} {side}² B={batch} | {step('gems')} | {step('eager')} | "
              f"{step('compile')} | {ratio('eager')} | {ratio('compile')} | {rss[0]} | {rss[1]} |",
              flush=True)
        if "gems before" in r:
            print(f"|   gems before: {step('gems before')}, {ratio('gems before')} of it, peak "
                  f"RSS {r['gems before'][1] / 2**30:.2f} GiB | | | | | | | |", flush=True)
    report["train"] = rows


def flops(g):
    return 2 * g["n"] * g["c_out"] * g["h_out"] * g["w_out"] * g["c_in"] // g["groups"] * g["kh"] * g["kw"]


def parse_geom(s):
    # "ConvGeom { n: 1, c_in: 16, ..., stride: (1, 1), ... }" from `gems bench kernels --json`.
    body = s[s.index("{") + 1:s.rindex("}")]
    g, key = {}, None
    for part in body.replace("(", "").replace(")", "").split(","):
        if ":" in part:
            key, v = part.split(":")
            key = key.strip()
            g[key] = int(v)
        else:
            g[key] = (g[key], int(part))
    return g


def torch_convs(geoms, threads, repeats):
    """Seconds of forward, backward-data and backward-filter of each geometry in PyTorch."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    out = []
    with torch.no_grad():
        for g in geoms:
            pair = lambda v: v if isinstance(v, tuple) else (v, v)
            x = torch.randn(g["n"], g["c_in"], g["h"], g["w"])
            w = torch.randn(g["c_out"], g["c_in"] // g["groups"], g["kh"], g["kw"])
            dy = torch.randn(g["n"], g["c_out"], g["h_out"], g["w_out"])
            kw = dict(stride=pair(g["stride"]), padding=pair(g["pad"]),
                      dilation=pair(g["dilation"]), groups=g["groups"])

            def back(mask):
                return lambda: torch.ops.aten.convolution_backward(
                    dy, x, w, None, list(kw["stride"]), list(kw["padding"]),
                    list(kw["dilation"]), False, [0, 0], g["groups"], mask)

            secs = []
            for f in [lambda: F.conv2d(x, w, **kw), back([True, False, False]),
                      back([False, True, False])]:
                for _ in range(2):
                    f()
                ts = []
                for _ in range(repeats):
                    t = time.perf_counter()
                    f()
                    ts.append(time.perf_counter() - t)
                secs.append(statistics.median(ts))
            out.append(secs)
    return out


def sgemm_rate(threads, n=2048, repeats=10):
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(2):
        a @ b
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        ts.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(ts) / 1e9


def convs(a, report):
    model, side, batch = a.model or "resnet110v2", a.side or 256, a.batch or 1
    print(f"{model} at {side}², batch {batch}")
    with tempfile.NamedTemporaryFile(suffix=".json") as j:
        run_child([GEMS, "bench", "kernels", "--device", "cpu", "--threads", str(a.threads),
                   "--model", model, "--image-size", str(side), "--batch", str(batch),
                   "--repeats", str(a.repeats), "--json", j.name])
        ours = json.load(open(j.name))["convolutions"]
    geoms = [parse_geom(c["geom"]) for c in ours]
    theirs = torch_convs(geoms, a.threads, a.repeats)
    rate = sgemm_rate(a.threads)
    print(f"sgemm (torch.mm, 2048², {a.threads} threads): {rate:.1f} GFLOP/s")
    print("| convolution | count | shape | gems fwd | torch fwd | gems bwd-data | torch bwd-data "
          "| gems bwd-filter | torch bwd-filter |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows, tot = [], [[0.0] * 3, [0.0] * 3]
    for c, g, t in zip(ours, geoms, theirs):
        f = flops(g)
        gf = [f / s / 1e9 for s in c["seconds"]]
        tf = [f / s / 1e9 for s in t]
        for p in range(3):
            tot[0][p] += c["count"] * c["seconds"][p]
            tot[1][p] += c["count"] * t[p]
        shape = (f"{g['c_in']}→{g['c_out']} {g['kh']}×{g['kw']}/{g['stride'][0]} "
                 f"{g['h']}²")
        print(f"| {c['node']} | {c['count']} | {shape} | " + " | ".join(
            f"{gf[p]:.0f} | {tf[p]:.0f}" for p in range(3)) + " |")
        rows.append({"node": c["node"], "count": c["count"], "geom": g,
                     "gems_s": c["seconds"], "torch_s": t})
    print("all convolutions of a step (ms, count-weighted): gems "
          + " / ".join(f"{x * 1e3:.0f}" for x in tot[0]) + ", torch "
          + " / ".join(f"{x * 1e3:.0f}" for x in tot[1]) + " (forward / bwd-data / bwd-filter)")
    report["convs"] = {"model": model, "side": side, "batch": batch, "sgemm_gflops": rate,
                       "rows": rows}


def scaling(a, report):
    print("| side | gems step | per megapixel | eager step | per megapixel |")
    print("|---|---|---|---|---|")
    rows = []
    for side in SIDES:
        steps = 3 if side <= 512 else 2
        r = rounds_of([
            ("gems", lambda: gems_train("resnet110v2", side, 1, 1, steps, a.threads)),
            ("eager", lambda: torch_train("eager", "resnet110v2", side, 1, 1, steps, a.threads)),
        ], a.rounds)
        mp = side * side / 1e6
        print(f"| {side}² | {r['gems'][0]:.2f} s | {r['gems'][0] / mp:.2f} s | "
              f"{r['eager'][0]:.2f} s | {r['eager'][0] / mp:.2f} s |", flush=True)
        rows.append({"side": side, "gems_step_s": r["gems"][0], "eager_step_s": r["eager"][0],
                     "gems_peak_rss": r["gems"][1], "eager_peak_rss": r["eager"][1]})
    report["scaling"] = rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("what", choices=["train", "convs", "scaling", "all", "_torch_worker"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per measurement")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per conv pass")
    p.add_argument("--only", nargs="*", help="train: only these models")
    p.add_argument("--skip", nargs="*", default=[], choices=["eager", "compile"],
                   help="train: leave these PyTorch modes out")
    p.add_argument("--gems-before", metavar="PATH",
                   help="train: another gems binary (an earlier build) in the same rounds")
    p.add_argument("--compile-every-round", action="store_true",
                   help="torch.compile in every round (default: the first only; it compiles "
                   "for about 3 minutes per model on 2 cores)")
    p.add_argument("--json", help="write every result to this file")
    p.add_argument("--model", help="convs: this model (default resnet110v2); worker: its model")
    p.add_argument("--side", type=int, help="convs: image side (default 256)")
    p.add_argument("--batch", type=int, help="convs: batch (default 1)")
    w = p.add_argument_group("worker (internal)")
    w.add_argument("--mode", choices=["eager", "compile"])
    w.add_argument("--warmup", type=int)
    w.add_argument("--steps", type=int)
    a = p.parse_args()
    if a.what == "_torch_worker":
        return torch_worker(a)
    # torch is imported only in child processes: a child's peak RSS counts what it inherited
    # from this one at fork.
    version = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    report = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "cpu": cpu, "cores": os.cpu_count(),
              "threads": a.threads, "torch": version}
    print(f"{report['date']}, {cpu}, {os.cpu_count()} cores, {a.threads} threads, "
          f"torch {version}, load {os.getloadavg()[0]:.1f}")
    # convs last: it imports torch into this process.
    for what, f in [("train", train), ("scaling", scaling), ("convs", convs)]:
        if a.what in (what, "all"):
            f(a, report)
            if a.json:
                with open(a.json, "w") as out:
                    json.dump(report, out, indent=1)
    print(f"load {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
