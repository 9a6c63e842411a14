#!/usr/bin/env python3
"""Writes tests/data/torch_init/: weights initialised by PyTorch and the losses PyTorch computes
with them, for tests/checkpoint.rs's check that `gems eval --init` scores as PyTorch does.

    .venv-torch/bin/python scripts/make_init_fixture.py

- weights.safetensors: resnet20v2 for 2 classes as scripts/torch_reference.py builds it,
  PyTorch's own initialisation (seed 0) with the BN affine parameters and running statistics
  drawn at random too (so evaluation-mode BN matters), stored as f16 to stay small;
- images/<class>/<n>.png: 32×32 RGB images of random pixels, two classes;
- expected.json: each image's cross-entropy in evaluation mode, computed in f64 from the f16
  weights, the images normalised as gems does ((v/255 - mean) / std, ImageNet's).
Written with the standard library and torch only (no safetensors package needed).
"""

import json
import os
import struct
import sys

import numpy as np
import torch
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from torch_reference import build_model  # noqa: E402

OUT = os.path.join(HERE, "..", "tests", "data", "torch_init")
MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]
CLASSES = ["a", "b"]
PER_CLASS = 3


def save_safetensors(path, tensors):
    """The safetensors layout: an 8-byte header length, a JSON header, the raw bytes."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        data = t.contiguous().numpy().astype(np.float16 if t.is_floating_point() else np.int64)
        raw = data.tobytes()
        header[name] = {
            "dtype": "F16" if t.is_floating_point() else "I64",
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def main():
    torch.manual_seed(0)
    model, _ = build_model("resnet20v2", len(CLASSES))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        # The f16 file's values are what both sides compute with.
        rounded = {k: (v.half().double() if v.is_floating_point() else v) for k, v in state.items()}
    os.makedirs(OUT, exist_ok=True)
    save_safetensors(os.path.join(OUT, "weights.safetensors"), state)
    model = model.double()
    model.load_state_dict(rounded)
    model.eval()
    rng = np.random.default_rng(0)
    expected = {}
    for label, cls in enumerate(CLASSES):
        folder = os.path.join(OUT, "images", cls)
        os.makedirs(folder, exist_ok=True)
        for n in range(PER_CLASS):
            pixels = rng.integers(0, 256, size=(32, 32, 3), dtype=np.uint8)
            name = os.path.join(folder, f"{n}.png")
            Image.fromarray(pixels).save(name)
            x = torch.tensor(pixels, dtype=torch.float64).permute(2, 0, 1) / 255.0
            x = (x - torch.tensor(MEAN, dtype=torch.float64)[:, None, None]) / torch.tensor(
                STD, dtype=torch.float64
            )[:, None, None]
            with torch.no_grad():
                logits = model(x[None])
            loss = torch.nn.functional.cross_entropy(logits, torch.tensor([label]))
            expected[f"{cls}/{n}.png"] = loss.item()
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
    print(f"wrote {OUT}: {len(expected)} images")


if __name__ == "__main__":
    main()
