//! The optimizers equal PyTorch's in f64 (tests/data/optim/expected.json, written by
//! scripts/make_optim_fixture.py): Adam with L2 weight decay, AdamW with decoupled weight decay,
//! a parameter group without decay and gradient clipping by global norm, and SGD with
//! clipping, over 3 steps: every parameter after every step and the final state by name
//! within 1e-12.

use gems::graph::Params;
use gems::memory::Category;
use gems::optim::{self, AdamConfig, Optimizer, SgdConfig, Stepper};
use gems::{DType, Device, Shape};
use serde_json::Value;

const TOL: f64 = 1e-12;

fn numbers(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

fn shape(v: &Value) -> Shape {
    let dims: Vec<usize> = numbers(v).iter().map(|&d| d as usize).collect();
    Shape::new(dims)
}

fn assert_close(what: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs() / w.abs().max(1.0);
        assert!(err <= TOL, "{what}[{i}]: gems {g}, PyTorch {w} ({err:e})");
    }
}

/// The fixture's case run by gems: `optimizer` over its parameters, gradients clipped when it
/// says so; checked against PyTorch after every step and at the end.
fn check<O: Optimizer>(fixture: &Value, case: &Value, optimizer: O) {
    let name = case["name"].as_str().unwrap();
    let device = Device::cpu("cpu:0", None);
    let shapes: Vec<Shape> = fixture["shapes"]
        .as_array()
        .unwrap()
        .iter()
        .map(shape)
        .collect();
    let upload = |s: &Shape, v: &Value, c: Category| {
        device
            .upload(s.clone(), &numbers(v), DType::F64, c)
            .unwrap()
    };
    let mut params = Params {
        first: 0,
        values: shapes
            .iter()
            .zip(fixture["init"].as_array().unwrap())
            .map(|(s, v)| upload(s, v, Category::Weights))
            .collect(),
        grads: shapes
            .iter()
            .map(|s| {
                Some(
                    device
                        .zeros(s.clone(), DType::F64, Category::Gradients)
                        .unwrap(),
                )
            })
            .collect(),
    };
    let exempt: Vec<usize> = numbers(&case["exempt"])
        .iter()
        .map(|&i| i as usize)
        .collect();
    let mut stepper = Stepper::new(&params, &device, optimizer)
        .unwrap()
        .exempt_from_decay(|i| exempt.contains(&i));
    let lr = case["lr"].as_f64().unwrap();
    let steps = fixture["grads"].as_array().unwrap();
    for (k, grads) in steps.iter().enumerate() {
        for ((g, s), v) in params
            .grads
            .iter_mut()
            .zip(&shapes)
            .zip(grads.as_array().unwrap())
        {
            *g = Some(upload(s, v, Category::Gradients));
        }
        let clip = match case["max_norm"].as_f64() {
            Some(max_norm) => {
                optim::clip_factor(&optim::squared_norms(&params).unwrap(), 1.0, max_norm)
            }
            None => 1.0,
        };
        stepper.step(&mut params, &device, lr, clip).unwrap();
        for (i, want) in case["after"][k].as_array().unwrap().iter().enumerate() {
            let got = params.values[i].to_f64_vec().unwrap();
            assert_close(
                &format!("{name}: parameter {i} after step {}", k + 1),
                &got,
                &numbers(want),
            );
        }
    }
    let names = stepper.optimizer.state_names().to_vec();
    for (i, state) in stepper.states().iter().enumerate() {
        let (state, want) = (state.as_ref().unwrap(), &case["state"][i]);
        // PyTorch's SGD counts no steps.
        if let Some(steps) = want["step"].as_f64() {
            assert_eq!(state.steps as f64, steps, "{name}: steps of {i}");
        }
        for (n, t) in names.iter().zip(&state.tensors) {
            let what = format!("{name}: {n} of parameter {i}");
            assert_close(&what, &t.to_f64_vec().unwrap(), &numbers(&want[*n]));
        }
    }
}

#[test]
fn optimizers_and_clipping_equal_pytorch_in_f64() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/optim/expected.json"
    );
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = fixture["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 3);
    for case in cases {
        let weight_decay = case["weight_decay"].as_f64().unwrap();
        match case["optimizer"].as_str().unwrap() {
            "sgd" => check(
                &fixture,
                case,
                SgdConfig {
                    momentum: case["momentum"].as_f64().unwrap(),
                    weight_decay,
                    nesterov: case["nesterov"].as_bool().unwrap(),
                },
            ),
            adam => {
                let betas = numbers(&case["betas"]);
                check(
                    &fixture,
                    case,
                    AdamConfig {
                        betas: (betas[0], betas[1]),
                        eps: case["eps"].as_f64().unwrap(),
                        weight_decay,
                        decoupled: adam == "adamw",
                    },
                )
            }
        }
    }
}
