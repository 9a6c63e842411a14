#!/usr/bin/env python3
"""PyTorch reference figures for gems's GPU benchmarks: training throughput, the baselines of the
offload study, and host<->device copy bandwidth, with the models, optimizer and loss gems uses.

    python3 scripts/torch_reference.py all --json $OUT/torch_reference.json
    python3 scripts/torch_reference.py train --model resnet110v2 --image-size 1024 --batch max
    python3 scripts/torch_reference.py offload-models --batch 16
    python3 scripts/torch_reference.py bandwidth
    python3 scripts/torch_reference.py state-dict --model unet --classes 2 --out tests/data/unet.names

Each prints one line per measurement and writes every result to the --json file, rewritten after
each measurement so that a run cut short keeps what it measured. A measurement that fails (out
of memory, unsupported) is recorded as an error and the others still run; the exit status is 1
if any failed.

state-dict writes a model's state_dict keys and shapes, one `name d0,d1,...` line each, the
fixtures (tests/data/<model>.names) that gems's parameter names and shapes are checked against;
it needs no GPU. The ResNet-encoder U-Net comes from the segmentation-models-pytorch package.

--device cpu exists only to check this script on a machine without a GPU: CUDA events become
time.perf_counter, pinned memory is skipped, `all` shrinks every size. Its numbers mean nothing.
"""

import argparse
import datetime
import gc
import json
import platform
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision

# gems's trainable parameter counts with 10 classes (`gems models --classes 10`) and the input
# width of each model's last linear layer, which gives the count for any other number of classes.
GEMS_PARAMS = {
    "resnet20v2": (219_482, 256),
    "resnet56v2": (590_426, 256),
    "resnet110v2": (1_146_842, 256),
    "resnet50": (23_528_522, 2048),
    "resnet50_gn": (23_528_522, 2048),
    "vgg19": (139_611_210, 4096),
    "alexnet": (57_044_810, 4096),
    "inception_v3_noaux": (21_806_058, 2048),
    # Segmentation: the input width of the last conv times its kernel area.
    "unet": (31_038_218, 64),
    "unet_resnet34": (24_437_674, 16 * 9),
}

# Models whose output is a [classes, H, W] map of logits, trained on one label per pixel.
SEGMENTATION = {"unet", "unet_resnet34"}

# torchvision's auxiliary Inception head needs 299² inputs; without it the model takes 224²
# (gems calls that model inception_v3_noaux).
GEMS_NAME = {"inception_v3": "inception_v3_noaux"}

MODELS = ["resnet20v2", "resnet56v2", "resnet110v2", "resnet50", "resnet50_gn", "vgg19", "alexnet",
          "inception_v3", "unet", "unet_resnet34"]
OFFLOAD_MODELS = ["vgg19", "alexnet", "resnet50", "inception_v3"]

# Seconds for 20 epochs of the GPU baseline on a V100 in the GEMS follow-up poster's offload
# table, for scale only: it includes data loading, which ours leaves out.
POSTER_V100_20_EPOCHS = {"vgg19": 30.07, "alexnet": 24.13, "resnet50": 26.17, "inception_v3": 32.22}

AUTOCAST = {"fp32": None, "tf32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class PreActBottleneck(nn.Module):
    """gems's v2 block: BN-ReLU-conv1×1 → BN-ReLU-conv3×3(stride) → BN-ReLU-conv1×1(4·width),
    plus the identity, or a strided 1×1 projection of the pre-activated input where the shape
    changes. Module names are gems's parameter names."""

    def __init__(self, c_in, width, stride):
        super().__init__()
        out = 4 * width
        self.bn1 = nn.BatchNorm2d(c_in)
        self.relu1 = nn.ReLU(inplace=True)
        self.shortcut = None
        if stride != 1 or c_in != out:
            self.shortcut = nn.Conv2d(c_in, out, 1, stride, 0, bias=False)
        self.conv1 = nn.Conv2d(c_in, width, 1, 1, 0, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(width)
        self.relu3 = nn.ReLU(inplace=True)
        self.conv3 = nn.Conv2d(width, out, 1, 1, 0, bias=False)

    def forward(self, x):
        pre = self.relu1(self.bn1(x))
        shortcut = x if self.shortcut is None else self.shortcut(pre)
        h = self.conv1(pre)
        h = self.conv2(self.relu2(self.bn2(h)))
        h = self.conv3(self.relu3(self.bn3(h)))
        return h + shortcut


class ResNetV2(nn.Module):
    """gems's resnet<9n+2>v2 (src/models/resnet.rs): conv3×3 → 16 stem without BN, three stages
    of n bottlenecks of widths 16, 32, 64 (outputs 64, 128, 256; the first block of stages 2
    and 3 strides 2), then BN-ReLU-global average pool-linear."""

    def __init__(self, depth, classes):
        super().__init__()
        if depth < 11 or (depth - 2) % 9:
            raise ValueError(f"resnet{depth}v2: depth is not 9n+2 (e.g. 20, 56, 110)")
        blocks = (depth - 2) // 9
        self.conv1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        c = 16
        for stage in range(3):
            width = 16 << stage
            layer = []
            for i in range(blocks):
                layer.append(PreActBottleneck(c, width, 2 if stage > 0 and i == 0 else 1))
                c = 4 * width
            self.add_module(f"layer{stage + 1}", nn.Sequential(*layer))
        self.bn = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        x = self.layer3(self.layer2(self.layer1(self.conv1(x))))
        x = self.avgpool(self.relu(self.bn(x)))
        return self.fc(torch.flatten(x, 1))


class DoubleConv(nn.Module):
    """(3×3 conv without bias, BN, ReLU) twice, as milesial/Pytorch-UNet's DoubleConv (and with
    its names: `double_conv.0.weight`, `double_conv.1.running_mean`, ...)."""

    def __init__(self, c_in, c_out):
        super().__init__()
        self.double_conv = nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out),
            nn.ReLU(inplace=True),
            nn.Conv2d(c_out, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out),
            nn.ReLU(inplace=True))

    def forward(self, x):
        return self.double_conv(x)


class Down(nn.Module):
    """A 2×2 max pool, then a DoubleConv."""

    def __init__(self, c_in, c_out):
        super().__init__()
        self.maxpool_conv = nn.Sequential(nn.MaxPool2d(2), DoubleConv(c_in, c_out))

    def forward(self, x):
        return self.maxpool_conv(x)


class Up(nn.Module):
    """A 2×2/2 transposed conv halving the channels, the skip concatenated before it, then a
    DoubleConv (milesial's Up with bilinear=False; sides divisible by 2^depth need no padding)."""

    def __init__(self, c_in, c_out):
        super().__init__()
        self.up = nn.ConvTranspose2d(c_in, c_in // 2, 2, stride=2)
        self.conv = DoubleConv(c_in, c_out)

    def forward(self, x, skip):
        return self.conv(torch.cat([skip, self.up(x)], dim=1))


class OutConv(nn.Module):
    def __init__(self, c_in, classes):
        super().__init__()
        self.conv = nn.Conv2d(c_in, classes, 1)

    def forward(self, x):
        return self.conv(x)


class UNet(nn.Module):
    """milesial/Pytorch-UNet's UNet(3, classes, bilinear=False) for depth 4 and width 64, rebuilt
    with the same modules and names; gems's unet_d<depth>_w<width> for others."""

    def __init__(self, classes, depth=4, width=64):
        super().__init__()
        self.depth = depth
        self.inc = DoubleConv(3, width)
        for i in range(1, depth + 1):
            self.add_module(f"down{i}", Down(width << (i - 1), width << i))
        for i in range(1, depth + 1):
            c = width << (depth - i)
            self.add_module(f"up{i}", Up(2 * c, c))
        self.outc = OutConv(width, classes)

    def forward(self, x):
        x = self.inc(x)
        skips = []
        for i in range(1, self.depth + 1):
            skips.append(x)
            x = getattr(self, f"down{i}")(x)
        for i in range(1, self.depth + 1):
            x = getattr(self, f"up{i}")(x, skips.pop())
        return self.outc(x)


def build_model(name, classes):
    """The model called `name`, checked against gems's parameter count."""
    if name == "unet":
        model = UNet(classes)
    elif name == "unet_resnet34":
        import segmentation_models_pytorch as smp  # only the ResNet-encoder U-Net needs it

        model = smp.Unet("resnet34", encoder_weights=None, classes=classes)
    elif name.endswith("v2"):
        model = ResNetV2(int(name[len("resnet"):-len("v2")]), classes)
    elif name == "resnet50_gn":
        # torchvision's resnet50 with every BatchNorm2d a GroupNorm of 32 groups.
        model = torchvision.models.resnet50(
            weights=None, num_classes=classes, norm_layer=lambda c: nn.GroupNorm(32, c)
        )
    elif name == "inception_v3":
        model = torchvision.models.inception_v3(
            weights=None, aux_logits=False, init_weights=True, num_classes=classes
        )
    else:
        model = getattr(torchvision.models, name)(weights=None, num_classes=classes)
    count = sum(p.numel() for p in model.parameters())
    gems_name = GEMS_NAME.get(name, name)
    at_10, features = GEMS_PARAMS[gems_name]
    expected = at_10 + (classes - 10) * (features + 1)
    if count != expected:
        raise RuntimeError(
            f"PARAMETER COUNT MISMATCH: {name} has {count:,} parameters, gems's {gems_name} "
            f"{expected:,}: the models differ and the comparison would mean nothing"
        )
    return model, count


def set_precision(precision):
    # PyTorch lets cuDNN use TF32 by default: plain fp32 must turn it off.
    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


def make_trainer(name, classes, precision, channels_last, device):
    """One training step of `name` as gems trains it (SGD momentum 0.9, weight decay 5e-4,
    softmax cross-entropy), on batches given as tensors already on the device."""
    model, count = build_model(name, classes)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(device, memory_format=layout).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    amp = AUTOCAST[precision]
    # bf16 and fp16 keep fp32 master weights (autocast); fp16 also needs loss scaling.
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

    def step(x, y):
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    def inputs(batch, image_size):
        x = torch.randn(batch, 3, image_size, image_size, device=device)
        # A label per image, or per pixel for segmentation (cross-entropy averages over pixels).
        labels = (batch, image_size, image_size) if name in SEGMENTATION else (batch,)
        return x.contiguous(memory_format=layout), torch.randint(classes, labels, device=device)

    return step, inputs, count


def elapsed_s(device, work):
    """Seconds `work` takes on the device: CUDA events around it on the GPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    # --device cpu (checking the script only): wall clock.
    t = time.perf_counter()
    work()
    return time.perf_counter() - t


def release(device):
    """Frees what the last measurement left, so the next starts from an empty device and its
    peak memory is its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_bytes(device):
    return torch.cuda.max_memory_allocated() if device.type == "cuda" else None


def is_oom(e):
    # cuDNN and cuBLAS report a failed workspace allocation as a RuntimeError.
    return isinstance(e, torch.cuda.OutOfMemoryError) or "ALLOC_FAILED" in str(e)


def attempt(what, measure):
    """Runs one measurement; a failure becomes {"error": ...} so that the rest still runs."""
    try:
        return measure()
    except Exception as e:  # any failure is a result to record
        error = f"{type(e).__name__}: {e}"
        print(f"{what}: FAILED {error.splitlines()[0]}", flush=True)
        return {"error": error}


def gib(n):
    return "n/a (cpu)" if n is None else f"{n / 2**30:.2f} GiB"


def largest_batch(fits, cap):
    """The largest batch <= cap for which fits(batch) holds, by doubling then bisection, and
    every batch tried with its outcome."""
    tried = {}

    def check(b):
        tried[b] = fits(b)
        return tried[b]

    lo, hi = 0, 1
    while hi <= cap and check(hi):
        lo, hi = hi, 2 * hi
    hi = min(hi, cap + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if check(mid) else (lo, mid)
    return lo, tried


def find_max_batch(name, image_size, classes, precision, channels_last, cap, device):
    """The largest batch that trains without running out of device memory."""
    step, inputs, _ = make_trainer(name, classes, precision, channels_last, device)

    def fits(batch):
        def two_steps():
            # Two steps: the first creates the momentum buffers, the second also holds the
            # previous step's gradients during its forward.
            x, y = inputs(batch, image_size)
            step(x, y)
            step(x, y)
            if device.type == "cuda":
                torch.cuda.synchronize()

        ok = True
        try:
            two_steps()
        except Exception as e:  # only running out of memory means "does not fit"
            if not is_oom(e):
                raise
            ok = False
        # After the except block, so that the exception no longer holds the activations.
        release(device)
        print(f"  batch {batch}: {'fits' if ok else 'out of memory'}", flush=True)
        return ok

    return largest_batch(fits, cap)


def time_training(name, image_size, batch, classes, precision, channels_last, timing, device):
    release(device)
    step, inputs, _ = make_trainer(name, classes, precision, channels_last, device)
    x, y = inputs(batch, image_size)
    warmup, steps, repeats = timing
    for _ in range(warmup):  # also cuDNN's algorithm search (benchmark mode)
        step(x, y)

    def timed():
        for _ in range(steps):
            step(x, y)

    times = [elapsed_s(device, timed) for _ in range(repeats)]
    median = statistics.median(times)
    return {
        "images_per_s": batch * steps / median,
        "step_ms": 1e3 * median / steps,
        "repeat_images_per_s": [batch * steps / t for t in times],
        "peak_memory_bytes": peak_bytes(device),
    }


def train(name, image_size, batch, classes, precision, channels_last, timing, cap, device):
    """Training images/s; channels_last "auto" times both layouts and reports the faster."""
    set_precision(precision)
    layouts = {"off": [False], "on": [True], "auto": [False, True]}[channels_last]
    what = f"train {name} {image_size}² {precision}"
    _, params = build_model(name, classes)  # fails here, before any timing, if it is not gems's
    print(f"{what}: {params:,} parameters, as gems's {GEMS_NAME.get(name, name)}", flush=True)
    warmup, steps, repeats = timing
    result = {"kind": "train", "model": name, "image_size": image_size, "classes": classes,
              "precision": precision, "parameters": params,
              "timing": {"warmup_steps": warmup, "timed_steps": steps, "repeats": repeats}}
    if batch == "max":
        # Searched in the first layout only (the search costs more than the timing); the other
        # is timed at the same batch.
        batch, tried = find_max_batch(name, image_size, classes, precision, layouts[0], cap, device)
        result["batch_search"] = {"largest": batch, "cap": cap, "tried": tried}
        print(f"{what}: largest batch {batch} (cap {cap})", flush=True)
        if batch == 0:
            return {**result, "error": "batch 1 does not fit"}
    result["batch"] = batch
    runs = {}
    for cl in layouts:
        label = f"{what} B={batch} channels-last {'on' if cl else 'off'}"
        run = attempt(label, lambda: time_training(
            name, image_size, batch, classes, precision, cl, timing, device))
        runs["on" if cl else "off"] = run
        if "error" not in run:
            print(f"{label}: {run['images_per_s']:.1f} images/s (step {run['step_ms']:.2f} ms; "
                  f"repeats {', '.join(f'{r:.1f}' for r in run['repeat_images_per_s'])}), "
                  f"peak {gib(run['peak_memory_bytes'])}", flush=True)
    result["channels_last"] = runs
    done = {k: r for k, r in runs.items() if "error" not in r}
    if not done:
        return {**result, "error": "every layout failed"}
    best = max(done, key=lambda k: done[k]["images_per_s"])
    result.update(best_channels_last=best, **done[best])
    if len(layouts) > 1:
        print(f"{what} B={batch}: best channels-last {best}, "
              f"{done[best]['images_per_s']:.1f} images/s", flush=True)
    return result


def epoch_time(name, image_size, batch, images, epochs, device):
    """Seconds per epoch over `images` random images (the last batch partial), fp32."""
    release(device)
    set_precision("fp32")
    step, inputs, params = make_trainer(name, 2, "fp32", False, device)
    x, y = inputs(images, image_size)

    def epoch():
        for i in range(0, images, batch):
            step(x[i:i + batch], y[i:i + batch])

    epoch()  # warm-up: cuDNN's algorithm search for the full and the partial batch
    times = [elapsed_s(device, epoch) for _ in range(epochs)]
    seconds = statistics.median(times)
    return {"kind": "offload-baseline", "model": name, "image_size": image_size, "batch": batch,
            "images": images, "classes": 2, "precision": "fp32", "parameters": params,
            "s_per_epoch": seconds, "repeat_s_per_epoch": times,
            "peak_memory_bytes": peak_bytes(device)}


def offload_models(image_size, batch, images, epochs, device, report):
    print("offload baselines: inception_v3 runs without its auxiliary head (which needs 299²), "
          "as gems's inception_v3_noaux; the poster's 24,348,900 parameters include that head",
          flush=True)
    for name in OFFLOAD_MODELS:
        what = f"offload baseline {name} {image_size}² B={batch}"
        r = attempt(what, lambda: epoch_time(name, image_size, batch, images, epochs, device))
        if "error" not in r:
            print(f"{what}: {r['s_per_epoch']:.3f} s/epoch of {images} images "
                  f"(x20 epochs: {20 * r['s_per_epoch']:.1f} s; poster's V100 baseline with data "
                  f"loading: {POSTER_V100_20_EPOCHS[name]} s), {r['parameters']:,} parameters, "
                  f"peak {gib(r['peak_memory_bytes'])}", flush=True)
        report.add(what, r)


def copy_rate(copy, nbytes, repeats, device):
    """GB/s (1e9 bytes per second, as gems counts) of `copy` moving `nbytes`, median of repeats."""
    copy()  # warm-up: first-touch and driver setup
    times = [elapsed_s(device, copy) for _ in range(repeats)]
    return {"gb_per_s": nbytes / statistics.median(times) / 1e9,
            "repeat_gb_per_s": [nbytes / t / 1e9 for t in times]}


def bandwidth(mib, repeats, device, report):
    release(device)
    n = mib << 20
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    # Filled, not empty: the pages must be mapped before a copy is timed.
    hosts = {"pageable": torch.ones(n, dtype=torch.uint8)}
    if device.type == "cuda":
        hosts["pinned"] = torch.ones(n, dtype=torch.uint8).pin_memory()
    else:
        print("bandwidth: pinned host memory skipped (needs CUDA); 'device' is host memory here")
    copies = []
    for kind, host in hosts.items():
        pinned = kind == "pinned"
        copies.append((f"host_to_device {kind}", n,
                       lambda h=host, p=pinned: dev.copy_(h, non_blocking=p)))
        copies.append((f"device_to_host {kind}", n,
                       lambda h=host, p=pinned: h.copy_(dev, non_blocking=p)))
    dst = torch.empty_like(dev)
    # Device to device reads and writes every byte: both count.
    copies.append(("device_to_device (read + write)", 2 * n, lambda: dst.copy_(dev)))
    for what, nbytes, copy in copies:
        r = attempt(what, lambda: copy_rate(copy, nbytes, repeats, device))
        if "error" not in r:
            print(f"bandwidth {what}: {r['gb_per_s']:.1f} GB/s ({mib} MiB, median of {repeats})",
                  flush=True)
        report.add(f"bandwidth {what}", {"kind": "bandwidth", "copy": what, "mib": mib, **r})


def run_all(budget_s, device, report):
    """Every measurement, cheapest first so that a short budget loses the fewest
    figures; a measurement not started before the budget ends is recorded as skipped."""
    tiny = device.type == "cpu"  # checking the script: the same plan at sizes a CPU runs
    cap = 4 if tiny else 4096

    def train_item(model, size, batch, precision, timing):
        what = f"train {model} {size}² B={batch} {precision}"
        return what, lambda: report.add(what, attempt(what, lambda: train(
            model, size, batch, 10, precision, "auto", timing, cap, device)))

    plan = [
        ("bandwidth", lambda: bandwidth(16 if tiny else 256, 3 if tiny else 10, device, report)),
        ("offload-models", lambda: offload_models(
            80 if tiny else 224, 4 if tiny else 16, 10 if tiny else 245, 2 if tiny else 3,
            device, report)),
    ]
    for precision in ["fp32", "tf32", "bf16"]:
        plan.append(train_item("resnet50", 32 if tiny else 224, 2 if tiny else 64, precision,
                               (1, 2, 2) if tiny else (10, 20, 3)))
    for precision in ["tf32", "bf16"]:
        plan.append(train_item("resnet110v2", 64 if tiny else 1024, "max", precision,
                               (1, 2, 2) if tiny else (3, 5, 3)))
    deadline = time.monotonic() + budget_s
    for what, run in plan:
        if time.monotonic() > deadline:
            print(f"{what}: skipped (time budget of {budget_s} s spent)", flush=True)
            report.add(what, {"skipped": f"time budget of {budget_s} s spent"})
            continue
        run()


class Report:
    """All results of one invocation in one JSON file, rewritten after each result."""

    def __init__(self, path, device):
        self.path = path
        self.doc = {"argv": sys.argv,
                    "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                    "environment": environment(device), "results": []}

    def add(self, what, result):
        self.doc["results"].append({"what": what, **result})
        if self.path:
            with open(self.path, "w") as f:
                json.dump(self.doc, f, indent=1)

    def failed(self):
        return any("error" in r for r in self.doc["results"])


def environment(device):
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "torchvision": torchvision.__version__, "device": str(device),
           "timer": "CUDA events" if device.type == "cuda"
           else "time.perf_counter: a check of the script, the numbers mean nothing"}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version(), capability=f"{props.major}.{props.minor}")
    return env


def state_dict_names(name, classes, out):
    """Writes `name`'s state_dict as `key d0,d1,...` lines (a scalar has no dims)."""
    model, count = build_model(name, classes)
    lines = [f"{k} {','.join(map(str, v.shape))}".rstrip() for k, v in model.state_dict().items()]
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"{name} for {classes} classes: {count:,} parameters, {len(lines)} entries in {out}")


def batch_arg(s):
    return s if s == "max" else int(s)


def main():
    # The options every subcommand takes, given after it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: only to check this script (timings meaningless)")
    common.add_argument("--json", help="write every result to this file")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def command(name, help):
        return sub.add_parser(name, help=help, parents=[common])

    t = command("train", "training images/s of one model")
    t.add_argument("--model", default="resnet50", choices=MODELS)
    t.add_argument("--image-size", type=int, default=224)
    t.add_argument("--batch", type=batch_arg, default=64, help="images per step, or max")
    t.add_argument("--batch-cap", type=int, default=4096, help="largest batch --batch max tries")
    t.add_argument("--classes", type=int, default=10, help="gems's default (synthetic data)")
    t.add_argument("--precision", default="tf32", choices=list(AUTOCAST))
    t.add_argument("--channels-last", default="auto", choices=["auto", "on", "off"])
    t.add_argument("--warmup", type=int, default=10)
    t.add_argument("--steps", type=int, default=20, help="steps per timed repeat")
    t.add_argument("--repeats", type=int, default=3)

    o = command("offload-models", "seconds per epoch of the offload study's models")
    o.add_argument("--image-size", type=int, default=224)
    o.add_argument("--batch", type=int, default=16)
    o.add_argument("--images", type=int, default=245, help="245: the Hymenoptera training set")
    o.add_argument("--epochs", type=int, default=3, help="timed epochs (median), after one warm-up")

    b = command("bandwidth", "host<->device and device copy bandwidth")
    b.add_argument("--mib", type=int, default=256)
    b.add_argument("--repeats", type=int, default=10)

    a = command("all", "every measurement, cheapest first, within a time budget")
    a.add_argument("--budget-s", type=float, default=240)

    n = sub.add_parser("state-dict", help="a model's state_dict names and shapes (a fixture)")
    n.add_argument("--model", required=True, choices=MODELS)
    n.add_argument("--classes", type=int, default=2)
    n.add_argument("--out", required=True, help="the .names file to write")

    args = p.parse_args()
    if args.command == "state-dict":
        state_dict_names(args.model, args.classes, args.out)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device (use --device cpu to check the script)")
    device = torch.device(args.device)
    torch.backends.cudnn.benchmark = True
    report = Report(args.json, device)
    print(f"{json.dumps(report.doc['environment'])}", flush=True)

    if args.command == "train":
        timing = (args.warmup, args.steps, args.repeats)
        what = f"train {args.model} {args.image_size}² B={args.batch} {args.precision}"
        report.add(what, attempt(what, lambda: train(
            args.model, args.image_size, args.batch, args.classes, args.precision,
            args.channels_last, timing, args.batch_cap, device)))
    elif args.command == "offload-models":
        offload_models(args.image_size, args.batch, args.images, args.epochs, device, report)
    elif args.command == "bandwidth":
        bandwidth(args.mib, args.repeats, device, report)
    else:
        run_all(args.budget_s, device, report)
    if args.json:
        print(f"wrote {args.json}")
    sys.exit(1 if report.failed() else 0)


if __name__ == "__main__":
    main()
