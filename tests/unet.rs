//! The U-Nets (src/models/unet.rs): parameter counts, names, shapes and order against the
//! references' state_dicts (tests/data/<model>.names, written by `scripts/torch_reference.py
//! state-dict`: milesial's UNet as rebuilt there, smp's Unet from its package), per-pixel
//! outputs, where the skips go, refused configurations, the forward against PyTorch's
//! (tests/data/unet_forward, written by `scripts/make_unet_fixture.py`), and whole-model
//! gradients of the per-pixel loss (unlabelled pixels, weighted classes) against finite
//! differences.

mod common;

use common::{check_model_gradients, state_dict, Spot};
use gems::graph::{self, Graph, Params};
use gems::ops::{batched, Op};
use gems::tensor::Device;
use gems::{models, Category, DType};
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;

#[test]
fn parameter_counts_match_the_references() {
    // PyTorch's counts (sum of numel over parameters) for 2 classes.
    for (name, want) in [
        ("unet", 31_037_698),
        ("unet_d3_w16", 482_754),
        ("unet_d2_w4", 7_554),
        ("unet_resnet34", 24_436_514),
        ("unet_resnet18", 14_328_354),
    ] {
        let g = models::build(name, 64, 2).unwrap();
        assert_eq!(g.parameter_count(), want, "{name}");
    }
    assert_eq!(
        models::build("unet_d4_w64", 32, 2)
            .unwrap()
            .parameter_count(),
        31_037_698
    );
}

#[test]
fn parameters_are_named_and_shaped_as_the_reference_state_dicts() {
    for name in ["unet", "unet_resnet34"] {
        let g = models::build(name, 64, 2).unwrap();
        let (tracked, entries): (Vec<_>, Vec<_>) = state_dict(name)
            .into_iter()
            .partition(|(n, _)| n.ends_with(".num_batches_tracked"));
        // Same entries in the same order, so that a state_dict loads strictly.
        let ours: Vec<(String, Vec<usize>)> = g
            .params
            .iter()
            .map(|p| (p.name.clone(), p.spec.shape.dims().to_vec()))
            .collect();
        for (i, (a, b)) in ours.iter().zip(&entries).enumerate() {
            assert_eq!(a, b, "{name}: entry {i}");
        }
        assert_eq!(ours.len(), entries.len(), "{name}");
        // num_batches_tracked: one per BN node, in the order gems carries them.
        let bns: Vec<String> = g
            .nodes
            .iter()
            .filter(|n| matches!(n.op, Op::BatchNorm(_)))
            .map(|n| format!("{}.num_batches_tracked", n.name))
            .collect();
        let tracked: Vec<String> = tracked.into_iter().map(|(n, _)| n).collect();
        assert_eq!(tracked, bns, "{name}");
    }
}

#[test]
fn outputs_are_per_pixel_logits() {
    for (name, side, classes) in [
        ("unet", 16, 2),
        ("unet_d3_w16", 40, 5),
        ("unet_resnet18", 96, 3),
    ] {
        let g = models::build(name, side, classes).unwrap();
        assert_eq!(g.outputs.len(), 1, "{name}");
        let out = &g.values[g.outputs[0].value].shape;
        assert_eq!(out.dims(), [classes, side, side], "{name}");
        assert_eq!(g.classes(), classes, "{name}");
    }
}

/// The node called `name`.
fn node<'g>(g: &'g Graph, name: &str) -> &'g graph::Node {
    g.nodes
        .iter()
        .find(|n| n.name == name)
        .unwrap_or_else(|| panic!("{}: no node {name}", g.name))
}

#[test]
fn skips_run_from_the_encoder_to_the_decoders_concats() {
    // milesial: up<i> concatenates [skip, upsampled]; up1's skip is down3's output.
    let g = models::build("unet", 64, 2).unwrap();
    let cat = node(&g, "up1.cat");
    let skip = node(&g, "down3.maxpool_conv.1.double_conv.4").output;
    assert_eq!(cat.inputs, [skip, node(&g, "up1.up").output]);
    assert_eq!(g.values[skip].shape.dims(), [512, 8, 8]);
    let cat4 = node(&g, "up4.cat");
    assert_eq!(cat4.inputs[0], node(&g, "inc.double_conv.4").output);
    // Each skip is read by the next down-step and by its concat only.
    assert_eq!(g.values[skip].consumers.len(), 2);
    // smp: [upsampled, skip]; block 0's skip is layer3's output, block 4 has none.
    let g = models::build("unet_resnet34", 64, 2).unwrap();
    let cat = node(&g, "decoder.blocks.0.cat");
    let layer3 = node(&g, "encoder.layer3.5.relu2").output;
    assert_eq!(cat.inputs, [node(&g, "decoder.blocks.0.up").output, layer3]);
    assert_eq!(
        node(&g, "decoder.blocks.3.cat").inputs[1],
        node(&g, "encoder.bn1").output
    );
    assert!(g.nodes.iter().all(|n| n.name != "decoder.blocks.4.cat"));
}

#[test]
fn bad_configurations_are_refused() {
    let msg = |name: &str, side: usize, classes: usize| {
        models::build(name, side, classes)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    let e = msg("unet", 100, 2);
    assert!(
        e.contains("multiple of 16") && e.contains("96 or 112"),
        "{e}"
    );
    let e = msg("unet_resnet34", 16, 2);
    assert!(
        e.contains("multiple of 32") && e.contains("such as 32;"),
        "{e}"
    );
    assert!(msg("unet_d3_w16", 0, 2).contains("multiple of 8"));
    assert!(msg("unet", 64, 1).contains("at least 2 classes"));
    for (name, why) in [
        ("unet_d0_w16", "at least 1"),
        ("unet_d3_w0", "at least 1"),
        ("unet_d3", "_w<width>"),
        ("unet_dx_w16", "numbers"),
        ("unet_d12_w64", "at most 65536"),
        ("unet_d99_w1", "at most 65536"),
    ] {
        let e = msg(name, 64, 2);
        assert!(e.contains(why), "{name}: {e}");
    }
    assert!(msg("unet_resnet50", 64, 2).contains("unknown model"));
}

#[test]
fn whole_model_gradients_match_finite_differences() {
    // The stem, a skip's producer, an up-convolution, a decoder BN, the head. unet_resnet18 at
    // 64², so that layer4's training-mode BN sees 2×2 pixels per image: at 32² it normalizes
    // two values per channel to ±1, and finite differences through it lose their accuracy.
    for (name, side, probes) in [
        (
            "unet_d2_w4",
            16,
            &[
                "inc.double_conv.0.weight",
                "down1.maxpool_conv.1.double_conv.3.weight",
                "up1.up.weight",
                "up1.up.bias",
                "up2.conv.double_conv.1.weight",
                "outc.conv.bias",
            ][..],
        ),
        (
            "unet_resnet18",
            64,
            &[
                "encoder.conv1.weight",
                "encoder.layer2.0.downsample.0.weight",
                "decoder.blocks.1.conv1.0.weight",
                "decoder.blocks.4.conv2.1.bias",
                "segmentation_head.0.weight",
            ][..],
        ),
    ] {
        check_model_gradients(name, side, probes, &[Spot::First, Spot::Middle, Spot::Last]);
    }
}

/// The values of tensor `name` (f32 or f64) of a safetensors file, as f64.
fn read(st: &SafeTensors, name: &str) -> Vec<f64> {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    let bytes = t.data();
    match t.dtype() {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()) as f64)
            .collect(),
        Dtype::F64 => bytes
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().unwrap()))
            .collect(),
        other => panic!("{name}: {other:?}"),
    }
}

/// Evaluation-mode logits of `g` in f64 on `x`, a batch of `n` images, with `values` as its
/// parameters in `g.params` order.
fn eval_logits(g: &Graph, values: Vec<Vec<f64>>, x: &[f64], n: usize) -> Vec<f64> {
    let d = Device::cpu("test", None);
    let mut params = Params::init(g, &d, DType::F64, 0).unwrap();
    for (i, (p, v)) in g.params.iter().zip(values).enumerate() {
        params.values[i] = d
            .upload(p.spec.shape.clone(), &v, DType::F64, Category::Weights)
            .unwrap();
    }
    let x = d
        .upload(
            batched(n, g.input_shape()),
            x,
            DType::F64,
            Category::Activations,
        )
        .unwrap();
    let out = g.outputs[0].value;
    let (ys, _) = graph::forward(
        g,
        &mut params,
        &d,
        vec![(g.input, x)],
        0..g.nodes.len(),
        &[out],
        None,
        false,
        0,
        None,
    )
    .unwrap();
    ys[0].to_f64_vec().unwrap()
}

/// The largest difference between `got` and `want`, relative to want's largest magnitude.
fn worst_relative(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0.0, |m: f64, v| m.max(v.abs()));
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs() / scale)
        .fold(0.0, f64::max)
}

fn fixture(file: &str) -> Vec<u8> {
    let path = format!(
        "{}/tests/data/unet_forward/{file}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

#[test]
fn unet_computes_what_pytorch_computes() {
    // milesial's UNet at depth 2, width 4 with PyTorch's weights and random BN statistics, in
    // evaluation mode, f64: the same logits up to the order of summation.
    let weights = fixture("weights.safetensors");
    let weights = SafeTensors::deserialize(&weights).unwrap();
    let io = fixture("io.safetensors");
    let io = SafeTensors::deserialize(&io).unwrap();
    let g = models::build("unet_d2_w4", 16, 2).unwrap();
    let values = g
        .params
        .iter()
        .map(|p| {
            let dims = weights.tensor(&p.name).unwrap().shape().to_vec();
            assert_eq!(dims, p.spec.shape.dims(), "{}", p.name);
            read(&weights, &p.name)
        })
        .collect();
    let got = eval_logits(&g, values, &read(&io, "input"), 2);
    let worst = worst_relative(&got, &read(&io, "logits"));
    assert!(worst < 1e-12, "largest difference from PyTorch {worst}");
}

/// make_unet_fixture.py's `pattern`: tensor `j`'s values from integer hashing, u in [-1, 1)
/// scaled by shape and name (conv weights u·√(3/fan_in), BN weights and running variances
/// 1 + u/2, other vectors u/5), bit for bit as PyTorch's side makes them.
fn pattern(j: u64, dims: &[usize], name: &str) -> Vec<f64> {
    let n = dims.iter().product::<usize>() as u64;
    (0..n)
        .map(|i| {
            let h = (i * 2_654_435_761 + (j + 1) * 2_246_822_519) % (1 << 32);
            let u = h as f64 / (1u64 << 32) as f64 * 2.0 - 1.0;
            if dims.len() == 4 {
                u * (3.0 / dims[1..].iter().product::<usize>() as f64).sqrt()
            } else if name.ends_with(".running_var") || name.ends_with(".weight") {
                1.0 + u / 2.0
            } else {
                u / 5.0
            }
        })
        .collect()
}

#[test]
fn unet_resnet34_computes_what_smp_computes() {
    // smp's Unet("resnet34") in evaluation mode, f64, on weights and an image both sides make.
    let g = models::build("unet_resnet34", 32, 2).unwrap();
    let values = g
        .params
        .iter()
        .enumerate()
        .map(|(j, p)| pattern(j as u64 + 1, p.spec.shape.dims(), &p.name))
        .collect();
    let x = pattern(0, &[1, 3, 32, 32], "input");
    let got = eval_logits(&g, values, &x, 1);
    let want = fixture("resnet34_logits.safetensors");
    let want = read(&SafeTensors::deserialize(&want).unwrap(), "logits");
    let worst = worst_relative(&got, &want);
    assert!(worst < 1e-12, "largest difference from smp {worst}");
}

#[test]
fn images_divided_by_255_score_as_a_pytorch_pipeline_scores_them() {
    // tests/data/unet_preprocess (scripts/make_preprocess_fixture.py): images of four shapes
    // with masks, and each one's loss under milesial's UNet (unet_forward's weights) on inputs
    // x/255, cut to the centred square or resized whole with PyTorch's antialiased bilinear.
    let dir = format!("{}/tests/data", env!("CARGO_MANIFEST_DIR"));
    let expected: std::collections::BTreeMap<String, std::collections::BTreeMap<String, f64>> =
        serde_json::from_str(
            &std::fs::read_to_string(format!("{dir}/unet_preprocess/expected.json")).unwrap(),
        )
        .unwrap();
    let out = std::env::temp_dir().join(format!("gems-unet-preprocess-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    for (how, extra) in [("crop", None), ("resize", Some("--resize"))] {
        let csv = out.join(format!("{how}.csv"));
        let run = std::process::Command::new(env!("CARGO_BIN_EXE_gems"))
            .args([
                "eval",
                "--init",
                &format!("{dir}/unet_forward/weights.safetensors"),
            ])
            .args([
                "--model",
                "unet_d2_w4",
                "--image-size",
                "16",
                "--dtype",
                "f64",
            ])
            .args(["--normalize", "unit"])
            .args(extra)
            .arg("--data")
            .arg(format!("folder:{dir}/unet_preprocess/pairs"))
            .arg("--per-sample")
            .arg(&csv)
            .output()
            .unwrap();
        assert!(
            run.status.success(),
            "{}",
            String::from_utf8_lossy(&run.stderr)
        );
        let want = &expected[how];
        let rows = std::fs::read_to_string(&csv).unwrap();
        let mut seen = 0;
        for row in rows.lines().skip(1) {
            let fields: Vec<&str> = row.split(',').collect();
            let stem = fields[0]
                .rsplit('/')
                .next()
                .unwrap()
                .trim_end_matches(".png");
            let (ours, theirs) = (fields[3].parse::<f64>().unwrap(), want[stem]);
            // Inputs decoded to f32 (v/255), the rest in f64.
            assert!(
                (ours - theirs).abs() <= 1e-6 * theirs,
                "{how} {stem}: gems {ours}, PyTorch {theirs}"
            );
            seen += 1;
        }
        assert_eq!(seen, want.len(), "{how}");
    }
    std::fs::remove_dir_all(out).ok();
}
