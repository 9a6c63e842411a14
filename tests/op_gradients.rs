//! Every op's backward against central finite differences in f64 on random inputs, and its
//! f32 forward against its f64 forward, by the check the crate exports
//! ([`gems::ops::check_gradients`]); and each op's forward against a direct definition.

use gems::data::UNLABELLED;
use gems::ops::activation::Nonlinearity;
use gems::ops::conv::{Conv2d, ConvTranspose2d};
use gems::ops::groupnorm::GroupNorm;
use gems::ops::loss::Norm;
use gems::ops::pool::AdaptiveAvgPool;
use gems::ops::pool::{AvgPool, GlobalAvgPool, MaxPool, Window};
use gems::ops::{
    activation, dropout, elementwise, linear, loss, norm, resize, shape, Ctx, Op, Saved,
};
use gems::tensor::Device;
use gems::{Category, DType, Shape, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Finite-difference step: truncation error ~h², rounding ~1e-16/h, both far below 1e-6.
const H: f64 = 1e-5;

struct Case {
    op: Op,
    /// Per-sample input shapes.
    inputs: Vec<Vec<usize>>,
    batch: usize,
}

fn device() -> Device {
    Device::cpu("test", None)
}

/// Distinct values well away from 0 and from each other, so ReLU kinks and max-pool ties
/// stay farther than H from every probe.
fn distinct_values(n: usize, rng: &mut ChaCha8Rng) -> Vec<f64> {
    let mut idx: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        idx.swap(i, rng.random_range(0..=i));
    }
    idx.iter()
        .map(|&i| {
            let v = 0.05 + 2.0 * i as f64 / n as f64;
            if i % 2 == 0 {
                v
            } else {
                -v
            }
        })
        .collect()
}

fn upload(d: &Device, shape: &Shape, data: &[f64], dtype: DType) -> Tensor {
    d.upload(shape.clone(), data, dtype, Category::Activations)
        .unwrap()
}

struct Setup {
    in_shapes: Vec<Shape>,
    inputs: Vec<Vec<f64>>,
    param_shapes: Vec<Shape>,
    params: Vec<Vec<f64>>,
    out_shape: Shape,
}

fn setup(case: &Case, seed: u64) -> Setup {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let per: Vec<Shape> = case.inputs.iter().map(|s| Shape::new(s.clone())).collect();
    let refs: Vec<&Shape> = per.iter().collect();
    let op = case.op.get();
    let out = op.infer(&refs).expect("valid case");
    let specs = op.params(&refs);
    let in_shapes: Vec<Shape> = per
        .iter()
        .map(|s| gems::ops::batched(case.batch, s))
        .collect();
    let inputs = in_shapes
        .iter()
        .map(|s| distinct_values(s.numel(), &mut rng))
        .collect();
    let params = specs
        .iter()
        .map(|p| {
            (0..p.shape.numel())
                .map(|_| {
                    if p.suffix == "running_var" {
                        rng.random_range(0.5..1.5)
                    } else {
                        rng.random_range(-1.0..1.0)
                    }
                })
                .collect()
        })
        .collect();
    let out_shape = gems::ops::batched(case.batch, &out);
    Setup {
        in_shapes,
        inputs,
        param_shapes: specs.iter().map(|p| p.shape.clone()).collect(),
        params,
        out_shape,
    }
}

fn run_forward(
    case: &Case,
    s: &Setup,
    inputs: &[Vec<f64>],
    params: &[Vec<f64>],
    dtype: DType,
    training: bool,
) -> (Tensor, Saved, Vec<Tensor>) {
    let d = device();
    let xs: Vec<Tensor> = s
        .in_shapes
        .iter()
        .zip(inputs)
        .map(|(sh, x)| upload(&d, sh, x, dtype))
        .collect();
    let mut ps: Vec<Tensor> = s
        .param_shapes
        .iter()
        .zip(params)
        .map(|(sh, p)| upload(&d, sh, p, dtype))
        .collect();
    let ctx = Ctx {
        device: &d,
        training,
        seed: 42,
        tiles: None,
    };
    let refs: Vec<&Tensor> = xs.iter().collect();
    let (y, saved) = case.op.get().forward(&ctx, &refs, &mut ps).unwrap();
    assert_eq!(y.shape(), &s.out_shape, "{:?}", case.op);
    (y, saved, ps)
}

/// ‖a − n‖ / max(‖a‖, ‖n‖) over the probed entries.
fn rel_error(a: &[f64], n: &[f64]) -> f64 {
    let diff: f64 = a
        .iter()
        .zip(n)
        .map(|(x, y)| (x - y) * (x - y))
        .sum::<f64>()
        .sqrt();
    let scale = a
        .iter()
        .map(|x| x * x)
        .sum::<f64>()
        .sqrt()
        .max(n.iter().map(|x| x * x).sum::<f64>().sqrt());
    if scale == 0.0 {
        diff
    } else {
        diff / scale
    }
}

/// The exported check: every input's and trainable parameter's gradient against finite
/// differences, and the f32 forward against the f64 one.
fn check_gradients(name: &str, case: Case) {
    let shapes: Vec<Shape> = case.inputs.iter().map(|s| Shape::new(s.clone())).collect();
    let check = gems::ops::check_gradients(case.op.get(), &shapes, case.batch, 1).unwrap();
    assert!(check.passed(), "{name}:\n{check}");
}

fn conv(
    c_out: usize,
    k: (usize, usize),
    stride: usize,
    pad: (usize, usize),
    dilation: usize,
    groups: usize,
    bias: bool,
) -> Op {
    Op::Conv2d(Conv2d {
        c_out,
        kernel: k,
        stride: (stride, stride),
        pad,
        dilation: (dilation, dilation),
        groups,
        bias,
    })
}

fn one(op: Op, input: &[usize], batch: usize) -> Case {
    Case {
        op,
        inputs: vec![input.to_vec()],
        batch,
    }
}

#[test]
fn conv_3x3() {
    check_gradients(
        "conv 3x3",
        one(conv(4, (3, 3), 1, (1, 1), 1, 1, false), &[3, 6, 7], 3),
    );
}

#[test]
fn conv_strided_padded_with_bias() {
    check_gradients(
        "conv 3x3/2",
        one(conv(5, (3, 3), 2, (1, 1), 1, 1, true), &[3, 9, 8], 2),
    );
    check_gradients(
        "conv 5x5 pad 2",
        one(conv(2, (5, 5), 1, (2, 2), 1, 1, false), &[2, 7, 7], 1),
    );
    check_gradients(
        "conv 3x1",
        one(conv(3, (3, 1), 1, (1, 0), 1, 1, true), &[2, 5, 4], 2),
    );
}

#[test]
fn conv_dilated() {
    check_gradients(
        "conv dilation 2",
        one(conv(3, (3, 3), 1, (2, 2), 2, 1, false), &[2, 8, 8], 2),
    );
    check_gradients(
        "conv dilation 2 stride 2",
        one(conv(2, (3, 3), 2, (1, 1), 2, 1, false), &[3, 9, 9], 1),
    );
}

#[test]
fn conv_grouped_and_depthwise() {
    check_gradients(
        "conv groups 2",
        one(conv(4, (3, 3), 1, (1, 1), 1, 2, false), &[6, 5, 5], 3),
    );
    check_gradients(
        "conv depthwise",
        one(conv(4, (3, 3), 2, (1, 1), 1, 4, true), &[4, 7, 6], 2),
    );
}

#[test]
fn conv_pointwise() {
    check_gradients(
        "conv 1x1",
        one(conv(5, (1, 1), 1, (0, 0), 1, 1, false), &[3, 4, 5], 3),
    );
    check_gradients(
        "conv 1x1/2",
        one(conv(4, (1, 1), 2, (0, 0), 1, 1, false), &[3, 7, 7], 2),
    );
}

#[test]
fn batchnorm_training() {
    check_gradients(
        "batchnorm",
        one(Op::BatchNorm(norm::BatchNorm::default()), &[3, 4, 5], 4),
    );
    check_gradients(
        "batchnorm batch 1",
        one(Op::BatchNorm(norm::BatchNorm::default()), &[2, 3, 3], 1),
    );
    let fused = norm::BatchNorm {
        relu: true,
        ..Default::default()
    };
    check_gradients("batchnorm+relu", one(Op::BatchNorm(fused), &[3, 4, 5], 4));
}

fn group_norm(groups: usize) -> Op {
    Op::GroupNorm(GroupNorm::new(groups))
}

#[test]
fn group_norm_gradients() {
    check_gradients("groupnorm 2 groups", one(group_norm(2), &[4, 3, 3], 3));
    check_gradients("layernorm", one(group_norm(1), &[3, 4, 5], 2));
    check_gradients(
        "groupnorm a channel a group",
        one(group_norm(3), &[3, 2, 3], 2),
    );
    check_gradients("groupnorm batch 1", one(group_norm(2), &[6, 2, 2], 1));
    check_gradients("groupnorm of vectors", one(group_norm(2), &[6], 3));
}

/// y = (x − mean)/√(var + eps)·γ[c] + β[c] with each (sample, group)'s mean and biased
/// variance, PyTorch's definition computed here in f64, in training and evaluation alike.
#[test]
fn group_norm_follows_pytorch() {
    let (c, hw, groups, batch) = (6, 5, 3, 2);
    let case = one(group_norm(groups), &[c, 1, hw], batch);
    let s = setup(&case, 7);
    let [gamma, beta] = &s.params[..] else {
        panic!("group norm has a weight and a bias")
    };
    let x = &s.inputs[0];
    let len = c / groups * hw;
    for training in [true, false] {
        let (y, _, _) = run_forward(&case, &s, &s.inputs, &s.params, DType::F64, training);
        let y = y.to_f64_vec().unwrap();
        for (k, run) in x.chunks(len).enumerate() {
            let mean = run.iter().sum::<f64>() / len as f64;
            let var = run.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / len as f64;
            for (j, &v) in run.iter().enumerate() {
                let ch = k % groups * (c / groups) + j / hw;
                let want = (v - mean) / (var + 1e-5).sqrt() * gamma[ch] + beta[ch];
                let got = y[k * len + j];
                assert!((want - got).abs() < 1e-12, "{want} vs {got}");
            }
        }
    }
}

#[test]
fn group_norm_refuses_channels_that_do_not_divide() {
    let (mut b, x) = gems::graph::GraphBuilder::new("m", "M", Shape::new([30, 4, 4]));
    let e = b.group_norm("gn", x, 32).unwrap_err().to_string();
    assert!(
        e.contains("30 channels do not divide into 32 groups"),
        "{e}"
    );
    let e = b.group_norm("gn", x, 0).unwrap_err().to_string();
    assert!(e.contains("0 groups"), "{e}");
    assert!(b.group_norm("gn", x, 3).is_ok());
}

#[test]
fn smooth_activation_gradients() {
    for f in Nonlinearity::ALL {
        check_gradients(
            f.name(),
            one(Op::Smooth(activation::Smooth(f)), &[3, 4, 4], 2),
        );
    }
}

/// Each activation at a few points against PyTorch's definitions evaluated independently
/// (Python's math.erf and math.tanh in f64): x·Φ(x), the tanh approximation, x·σ(x), σ(x).
#[test]
fn smooth_activations_follow_pytorch() {
    let x = [1.0, -0.5, 2.0, -3.0];
    let want: [(Nonlinearity, [f64; 4]); 4] = [
        (
            Nonlinearity::Gelu,
            [
                0.8413447460685429,
                -0.15426876936299344,
                1.9544997361036416,
                -0.00404969409489031,
            ],
        ),
        (
            Nonlinearity::GeluTanh,
            [
                0.8411919906082768,
                -0.15428599017485606,
                1.954597694087775,
                -0.0036373920817729943,
            ],
        ),
        (
            Nonlinearity::Silu,
            [
                0.7310585786300049,
                -0.1887703343990727,
                1.7615941559557646,
                -0.14227761953270035,
            ],
        ),
        (
            Nonlinearity::Sigmoid,
            [
                0.7310585786300049,
                0.3775406687981454,
                0.8807970779778823,
                0.04742587317756678,
            ],
        ),
    ];
    let d = device();
    let ctx = Ctx {
        device: &d,
        training: true,
        seed: 0,
        tiles: None,
    };
    for (f, want) in want {
        let xs = upload(&d, &Shape::new([1, 4]), &x, DType::F64);
        let op = Op::Smooth(activation::Smooth(f));
        let (y, _) = op.get().forward(&ctx, &[&xs], &mut []).unwrap();
        let y = y.to_f64_vec().unwrap();
        for (got, want) in y.iter().zip(want) {
            assert!(
                (got - want).abs() <= 1e-15 * want.abs().max(1.0),
                "{}: {got} against {want}",
                f.name()
            );
        }
    }
}

#[test]
fn relu_add_flatten_concat() {
    check_gradients("relu", one(Op::Relu(activation::Relu), &[3, 4, 4], 2));
    check_gradients(
        "add",
        Case {
            op: Op::Add(elementwise::Add::default()),
            inputs: vec![vec![2, 3, 3], vec![2, 3, 3]],
            batch: 2,
        },
    );
    check_gradients(
        "add+relu",
        Case {
            op: Op::Add(elementwise::Add { relu: true }),
            inputs: vec![vec![2, 3, 3], vec![2, 3, 3]],
            batch: 2,
        },
    );
    check_gradients("flatten", one(Op::Flatten(shape::Flatten), &[2, 3, 3], 2));
    check_gradients(
        "concat",
        Case {
            op: Op::Concat(shape::Concat),
            inputs: vec![vec![2, 3, 4], vec![1, 3, 4], vec![3, 3, 4]],
            batch: 2,
        },
    );
}

#[test]
fn pools() {
    check_gradients(
        "maxpool 3x3/2 pad 1",
        one(Op::MaxPool(MaxPool(Window::square(3, 2, 1))), &[2, 7, 8], 2),
    );
    check_gradients(
        "maxpool 2x2/2",
        one(Op::MaxPool(MaxPool(Window::square(2, 2, 0))), &[2, 6, 6], 1),
    );
    check_gradients(
        "avgpool 3x3/2 pad 1",
        one(Op::AvgPool(AvgPool(Window::square(3, 2, 1))), &[2, 7, 8], 2),
    );
    check_gradients(
        "avgpool 2x2/2",
        one(Op::AvgPool(AvgPool(Window::square(2, 2, 0))), &[3, 6, 6], 2),
    );
    check_gradients(
        "global avgpool",
        one(Op::GlobalAvgPool(GlobalAvgPool), &[3, 5, 4], 3),
    );
}

#[test]
fn pools_ceil_mode() {
    // Output sizes by PyTorch's rule, including the case where the last window would start
    // in the right padding and is dropped.
    for (h, k, st, p, floor, ceil) in [
        (8, 3, 2, 0, 3, 4),
        (8, 3, 2, 1, 4, 5),
        (7, 2, 2, 0, 3, 4),
        (5, 2, 2, 1, 3, 3),
        (6, 3, 3, 1, 2, 3),
        (112, 3, 2, 0, 55, 56),
    ] {
        for (w, want) in [
            (Window::square(k, st, p), floor),
            (Window::square(k, st, p).ceil(), ceil),
        ] {
            let y = Op::MaxPool(MaxPool(w))
                .get()
                .infer(&[&Shape::new([1, h, h])])
                .unwrap();
            assert_eq!(y.dims(), &[1, want, want], "{w} on {h}: {y}");
        }
    }
    check_gradients(
        "maxpool 3x3/2 ceil",
        one(
            Op::MaxPool(MaxPool(Window::square(3, 2, 0).ceil())),
            &[2, 8, 7],
            2,
        ),
    );
    check_gradients(
        "maxpool 3x3/2 pad 1 ceil",
        one(
            Op::MaxPool(MaxPool(Window::square(3, 2, 1).ceil())),
            &[2, 8, 6],
            2,
        ),
    );
    check_gradients(
        "avgpool 3x3/2 pad 1 ceil",
        one(
            Op::AvgPool(AvgPool(Window::square(3, 2, 1).ceil())),
            &[2, 8, 6],
            2,
        ),
    );
    check_gradients(
        "avgpool 2x2/2 ceil",
        one(
            Op::AvgPool(AvgPool(Window::square(2, 2, 0).ceil())),
            &[2, 5, 7],
            2,
        ),
    );
    // The divisor of a ceil-mode average window is the window clipped to the padded input:
    // 3×3/2 pad 1 on 4×4 gives windows over padded rows [0,3), [2,5), [4,6).
    let d = device();
    let x: Vec<f64> = (0..16).map(|i| i as f64).collect();
    let xt = upload(&d, &Shape::new([1, 1, 4, 4]), &x, DType::F64);
    let ctx = Ctx {
        device: &d,
        training: true,
        seed: 0,
        tiles: None,
    };
    let op = Op::AvgPool(AvgPool(Window::square(3, 2, 1).ceil()));
    let y = op
        .get()
        .forward(&ctx, &[&xt], &mut [])
        .unwrap()
        .0
        .to_f64_vec()
        .unwrap();
    assert_eq!(y.len(), 9);
    assert!(
        (y[0] - (0.0 + 1.0 + 4.0 + 5.0) / 9.0).abs() < 1e-15,
        "{y:?}"
    );
    assert!((y[2] - (3.0 + 7.0) / 6.0).abs() < 1e-15, "{y:?}");
    assert!((y[8] - 15.0 / 4.0).abs() < 1e-15, "{y:?}");
}

#[test]
fn adaptive_avg_pool() {
    // Windows [⌊i·H/oh⌋, ⌈(i+1)·H/oh⌉): 5 → 3 gives [0,2), [1,4), [3,5); 2 → 3 repeats.
    let d = device();
    let x: Vec<f64> = (0..10).map(|i| i as f64).collect();
    let xt = upload(&d, &Shape::new([1, 1, 5, 2]), &x, DType::F64);
    let ctx = Ctx {
        device: &d,
        training: true,
        seed: 0,
        tiles: None,
    };
    let op = Op::AdaptiveAvgPool(AdaptiveAvgPool { out: (3, 3) });
    let y = op
        .get()
        .forward(&ctx, &[&xt], &mut [])
        .unwrap()
        .0
        .to_f64_vec()
        .unwrap();
    // Row windows {0,1}, {1,2,3}, {3,4} of a 5×2 image whose (r, c) holds 2r + c; column
    // windows {0}, {0,1}, {1}.
    let want = [1.0, 1.5, 2.0, 4.0, 4.5, 5.0, 7.0, 7.5, 8.0];
    assert!(
        y.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-14),
        "{y:?}"
    );
    check_gradients(
        "adaptive avgpool 7x6 -> 3x2",
        one(
            Op::AdaptiveAvgPool(AdaptiveAvgPool { out: (3, 2) }),
            &[2, 7, 6],
            2,
        ),
    );
    check_gradients(
        "adaptive avgpool 5x3 -> 3x4 (up in one axis)",
        one(
            Op::AdaptiveAvgPool(AdaptiveAvgPool { out: (3, 4) }),
            &[3, 5, 3],
            2,
        ),
    );
    check_gradients(
        "adaptive avgpool 2x2 -> 7x7 (VGG at its minimum size)",
        one(
            Op::AdaptiveAvgPool(AdaptiveAvgPool { out: (7, 7) }),
            &[2, 2, 2],
            2,
        ),
    );
    check_gradients(
        "adaptive avgpool divisible 6x6 -> 3x3",
        one(
            Op::AdaptiveAvgPool(AdaptiveAvgPool { out: (3, 3) }),
            &[2, 6, 6],
            1,
        ),
    );
}

#[test]
fn linear_and_dropout() {
    check_gradients(
        "linear",
        one(
            Op::Linear(linear::Linear {
                d_in: 7,
                d_out: 4,
                bias: true,
            }),
            &[7],
            3,
        ),
    );
    check_gradients(
        "dropout",
        one(Op::Dropout(dropout::Dropout { p: 0.3 }), &[4, 5, 5], 2),
    );
}

/// Random logits of `shape` and labels for its places: every third place of a per-pixel map
/// unlabelled.
fn loss_case(shape: &[usize], seed: u64) -> (Shape, Vec<f64>, Vec<u32>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let shape = Shape::new(shape.to_vec());
    let logits = (0..shape.numel())
        .map(|_| rng.random_range(-2.0..2.0))
        .collect();
    let (k, places) = (shape.dim(1), shape.numel() / shape.dim(1));
    let labels = (0..places)
        .map(|q| match shape.rank() {
            4 if q % 3 == 1 => UNLABELLED,
            _ => rng.random_range(0..k as u32),
        })
        .collect();
    (shape, logits, labels)
}

/// The loss from its definition, in f64: each sample's Σ w·ℓ / Σ w over its labelled places,
/// averaged over the samples.
fn direct_loss(shape: &Shape, logits: &[f64], labels: &[u32], cw: Option<&[f64]>) -> f64 {
    let (n, k) = (shape.dim(0), shape.dim(1));
    let positions = shape.numel() / (n * k);
    let mut mean = 0.0;
    for s in 0..n {
        let (mut sum, mut total) = (0.0, 0.0);
        for p in 0..positions {
            let label = labels[s * positions + p];
            if label == UNLABELLED {
                continue;
            }
            let z: Vec<f64> = (0..k)
                .map(|j| logits[(s * k + j) * positions + p])
                .collect();
            let lse = z.iter().map(|v| v.exp()).sum::<f64>().ln();
            let w = cw.map_or(1.0, |cw| cw[label as usize]);
            sum += w * (lse - z[label as usize]);
            total += w;
        }
        mean += if total > 0.0 { sum / total } else { 0.0 } / n as f64;
    }
    mean
}

#[test]
fn softmax_cross_entropy_gradients_and_definition() {
    let d = device();
    for (dims, cw) in [
        (vec![4, 5], None),
        (vec![4, 5], Some(vec![0.5, 2.0, 1.0, 0.0, 3.0])),
        (vec![3, 4, 3, 5], None),
        (vec![3, 4, 3, 5], Some(vec![0.25, 1.5, 0.0, 2.0])),
    ] {
        let (shape, logits, labels) = loss_case(&dims, 3);
        let cw = cw.as_deref();
        let f = |l: &[f64]| {
            let x = upload(&d, &shape, l, DType::F64);
            loss::softmax_cross_entropy(&d, &x, &labels, cw, Norm::PerSample)
                .unwrap()
                .loss
        };
        let x = upload(&d, &shape, &logits, DType::F64);
        let ce = loss::softmax_cross_entropy(&d, &x, &labels, cw, Norm::PerSample).unwrap();
        let want = direct_loss(&shape, &logits, &labels, cw);
        assert!(
            (ce.loss - want).abs() <= 1e-12 * want,
            "{dims:?}: {} vs {want}",
            ce.loss
        );
        let per = loss::per_sample(&x, &labels, cw).unwrap();
        let mean = per.iter().sum::<f64>() / per.len() as f64;
        assert!((mean - want).abs() <= 1e-12 * want, "{dims:?} per sample");
        if let [_, _, h, w] = dims[..] {
            // The tiles' shares of a sample's loss add up to it.
            let grid = gems::ops::tiles::Grid { rows: 2, cols: 2 };
            let mut sum = vec![0.0; per.len()];
            for t in 0..grid.tiles() {
                let tile = gems::ops::tiles::cut(&d, &x, grid, t).unwrap();
                let part = grid.owned(t, (h, w));
                let shares = loss::per_sample_part(&tile, &labels, (h, w), &part, cw).unwrap();
                sum.iter_mut().zip(shares).for_each(|(s, p)| *s += p);
            }
            for (a, b) in sum.iter().zip(&per) {
                assert!(
                    (a - b).abs() <= 1e-12 * b,
                    "{dims:?}: tiles {a} against {b}"
                );
            }
        }
        for (s, &l) in per.iter().enumerate() {
            let sample = shape.numel() / shape.dim(0);
            let places = labels.len() / shape.dim(0);
            let one = Shape::new(
                [1].into_iter()
                    .chain(dims[1..].iter().copied())
                    .collect::<Vec<_>>(),
            );
            let direct = direct_loss(
                &one,
                &logits[s * sample..(s + 1) * sample],
                &labels[s * places..(s + 1) * places],
                cw,
            );
            assert!(
                (l - direct).abs() <= 1e-12 * direct.max(1.0),
                "{dims:?} sample {s}"
            );
        }
        let g = ce
            .backward(&d, 0.7, DType::F64)
            .unwrap()
            .to_f64_vec()
            .unwrap();
        let numeric: Vec<f64> = (0..logits.len())
            .map(|i| {
                let (mut a, mut b) = (logits.clone(), logits.clone());
                a[i] += H;
                b[i] -= H;
                0.7 * (f(&a) - f(&b)) / (2.0 * H)
            })
            .collect();
        assert!(
            rel_error(&g, &numeric) <= 1e-6,
            "{dims:?}: {g:?} vs {numeric:?}"
        );
    }
}

/// A batch of 4 scores exactly as the mean of its two micro-batches of 2, loss and gradients
/// (what the runtime relies on when it cuts a batch).
#[test]
fn softmax_cross_entropy_of_a_batch_is_the_mean_of_its_micro_batches() {
    let d = device();
    let (shape, logits, mut labels) = loss_case(&[4, 3, 4, 5], 5);
    // A sample with no labelled pixel counts 0 in either cut.
    labels[20..40].fill(UNLABELLED);
    let cw = [0.5, 2.0, 1.25];
    let whole = loss::softmax_cross_entropy(
        &d,
        &upload(&d, &shape, &logits, DType::F64),
        &labels,
        Some(&cw),
        Norm::PerSample,
    )
    .unwrap();
    let dwhole = whole
        .backward(&d, 1.0, DType::F64)
        .unwrap()
        .to_f64_vec()
        .unwrap();
    let half = Shape::new([2, 3, 4, 5]);
    let (mut loss, mut grad) = (0.0, Vec::new());
    for m in 0..2 {
        let x = upload(&d, &half, &logits[m * 120..(m + 1) * 120], DType::F64);
        let labels = &labels[m * 40..(m + 1) * 40];
        let ce = loss::softmax_cross_entropy(&d, &x, labels, Some(&cw), Norm::PerSample).unwrap();
        loss += ce.loss / 2.0;
        grad.extend(
            ce.backward(&d, 0.5, DType::F64)
                .unwrap()
                .to_f64_vec()
                .unwrap(),
        );
    }
    assert!(
        (loss - whole.loss).abs() <= 1e-15 * whole.loss,
        "{loss} vs {}",
        whole.loss
    );
    assert_eq!(grad, dwhole);
}

/// `--loss-reduction pytorch` is PyTorch's `CrossEntropyLoss(weight=w, ignore_index=255)`
/// (tests/data/loss/expected.json, written by scripts/make_loss_fixture.py), loss and
/// gradients, for a batch of 4 whose samples carry different weights, cut into 2 micro-batches
/// each divided by the whole batch's weight; the default reduction differs there.
#[test]
fn pytorch_reduction_over_micro_batches_equals_pytorchs_cross_entropy() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/loss/expected.json");
    let fixture: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let numbers = |key: &str| -> Vec<f64> {
        let v = fixture[key].as_array().unwrap();
        v.iter().map(|x| x.as_f64().unwrap()).collect()
    };
    let (logits, cw, want_grad) = (numbers("logits"), numbers("class_weights"), numbers("grad"));
    // PyTorch's ignore_index 255 is gems's UNLABELLED (what a mask's 255 reads as).
    let label = |l: f64| if l == 255.0 { UNLABELLED } else { l as u32 };
    let labels: Vec<u32> = numbers("labels").into_iter().map(label).collect();
    let want = fixture["loss"].as_f64().unwrap();
    let d = device();
    let total = loss::total_weight(&labels, 3, Some(&cw)).unwrap();
    let half = Shape::new([2, 3, 4, 5]);
    let (mut got, mut grad) = (0.0, Vec::new());
    for m in 0..2 {
        let x = upload(&d, &half, &logits[m * 120..(m + 1) * 120], DType::F64);
        let labels = &labels[m * 40..(m + 1) * 40];
        let ce =
            loss::softmax_cross_entropy(&d, &x, labels, Some(&cw), Norm::Total(total)).unwrap();
        got += ce.loss;
        grad.extend(
            ce.backward(&d, 1.0, DType::F64)
                .unwrap()
                .to_f64_vec()
                .unwrap(),
        );
    }
    assert!(
        (got - want).abs() <= 1e-12 * want,
        "{got} vs PyTorch's {want}"
    );
    let worst = grad
        .iter()
        .zip(&want_grad)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(
        worst <= 1e-12,
        "gradients differ from PyTorch's by {worst:e}"
    );
    let whole = upload(&d, &Shape::new([4, 3, 4, 5]), &logits, DType::F64);
    let per_sample = loss::softmax_cross_entropy(&d, &whole, &labels, Some(&cw), Norm::PerSample);
    let per_sample = per_sample.unwrap().loss;
    assert!(
        (per_sample - want).abs() > 1e-3 * want,
        "the fixture's samples weigh alike: {per_sample} vs {want}"
    );
}

/// With every pixel labelled and no weights, the loss is the plain mean over all pixels:
/// PyTorch's `F.cross_entropy(logits, target)` (reduction "mean") on N×K×H×W logits. With one
/// place per sample it is the mean over the batch, as before.
#[test]
fn softmax_cross_entropy_is_pytorchs_mean_over_pixels() {
    let d = device();
    for dims in [vec![2, 3, 4, 5], vec![6, 7]] {
        let (shape, logits, _) = loss_case(&dims, 7);
        let places = shape.numel() / shape.dim(1);
        let labels: Vec<u32> = (0..places).map(|q| (q % dims[1]) as u32).collect();
        let (k, positions) = (dims[1], places / dims[0]);
        let sum: f64 = (0..places)
            .map(|q| {
                let (s, p) = (q / positions, q % positions);
                let z: Vec<f64> = (0..k)
                    .map(|j| logits[(s * k + j) * positions + p])
                    .collect();
                z.iter().map(|v| v.exp()).sum::<f64>().ln() - z[labels[q] as usize]
            })
            .sum();
        let x = upload(&d, &shape, &logits, DType::F64);
        let ce = loss::softmax_cross_entropy(&d, &x, &labels, None, Norm::PerSample).unwrap();
        let want = sum / places as f64;
        assert!(
            (ce.loss - want).abs() <= 1e-13 * want,
            "{dims:?}: {} vs {want}",
            ce.loss
        );
        // The predictions are the most probable class of each place.
        let p = ce.probs.to_f64_vec().unwrap();
        for (q, &c) in loss::predictions(&ce.probs).unwrap().iter().enumerate() {
            let (s, pos) = (q / positions, q % positions);
            let at = |j: usize| p[(s * k + j) * positions + pos];
            assert!(
                (0..k).all(|j| at(j) <= at(c as usize)),
                "{dims:?} place {q}"
            );
        }
    }
}

#[test]
fn softmax_cross_entropy_refuses_bad_labels_and_weights() {
    let d = device();
    let (shape, logits, labels) = loss_case(&[2, 3, 2, 2], 9);
    let x = upload(&d, &shape, &logits, DType::F64);
    let mut bad = labels.clone();
    bad[5] = 3;
    let refused = |labels: &[u32], cw: Option<&[f64]>| {
        loss::softmax_cross_entropy(&d, &x, labels, cw, Norm::PerSample).is_err()
            && loss::per_sample(&x, labels, cw).is_err()
    };
    assert!(refused(&bad, None), "a label ≥ K");
    assert!(
        refused(&labels[1..], None),
        "a label count that does not match"
    );
    assert!(refused(&labels, Some(&[1.0, 1.0])), "a weight count ≠ K");
    assert!(
        refused(&labels, Some(&[1.0, -0.5, 1.0])),
        "a negative weight"
    );
    assert!(
        refused(&labels, Some(&[1.0, f64::NAN, 1.0])),
        "a NaN weight"
    );
    let flat = upload(&d, &Shape::new([24]), &logits, DType::F64);
    assert!(
        loss::softmax_cross_entropy(&d, &flat, &labels, None, Norm::PerSample).is_err(),
        "logits of rank 1"
    );
    let empty = upload(&d, &Shape::new([2, 3, 0, 4]), &[], DType::F64);
    assert!(
        loss::softmax_cross_entropy(&d, &empty, &[], None, Norm::PerSample).is_err(),
        "logits of no places"
    );
}

#[test]
fn batchnorm_eval_uses_running_statistics() {
    let case = one(Op::BatchNorm(norm::BatchNorm::default()), &[2, 3, 3], 2);
    let s = setup(&case, 5);
    let (y, _, _) = run_forward(&case, &s, &s.inputs, &s.params, DType::F64, false);
    let y = y.to_f64_vec().unwrap();
    let [gamma, beta, mean, var] = &s.params[..] else {
        panic!()
    };
    for (i, (&x, &y)) in s.inputs[0].iter().zip(&y).enumerate() {
        let c = (i / 9) % 2;
        let want = gamma[c] * (x - mean[c]) / (var[c] + 1e-5).sqrt() + beta[c];
        assert!((want - y).abs() < 1e-12, "{want} vs {y}");
    }
}

#[test]
fn batchnorm_running_statistics_follow_pytorch() {
    let case = one(Op::BatchNorm(norm::BatchNorm::default()), &[1, 2, 2], 2);
    let mut s = setup(&case, 6);
    s.inputs[0] = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
    s.params[2] = vec![0.0];
    s.params[3] = vec![1.0];
    let (_, saved, mut ps) = run_forward(&case, &s, &s.inputs, &s.params, DType::F64, true);
    // Training forward leaves the running statistics alone ...
    assert_eq!(
        (ps[2].scalar().unwrap(), ps[3].scalar().unwrap()),
        (0.0, 1.0)
    );
    // ... and committing its batch statistics applies PyTorch's rule: mean 4.5, unbiased
    // variance 6 → running = 0.9·old + 0.1·batch.
    let stats = norm::BatchNorm::batch_stats(&saved, &Shape::new([1, 2, 2])).unwrap();
    assert_eq!(stats.count, 8);
    norm::BatchNorm::default()
        .commit(&device(), &mut ps, &stats)
        .unwrap();
    assert!((ps[2].scalar().unwrap() - 0.45).abs() < 1e-12);
    assert!((ps[3].scalar().unwrap() - (0.9 + 0.6)).abs() < 1e-12);
}

/// Direct convolution by the definition, for comparison.
fn direct_conv(x: &[f64], w: &[f64], g: &gems::backend::ConvGeom) -> Vec<f64> {
    let (ci_g, co_g) = (g.c_in / g.groups, g.c_out / g.groups);
    let mut y = vec![0.0; g.n * g.c_out * g.h_out * g.w_out];
    for n in 0..g.n {
        for co in 0..g.c_out {
            let grp = co / co_g;
            for oh in 0..g.h_out {
                for ow in 0..g.w_out {
                    let mut s = 0.0;
                    for ci in 0..ci_g {
                        for i in 0..g.kh {
                            for j in 0..g.kw {
                                let ih = (oh * g.stride.0 + i * g.dilation.0) as isize
                                    - g.pad.0 as isize;
                                let iw = (ow * g.stride.1 + j * g.dilation.1) as isize
                                    - g.pad.1 as isize;
                                if ih >= 0 && iw >= 0 && (ih as usize) < g.h && (iw as usize) < g.w
                                {
                                    let c = grp * ci_g + ci;
                                    s += x[((n * g.c_in + c) * g.h + ih as usize) * g.w
                                        + iw as usize]
                                        * w[((co * ci_g + ci) * g.kh + i) * g.kw + j];
                                }
                            }
                        }
                    }
                    y[((n * g.c_out + co) * g.h_out + oh) * g.w_out + ow] = s;
                }
            }
        }
    }
    y
}

#[test]
fn conv_matches_direct_convolution_across_tiles_and_lanes() {
    // Shapes large enough to be cut into several im2col tiles, batches that split unevenly
    // over lanes, and each variant of the geometry.
    let cases = [
        (conv(3, (3, 3), 1, (1, 1), 1, 1, false), [2, 300, 40], 3),
        (conv(4, (3, 3), 2, (1, 1), 1, 2, false), [2, 600, 50], 1),
        (conv(2, (3, 3), 1, (2, 2), 2, 1, false), [3, 260, 33], 2),
        (conv(3, (5, 3), 2, (2, 1), 1, 3, false), [3, 301, 61], 3),
        (conv(5, (1, 1), 1, (0, 0), 1, 1, false), [3, 50, 40], 3),
        (conv(4, (1, 1), 2, (0, 0), 1, 1, false), [3, 41, 37], 2),
    ];
    let d = device();
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for (op, input, n) in cases {
        let Op::Conv2d(c) = &op else { unreachable!() };
        let xs = gems::ops::batched(n, &Shape::new(input));
        let g = c.geom(&xs).unwrap();
        let wshape = Shape::new([g.c_out, g.c_in / g.groups, g.kh, g.kw]);
        let x: Vec<f64> = (0..xs.numel())
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let w: Vec<f64> = (0..wshape.numel())
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let xt = upload(&d, &xs, &x, DType::F64);
        let mut params = vec![upload(&d, &wshape, &w, DType::F64)];
        let ctx = Ctx {
            device: &d,
            training: true,
            seed: 0,
            tiles: None,
        };
        let (y, _) = op.get().forward(&ctx, &[&xt], &mut params).unwrap();
        let want = direct_conv(&x, &w, &g);
        let e = rel_error(&y.to_f64_vec().unwrap(), &want);
        assert!(e < 1e-13, "{c} on {xs}: relative error {e:e}");
    }
    // The tiled path's own gradients, across tiles.
    check_gradients(
        "conv over tiles",
        one(conv(3, (3, 3), 1, (1, 1), 1, 1, true), &[2, 300, 40], 3),
    );
    check_gradients(
        "conv over tiles, strided groups",
        one(conv(4, (3, 3), 2, (1, 1), 1, 2, false), &[2, 600, 50], 1),
    );
}

#[test]
fn avg_pool_excluding_padding() {
    use gems::ops::pool::AvgPoolExcludePad;
    // 3×3/1 pad 1 on a 3×3 image: a corner window covers 4 elements, an edge one 6, the centre 9.
    let d = device();
    let x: Vec<f64> = (0..9).map(|i| i as f64).collect();
    let xt = upload(&d, &Shape::new([1, 1, 3, 3]), &x, DType::F64);
    let ctx = Ctx {
        device: &d,
        training: true,
        seed: 0,
        tiles: None,
    };
    let op = Op::AvgPoolExcludePad(AvgPoolExcludePad(Window::square(3, 1, 1)));
    let y = op
        .get()
        .forward(&ctx, &[&xt], &mut [])
        .unwrap()
        .0
        .to_f64_vec()
        .unwrap();
    let want = [2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5, 6.0];
    assert!(
        y.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-14),
        "{y:?}"
    );
    assert_eq!(d.memory().live.get(Category::Workspace), 0);
    check_gradients(
        "avgpool 3x3/1 pad 1 excluding padding",
        one(
            Op::AvgPoolExcludePad(AvgPoolExcludePad(Window::square(3, 1, 1))),
            &[2, 5, 6],
            2,
        ),
    );
    check_gradients(
        "avgpool 3x3/2 pad 1 excluding padding",
        one(
            Op::AvgPoolExcludePad(AvgPoolExcludePad(Window::square(3, 2, 1))),
            &[3, 7, 8],
            2,
        ),
    );
}

#[test]
fn pad2d_pads_and_crops() {
    // AmoebaNet's shift: crop the first row and column, pad one zero row and column at the end.
    let shift = shape::Pad2d {
        top: -1,
        bottom: 1,
        left: -1,
        right: 1,
    };
    let d = device();
    let x: Vec<f64> = (1..=6).map(|i| i as f64).collect();
    let xt = upload(&d, &Shape::new([1, 1, 2, 3]), &x, DType::F64);
    let ctx = Ctx {
        device: &d,
        training: true,
        seed: 0,
        tiles: None,
    };
    let y = Op::Pad2d(shift.clone())
        .get()
        .forward(&ctx, &[&xt], &mut [])
        .unwrap()
        .0;
    assert_eq!(y.shape().dims(), &[1, 1, 2, 3]);
    assert_eq!(y.to_f64_vec().unwrap(), [5.0, 6.0, 0.0, 0.0, 0.0, 0.0]);
    check_gradients("pad2d shift", one(Op::Pad2d(shift), &[3, 5, 4], 2));
    check_gradients(
        "pad2d mixed",
        one(
            Op::Pad2d(shape::Pad2d {
                top: 2,
                bottom: -1,
                left: -2,
                right: 3,
            }),
            &[2, 4, 5],
            2,
        ),
    );
    let too_much = shape::Pad2d {
        top: -2,
        bottom: -1,
        left: 0,
        right: 0,
    };
    assert!(Op::Pad2d(too_much)
        .get()
        .infer(&[&Shape::new([1, 3, 3])])
        .is_err());
}

#[test]
fn conv_kernel_wider_than_image() {
    // Kernel columns (rows) that only ever read padding: AmoebaNet's 1×7 / 7×1 pad 3 convs on
    // the 2×2 maps of a small image.
    check_gradients(
        "conv 1x7 pad 3 on width 2",
        one(conv(3, (1, 7), 1, (0, 3), 1, 1, false), &[2, 3, 2], 2),
    );
    check_gradients(
        "conv 7x1 pad 3 on height 1",
        one(conv(2, (7, 1), 1, (3, 0), 1, 1, true), &[3, 1, 4], 2),
    );
    check_gradients(
        "conv 5x5 pad 3 stride 2 on 2x3",
        one(conv(2, (5, 5), 2, (3, 3), 1, 1, false), &[2, 2, 3], 2),
    );
}

fn conv_t(
    c_out: usize,
    k: usize,
    stride: usize,
    pad: usize,
    out_pad: usize,
    groups: usize,
    bias: bool,
) -> Op {
    Op::ConvTranspose2d(ConvTranspose2d {
        c_out,
        kernel: (k, k),
        stride: (stride, stride),
        pad: (pad, pad),
        output_padding: (out_pad, out_pad),
        groups,
        bias,
    })
}

#[test]
fn conv_transpose() {
    check_gradients(
        "conv-transpose 2x2/2 (U-Net)",
        one(conv_t(3, 2, 2, 0, 0, 1, true), &[4, 5, 6], 2),
    );
    check_gradients(
        "conv-transpose 3x3/2 pad 1 out-pad 1",
        one(conv_t(2, 3, 2, 1, 1, 1, true), &[3, 4, 5], 2),
    );
    check_gradients(
        "conv-transpose 4x4/2 pad 1 groups 2",
        one(conv_t(4, 4, 2, 1, 0, 2, false), &[2, 3, 4], 1),
    );
    check_gradients(
        "conv-transpose 3x3/1 pad 1",
        one(conv_t(2, 3, 1, 1, 0, 1, false), &[3, 5, 5], 2),
    );
}

#[test]
fn conv_transpose_matches_a_direct_scatter() {
    // PyTorch's definition, independent of the adjoint the op runs as: every input pixel adds
    // its weighted kernel into the output at (i·s - p + a, j·s - p + b).
    for (op, input, batch) in [
        (conv_t(3, 2, 2, 0, 0, 1, true), [4, 5, 6], 2),
        (conv_t(2, 3, 2, 1, 1, 1, true), [3, 40, 37], 2),
        (conv_t(4, 4, 2, 1, 0, 2, false), [2, 7, 9], 3),
    ] {
        let Op::ConvTranspose2d(t) = &op else {
            unreachable!()
        };
        let case = one(op.clone(), &input, batch);
        let s = setup(&case, 7);
        let (y, _, _) = run_forward(&case, &s, &s.inputs, &s.params, DType::F64, true);
        let got = y.to_f64_vec().unwrap();
        let (x, w) = (&s.inputs[0], &s.params[0]);
        let [c_in, h, wi] = input;
        let (oh, ow) = (s.out_shape.dim(2), s.out_shape.dim(3));
        let (ci_g, co_g, k) = (c_in / t.groups, t.c_out / t.groups, t.kernel.0);
        let mut want = vec![0.0; s.out_shape.numel()];
        for n in 0..batch {
            for ci in 0..c_in {
                let grp = ci / ci_g;
                for i in 0..h {
                    for j in 0..wi {
                        let v = x[((n * c_in + ci) * h + i) * wi + j];
                        for co in 0..co_g {
                            for a in 0..k {
                                for b in 0..k {
                                    let (r, c) = (
                                        (i * t.stride.0 + a) as isize - t.pad.0 as isize,
                                        (j * t.stride.1 + b) as isize - t.pad.1 as isize,
                                    );
                                    if r >= 0 && c >= 0 && (r as usize) < oh && (c as usize) < ow {
                                        let out = grp * co_g + co;
                                        want[((n * t.c_out + out) * oh + r as usize) * ow
                                            + c as usize] +=
                                            v * w[((ci * co_g + co) * k + a) * k + b];
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        if t.bias {
            for (i, v) in want.iter_mut().enumerate() {
                *v += s.params[1][(i / (oh * ow)) % t.c_out];
            }
        }
        let err = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(err < 1e-12, "{}: max error {err}", op.describe());
        assert_eq!(
            (oh, ow),
            (
                (input[1] - 1) * t.stride.0 + k + t.output_padding.0 - 2 * t.pad.0,
                (input[2] - 1) * t.stride.1 + k + t.output_padding.1 - 2 * t.pad.1
            )
        );
    }
}

#[test]
fn upsample_nearest_repeats_pixels() {
    let (mut b, x) = gems::GraphBuilder::new("up", "Up", Shape::new([2, 3, 4]));
    let y = b.upsample_nearest("up", x, 2).unwrap();
    assert_eq!(b.shape(y).dims(), &[2, 6, 8]);
    let g = b.finish(vec![]).unwrap();
    let Op::AdaptiveAvgPool(p) = g.nodes[0].op.clone() else {
        panic!("{:?}", g.nodes[0].op)
    };
    let case = one(Op::AdaptiveAvgPool(p), &[2, 3, 4], 2);
    let s = setup(&case, 3);
    let (y, _, _) = run_forward(&case, &s, &s.inputs, &s.params, DType::F64, true);
    let got = y.to_f64_vec().unwrap();
    for (i, v) in got.iter().enumerate() {
        let (nc, r, c) = (i / 48, (i / 8) % 6, i % 8);
        assert_eq!(*v, s.inputs[0][nc * 12 + (r / 2) * 4 + c / 2]);
    }
}

fn resize(out: (usize, usize), align_corners: bool) -> Op {
    Op::ResizeBilinear(resize::ResizeBilinear { out, align_corners })
}

#[test]
fn resize_bilinear_gradients() {
    for align_corners in [false, true] {
        for (input, out) in [
            ([2, 3, 5], (7, 8)), // enlarging, odd sizes
            ([2, 7, 6], (3, 4)), // shrinking
            ([1, 4, 9], (9, 2)), // one way each
            ([3, 5, 4], (1, 3)), // a single row: align_corners' scale 0
            ([1, 1, 1], (3, 2)), // a single pixel spread
        ] {
            check_gradients(
                &format!("bilinear {input:?} -> {out:?} align_corners={align_corners}"),
                one(resize(out, align_corners), &input, 2),
            );
        }
    }
}

/// PyTorch's `upsample_bilinear2d` written out from its definition (area_pixel_compute_scale
/// and area_pixel_compute_source_index), in f64.
fn pytorch_bilinear(x: &[f64], (h, w): (usize, usize), out: (usize, usize), ac: bool) -> Vec<f64> {
    let tap = |o: usize, input: usize, out: usize| {
        let src = if ac {
            let scale = if out > 1 {
                (input - 1) as f64 / (out - 1) as f64
            } else {
                0.0
            };
            scale * o as f64
        } else {
            let src = input as f64 / out as f64 * (o as f64 + 0.5) - 0.5;
            if src < 0.0 {
                0.0
            } else {
                src
            }
        };
        let i0 = (src.floor() as usize).min(input - 1);
        let i1 = if i0 < input - 1 { i0 + 1 } else { i0 };
        let l1 = src - i0 as f64;
        (i0, i1, 1.0 - l1, l1)
    };
    let mut y = Vec::new();
    for plane in x.chunks(h * w) {
        for oh in 0..out.0 {
            let (h0, h1, a0, a1) = tap(oh, h, out.0);
            for ow in 0..out.1 {
                let (w0, w1, b0, b1) = tap(ow, w, out.1);
                let at = |r: usize, c: usize| plane[r * w + c];
                y.push(
                    a0 * (b0 * at(h0, w0) + b1 * at(h0, w1))
                        + a1 * (b0 * at(h1, w0) + b1 * at(h1, w1)),
                );
            }
        }
    }
    y
}

#[test]
fn resize_bilinear_matches_pytorch() {
    // F.interpolate(torch.tensor([[[[1., 2.], [3., 4.]]]]), size=4, mode="bilinear", ...).
    let known = [
        (
            false,
            [
                1.0, 1.25, 1.75, 2.0, 1.5, 1.75, 2.25, 2.5, 2.5, 2.75, 3.25, 3.5, 3.0, 3.25, 3.75,
                4.0,
            ],
        ),
        (
            true,
            [
                1.0,
                4.0 / 3.0,
                5.0 / 3.0,
                2.0,
                5.0 / 3.0,
                2.0,
                7.0 / 3.0,
                8.0 / 3.0,
                7.0 / 3.0,
                8.0 / 3.0,
                3.0,
                10.0 / 3.0,
                3.0,
                10.0 / 3.0,
                11.0 / 3.0,
                4.0,
            ],
        ),
    ];
    for (ac, want) in known {
        let case = one(resize((4, 4), ac), &[1, 2, 2], 1);
        let mut s = setup(&case, 1);
        s.inputs[0] = vec![1.0, 2.0, 3.0, 4.0];
        let (y, _, _) = run_forward(&case, &s, &s.inputs, &s.params, DType::F64, true);
        let got = y.to_f64_vec().unwrap();
        assert!(
            rel_error(&got, &want) <= 1e-15,
            "align_corners={ac}: {got:?}"
        );
        assert_eq!(pytorch_bilinear(&s.inputs[0], (2, 2), (4, 4), ac), got);
    }
    for ac in [false, true] {
        for (input, out) in [
            ([3, 5, 7], (11, 4)),
            ([2, 6, 6], (6, 6)),
            ([2, 9, 4], (2, 13)),
        ] {
            let case = one(resize(out, ac), &input, 2);
            let s = setup(&case, 4);
            let (y, _, _) = run_forward(&case, &s, &s.inputs, &s.params, DType::F64, true);
            let want = pytorch_bilinear(&s.inputs[0], (input[1], input[2]), out, ac);
            assert_eq!(
                y.to_f64_vec().unwrap(),
                want,
                "{input:?} -> {out:?} ac={ac}"
            );
        }
    }
    // Same size without align_corners, or with it: the identity.
    let case = one(resize((6, 6), false), &[2, 6, 6], 2);
    let s = setup(&case, 4);
    let (y, _, _) = run_forward(&case, &s, &s.inputs, &s.params, DType::F64, true);
    assert_eq!(y.to_f64_vec().unwrap(), s.inputs[0]);
}

#[test]
fn upsample_and_resize_bilinear_in_the_builder() {
    let (mut b, x) = gems::GraphBuilder::new("up", "Up", Shape::new([2, 3, 5]));
    let y = b.upsample_bilinear("up", x, 2, false).unwrap();
    assert_eq!(b.shape(y).dims(), &[2, 6, 10]);
    let z = b.resize_bilinear("down", y, (4, 7), true).unwrap();
    assert_eq!(b.shape(z).dims(), &[2, 4, 7]);
    assert!(b.upsample_bilinear("zero", z, 0, false).is_err());
    assert!(b.resize_bilinear("empty", z, (0, 3), false).is_err());
    let g = b.finish(vec![]).unwrap();
    let op = g.nodes[1].op.get();
    let (input, output) = (Shape::new([2, 6, 10]), Shape::new([2, 4, 7]));
    assert_eq!(op.flops(&[&input], &output), 8 * 2 * 4 * 7);
    assert_eq!(op.saves(&[&input]), gems::ops::SavesFor::default());
    assert_eq!(g.nodes[1].op.describe(), "bilinear 4x7 align-corners");
}
