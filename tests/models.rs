//! Model construction: exact parameter counts, refused configurations, and whole-model
//! gradients against finite differences.

mod common;

use common::{check_model_gradients, Spot};
use gems::{models, Error};

#[test]
fn resnet_v2_parameter_counts() {
    for (name, want) in [
        ("resnet110v2", 1_146_842),
        ("resnet164v2", 1_703_258),
        ("resnet1001v2", 10_327_706),
    ] {
        let g = models::build(name, 32, 10).unwrap();
        assert_eq!(g.parameter_count(), want, "{name}");
        // Image size changes activations, never parameters.
        assert_eq!(
            models::build(name, 64, 10).unwrap().parameter_count(),
            want,
            "{name} at 64²"
        );
    }
}

#[test]
fn bad_configurations_are_refused() {
    let msg = |r: Result<_, Error>| r.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(msg(models::build("resnet18v3", 32, 10)).contains("unknown model"));
    assert!(msg(models::build("vgg7", 32, 10)).contains("unknown model"));
    assert!(msg(models::build("resnet21v2", 32, 10)).contains("9n+2"));
    assert!(msg(models::build("resnet22v1", 32, 10)).contains("6n+2"));
    assert!(msg(models::build("resnet20v2", 31, 10)).contains("at least 32"));
    assert!(msg(models::build("resnet20v2", 32, 1)).contains("at least 2 classes"));
    // Not a square power of two: still fine.
    assert!(models::build("resnet20v2", 45, 3).is_ok());
}

#[test]
fn graph_keeps_blocks_and_adjacency() {
    let g = models::build("resnet20v2", 32, 10).unwrap();
    let tree = g.block_tree();
    assert!(tree.contains("layer3 (Stage)"), "{tree}");
    assert!(tree.contains("  1 (PreActBottleneck)"), "{tree}");
    let adj = g.adjacency_list();
    assert!(adj.contains("layer1.0.shortcut = conv 1x1 ->64"), "{adj}");
    assert_eq!(adj.lines().count(), g.nodes.len() + 1);
    let names: Vec<&str> = g.params.iter().map(|p| p.name.as_str()).collect();
    assert!(
        names.contains(&"layer2.0.conv2.weight")
            && names.contains(&"bn.running_var")
            && names.contains(&"fc.bias")
    );
}

#[test]
fn whole_model_gradients_match_finite_differences() {
    // Stem, a shortcut, BN scale and shift, the head.
    for name in ["resnet20v2", "resnet20v1"] {
        let probes: &[&str] = if name.ends_with("v2") {
            &[
                "conv1.weight",
                "layer1.0.conv2.weight",
                "layer2.0.shortcut.weight",
                "layer2.0.bn2.weight",
                "layer3.1.bn1.bias",
                "fc.weight",
                "fc.bias",
            ]
        } else {
            &[
                "conv1.weight",
                "layer1.0.conv2.weight",
                "layer2.0.downsample.0.weight",
                "layer2.0.bn2.weight",
                "layer3.1.bn1.bias",
                "fc.weight",
                "fc.bias",
            ]
        };
        check_model_gradients(name, 32, probes, &[Spot::First, Spot::Middle, Spot::Last]);
    }
}
