#!/usr/bin/env python3
"""Writes tests/data/unet_forward/: U-Net logits PyTorch computes, for tests/unet.rs's checks that
gems's unet and unet_resnet34 compute what milesial's UNet and smp's Unet compute.

    .venv-torch/bin/python scripts/make_unet_fixture.py

- weights.safetensors: the state_dict of scripts/torch_reference.py's UNet(2 classes, depth 2,
  width 4) (gems's unet_d2_w4), PyTorch's initialisation (seed 0) with the BN affine parameters
  and running statistics drawn at random too (so evaluation-mode BN matters), stored as f32;
- io.safetensors: `input`, 2 random 3×16×16 images, and `logits`, the 2×2×16×16 output in
  evaluation mode, both f64, computed in f64 from the f32 weights;
- resnet34_logits.safetensors: `logits`, smp's Unet("resnet34", classes=2) in evaluation mode on
  one 32² image, f64, with weights and image from `pattern` (too many weights to ship: gems's
  test makes the same ones).
Written with the standard library, torch and segmentation-models-pytorch (no safetensors
package needed).
"""

import json
import os
import struct
import sys

import math

import segmentation_models_pytorch as smp
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from torch_reference import UNet  # noqa: E402

OUT = os.path.join(HERE, "..", "tests", "data", "unet_forward")
DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.int64: "I64"}


def save_safetensors(path, tensors):
    """The safetensors layout: an 8-byte header length, a JSON header, the raw bytes."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        raw = t.contiguous().numpy().tobytes()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def pattern(j, shape, name):
    """Tensor j's values (j = 0 for the image, then 1, 2, ... in state_dict order without
    num_batches_tracked), from integer hashing so that gems rebuilds them bit for bit: u in
    [-1, 1) per element, scaled as a layer keeps activations at scale (conv weights
    u·√(3/fan_in), BN weights and running variances 1 + u/2, other vectors u/5)."""
    n = math.prod(shape)
    h = (torch.arange(n, dtype=torch.int64) * 2654435761 + (j + 1) * 2246822519) % 2**32
    u = h.double() / 2**32 * 2 - 1
    if len(shape) == 4:
        u = u * math.sqrt(3 / math.prod(shape[1:]))
    elif name.endswith((".running_var", ".weight")):
        u = 1 + u / 2
    elif len(shape) == 1:
        u = u / 5
    return u.reshape(shape)


def resnet34_logits():
    model = smp.Unet("resnet34", encoder_weights=None, classes=2).double().eval()
    state = model.state_dict()
    names = [k for k in state if not k.endswith(".num_batches_tracked")]
    with torch.no_grad():
        for j, k in enumerate(names, start=1):
            state[k].copy_(pattern(j, list(state[k].shape), k))
        return model(pattern(0, [1, 3, 32, 32], "input"))


def main():
    torch.manual_seed(0)
    model = UNet(2, depth=2, width=4)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model = model.double().eval()
    # The f32 values in the file are what both sides compute with.
    model.load_state_dict({k: v.double() if v.is_floating_point() else v for k, v in state.items()})
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    with torch.no_grad():
        logits = model(x)
    os.makedirs(OUT, exist_ok=True)
    save_safetensors(os.path.join(OUT, "weights.safetensors"), state)
    save_safetensors(os.path.join(OUT, "io.safetensors"), {"input": x, "logits": logits})
    print(f"wrote {OUT}: {len(state)} tensors, logits {list(logits.shape)}")
    logits = resnet34_logits()
    save_safetensors(os.path.join(OUT, "resnet34_logits.safetensors"), {"logits": logits})
    print(f"unet_resnet34 logits {list(logits.shape)}, |max| {logits.abs().max().item():.3g}")


if __name__ == "__main__":
    main()
