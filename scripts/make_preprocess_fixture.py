#!/usr/bin/env python3
"""Writes tests/data/unet_preprocess/: images and masks of several shapes and the losses
PyTorch computes on them with milesial's UNet, its inputs divided by 255 only, for
tests/unet.rs's check that `gems eval --init --normalize unit` (centred square) and
`--normalize unit --resize` (whole image resampled) prepare images as such a pipeline does.

    .venv-torch/bin/python scripts/make_preprocess_fixture.py

- the weights are tests/data/unet_forward/weights.safetensors (gems's unet_d2_w4, 2 classes);
- pairs/images/<stem>.png, pairs/masks/<stem>.png, pairs/classes.txt: RGB images of random
  pixels, 16×16, 16×24, 24×16 and 20×28, with random masks of classes 0 and 1;
- expected.json: per image, the mean cross-entropy over its pixels in evaluation mode, in f64
  from the f32 weights, of the 16×16 input made from x/255 two ways: `crop`, the centred
  largest square resampled to 16 (a square of side 16 is taken as it is), and `resize`, the
  whole image resampled to 16×16; both with F.interpolate(bilinear, antialias=True) for the
  image and nearest-exact for the mask.
Written with the standard library, numpy, Pillow and torch (no safetensors package needed).
"""

import json
import os
import struct
import sys

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from torch_reference import UNet  # noqa: E402

DATA = os.path.join(HERE, "..", "tests", "data")
OUT = os.path.join(DATA, "unet_preprocess")
SIDE = 16
SHAPES = {"square": (16, 16), "wide": (16, 24), "tall": (24, 16), "large": (20, 28)}


def load_safetensors(path):
    """The tensors of a safetensors file (F32 and I64 only)."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    body = raw[8 + n:]
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        a, b = h["data_offsets"]
        dtype = {"F32": np.float32, "I64": np.int64}[h["dtype"]]
        out[name] = torch.from_numpy(np.frombuffer(body[a:b], dtype=dtype).copy()).reshape(h["shape"])
    return out


def resampled(x, mode):
    """x (N×C×H×W) at SIDE×SIDE."""
    if x.shape[-2:] == (SIDE, SIDE):
        return x
    if mode == "nearest-exact":
        return F.interpolate(x, size=(SIDE, SIDE), mode=mode)
    return F.interpolate(x, size=(SIDE, SIDE), mode="bilinear", align_corners=False, antialias=True)


def centred_square(x):
    h, w = x.shape[-2:]
    s = min(h, w)
    y0, x0 = (h - s) // 2, (w - s) // 2
    return x[..., y0:y0 + s, x0:x0 + s]


def main():
    model = UNet(2, depth=2, width=4)
    state = load_safetensors(os.path.join(DATA, "unet_forward", "weights.safetensors"))
    model.load_state_dict({k: v.double() if v.is_floating_point() else v for k, v in state.items()})
    model = model.double().eval()
    rng = np.random.default_rng(0)
    for sub in ("images", "masks"):
        os.makedirs(os.path.join(OUT, "pairs", sub), exist_ok=True)
    with open(os.path.join(OUT, "pairs", "classes.txt"), "w") as f:
        f.write("background\nforeground\n")
    expected = {"crop": {}, "resize": {}}
    for stem, (h, w) in SHAPES.items():
        pixels = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
        mask = rng.integers(0, 2, size=(h, w), dtype=np.uint8)
        Image.fromarray(pixels).save(os.path.join(OUT, "pairs", "images", f"{stem}.png"))
        Image.fromarray(mask, mode="L").save(os.path.join(OUT, "pairs", "masks", f"{stem}.png"))
        x = torch.from_numpy(pixels).double().permute(2, 0, 1)[None] / 255
        m = torch.from_numpy(mask).double()[None, None]
        for how, window in (("crop", centred_square), ("resize", lambda t: t)):
            inputs = resampled(window(x), "bilinear")
            target = resampled(window(m), "nearest-exact")[:, 0].long()
            with torch.no_grad():
                loss = F.cross_entropy(model(inputs), target)
            expected[how][stem] = loss.item()
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {OUT}: {json.dumps(expected)}")


if __name__ == "__main__":
    main()
