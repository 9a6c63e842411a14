// Each test binary compiles this module and uses part of it.
#![allow(dead_code)]

//! Shared by the tests: a whole model's gradients against central finite differences; whether
//! libopenslide is there.

use gems::graph::{self, Graph, Params};
use gems::ops::loss::Norm;
use gems::ops::{batched, loss};
use gems::optim::{Optimizer, Update};
use gems::schemes::schedule::{Pass, Schedule, Task};
use gems::tensor::Device;
use gems::{models, Category, DType, Tensor};

/// Which elements of a parameter to probe.
#[derive(Clone, Copy, Debug)]
pub enum Spot {
    First,
    Middle,
    Last,
    /// The element with the largest gradient (a tight relative check).
    Largest,
}

/// One training-mode forward of every output in f64: Σ weight·loss; with `backward`,
/// parameter gradients are added into `params.grads`.
fn run(
    g: &Graph,
    params: &mut Params,
    d: &Device,
    x: &[f64],
    labels: &[u32],
    backward: bool,
) -> f64 {
    let xt = d
        .upload(
            batched(labels.len() / g.positions(), g.input_shape()),
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
        Some(&gems::graph::policy::SavePolicy::keep_all()),
        false,
        9,
        None,
    )
    .unwrap();
    let (mut total, mut seeds) = (0.0, Vec::new());
    for (o, y) in g.outputs.iter().zip(ys) {
        let weights = class_weights(g);
        let ce = loss::softmax_cross_entropy(d, &y, labels, weights.as_deref(), Norm::PerSample)
            .unwrap();
        total += o.weight * ce.loss;
        if backward {
            let dy = ce.backward(d, o.weight, y.dtype());
            seeds.push((o.value, dy.unwrap()));
        }
    }
    if backward {
        graph::backward(g, params, d, tape, seeds, &[], None, false).unwrap();
    }
    total
}

/// The loss's targets for `labels` (one per image): those labels for a classifier; for a
/// segmentation model a class per pixel (a pattern of both classes, with a few pixels
/// unlabelled) and the classes weighed unequally, so the per-pixel loss is checked in full.
fn targets(g: &Graph, labels: &[u32]) -> Vec<u32> {
    let places = g.positions();
    if places == 1 {
        return labels.to_vec();
    }
    (0..labels.len() * places)
        .map(|i| match i % 7 {
            0 => gems::data::UNLABELLED,
            r => (r as u32 + i as u32 / 13) % g.classes() as u32,
        })
        .collect()
}

/// Class weights of the loss: none for a classifier, unequal ones for a segmentation model.
fn class_weights(g: &Graph) -> Option<Vec<f64>> {
    (g.positions() > 1).then(|| (0..g.classes()).map(|k| 1.0 + 0.5 * k as f64).collect())
}

/// Forward and backward of `name` (2 classes) on 2 synthetic images of `size`² in f64, then
/// the gradient of the total loss at `spots` of each parameter in `probes` against central
/// differences. Also checks that backward leaves no activation or workspace bytes behind.
///
/// Steps: h = 1e-7/max(1, |∂L/∂w|), small enough that no ReLU input or max-pool choice
/// switches; where a stem weight still carries a unit across its kink (ResNet-50's conv1 at
/// batch 2), 10× and 100× smaller steps are tried — a wrong gradient disagrees at every step.
/// Tolerance: 1e-5 relative plus the rounding of two whole-model losses over 2h (10·ε·|L|/h).
pub fn check_model_gradients(name: &str, size: usize, probes: &[&str], spots: &[Spot]) {
    let g = models::build(name, size, 2).unwrap();
    let d = Device::cpu("test", None);
    let mut params = Params::init(&g, &d, DType::F64, 3).unwrap();
    let data = gems::data::synthetic::Synthetic {
        seed: 1,
        classes: 2,
        image_size: size,
    };
    let (x, labels) = data.batch(0, 2);
    let labels = targets(&g, &labels);
    let total = run(&g, &mut params, &d, &x, &labels, true);
    assert!(total.is_finite(), "{name}: loss {total}");
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
    for pname in probes {
        let pi = g
            .params
            .iter()
            .position(|p| p.name == *pname)
            .unwrap_or_else(|| panic!("{name} has no parameter {pname}"));
        let analytic = params.grads[pi].as_ref().unwrap().to_f64_vec().unwrap();
        assert!(
            analytic.iter().any(|v| *v != 0.0),
            "{name} {pname}: no gradient at all"
        );
        let original = params.values[pi].to_f64_vec().unwrap();
        let shape = g.params[pi].spec.shape.clone();
        let n = original.len();
        for spot in spots {
            let i = match spot {
                Spot::First => 0,
                Spot::Middle => n / 2,
                Spot::Last => n - 1,
                Spot::Largest => (0..n)
                    .max_by(|&i, &j| analytic[i].abs().total_cmp(&analytic[j].abs()))
                    .unwrap(),
            };
            let a = analytic[i];
            let set = |params: &mut Params, delta: f64| {
                let mut v = original.clone();
                v[i] += delta;
                params.values[pi] = d
                    .upload(shape.clone(), &v, DType::F64, Category::Weights)
                    .unwrap();
            };
            let agrees = |numeric: f64, h: f64| {
                (a - numeric).abs()
                    <= 1e-5 * a.abs().max(numeric.abs()) + 10.0 * f64::EPSILON * total.abs() / h
            };
            let mut tried = Vec::new();
            for shrink in [1.0, 1e-1, 1e-2] {
                let h = shrink * 1e-7 / a.abs().max(1.0);
                set(&mut params, h);
                let up = run(&g, &mut params, &d, &x, &labels, false);
                set(&mut params, -h);
                let down = run(&g, &mut params, &d, &x, &labels, false);
                set(&mut params, 0.0);
                tried.push((h, (up - down) / (2.0 * h)));
                if agrees((up - down) / (2.0 * h), h) {
                    break;
                }
            }
            let &(h, numeric) = tried.last().unwrap();
            assert!(
                agrees(numeric, h),
                "{name} {pname}[{i}]: analytic {a:e}, numeric (h, value) {tried:?}"
            );
        }
    }
}

/// `(name, shape)` per line of a `.names` file; an empty shape is a scalar.
pub fn state_dict(model: &str) -> Vec<(String, Vec<usize>)> {
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

/// An optimizer written outside the crate, on the host: v ← v/2 + g, w ← w − lr·v.
pub struct HeavyBall;

impl Optimizer for HeavyBall {
    fn state_names(&self) -> &[&str] {
        &["velocity"]
    }
    fn weight_decay(&self) -> f64 {
        0.0
    }
    fn update(
        &self,
        device: &Device,
        w: &mut Tensor,
        grad: &Tensor,
        state: &mut [Tensor],
        u: &Update,
    ) -> gems::Result<()> {
        let (g, v) = (grad.to_f64_vec()?, state[0].to_f64_vec()?);
        let v: Vec<f64> = (v.iter().zip(&g))
            .map(|(v, g)| 0.5 * v + g * u.grad_scale)
            .collect();
        let new: Vec<f64> = (w.to_f64_vec()?.iter().zip(&v))
            .map(|(w, v)| w - u.lr * v)
            .collect();
        *w = device.upload(w.shape().clone(), &new, w.dtype(), Category::Weights)?;
        let (shape, dtype) = (state[0].shape().clone(), state[0].dtype());
        state[0] = device.upload(shape, &v, dtype, Category::OptimizerState)?;
        Ok(())
    }
}

/// `schedule` with each BW split into its B, in place, and its W, at the end of the rank's
/// passes (its REDUCEs and STEP follow the last W): 1F1B with every weight gradient deferred
/// to the end of the step.
pub fn defer_weights(schedule: &Schedule) -> Schedule {
    let mut late = schedule.clone();
    for tasks in &mut late.ranks {
        let ws: Vec<Task> = (tasks.iter())
            .filter(|t| t.pass == Pass::Backward)
            .map(|t| Task::weight(t.stage, t.micro))
            .collect();
        for t in tasks.iter_mut().filter(|t| t.pass == Pass::Backward) {
            t.pass = Pass::Input;
        }
        let (closing, mut passes): (Vec<Task>, Vec<Task>) =
            tasks.iter().partition(|t| t.pass.is_collective());
        passes.extend(ws);
        passes.extend(closing);
        *tasks = passes;
    }
    late
}

/// `schedule` with what each B leaves for its W offloaded until that W: an OFFLOAD right after
/// the B, a PREFETCH right before the W.
pub fn offload_weight_work(schedule: &Schedule) -> Schedule {
    let mut out = schedule.clone();
    for tasks in &mut out.ranks {
        let mut with = Vec::new();
        for &t in tasks.iter() {
            let at = |pass| Task { pass, ..t };
            match t.pass {
                Pass::Input => with.extend([t, at(Pass::Offload)]),
                Pass::Weight => with.extend([at(Pass::Prefetch), t]),
                _ => with.push(t),
            }
        }
        *tasks = with;
    }
    out
}

/// `schedule` with each rank's activations sent late: every SEND_F moved to just before the
/// rank's next receive or collective (REDUCE, STEP), or the end of its list. A rank blocks
/// only there, so what it sends before blocking still comes, and the schedule stays free of
/// deadlock.
pub fn send_activations_late(schedule: &Schedule) -> Schedule {
    let mut late = schedule.with_messages();
    for tasks in &mut late.ranks {
        let mut out: Vec<Task> = Vec::with_capacity(tasks.len());
        let mut waiting: Vec<Task> = Vec::new();
        for &t in tasks.iter() {
            match t.pass {
                Pass::SendActivations => waiting.push(t),
                Pass::RecvActivations | Pass::RecvGradients | Pass::Reduce | Pass::Step => {
                    out.append(&mut waiting);
                    out.push(t);
                }
                _ => out.push(t),
            }
        }
        out.append(&mut waiting);
        *tasks = out;
    }
    late
}

/// Whether libopenslide loads, for a test part that compares with it (`what`). Under
/// scripts/test.sh (`GEMS_REQUIRE_OPENSLIDE=1`, which installs it) it must; elsewhere the part
/// is skipped and says so on the terminal (written past the test harness's capture).
pub fn openslide_present(what: &str) -> bool {
    use std::io::Write;
    match gems::data::openslide::available() {
        Ok(()) => true,
        Err(why) if std::env::var_os("GEMS_REQUIRE_OPENSLIDE").is_some() => {
            panic!("{what}: {why}, and GEMS_REQUIRE_OPENSLIDE is set")
        }
        Err(why) => {
            let _ = writeln!(std::io::stderr(), "SKIPPED: {what}: {why}");
            false
        }
    }
}
