//! The torchvision models (vgg19, alexnet, resnet50): exact parameter counts, parameter names
//! and shapes against torchvision's state_dict (tests/data/<model>.names), the smallest images
//! they accept, and whole-model gradients against finite differences.

use std::time::Instant;

use gems::backend::Device;
use gems::graph::{self, Graph, Params};
use gems::models::{self, torchvision::Arch};
use gems::ops::{batched, loss, Op};
use gems::{Category, DType};

#[test]
fn parameter_counts_with_two_classes() {
    for (name, want) in [
        ("vgg19", 139_578_434),
        ("alexnet", 57_012_034),
        ("resnet50", 23_512_130),
    ] {
        let g = models::build(name, 224, 2).unwrap();
        assert_eq!(g.parameter_count(), want, "{name}");
    }
}

/// `(name, shape)` per line of a `.names` file; an empty shape is a scalar.
fn state_dict(model: &str) -> Vec<(String, Vec<usize>)> {
    let path = format!("{}/tests/data/{model}.names", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .lines()
        .map(|line| {
            let (name, shape) = line.split_once(' ').unwrap_or((line, ""));
            let dims = shape
                .split(',')
                .filter(|d| !d.is_empty())
                .map(|d| d.parse().unwrap())
                .collect();
            (name.to_string(), dims)
        })
        .collect()
}

#[test]
fn parameters_are_named_and_shaped_as_torchvision_state_dict() {
    for arch in Arch::ALL {
        let g = models::build(arch.name(), 224, 1000).unwrap();
        let (tracked, entries): (Vec<_>, Vec<_>) = state_dict(arch.name())
            .into_iter()
            .partition(|(n, _)| n.ends_with(".num_batches_tracked"));
        // Same entries in the same order (a module's parameters, then its buffers, then its
        // children, in registration order).
        let ours: Vec<(String, Vec<usize>)> = g
            .params
            .iter()
            .map(|p| (p.name.clone(), p.spec.shape.dims().to_vec()))
            .collect();
        for (i, (a, b)) in ours.iter().zip(&entries).enumerate() {
            assert_eq!(a, b, "{}: entry {i}", arch.name());
        }
        assert_eq!(ours.len(), entries.len(), "{}", arch.name());
        // num_batches_tracked (not kept by gems yet): one scalar per BN node.
        let bns: Vec<String> = g
            .nodes
            .iter()
            .filter(|n| matches!(n.op, Op::BatchNorm(_)))
            .map(|n| format!("{}.num_batches_tracked", n.name))
            .collect();
        assert!(tracked.iter().all(|(_, s)| s.is_empty()));
        let tracked: Vec<String> = tracked.into_iter().map(|(n, _)| n).collect();
        assert_eq!(tracked, bns, "{}", arch.name());
    }
}

#[test]
fn smallest_images_are_computed_and_refused_below() {
    for (arch, min) in [(Arch::Vgg19, 32), (Arch::AlexNet, 63), (Arch::ResNet50, 1)] {
        assert_eq!(arch.min_image_size(), min, "{}", arch.name());
        assert!(
            models::build(arch.name(), min, 2).is_ok(),
            "{}",
            arch.name()
        );
        if min > 1 {
            let e = models::build(arch.name(), min - 1, 2)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!("at least {min}×{min}")) && e.contains(arch.name()),
                "{e}"
            );
        }
    }
    // The classifier head sees the adaptive pool's fixed size at any image size.
    for size in [32, 45, 224] {
        let g = models::build("vgg19", size, 2).unwrap();
        assert_eq!(g.parameter_count(), 139_578_434, "vgg19 at {size}²");
    }
    let e = models::build("alexnet", 224, 1).unwrap_err().to_string();
    assert!(e.contains("at least 2 classes"), "{e}");
}

/// Loss of one training-mode forward pass in f64 (dropout seeded by the pass seed).
fn loss_of(g: &Graph, params: &mut Params, d: &Device, x: &[f64], labels: &[u32]) -> f64 {
    let y = forward(g, params, d, x, labels.len(), false).0;
    loss::softmax_cross_entropy(d, &y, labels).unwrap().0
}

fn forward(
    g: &Graph,
    params: &mut Params,
    d: &Device,
    x: &[f64],
    n: usize,
    tape: bool,
) -> (gems::Tensor, Option<graph::Tape>) {
    let xt = d
        .upload(
            batched(n, g.input_shape()),
            x,
            DType::F64,
            Category::Activations,
        )
        .unwrap();
    let out = g.outputs[0].value;
    let (mut y, t) = graph::forward(
        g,
        params,
        d,
        vec![(g.input, xt)],
        0..g.nodes.len(),
        &[out],
        true,
        false,
        9,
    )
    .unwrap();
    (y.remove(0), tape.then_some(t))
}

/// Finite-difference steps, tried in turn. h = 1e-7 as in tests/models.rs; but in a deep ReLU
/// net with batch-2 BN a stem weight moves so many units that a step can carry some across
/// their kinks (ResNet-50's `conv1`: off by 0.5% at 1e-7, 1e-7 relative at 1e-9). A wrong
/// gradient disagrees at every step; a kink only at the larger ones.
const STEPS: [f64; 3] = [1e-7, 1e-8, 1e-9];
/// Rounding in a loss near ln 2 leaves about NOISE/h of absolute error in a central difference
/// (a few ε·L/h), which dominates small gradients: allowed on top of the relative error.
const NOISE: f64 = 3e-16;

/// Forward and backward of `name` on 2 images of `size`² in f64, then central differences of
/// the loss at three elements of each probed parameter.
fn check_model(name: &str, size: usize, probes: &[&str]) {
    let start = Instant::now();
    let g = models::build(name, size, 2).unwrap();
    let d = Device::cpu("test", None);
    let mut params = Params::init(&g, &d, DType::F64, 3).unwrap();
    let data = gems::data::synthetic::Synthetic {
        seed: 1,
        classes: 2,
        image_size: size,
    };
    let (x, labels) = data.batch(0, 2);
    let (y, tape) = forward(&g, &mut params, &d, &x, 2, true);
    let (_, probs) = loss::softmax_cross_entropy(&d, &y, &labels).unwrap();
    drop(y);
    let seed = loss::softmax_cross_entropy_backward(&d, &probs, &labels, 1.0).unwrap();
    drop(probs);
    let out = g.outputs[0].value;
    graph::backward(&g, &mut params, &d, tape.unwrap(), vec![(out, seed)], &[]).unwrap();
    assert_eq!(d.memory().live.get(Category::Activations), 0, "{name}");
    let pass = start.elapsed();

    for &pname in probes {
        let pi = g
            .params
            .iter()
            .position(|p| p.name == pname)
            .unwrap_or_else(|| panic!("{name} has no parameter {pname}"));
        let analytic = params.grads[pi].as_ref().unwrap().to_f64_vec();
        let original = params.values[pi].to_f64_vec();
        let shape = g.params[pi].spec.shape.clone();
        // The largest gradient (a tight relative check), the first and the last element.
        let largest = (0..analytic.len())
            .max_by(|&i, &j| analytic[i].abs().total_cmp(&analytic[j].abs()))
            .unwrap();
        let set = |params: &mut Params, i: usize, delta: f64| {
            let mut v = original.clone();
            v[i] += delta;
            params.values[pi] = d
                .upload(shape.clone(), &v, DType::F64, Category::Weights)
                .unwrap();
        };
        for i in [largest, 0, original.len() - 1] {
            let a = analytic[i];
            let agrees = |numeric: f64, h: f64| {
                (a - numeric).abs() <= 1e-5 * a.abs().max(numeric.abs()) + NOISE / h
            };
            let mut tried = Vec::new();
            for h in STEPS {
                set(&mut params, i, h);
                let up = loss_of(&g, &mut params, &d, &x, &labels);
                set(&mut params, i, -h);
                let down = loss_of(&g, &mut params, &d, &x, &labels);
                set(&mut params, i, 0.0);
                tried.push((h, (up - down) / (2.0 * h)));
                if agrees(tried.last().unwrap().1, h) {
                    break;
                }
            }
            let (h, numeric) = *tried.last().unwrap();
            eprintln!("{name} {pname}[{i}]: analytic {a:e}, numeric {numeric:e} (h {h:e})");
            assert!(
                agrees(numeric, h),
                "{name} {pname}[{i}]: analytic {a:e}, numeric (h, value) {tried:?}"
            );
        }
    }
    eprintln!(
        "{name} at {size}²: forward+backward {:.2?}, with {} probes {:.2?}",
        pass,
        3 * probes.len(),
        start.elapsed()
    );
}

#[test]
fn resnet50_gradients_match_finite_differences() {
    check_model(
        "resnet50",
        64,
        &[
            "conv1.weight",
            "layer2.0.downsample.0.weight",
            "layer3.2.bn2.weight",
            "fc.bias",
        ],
    );
}

#[test]
fn alexnet_gradients_match_finite_differences() {
    let min = Arch::AlexNet.min_image_size();
    check_model(
        "alexnet",
        min,
        &[
            "features.0.weight",
            "features.6.weight",
            "classifier.6.bias",
        ],
    );
}

#[test]
fn vgg19_gradients_match_finite_differences() {
    let min = Arch::Vgg19.min_image_size();
    check_model(
        "vgg19",
        min,
        &[
            "features.0.weight",
            "features.19.weight",
            "classifier.6.bias",
        ],
    );
}
