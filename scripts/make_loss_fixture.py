#!/usr/bin/env python3
"""Writes tests/data/loss/expected.json: PyTorch's CrossEntropyLoss(weight=w, ignore_index=255)
on a batch of per-pixel logits, in f64, for tests/op_gradients.rs's check that gems's
`--loss-reduction pytorch` equals it (1e-12) when the batch is cut into micro-batches.

    .venv-torch/bin/python scripts/make_loss_fixture.py

A batch of 4 logits 3×4×5 (3 classes, 4×5 pixels) with labels in which every sample has its
own share of unlabelled pixels (255), so that samples carry different total weights; class
weights 0.5, 2, 1.25. Recorded: the logits and labels (sample-major, row-major), the class
weights, the loss and its gradient with respect to the logits. Written with the standard
library and torch only.
"""

import json
import os

import torch

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "loss")
N, K, H, W = 4, 3, 4, 5
WEIGHTS = [0.5, 2.0, 1.25]


def main():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(N, K, H, W, dtype=torch.float64, generator=g)
    labels = torch.randint(0, K, (N, H, W), generator=g)
    # Sample s has its first 3·s pixels unlabelled (sample 0 none, sample 3 nine).
    for s in range(N):
        labels[s].view(-1)[: 3 * s] = 255
    x = logits.clone().requires_grad_(True)
    weight = torch.tensor(WEIGHTS, dtype=torch.float64)
    loss = torch.nn.CrossEntropyLoss(weight=weight, ignore_index=255)(x, labels)
    loss.backward()
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(
            {
                "torch": torch.__version__,
                "shape": [N, K, H, W],
                "logits": logits.flatten().tolist(),
                "labels": labels.flatten().tolist(),
                "class_weights": WEIGHTS,
                "loss": loss.item(),
                "grad": x.grad.flatten().tolist(),
            },
            f,
        )
        f.write("\n")


if __name__ == "__main__":
    main()
