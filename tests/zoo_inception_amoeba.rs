//! Inception v3 and AmoebaNet-D: exact parameter counts, torchvision's state_dict names,
//! forward and backward through every output, and whole-model gradients against finite
//! differences in f64.

mod common;

use common::{check_model_gradients, Spot};
use gems::models;
use gems::ops::Op;
use gems::optim::schedule::{Decay, LrSchedule};
use gems::optim::SgdConfig;
use gems::{Dataset, RunConfig, Scheme, Session, TrainConfig};

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

#[test]
fn inception_v3_gradients_match_finite_differences() {
    // 299² is the smallest image the auxiliary classifier allows; the total loss is
    // loss(fc) + 0.4·loss(AuxLogits.fc), so AuxLogits.fc.bias sees only the auxiliary loss
    // and Conv2d_1a_3x3 both.
    check_model_gradients(
        "inception_v3",
        299,
        &[
            "Conv2d_1a_3x3.conv.weight",
            "Mixed_6b.branch7x7dbl_3.conv.weight",
            "fc.bias",
            "AuxLogits.fc.bias",
        ],
        &[Spot::First, Spot::Last],
    );
}

#[test]
fn amoebanet_d_gradients_match_finite_differences() {
    // 6 normal cells (two per group) of 16 filters at 64²: the last cells see 2×2 maps.
    check_model_gradients(
        "amoebanet_d_6x16",
        64,
        &[
            "stem1.conv.weight",
            "cell1_normal1.reduce2.conv2.weight",
            "cell3_normal1.operations.3.module.4.weight",
            "cell5_normal2.reduce2.1.weight",
            "classify.fc.bias",
        ],
        &[Spot::First, Spot::Middle, Spot::Last],
    );
}

#[test]
fn training_steps_use_the_auxiliary_output() {
    // Plain SGD: whatever has a gradient moves. AuxLogits only gets one from the auxiliary
    // output's loss.
    let g = models::build("inception_v3", 299, 2).unwrap();
    let train = TrainConfig {
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
        ..TrainConfig::new(2, 1)
    };
    let data = Dataset::synthetic(299, 2, 5);
    let mut t = Session::new(&g, RunConfig::new(train, Scheme::single(1)), data).unwrap();
    let idx = |name: &str| g.params.iter().position(|p| p.name == name).unwrap();
    let probes = [
        idx("AuxLogits.fc.bias"),
        idx("AuxLogits.conv0.conv.weight"),
        idx("fc.bias"),
    ];
    let values = |t: &mut Session| -> Vec<Vec<f64>> {
        let all = t.parameters().unwrap().swap_remove(0);
        probes.iter().map(|&i| all[i].2.clone()).collect()
    };
    let before = values(&mut t);
    let r = t.step().unwrap();
    assert!(r.loss.is_finite());
    for ((&i, b), a) in probes.iter().zip(&before).zip(values(&mut t)) {
        assert_ne!(&a, b, "{} did not move", g.params[i].name);
    }
}
