//! Model construction: exact parameter counts, refused configurations, and whole-model
//! gradients against finite differences.

use gems::backend::Device;
use gems::graph::{self, Params};
use gems::ops::{batched, loss};
use gems::{models, Category, DType, Error};

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

/// Loss of one training-mode forward pass in f64.
fn loss_of(
    g: &gems::graph::Graph,
    params: &mut Params,
    d: &Device,
    x: &[f64],
    labels: &[u32],
) -> f64 {
    let xt = d
        .upload(
            batched(labels.len(), g.input_shape()),
            x,
            DType::F64,
            Category::Activations,
        )
        .unwrap();
    let out = g.outputs[0].value;
    let (y, _) = graph::forward(
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
    loss::softmax_cross_entropy(d, &y[0], labels).unwrap().0
}

#[test]
fn whole_model_gradients_match_finite_differences() {
    for name in ["resnet20v2", "resnet20v1"] {
        let g = models::build(name, 32, 4).unwrap();
        let d = Device::cpu("test", None);
        let mut params = Params::init(&g, &d, DType::F64, 3).unwrap();
        let data = gems::data::synthetic::Synthetic {
            seed: 1,
            classes: 4,
            image_size: 32,
        };
        let (x, labels) = data.batch(0, 3);
        let xt = d
            .upload(
                batched(3, g.input_shape()),
                &x,
                DType::F64,
                Category::Activations,
            )
            .unwrap();
        let out = g.outputs[0].value;
        let (y, tape) = graph::forward(
            &g,
            &mut params,
            &d,
            vec![(g.input, xt)],
            0..g.nodes.len(),
            &[out],
            true,
            false,
            9,
        )
        .unwrap();
        let (_, probs) = loss::softmax_cross_entropy(&d, &y[0], &labels).unwrap();
        drop(y);
        let seed = loss::softmax_cross_entropy_backward(&d, &probs, &labels, 1.0).unwrap();
        drop(probs);
        graph::backward(&g, &mut params, &d, tape, vec![(out, seed)], &[]).unwrap();
        let live = d.memory().live;
        assert_eq!(
            live.get(Category::Activations),
            0,
            "{name}: activations left after backward"
        );
        assert_eq!(
            live.get(Category::Workspace),
            0,
            "{name}: workspace left after backward"
        );

        // A handful of parameters across the depth: stem, a shortcut, BN scale and shift, the head.
        let probes = [
            "conv1.weight",
            "layer1.0.conv2.weight",
            "layer2.0.bn2.weight",
            "layer3.1.bn1.bias",
            "fc.weight",
            "fc.bias",
        ];
        for pname in probes {
            let Some(pi) = g.params.iter().position(|p| p.name == pname) else {
                continue;
            };
            let analytic = params.grads[pi].as_ref().unwrap().to_f64_vec();
            let original = params.values[pi].to_f64_vec();
            for &i in &[0, original.len() / 2, original.len() - 1] {
                // Small enough that no ReLU input among the ~10⁵ of a whole model crosses zero
                // (h = 1e-5 made one cross), large enough that rounding stays near 1e-9.
                let h = 1e-7;
                let mut eval = |delta: f64| {
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
                    loss_of(&g, &mut params, &d, &x, &labels)
                };
                let numeric = (eval(h) - eval(-h)) / (2.0 * h);
                eval(0.0);
                let a = analytic[i];
                let rel = (a - numeric).abs() / a.abs().max(numeric.abs()).max(1e-6);
                assert!(
                    rel < 1e-5,
                    "{name} {pname}[{i}]: analytic {a:e}, numeric {numeric:e}, rel {rel:e}"
                );
            }
        }
    }
}
