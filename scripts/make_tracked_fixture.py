#!/usr/bin/env python3
"""Writes tests/data/unet_tracked/: a state_dict whose BatchNorm layers have counted different
numbers of batches, and the counts PyTorch reaches after training steps, for
tests/checkpoint.rs's check that gems reads `num_batches_tracked`, advances it as PyTorch does
and writes it back.

    .venv-torch/bin/python scripts/make_tracked_fixture.py

- weights.safetensors: tests/data/unet_forward's weights (gems's unet_d2_w4, 2 classes) with
  BN layer i's num_batches_tracked set to 10·i + 3;
- expected.json: `steps`, the training steps taken (one forward and backward of a batch of 2
  random 16×16 images, then SGD), and `tracked`, each BN layer's num_batches_tracked after
  them, by name.
Written with the standard library, numpy and torch (no safetensors package needed).
"""

import json
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_preprocess_fixture import load_safetensors  # noqa: E402
from make_unet_fixture import save_safetensors  # noqa: E402
from torch_reference import UNet  # noqa: E402

DATA = os.path.join(HERE, "..", "tests", "data")
OUT = os.path.join(DATA, "unet_tracked")
STEPS = 3
def main():
    state = load_safetensors(os.path.join(DATA, "unet_forward", "weights.safetensors"))
    tracked = [k for k in state if k.endswith(".num_batches_tracked")]
    for i, k in enumerate(tracked):
        state[k] = torch.tensor(10 * i + 3, dtype=torch.int64)
    os.makedirs(OUT, exist_ok=True)
    save_safetensors(os.path.join(OUT, "weights.safetensors"), state)
    torch.manual_seed(0)
    model = UNet(2, depth=2, width=4)
    model.load_state_dict(state)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(STEPS):
        x = torch.rand(2, 3, 16, 16)
        y = torch.randint(0, 2, (2, 16, 16))
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    after = {k: int(v) for k, v in model.state_dict().items() if k in tracked}
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump({"steps": STEPS, "tracked": after}, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {OUT}: {after}")


if __name__ == "__main__":
    main()
