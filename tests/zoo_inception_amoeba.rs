//! Inception v3 and AmoebaNet-D: exact parameter counts, torchvision's state_dict names,
//! forward and backward through every output, and whole-model gradients against finite
//! differences in f64.

use std::time::Instant;

use gems::backend::Device;
use gems::graph::{self, Graph, Params};
use gems::ops::{batched, loss, Op};
use gems::runtime::optim::SgdConfig;
use gems::runtime::schedule::{Decay, LrSchedule};
use gems::train::{TrainConfig, Trainer};
use gems::{models, Category, DType};

#[test]
fn inception_v3_parameter_counts() {
    // torchvision: 27,161,264 with 1000 classes; the two fc layers shrink to 2 classes.
    for (name, size, classes, want) in [
        ("inception_v3", 299, 2, 24_348_900),
        ("inception_v3", 299, 1000, 27_161_264),
        ("inception_v3", 512, 2, 24_348_900),
        // aux_logits=False
        ("inception_v3_noaux", 75, 1000, 23_834_568),
    ] {
        let g = models::build(name, size, classes).unwrap();
        assert_eq!(
            g.parameter_count(),
            want,
            "{name} at {size}², {classes} classes"
        );
    }
    let g = models::build("inception_v3", 299, 2).unwrap();
    assert_eq!(g.outputs.len(), 2);
    assert!(!g.outputs[0].training_only && g.outputs[0].weight == 1.0);
    assert!(g.outputs[1].training_only && g.outputs[1].weight == 0.4);
    // Mixed_6e is 17×17 at 299², 8×8 after Mixed_7c.
    let adj = g.adjacency_list();
    assert!(adj.contains("Mixed_6e.cat = concat(") && adj.contains("[768, 17, 17]"));
    assert!(adj.contains("Mixed_7c.cat = concat(") && adj.contains("[2048, 8, 8]"));
    for (name, size, min) in [("inception_v3", 298, 299), ("inception_v3_noaux", 74, 75)] {
        let e = models::build(name, size, 2).unwrap_err().to_string();
        assert!(e.contains(&format!("at least {min}×{min}")), "{e}");
    }
}

#[test]
fn inception_v3_matches_torchvision_state_dict() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/inception_v3.names"
    ))
    .unwrap();
    let mut want = Vec::new();
    let mut tracked = Vec::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (name, shape) = line.split_once(' ').unwrap();
        let dims: Vec<usize> = shape
            .trim_matches(|c| c == '[' || c == ']')
            .split(", ")
            .filter(|s| !s.is_empty())
            .map(|s| s.parse().unwrap())
            .collect();
        match name.strip_suffix(".num_batches_tracked") {
            Some(bn) => {
                assert!(dims.is_empty(), "{line}");
                tracked.push(bn.to_string());
            }
            None => want.push((name.to_string(), dims)),
        }
    }
    let g = models::build("inception_v3", 299, 1000).unwrap();
    let got: Vec<(String, Vec<usize>)> = g
        .params
        .iter()
        .map(|p| (p.name.clone(), p.spec.shape.dims().to_vec()))
        .collect();
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        assert_eq!(a, b, "entry {i}");
    }
    assert_eq!(got.len(), want.len());
    // num_batches_tracked: exactly one per BN node, none elsewhere.
    let bns: Vec<&str> = g
        .nodes
        .iter()
        .filter(|n| matches!(n.op, Op::BatchNorm(_)))
        .map(|n| n.name.as_str())
        .collect();
    assert_eq!(bns, tracked);
    assert!(g.nodes.iter().all(|n| match &n.op {
        Op::BatchNorm(bn) => bn.eps == 1e-3,
        _ => true,
    }));
}

#[test]
fn amoebanet_d_parameter_counts_match_torchgpipe() {
    // torchgpipe's benchmarks/amoebanetd-memory README (1000 classes, 224²): 81.5M, 319.0M,
    // 542.7M, 1.06B, 1.84B.
    for (name, want, unit) in [
        ("amoebanet_d_18x208", 81.5, 1e6),
        ("amoebanet_d_18x416", 319.0, 1e6),
        ("amoebanet_d_18x544", 542.7, 1e6),
        ("amoebanet_d_36x544", 1.06, 1e9),
        ("amoebanet_d_72x512", 1.84, 1e9),
    ] {
        let n = models::build(name, 224, 1000).unwrap().parameter_count() as f64;
        let rounded = if unit == 1e6 {
            (n / 1e5).round() / 10.0
        } else {
            (n / 1e7).round() / 100.0
        };
        assert_eq!(rounded, want, "{name}: {n}");
    }
    assert_eq!(
        models::build("amoebanet_d_18x208", 224, 1000)
            .unwrap()
            .parameter_count(),
        81_505_540
    );
    // The default is the speed benchmark's (18, 256); image size changes no parameter.
    let a = models::build("amoebanet_d", 224, 10).unwrap();
    let b = models::build("amoebanet_d_18x256", 1024, 10).unwrap();
    assert_eq!(a.parameter_count(), b.parameter_count());
    let names: Vec<&str> = a.params.iter().map(|p| p.name.as_str()).collect();
    for want in [
        "stem1.conv.weight",
        "stem2.reduce1.1.weight",
        "stem3.reduce2.conv2.weight",
        "stem3.operations.3.module.4.weight",
        "cell1_normal1.reduce2.bn.running_var",
        "cell1_normal2.operations.5.module.7.weight",
        "cell5_normal6.operations.9.module.2.bias",
        "classify.fc.bias",
    ] {
        assert!(names.contains(&want), "{want}");
    }
    let e = models::build("amoebanet_d", 100, 10)
        .unwrap_err()
        .to_string();
    assert!(e.contains("multiple of 16"), "{e}");
    let e = models::build("amoebanet_d_4x64", 224, 10)
        .unwrap_err()
        .to_string();
    assert!(e.contains("multiple of 3"), "{e}");
}

/// One training-mode forward of every output in f64: Σ weight·loss and each output's loss;
/// with `backward`, parameter gradients are added into `params.grads`.
fn run(
    g: &Graph,
    params: &mut Params,
    d: &Device,
    x: &[f64],
    labels: &[u32],
    backward: bool,
) -> (f64, Vec<f64>) {
    let xt = d
        .upload(
            batched(labels.len(), g.input_shape()),
            x,
            DType::F64,
            Category::Activations,
        )
        .unwrap();
    let keep: Vec<usize> = g.outputs.iter().map(|o| o.value).collect();
    let (ys, tape) = graph::forward(
        g,
        params,
        d,
        vec![(g.input, xt)],
        0..g.nodes.len(),
        &keep,
        true,
        false,
        9,
    )
    .unwrap();
    let (mut total, mut each, mut seeds) = (0.0, Vec::new(), Vec::new());
    for (o, y) in g.outputs.iter().zip(ys) {
        let (l, probs) = loss::softmax_cross_entropy(d, &y, labels).unwrap();
        total += o.weight * l;
        each.push(l);
        if backward {
            let seed = loss::softmax_cross_entropy_backward(d, &probs, labels, o.weight).unwrap();
            seeds.push((o.value, seed));
        }
    }
    if backward {
        graph::backward(g, params, d, tape, seeds, &[]).unwrap();
    }
    (total, each)
}

/// Forward and backward at batch 2 in f64, then central differences of the total loss on
/// entries of `probes`: the first and last of each, and with `middle` the middle one too.
fn check_model(name: &str, image_size: usize, probes: &[&str], middle: bool) {
    let t = Instant::now();
    let g = models::build(name, image_size, 2).unwrap();
    let d = Device::cpu("test", None);
    let mut params = Params::init(&g, &d, DType::F64, 3).unwrap();
    let data = gems::data::synthetic::Synthetic {
        seed: 1,
        classes: 2,
        image_size,
    };
    let (x, labels) = data.batch(0, 2);
    let (total, each) = run(&g, &mut params, &d, &x, &labels, true);
    assert!(total.is_finite() && each.iter().all(|l| l.is_finite() && *l > 0.0));
    let live = d.memory().live;
    assert_eq!(
        live.get(Category::Activations),
        0,
        "{name}: activations left"
    );
    assert_eq!(live.get(Category::Workspace), 0, "{name}: workspace left");
    eprintln!(
        "{name} {image_size}²: forward+backward {:.2}s, losses {each:?}",
        t.elapsed().as_secs_f64()
    );
    for pname in probes {
        let pi = g
            .params
            .iter()
            .position(|p| p.name == *pname)
            .unwrap_or_else(|| panic!("{name} has no {pname}"));
        let analytic = params.grads[pi].as_ref().unwrap().to_f64_vec();
        assert!(
            analytic.iter().any(|v| *v != 0.0),
            "{name} {pname}: no gradient"
        );
        let original = params.values[pi].to_f64_vec();
        let n = original.len();
        let spots = if middle {
            vec![0, n / 2, n - 1]
        } else {
            vec![0, n - 1]
        };
        for i in spots {
            let a = analytic[i];
            // As in tests/models.rs, h = 1e-7: small enough that no ReLU input or max-pool
            // choice switches, large enough that rounding stays small. Where the loss is very
            // sensitive (Inception's first conv at 299²: |∂L/∂w| ≈ 100, and ~10⁷ ReLU inputs
            // downstream), h shrinks so that the loss still moves by at most ~1e-7.
            let h = 1e-7 / a.abs().max(1.0);
            let set = |params: &mut Params, delta: f64| {
                let mut v = original.clone();
                v[i] += delta;
                params.values[pi] = d
                    .upload(
                        g.params[pi].spec.shape.clone(),
                        &v,
                        DType::F64,
                        Category::Weights,
                    )
                    .unwrap();
            };
            set(&mut params, h);
            let plus = run(&g, &mut params, &d, &x, &labels, false).0;
            set(&mut params, -h);
            let minus = run(&g, &mut params, &d, &x, &labels, false).0;
            set(&mut params, 0.0);
            let numeric = (plus - minus) / (2.0 * h);
            // Relative 1e-5, plus the rounding of the two loss values over 2h: each is a sum
            // over a whole model, good to a few ulps of the loss, so ~10·ε·|loss|/h ≈ 1e-8
            // absolute (the 1e-5 relative part dominates for gradients above ~1e-3).
            let tol = 1e-5 * a.abs().max(numeric.abs()) + 10.0 * f64::EPSILON * total.abs() / h;
            assert!(
                (a - numeric).abs() <= tol,
                "{name} {pname}[{i}]: analytic {a:e}, numeric {numeric:e}, tolerance {tol:e}"
            );
        }
    }
    eprintln!("{name}: total {:.2}s", t.elapsed().as_secs_f64());
}

#[test]
fn inception_v3_gradients_match_finite_differences() {
    // 299² is the smallest image the auxiliary classifier allows; the total loss is
    // loss(fc) + 0.4·loss(AuxLogits.fc), so AuxLogits.fc.bias sees only the auxiliary loss
    // and Conv2d_1a_3x3 both.
    check_model(
        "inception_v3",
        299,
        &[
            "Conv2d_1a_3x3.conv.weight",
            "Mixed_6b.branch7x7dbl_3.conv.weight",
            "fc.bias",
            "AuxLogits.fc.bias",
        ],
        false,
    );
}

#[test]
fn amoebanet_d_gradients_match_finite_differences() {
    // 6 normal cells (two per group) of 16 filters at 64²: the last cells see 2×2 maps.
    check_model(
        "amoebanet_d_6x16",
        64,
        &[
            "stem1.conv.weight",
            "cell1_normal1.reduce2.conv2.weight",
            "cell3_normal1.operations.3.module.4.weight",
            "cell5_normal2.reduce2.1.weight",
            "classify.fc.bias",
        ],
        true,
    );
}

#[test]
fn training_steps_use_the_auxiliary_output() {
    // Plain SGD: whatever has a gradient moves. AuxLogits only gets one from the auxiliary
    // output's loss.
    let mut t = Trainer::new(TrainConfig {
        model: "inception_v3".into(),
        image_size: 299,
        classes: 2,
        batch_size: 2,
        steps: 1,
        schedule: LrSchedule {
            base: 0.1,
            decay: Decay::Constant,
            warmup: 0,
            total: 1,
        },
        sgd: SgdConfig {
            momentum: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        },
        seed: 5,
        dtype: DType::F32,
        device_memory: None,
    })
    .unwrap();
    let idx = |name: &str| t.graph.params.iter().position(|p| p.name == name).unwrap();
    let probes = [
        idx("AuxLogits.fc.bias"),
        idx("AuxLogits.conv0.conv.weight"),
        idx("fc.bias"),
    ];
    let before: Vec<Vec<f64>> = probes
        .iter()
        .map(|&i| t.params.values[i].to_f64_vec())
        .collect();
    let r = t.step().unwrap();
    assert!(r.loss.is_finite());
    for (&i, b) in probes.iter().zip(&before) {
        assert_ne!(
            &t.params.values[i].to_f64_vec(),
            b,
            "{} did not move",
            t.graph.params[i].name
        );
    }
}
