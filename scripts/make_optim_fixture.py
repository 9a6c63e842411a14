#!/usr/bin/env python3
"""Writes tests/data/optim/expected.json: what PyTorch's optimizers do, in f64, for
tests/optim.rs's check that gems' Adam, AdamW, SGD and gradient clipping equal them (1e-12).

    .venv-torch/bin/python scripts/make_optim_fixture.py

Three parameters (a 4×3 matrix, a bias of 3, a 2×2×2 kernel) with given gradients for 3
steps, per case: Adam with an L2 weight decay; AdamW with decoupled weight decay, the bias in
a second parameter group without decay, and torch.nn.utils.clip_grad_norm_ before each step;
SGD (Nesterov momentum) with clipping. The gradients of step 2 are small enough that clipping
leaves them alone; steps 1 and 3 are clipped. Recorded: the initial values, each step's
gradients, the parameters after each step, and the final optimizer state by PyTorch's names.
Written with the standard library and torch only.
"""

import json
import os

import torch

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "optim")
SHAPES = [[4, 3], [3], [2, 2, 2]]
STEPS = 3
# Gradient size per step: clipped, not clipped, clipped.
GRAD_SCALE = [1.0, 0.01, 3.0]

CASES = [
    {
        "name": "adam",
        "optimizer": "adam",
        "lr": 0.01,
        "betas": [0.8, 0.95],
        "eps": 1e-6,
        "weight_decay": 0.1,
        "max_norm": None,
        "exempt": [],
    },
    {
        "name": "adamw_clip_groups",
        "optimizer": "adamw",
        "lr": 0.02,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
        "weight_decay": 0.05,
        "max_norm": 0.5,
        "exempt": [1],
    },
    {
        "name": "sgd_clip",
        "optimizer": "sgd",
        "lr": 0.1,
        "momentum": 0.9,
        "nesterov": True,
        "weight_decay": 1e-3,
        "max_norm": 0.5,
        "exempt": [],
    },
]


def flat(t):
    return [float(x) for x in t.detach().reshape(-1).tolist()]


def run(case, init, grads):
    params = [torch.nn.Parameter(t.clone()) for t in init]
    decay = [p for i, p in enumerate(params) if i not in case["exempt"]]
    exempt = [p for i, p in enumerate(params) if i in case["exempt"]]
    groups = [{"params": decay}] + ([{"params": exempt, "weight_decay": 0.0}] if exempt else [])
    wd, lr = case["weight_decay"], case["lr"]
    if case["optimizer"] == "sgd":
        opt = torch.optim.SGD(groups, lr=lr, momentum=case["momentum"],
                              nesterov=case["nesterov"], weight_decay=wd, foreach=False)
    else:
        cls = torch.optim.AdamW if case["optimizer"] == "adamw" else torch.optim.Adam
        opt = cls(groups, lr=lr, betas=tuple(case["betas"]), eps=case["eps"],
                  weight_decay=wd, foreach=False)
    after = []
    for step in range(STEPS):
        for p, g in zip(params, grads[step]):
            p.grad = g.clone()
        if case["max_norm"] is not None:
            torch.nn.utils.clip_grad_norm_(params, case["max_norm"], foreach=False)
        opt.step()
        after.append([flat(p) for p in params])
    state = []
    for p in params:
        st = opt.state[p]
        state.append({k: (float(v) if k == "step" else flat(v)) for k, v in st.items()})
    return after, state


def main():
    torch.manual_seed(0)
    init = [torch.randn(s, dtype=torch.float64) for s in SHAPES]
    grads = [[torch.randn(s, dtype=torch.float64) * GRAD_SCALE[k] for s in SHAPES]
             for k in range(STEPS)]
    out = {"torch": torch.__version__, "shapes": SHAPES, "init": [flat(t) for t in init],
           "grads": [[flat(g) for g in step] for step in grads], "cases": []}
    for case in CASES:
        after, state = run(case, init, grads)
        out["cases"].append(dict(case, after=after, state=state))
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
