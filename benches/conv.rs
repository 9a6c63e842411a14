//! f32 convolution throughput on ResNet layer shapes, next to the `gemm` crate's sgemm on the
//! matrices conv forward multiplies, so the two rates compare directly.
//!
//! Every group sets `Throughput::Elements(flops)`, so criterion's "elem/s" column is FLOP/s
//! (e.g. "12.3 Gelem/s" = 12.3 GFLOP/s). FLOPs per pass = 2·N·C_out·H_out·W_out·(C_in/groups)·kh·kw,
//! the same count for forward, backward-data and backward-filter.
//!
//! Groups: conv_forward_f32, conv_backward_data_f32, conv_backward_filter_f32, sgemm_f32.
//! Ids: "n{N}_c{C_in}_{H}x{W}_k{k}_s{stride}_co{C_out}". Run one shape with e.g.
//! `cargo bench --bench conv -- n8_c64_56x56_k3_s1_co64`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use gems::backend::{Backend, ConvGeom};
use gems::ops::conv::Conv2d;
use gems::{Category, DType, Device, Shape, Tensor};

/// (N, C_in, H, W, C_out, k, stride, pad).
type ConvShape = (usize, usize, usize, usize, usize, usize, usize, usize);

const SHAPES: &[ConvShape] = &[
    // resnet110v2, batch 1 (the model runs at 1024²; 256² keeps an iteration short).
    (1, 16, 256, 256, 16, 3, 1, 1),
    (1, 64, 256, 256, 16, 1, 1, 0),
    (1, 32, 128, 128, 32, 3, 1, 1),
    (1, 64, 64, 64, 64, 3, 1, 1),
    // resnet50 at 224², batch 8.
    (8, 64, 56, 56, 64, 3, 1, 1),
    (8, 256, 56, 56, 64, 1, 1, 0),
    (8, 128, 28, 28, 128, 3, 1, 1),
    (8, 256, 14, 14, 256, 3, 1, 1),
    // CIFAR ResNet, batch 32.
    (32, 16, 32, 32, 16, 3, 1, 1),
    (32, 64, 8, 8, 64, 3, 1, 1),
];

fn id(&(n, c, h, w, co, k, s, _): &ConvShape) -> String {
    format!("n{n}_c{c}_{h}x{w}_k{k}_s{s}_co{co}")
}

fn flops(g: &ConvGeom) -> u64 {
    (2 * g.n * g.c_out * g.h_out * g.w_out * (g.c_in / g.groups) * g.kh * g.kw) as u64
}

/// Deterministic values in [-1, 1) from a 64-bit LCG (never all zero).
fn random(len: usize, seed: u64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        })
        .collect()
}

/// A geometry and its tensors: x (input or dx), w (weights or dw), y (output or dy), workspace.
struct Case {
    dev: Device,
    g: ConvGeom,
    x: Tensor,
    w: Tensor,
    y: Tensor,
    ws: Tensor,
}

fn case(&(n, c, h, w, co, k, s, p): &ConvShape) -> Case {
    let dev = Device::cpu("bench", None);
    let g = Conv2d::new(co, k, s, p)
        .geom(&Shape::new([n, c, h, w]))
        .expect("valid conv shape");
    let up = |dims: [usize; 4], seed| {
        let shape = Shape::new(dims);
        let data = random(shape.numel(), seed);
        dev.upload(shape, &data, DType::F32, Category::Activations)
            .unwrap()
    };
    let (x, wt, y) = (
        up([n, c, h, w], 1),
        up([co, c / g.groups, k, k], 2),
        up([n, co, g.h_out, g.w_out], 3),
    );
    let ws_len = dev.backend().conv2d_workspace(&g);
    let ws = dev
        .zeros(Shape::new([ws_len]), DType::F32, Category::Workspace)
        .unwrap();
    Case {
        dev,
        g,
        x,
        w: wt,
        y,
        ws,
    }
}

/// One group over all shapes; `pass` runs one convolution pass on a case.
fn bench_pass(c: &mut Criterion, name: &str, pass: fn(&dyn Backend, &mut Case)) {
    let mut group = c.benchmark_group(name);
    for s in SHAPES {
        let mut t = case(s);
        let dev = t.dev.clone();
        group.throughput(Throughput::Elements(flops(&t.g)));
        group.bench_function(id(s), |b| {
            b.iter(|| {
                pass(dev.backend(), &mut t);
                black_box(&t.x);
            })
        });
    }
    group.finish();
}

fn conv(c: &mut Criterion) {
    // Throughput in these groups is FLOP/s (criterion prints it as elem/s).
    bench_pass(c, "conv_forward_f32", |be, t| {
        let (y, ws) = (t.y.storage_mut().unwrap(), t.ws.storage_mut().unwrap());
        be.conv2d_forward(t.x.storage(), t.w.storage(), y, ws, &t.g)
            .unwrap();
    });
    bench_pass(c, "conv_backward_data_f32", |be, t| {
        let (dx, ws) = (t.x.storage_mut().unwrap(), t.ws.storage_mut().unwrap());
        be.conv2d_backward_data(t.y.storage(), t.w.storage(), dx, ws, &t.g)
            .unwrap();
    });
    bench_pass(c, "conv_backward_filter_f32", |be, t| {
        // Accumulates into dw (= t.w) every iteration, as the backend's contract says.
        let (dw, ws) = (t.w.storage_mut().unwrap(), t.ws.storage_mut().unwrap());
        be.conv2d_backward_filter(t.x.storage(), t.y.storage(), dw, ws, &t.g)
            .unwrap();
    });
}

/// sgemm on the matrices conv forward multiplies per sample: dst (m×n) = lhs (m×k) · rhs (k×n),
/// row-major, m = C_out, k = C_in·kh·kw, n = H_out·W_out. For N > 1 it runs the per-sample
/// product N times per iteration (same matrices and FLOPs as the forward pass), each with
/// `Parallelism::Rayon(all threads)`; throughput is FLOP/s (elem/s).
fn sgemm(c: &mut Criterion) {
    let mut group = c.benchmark_group("sgemm_f32");
    let par = gemm::Parallelism::Rayon(rayon::current_num_threads());
    for s in SHAPES {
        let g = case(s).g;
        let (m, k, n) = (g.c_out, g.col_rows(), g.h_out * g.w_out);
        let lhs: Vec<f32> = random(m * k, 2).into_iter().map(|v| v as f32).collect();
        let rhs: Vec<f32> = random(k * n, 1).into_iter().map(|v| v as f32).collect();
        let mut dst = vec![0f32; m * n];
        group.throughput(Throughput::Elements(flops(&g)));
        group.bench_function(id(s), |b| {
            b.iter(|| {
                for _ in 0..g.n {
                    // SAFETY: dst is m×n, lhs m×k, rhs k×n, all row-major (cs = 1, rs = columns).
                    unsafe {
                        gemm::gemm(
                            m,
                            n,
                            k,
                            dst.as_mut_ptr(),
                            1,
                            n as isize,
                            false,
                            lhs.as_ptr(),
                            1,
                            k as isize,
                            rhs.as_ptr(),
                            1,
                            n as isize,
                            0.0f32,
                            1.0f32,
                            false,
                            false,
                            false,
                            par,
                        )
                    }
                }
                black_box(&dst);
            })
        });
    }
    group.finish();
}

// Short measurement so the whole suite takes a few minutes on a small machine.
criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = conv, sgemm
}
criterion_main!(benches);
