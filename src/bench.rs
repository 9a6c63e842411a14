//! Kernel benchmarks (`gems bench kernels`): every distinct convolution of a model at a batch
//! size, each pass timed on a device, in TFLOP/s; and the memory-bound kernels (ReLU, batch
//! normalization) in GB/s next to the device's own copy bandwidth.
//!
//! Each measurement is the median of `repeats` timed runs after two warm-up runs; the device
//! is synchronized before and after each run, so queued GPU work is counted whole.

use std::time::Instant;

use crate::backend::host::HostPool;
use crate::backend::{ChannelGeom, ConvGeom};
use crate::graph::Graph;
use crate::ops::{batched, Op};
use crate::tensor::Device;
use crate::tensor::{DType, Storage};
use crate::Result;

/// One distinct convolution of a model and how often it occurs.
#[derive(Clone, Debug)]
pub struct ConvShape {
    /// Its geometry at the benchmark's batch.
    pub geom: ConvGeom,
    /// How many of the model's convolutions have it.
    pub count: usize,
    /// The first node that has it (`layer1.0.conv1`).
    pub example: String,
}

impl ConvShape {
    /// Multiply-adds × 2 of one pass (the three passes do the same amount).
    pub fn flops(&self) -> f64 {
        let g = &self.geom;
        2.0 * (g.n * g.c_out * g.h_out * g.w_out * g.col_rows()) as f64
    }
}

/// The distinct convolutions of `g` at batch `batch`, in the order they first occur.
pub fn conv_shapes(g: &Graph, batch: usize) -> Result<Vec<ConvShape>> {
    let mut shapes: Vec<ConvShape> = Vec::new();
    for node in &g.nodes {
        let Op::Conv2d(conv) = &node.op else { continue };
        let x = batched(batch, &g.values[node.inputs[0]].shape);
        let geom = conv.geom(&x)?;
        match shapes.iter_mut().find(|s| s.geom == geom) {
            Some(s) => s.count += 1,
            None => shapes.push(ConvShape {
                geom,
                count: 1,
                example: node.name.clone(),
            }),
        }
    }
    Ok(shapes)
}

/// Median seconds of `repeats` runs of `f` (after two warm-up runs).
pub fn time(device: &Device, repeats: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..2 {
        f()?;
    }
    let mut t = Vec::with_capacity(repeats.max(1));
    for _ in 0..repeats.max(1) {
        device.backend().synchronize()?;
        let start = Instant::now();
        f()?;
        device.backend().synchronize()?;
        t.push(start.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

fn random(device: &Device, n: usize, seed: u64, dtype: DType) -> Result<Storage> {
    // Cheap, deterministic, never zero: values in ±[0.05, 1).
    let data: Vec<f64> = (0..n as u64)
        .map(|i| {
            let u = crate::core::rng::uniform(seed, i);
            let v = 0.05 + 0.95 * u;
            if i % 2 == 0 {
                v
            } else {
                -v
            }
        })
        .collect();
    device.backend().upload(&data, dtype)
}

/// Seconds of forward, backward-data and backward-filter of one convolution over activations
/// of `dtype` (the weights and their gradient f32, as in training).
pub fn conv_passes(
    device: &Device,
    g: &ConvGeom,
    dtype: DType,
    repeats: usize,
) -> Result<[f64; 3]> {
    let be = device.backend();
    let (nx, nw, ny) = (
        g.n * g.c_in * g.h * g.w,
        g.c_out * g.col_rows(),
        g.n * g.c_out * g.h_out * g.w_out,
    );
    let (x, w, dy) = (
        random(device, nx, 1, dtype)?,
        random(device, nw, 2, DType::F32)?,
        random(device, ny, 3, dtype)?,
    );
    let (mut y, mut dx, mut dw) = (
        be.zeros(ny, dtype)?,
        be.zeros(nx, dtype)?,
        be.zeros(nw, DType::F32)?,
    );
    let mut ws = be.zeros(be.conv2d_workspace(g), dtype.compute())?;
    Ok([
        time(device, repeats, || {
            be.conv2d_forward(&x, &w, &mut y, &mut ws, g)
        })?,
        time(device, repeats, || {
            be.conv2d_backward_data(&dy, &w, &mut dx, &mut ws, g)
        })?,
        time(device, repeats, || {
            be.conv2d_backward_filter(&x, &dy, &mut dw, &mut ws, g)
        })?,
    ])
}

/// A memory-bound kernel's speed: the bytes it moves (each read and each write counted once)
/// over its median time.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Bandwidth {
    /// The kernel measured.
    pub kernel: &'static str,
    /// Bytes it reads and writes.
    pub bytes: u64,
    /// Its median time in seconds.
    pub seconds: f64,
}

impl Bandwidth {
    /// Bytes moved per second, in GB/s (10⁹ bytes).
    pub fn gb_per_s(&self) -> f64 {
        self.bytes as f64 / self.seconds / 1e9
    }
}

/// Copy, ReLU forward and backward, batch normalization's training forward and backward, and
/// the two fused with ReLU, over an N×C×HW tensor of `dtype` (BN's parameters and statistics
/// f32).
pub fn memory_bound(
    device: &Device,
    g: &ChannelGeom,
    dtype: DType,
    repeats: usize,
) -> Result<Vec<Bandwidth>> {
    let be = device.backend();
    let numel = g.n * g.c * g.hw;
    let b = (numel * dtype.size()) as u64;
    let (x, dy) = (
        random(device, numel, 4, dtype)?,
        random(device, numel, 5, dtype)?,
    );
    let f32s = |n, seed| random(device, n, seed, DType::F32);
    let (gamma, beta) = (f32s(g.c, 6)?, f32s(g.c, 7)?);
    let (mut y, mut dx) = (be.zeros(numel, dtype)?, be.zeros(numel, dtype)?);
    let (mut mean, mut var) = (be.zeros(g.c, DType::F32)?, be.zeros(g.c, DType::F32)?);
    let (mut dgamma, mut dbeta) = (be.zeros(g.c, DType::F32)?, be.zeros(g.c, DType::F32)?);
    let eps = 1e-5;
    let mut out = vec![
        Bandwidth {
            kernel: "copy",
            bytes: 2 * b,
            seconds: time(device, repeats, || be.copy(&x, &mut y))?,
        },
        Bandwidth {
            kernel: "relu forward",
            bytes: 2 * b,
            seconds: time(device, repeats, || be.relu_forward(&x, &mut y))?,
        },
        Bandwidth {
            kernel: "relu backward",
            bytes: 3 * b,
            seconds: time(device, repeats, || be.relu_backward(&x, &dy, &mut dx))?,
        },
    ];
    // Statistics read x; the normalization reads x and writes y.
    let forward = time(device, repeats, || {
        be.batchnorm_forward_train(&x, &gamma, &beta, &mut y, &mut mean, &mut var, eps, g)
    })?;
    out.push(Bandwidth {
        kernel: "batchnorm forward",
        bytes: 3 * b,
        seconds: forward,
    });
    // The reduction reads x and dy; dx reads them again and writes dx.
    let backward = time(device, repeats, || {
        be.batchnorm_backward(
            &x,
            &dy,
            &gamma,
            &mean,
            &var,
            &mut dx,
            &mut dgamma,
            &mut dbeta,
            eps,
            g,
        )
    })?;
    out.push(Bandwidth {
        kernel: "batchnorm backward",
        bytes: 5 * b,
        seconds: backward,
    });
    // Fused with ReLU: the same passes (backward recomputes the ReLU's mask from x).
    let fused_forward = time(device, repeats, || {
        be.batchnorm_relu_forward_train(&x, &gamma, &beta, &mut y, &mut mean, &mut var, eps, g)
    })?;
    out.push(Bandwidth {
        kernel: "batchnorm+relu forward",
        bytes: 3 * b,
        seconds: fused_forward,
    });
    let fused_backward = time(device, repeats, || {
        be.batchnorm_relu_backward(
            &x,
            &dy,
            &gamma,
            &beta,
            &mean,
            &var,
            &mut dx,
            &mut dgamma,
            &mut dbeta,
            eps,
            g,
        )
    })?;
    out.push(Bandwidth {
        kernel: "batchnorm+relu backward",
        bytes: 5 * b,
        seconds: fused_backward,
    });
    Ok(out)
}

/// Blocking copies between the device and host memory, pageable and pinned, each way: the
/// link offload runs over.
pub fn host_link(device: &Device, bytes: usize, repeats: usize) -> Result<Vec<Bandwidth>> {
    let be = device.backend();
    let numel = bytes / 4;
    let on_device = random(device, numel, 8, DType::F32)?;
    let mut back = be.zeros(numel, DType::F32)?;
    let pool = HostPool::new();
    let mut out = Vec::new();
    for (pinned, out_name, in_name) in [
        (false, "to host, pageable", "to device, pageable"),
        (true, "to host, pinned", "to device, pinned"),
    ] {
        let mut host = be.host_zeros(numel, DType::F32, pinned.then_some(&pool))?;
        let to_host = time(device, repeats, || {
            be.copy_out(&on_device, &mut host, false).map(drop)
        })?;
        let to_device = time(device, repeats, || {
            be.copy_in(&host, &mut back, false).map(drop)
        })?;
        out.push(Bandwidth {
            kernel: out_name,
            bytes: (numel * 4) as u64,
            seconds: to_host,
        });
        out.push(Bandwidth {
            kernel: in_name,
            bytes: (numel * 4) as u64,
            seconds: to_device,
        });
    }
    Ok(out)
}

/// This machine's processor, as /proc/cpuinfo names it ("unknown CPU" elsewhere).
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("model name")?.split_once(':'))
                .map(|(_, name)| name.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_each_distinct_convolution_of_a_model_once() {
        let g = crate::models::build("resnet20v2", 32, 10).unwrap();
        let shapes = conv_shapes(&g, 4).unwrap();
        let convs = g
            .nodes
            .iter()
            .filter(|n| matches!(n.op, Op::Conv2d(_)))
            .count();
        assert_eq!(shapes.iter().map(|s| s.count).sum::<usize>(), convs);
        for (i, a) in shapes.iter().enumerate() {
            assert!(shapes[i + 1..].iter().all(|b| b.geom != a.geom));
            assert_eq!(a.geom.n, 4);
        }
        // resnet20v2: the stem, two 3×3 shapes per stage width, and the strided shortcuts.
        assert!(shapes.len() >= 5, "{shapes:?}");
    }

    #[test]
    fn times_every_pass_and_kernel_on_the_cpu() {
        let d = Device::cpu("bench", None);
        let g = crate::models::build("resnet20v2", 32, 10).unwrap();
        let shape = &conv_shapes(&g, 2).unwrap()[1];
        let t = conv_passes(&d, &shape.geom, DType::F32, 3).unwrap();
        assert!(t.iter().all(|&s| s > 0.0 && s < 10.0), "{t:?}");
        let bw = memory_bound(
            &d,
            &ChannelGeom {
                n: 2,
                c: 16,
                hw: 1024,
            },
            DType::BF16,
            3,
        )
        .unwrap();
        assert_eq!(bw.len(), 7);
        assert!(bw.iter().all(|b| b.gb_per_s() > 0.0), "{bw:?}");
        let link = host_link(&d, 1 << 20, 3).unwrap();
        assert_eq!(link.len(), 4);
        assert!(link.iter().all(|b| b.gb_per_s() > 0.0), "{link:?}");
    }
}
