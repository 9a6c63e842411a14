//! The torchvision models (vgg19, alexnet, resnet50, resnet50_gn): exact parameter counts,
//! parameter names and shapes against torchvision's state_dict (tests/data/<model>.names), the
//! smallest images they accept, and whole-model gradients against finite differences.

mod common;

use common::{check_model_gradients, state_dict, Spot};
use gems::graph::policy::SavePolicy;
use gems::models::{self, torchvision::Arch};
use gems::ops::{batched, Op};
use gems::tensor::Device;
use gems::{Category, DType};

#[test]
fn parameter_counts_with_two_classes() {
    for (name, want) in [
        ("vgg19", 139_578_434),
        ("alexnet", 57_012_034),
        ("resnet50", 23_512_130),
        ("resnet50_gn", 23_512_130),
    ] {
        let g = models::build(name, 224, 2).unwrap();
        assert_eq!(g.parameter_count(), want, "{name}");
    }
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
        // num_batches_tracked: one scalar per BN node, in the order gems carries them.
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
    for (arch, min) in [
        (Arch::Vgg19, 32),
        (Arch::AlexNet, 63),
        (Arch::ResNet50, 1),
        (Arch::ResNet50Gn, 1),
    ] {
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

#[test]
fn resnet50_gradients_match_finite_differences() {
    check_model_gradients(
        "resnet50",
        64,
        &[
            "conv1.weight",
            "layer2.0.downsample.0.weight",
            "layer3.2.bn2.weight",
            "fc.bias",
        ],
        &[Spot::Largest, Spot::First, Spot::Last],
    );
}

#[test]
fn resnet50_gn_gradients_match_finite_differences() {
    check_model_gradients(
        "resnet50_gn",
        64,
        &[
            "conv1.weight",
            "bn1.bias",
            "layer2.0.downsample.1.weight",
            "layer3.2.bn2.weight",
            "fc.bias",
        ],
        &[Spot::Largest, Spot::First, Spot::Last],
    );
}

/// Group norm's statistics are each sample's own: resnet50_gn's training forward gives a
/// sample the same logits in a batch of three as alone, which batch norm's resnet50 does not.
#[test]
fn resnet50_gn_logits_do_not_depend_on_the_batch() {
    let (size, batch) = (32, 3);
    let d = Device::cpu("test", None);
    let data = gems::data::synthetic::Synthetic {
        seed: 4,
        classes: 2,
        image_size: size,
    };
    let (x, _) = data.batch(0, batch);
    let per = x.len() / batch;
    let logits = |name: &str, x: &[f64]| -> Vec<f64> {
        let g = models::build(name, size, 2).unwrap();
        let mut params = gems::graph::Params::init(&g, &d, DType::F64, 3).unwrap();
        let n = x.len() / per;
        let xt = d
            .upload(
                batched(n, g.input_shape()),
                x,
                DType::F64,
                Category::Activations,
            )
            .unwrap();
        let out = g.outputs[0].value;
        let (ys, _) = gems::graph::forward(
            &g,
            &mut params,
            &d,
            vec![(g.input, xt)],
            0..g.nodes.len(),
            &[out],
            Some(&SavePolicy::keep_all()),
            false,
            9,
            None,
        )
        .unwrap();
        ys[0].to_f64_vec().unwrap()
    };
    for (name, independent) in [("resnet50_gn", true), ("resnet50", false)] {
        let together = logits(name, &x);
        let alone: Vec<f64> = x.chunks(per).flat_map(|s| logits(name, s)).collect();
        let same = together
            .iter()
            .zip(&alone)
            .all(|(a, b)| (a - b).abs() <= 1e-12 * a.abs().max(1.0));
        assert_eq!(same, independent, "{name}: {together:?} against {alone:?}");
    }
}

#[test]
fn alexnet_gradients_match_finite_differences() {
    let min = Arch::AlexNet.min_image_size();
    check_model_gradients(
        "alexnet",
        min,
        &[
            "features.0.weight",
            "features.6.weight",
            "classifier.6.bias",
        ],
        &[Spot::Largest, Spot::First, Spot::Last],
    );
}

#[test]
fn vgg19_gradients_match_finite_differences() {
    let min = Arch::Vgg19.min_image_size();
    check_model_gradients(
        "vgg19",
        min,
        &[
            "features.0.weight",
            "features.19.weight",
            "classifier.6.bias",
        ],
        &[Spot::Largest, Spot::First, Spot::Last],
    );
}
