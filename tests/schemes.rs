//! Every scheme trains exactly like single-device training on the same micro-batches: after k
//! steps every rank's parameters and BN statistics equal the reference's (f64: 1e-9 relative),
//! and the copies of a stage are bit-identical. Spread evaluation on held-out samples equals
//! the single-device evaluation of the same weights.

use std::collections::HashMap;

mod common;
use common::HeavyBall;

use gems::data::{DataConfig, SourceSpec, Task};
use gems::graph::{self, Graph, Params};
use gems::ops::loss::Norm;
use gems::ops::{batched, loss};
use gems::optim::schedule::{Decay, LrSchedule};
use gems::optim::{AdamConfig, CustomOptimizer, OptimizerKind, Sgd, SgdConfig};
use gems::plan::calibrate::Calibration;
use gems::plan::cost::{DeviceProfile, NodeCosts};
use gems::plan::Layout;
use gems::plan::{RunConfig, TrainConfig};
use gems::schemes::admission::Admission;
use gems::schemes::{Kind, Order, Scheme};
use gems::{fit, models, DType, Device, Evaluation, Session};

const STEPS: usize = 3;

fn model(name: &str, classes: usize) -> Graph {
    // AmoebaNet at 32² ends at 1×1 maps, where BN over a micro-batch of two values is so
    // ill-conditioned that rounding differences grow past 1e-9 in three steps; 64² is not.
    let image = if name.starts_with("amoebanet") {
        64
    } else {
        32
    };
    models::build(name, image, classes).unwrap()
}

/// The base learning rate of the equivalence runs.
const LR: f64 = 0.05;

fn train(batch: usize, dtype: DType, lr: f64) -> TrainConfig {
    TrainConfig {
        schedule: LrSchedule {
            base: lr,
            decay: Decay::Cosine,
            warmup: 1,
            total: STEPS,
        },
        sgd: SgdConfig {
            momentum: 0.9,
            weight_decay: 1e-3,
            nesterov: true,
        },
        seed: 11,
        dtype,
        ..TrainConfig::new(batch, STEPS)
    }
}

/// A session of `c` on `g` reading `c.train.data` (per-pixel targets for a segmentation model,
/// whose classes are also weighed, so the loss's per-sample normalisation is checked across
/// micro-batches and groups).
fn session(g: &Graph, mut c: RunConfig) -> Session {
    c.train.data.task = models::task(&g.name).unwrap();
    if c.train.data.task == Task::Segment {
        c.train.class_weights = Some((0..g.classes()).map(|k| 0.5 + k as f64).collect());
    }
    let t = &c.train;
    let data = gems::data::open(&t.data, g.image_size(), g.classes(), t.seed).unwrap();
    let scheme = c.scheme;
    Session::new(g, c, data).unwrap_or_else(|e| panic!("{scheme:?}: {e}"))
}

/// Every rank's parameters (orientation, id, values) after [`STEPS`] steps, and the steps'
/// losses (summed over the ranks).
struct Run {
    params: Vec<Vec<(usize, usize, Vec<f64>)>>,
    losses: Vec<f64>,
}

fn run(g: &Graph, scheme: Scheme, batch: usize, dtype: DType, lr: f64) -> Run {
    run_with(g, scheme, train(batch, dtype, lr))
}

fn run_with(g: &Graph, scheme: Scheme, config: TrainConfig) -> Run {
    run_config(g, RunConfig::new(config, scheme))
}

fn run_config(g: &Graph, c: RunConfig) -> Run {
    let scheme = c.scheme;
    let mut s = session(g, c);
    let losses = (0..STEPS)
        .map(|_| s.step().unwrap_or_else(|e| panic!("{scheme:?}: {e}")).loss)
        .collect();
    Run {
        params: s.parameters().unwrap(),
        losses,
    }
}

/// The reference: one rank, the same M micro-batches in order.
fn reference(
    g: &Graph,
    s: &Scheme,
    batch: usize,
    dtype: DType,
    lr: f64,
) -> (HashMap<usize, Vec<f64>>, Vec<f64>) {
    reference_with(g, s, train(batch, dtype, lr))
}

/// [`reference`] for a run of `config`.
fn reference_with(
    g: &Graph,
    s: &Scheme,
    config: TrainConfig,
) -> (HashMap<usize, Vec<f64>>, Vec<f64>) {
    let m = s.micro_batches_per_step();
    let single = Scheme::single(m);
    let batch = m * config.batch_size / s.parts;
    let r = run_with(
        g,
        single,
        TrainConfig {
            batch_size: batch,
            ..config
        },
    );
    let params = r.params[0]
        .iter()
        .map(|(_, id, v)| (*id, v.clone()))
        .collect();
    (params, r.losses)
}

fn check(model: &Graph, s: Scheme, batch: usize) {
    check_at(model, s, batch, LR)
}

/// [`check`] with base learning rate `lr`.
fn check_at(model: &Graph, s: Scheme, batch: usize, lr: f64) {
    check_run(model, RunConfig::new(train(batch, DType::F64, lr), s))
}

/// [`check`] for a run of `config` (f64).
fn check_with(model: &Graph, s: Scheme, config: TrainConfig) {
    check_run(model, RunConfig::new(config, s))
}

/// [`check`] of the run `c` (f64), whose tasks may be the caller's.
fn check_run(model: &Graph, c: RunConfig) {
    // The reference runs on one device without the run's memory cap.
    let uncapped = TrainConfig {
        device_memory: None,
        ..c.train.clone()
    };
    let reference = reference_with(model, &c.scheme, uncapped);
    check_against(model, c, &reference);
}

/// [`check_run`] against the reference's parameters and losses.
fn check_against(
    model: &Graph,
    c: RunConfig,
    (want, want_losses): &(HashMap<usize, Vec<f64>>, Vec<f64>),
) {
    let s = c.scheme;
    let name = &model.name;
    let got = run_config(model, c);
    let mut seen: HashMap<usize, &Vec<f64>> = HashMap::new();
    for (rank, params) in got.params.iter().enumerate() {
        for (_, id, v) in params {
            let w = &want[id];
            let diff = v
                .iter()
                .zip(w)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            let scale = w.iter().map(|x| x.abs()).fold(0.0, f64::max);
            // 1e-9 relative to the tensor's largest value; parameters that stay at rounding
            // noise (a BN shift ahead of another BN, ~1e-17) get an absolute 1e-12.
            assert!(
                diff <= 1e-9 * scale + 1e-12,
                "{name} {s:?}: rank {rank} param {id}: relative difference {:e}",
                diff / scale
            );
            // Copies of a stage are identical to the last bit.
            if let Some(prev) = seen.insert(*id, v) {
                assert!(
                    prev.iter().zip(v).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{s:?}: copies of param {id} differ"
                );
            }
        }
    }
    assert_eq!(
        seen.len(),
        want.len(),
        "{s:?}: every parameter is held somewhere"
    );
    // The loss is spread over the ranks that compute it; their sum is the reference's.
    assert_eq!(got.losses.len(), STEPS);
    for (step, (a, b)) in got.losses.iter().zip(want_losses).enumerate() {
        assert!(
            (a - b).abs() <= 1e-9 * b.abs(),
            "{name} {s:?}: step {step}: loss {a} against {b}"
        );
    }
}

/// Every scheme of the issue, on `model`.
fn every_scheme(name: &str) {
    let model = &self::model(name, 4);
    check(model, Scheme::new(Kind::Mp, 2, 2, 1, 1, Order::GPipe), 4);
    check(model, Scheme::new(Kind::Mp, 3, 3, 1, 1, Order::OneFOneB), 3);
    check(model, Scheme::new(Kind::Mast, 2, 2, 2, 1, Order::GPipe), 4);
    check(model, Scheme::new(Kind::Mast, 3, 1, 2, 1, Order::GPipe), 2);
    check(
        model,
        Scheme::new(Kind::Master, 2, 1, 4, 1, Order::GPipe),
        2,
    );
    check(model, Scheme::new(Kind::Mp, 2, 2, 1, 2, Order::OneFOneB), 2);
    check(model, Scheme::new(Kind::Mast, 2, 1, 2, 2, Order::GPipe), 2);
    check(model, Scheme::new(Kind::Dp, 1, 1, 1, 2, Order::GPipe), 2);
}

/// The zero-bubble and interleaved orders and a hand-written schedule on `model` (P ranks, m
/// micro-batches):
/// B and W as separate tasks, with and without data parallelism.
fn split_backward(name: &str, p: usize, m: usize) {
    let model = &self::model(name, 4);
    check(model, Scheme::new(Kind::Mp, p, m, 1, 1, Order::ZbH1), m);
    check(model, Scheme::new(Kind::Mp, p, m, 1, 2, Order::ZbH1), m);
    check(model, Scheme::new(Kind::Dp, 1, m, 1, 2, Order::ZbH1), m);
    check(model, Scheme::new(Kind::Mp, p, m, 1, 1, Order::ZbV), m);
    check(model, Scheme::new(Kind::Mp, p, m, 1, 2, Order::ZbV), m);
    let interleaved = Scheme::new(Kind::Mp, p, p, 1, 1, Order::Interleaved);
    check(model, interleaved.with_virtual_stages(2), p);
    let interleaved = Scheme::new(Kind::Mp, p, p, 1, 2, Order::Interleaved);
    check(model, interleaved.with_virtual_stages(2), p);
    // 1F1B with every W deferred to the end of the step: a schedule written by hand.
    let scheme = Scheme::new(Kind::Mp, p, m, 1, 1, Order::OneFOneB);
    let mut c = RunConfig::new(train(m, DType::F64, LR), scheme);
    let one_f = gems::plan::Layout::new(model, &c)
        .unwrap()
        .schedule
        .schedule(&scheme);
    let late = common::defer_weights(&one_f);
    c.schedule = Some(std::sync::Arc::new(late.clone()));
    check_run(model, c.clone());
    // Offloads as tasks: what every second micro-batch's F saved, out after the F and back a
    // pass before its backward; with every W at the end, what each B leaves for it.
    c.schedule = Some(std::sync::Arc::new(
        one_f.offloading(|t| t.micro % 2 == 0, 1),
    ));
    check_run(model, c.clone());
    c.schedule = Some(std::sync::Arc::new(common::offload_weight_work(&late)));
    check_run(model, c.clone());
    // 1F1B whose activations are sent late (each SEND_F just before the rank's next
    // receive): messages run where the schedule lists them.
    let late = common::send_activations_late(&one_f);
    assert_ne!(late, one_f.with_messages());
    c.schedule = Some(std::sync::Arc::new(late));
    check_run(model, c);
}

/// Gradient sums are tasks a schedule places. With two data-parallel groups, an interleaved
/// pipeline written by hand with split backwards sums each stage's gradients right after its
/// last W, while the rank still has its other chunk's passes to run; the same passes with
/// every REDUCE at the end (put in place, the file listing none) sum them last. Both train
/// as one device does.
#[test]
fn reductions_early_or_at_the_end_match_single() {
    use gems::schemes::schedule::{Pass, Task};
    let model = &self::model("resnet20v2", 4);
    let (p, m) = (2, 2);
    let scheme = Scheme::new(Kind::Mp, p, m, 1, 2, Order::Interleaved).with_virtual_stages(2);
    let mut c = RunConfig::new(train(m, DType::F64, LR), scheme);
    let built = Layout::new(model, &c).unwrap().schedule.schedule(&scheme);
    // The passes alone, each BW split into its B and its W, in place.
    let mut at_the_end = built.clone();
    for tasks in &mut at_the_end.ranks {
        *tasks = (tasks.iter().filter(|t| t.pass.computes()))
            .flat_map(|&t| match t.pass {
                Pass::Backward => vec![
                    Task {
                        pass: Pass::Input,
                        ..t
                    },
                    Task {
                        pass: Pass::Weight,
                        ..t
                    },
                ],
                _ => vec![t],
            })
            .collect();
    }
    // Each REDUCE right after its stage's last W, the STEP last.
    let mut early = at_the_end.clone();
    for tasks in &mut early.ranks {
        let mut with = Vec::new();
        for (i, &t) in tasks.iter().enumerate() {
            with.push(t);
            if t.pass == Pass::Weight && !tasks[i + 1..].iter().any(|u| u.stage == t.stage) {
                with.push(Task::reduce(t.stage));
            }
        }
        with.push(Task::step());
        *tasks = with;
    }
    // Every rank sums its later chunk's gradients before its first chunk's passes end.
    for tasks in &early.ranks {
        let first = tasks.iter().position(|t| t.pass == Pass::Reduce).unwrap();
        assert!(
            tasks[first..].iter().any(|t| t.pass.computes()),
            "{tasks:?}"
        );
    }
    for schedule in [early, at_the_end] {
        c.schedule = Some(std::sync::Arc::new(schedule));
        check_run(model, c.clone());
    }
}

#[test]
fn pipeline_orders_and_hand_written_schedules_match_single_on_resnet110v2() {
    split_backward("resnet110v2", 4, 4);
}

#[test]
fn pipeline_orders_and_hand_written_schedules_match_single_on_unet() {
    // Skip connections from the first stage to the last cross every boundary between them.
    split_backward("unet_d3_w4", 3, 3);
}

#[test]
fn every_scheme_matches_single_on_resnet_v2() {
    every_scheme("resnet20v2");
}

/// MAST under a device-memory cap between what the pair needs holding one replica's
/// activations at a time (the count rule, m per rank) and what the overlapped pair needs: the
/// second replica's forwards, admitted when a rank's free bytes hold them, keep more
/// micro-batches in flight than the count rule allows, every rank within the cap (metered, and
/// the real run's allocator holds it to it), a shorter predicted step where backward takes
/// twice forward (a GPU's roofline; at this size the CPU's ops cost about a call each and
/// the second replica gains nothing), and the same training as one device.
#[test]
fn mast_packed_by_bytes_under_a_cap_matches_single() {
    let model = &self::model("resnet20v2", 4);
    let costs = NodeCosts::analytic(model, 1, DType::F64, &DeviceProfile::CPU);
    let roofline = Calibration {
        model: model.name.clone(),
        image_size: model.image_size(),
        classes: model.classes(),
        micro_batch: 1,
        dtype: DType::F64,
        device: "roofline".into(),
        forward: costs.forward,
        backward: costs.backward,
        input: vec![],
        weight: vec![],
        data: 0.0,
        loss: vec![],
        optimizer: 0.0,
    };
    for (p, m, order) in [(2, 4, Order::GPipe), (3, 2, Order::GPipe)] {
        let s = Scheme::new(Kind::Mast, p, m, 2, 1, order);
        let mut pair = RunConfig::new(train(m, DType::F64, LR), s);
        pair.calibration = Some(std::sync::Arc::new(roofline.clone()));
        // One split for every variant: the one balanced by cost.
        let layout = Layout::new(model, &pair).unwrap();
        pair.balance = Some(layout.partition.balance(&layout.graph));
        let peak = |c: &RunConfig| {
            let ranks = fit::per_rank(model, c).unwrap();
            ranks.iter().map(|m| m.peak).max().unwrap()
        };
        let count = RunConfig {
            max_in_flight: Some(m),
            ..pair.clone()
        };
        let (low, high) = (peak(&count), peak(&pair));
        assert!(low < high, "{s:?}: {low} {high}");
        let cap = (low + high) / 2;
        let capped = |mut c: RunConfig| {
            c.train.device_memory = Some(cap);
            c
        };
        let (packed, count) = (capped(pair), capped(count));
        let layout = Layout::new(model, &packed).unwrap();
        assert!(matches!(layout.admission, Admission::Bytes(_)), "{s:?}");
        let held = layout.schedule.most_held();
        assert!(held.iter().any(|&h| h > m), "{s:?}: in flight {held:?}");
        assert!(peak(&packed) <= cap, "{s:?}: {} over {cap}", peak(&packed));
        let by_count = Layout::new(model, &count).unwrap();
        assert!(by_count.schedule.most_held().iter().all(|&h| h <= m));
        assert!(
            layout.predicted_step(false) < by_count.predicted_step(false),
            "{s:?}: {} against {}",
            layout.predicted_step(false),
            by_count.predicted_step(false)
        );
        check_run(model, packed);
    }
}

#[test]
fn every_scheme_matches_single_on_unet() {
    // Skip connections from the first stage to the last cross every boundary between them.
    every_scheme("unet_d3_w4");
}

#[test]
fn every_scheme_matches_single_on_amoebanet_d() {
    // Cells take the two previous cells' outputs: cuts carry two tensors.
    every_scheme("amoebanet_d_3x8");
}

/// `--loss-reduction pytorch` divides each micro-batch's weighted loss by the whole step's
/// weight, summed over every group's and replica's images: pipelines, MAST, data-parallel
/// groups and spatial tiles (the logits too) train as one device does on the same
/// micro-batches.
#[test]
fn pytorch_loss_reduction_matches_single_on_unet() {
    let model = &model("unet_d3_w4", 4);
    let config = |batch| TrainConfig {
        loss_reduction: loss::Reduction::Pytorch,
        ..train(batch, DType::F64, LR)
    };
    for (scheme, batch) in [
        (Scheme::new(Kind::Mp, 2, 2, 1, 1, Order::OneFOneB), 4),
        (Scheme::new(Kind::Mast, 2, 1, 2, 2, Order::GPipe), 2),
        (Scheme::new(Kind::Dp, 1, 2, 1, 2, Order::GPipe), 4),
        (
            Scheme::new(Kind::Mp, 2, 1, 1, 1, Order::GPipe).with_spatial(tiles(1, 2)),
            2,
        ),
        // The logits in tiles: each tile's places, divided by the whole step's weight.
        (Scheme::single(2).with_spatial(tiles(2, 2)), 4),
    ] {
        check_with(model, scheme, config(batch));
    }
}

/// A step's loss under `--loss-reduction pytorch` is Σ w·ℓ over the whole batch's labelled
/// pixels divided by their Σ w, its 2 micro-batches each scored in training mode: the batch's
/// weight is known before the step, not made up per micro-batch.
#[test]
fn pytorch_loss_reduction_divides_by_the_whole_batch_weight() {
    let g = &model("unet_d3_w4", 4);
    let mut c = RunConfig::new(
        TrainConfig {
            loss_reduction: loss::Reduction::Pytorch,
            ..train(4, DType::F64, LR)
        },
        Scheme::single(2),
    );
    c.train.data.task = Task::Segment;
    let got = session(g, c.clone()).step().unwrap().loss;
    let t = &c.train;
    let data = gems::data::open(&t.data, g.image_size(), g.classes(), t.seed).unwrap();
    let device = Device::cpu("test", None);
    let mut params = gems::graph::Params::init(g, &device, t.dtype, t.seed).unwrap();
    let weights: Vec<f64> = (0..g.classes()).map(|k| 0.5 + k as f64).collect();
    let (mut sum, mut total) = (0.0, 0.0);
    for first in [0, 2] {
        let (pixels, labels) = data.train.batch(first, 2).unwrap();
        let x = device
            .input(batched(2, g.input_shape()), pixels, DType::F64)
            .unwrap();
        let out = g.outputs[0].value;
        let (logits, _) = graph::forward(
            g,
            &mut params,
            &device,
            vec![(g.input, x)],
            0..g.nodes.len(),
            &[out],
            Some(&t.saves),
            false,
            0,
            None,
        )
        .unwrap();
        let ce = loss::softmax_cross_entropy(
            &device,
            &logits[0],
            &labels,
            Some(&weights),
            Norm::Total(1.0),
        );
        sum += ce.unwrap().loss;
        total += loss::total_weight(&labels, g.classes(), Some(&weights)).unwrap();
    }
    let want = sum / total;
    assert!((got - want).abs() <= 1e-12 * want, "{got} vs {want}");
}

/// Adam's and AdamW's state and gradient clipping by global norm: the norm is summed over
/// every stage and counts each parameter once, however many copies of it the scheme holds
/// (MAST's mirrored replicas, data-parallel groups, spatial tiles), so every scheme clips as
/// single-device training does. Decay is off on norms and biases. SGD with clipping too, whose
/// update, unlike Adam's, scales with the gradient, so a wrong norm shows at once.
#[test]
fn adamw_and_clipping_match_single() {
    let model = &model("resnet20v2", 4);
    let adamw = OptimizerKind::Adam(AdamConfig {
        betas: (0.9, 0.999),
        eps: 1e-8,
        weight_decay: 0.05,
        decoupled: true,
    });
    let own = OptimizerKind::Custom(CustomOptimizer::new("heavy-ball", HeavyBall));
    for (optimizer, lr) in [(adamw, 1e-3), (OptimizerKind::Sgd, LR), (own, LR)] {
        let config = |batch| TrainConfig {
            optimizer: optimizer.clone(),
            clip_grad_norm: Some(0.5),
            no_decay_norm_bias: true,
            ..train(batch, DType::F64, lr)
        };
        check_with(
            model,
            Scheme::new(Kind::Mp, 2, 2, 1, 1, Order::OneFOneB),
            config(4),
        );
        check_with(
            model,
            Scheme::new(Kind::Mast, 2, 2, 2, 1, Order::GPipe),
            config(4),
        );
        check_with(
            model,
            Scheme::new(Kind::Mast, 2, 1, 2, 2, Order::GPipe),
            config(2),
        );
        let tiled = Scheme::new(Kind::Mp, 2, 1, 1, 1, Order::GPipe).with_spatial(tiles(1, 2));
        check_with(model, tiled, config(2));
    }
}

/// Spatial parallelism: `model` at `image`² (sides that are not powers of two and that no
/// grid divides) under `grids` alone, and under the combinations of the issue, each against
/// single-device training on the same micro-batches.
fn spatial(name: &str, image: usize, schemes: &[(Scheme, usize)]) {
    let model = &models::build(name, image, 4).unwrap();
    // Tiles add in another order than one device (halo gradients, statistics over tiles):
    // rounding differences of 1e-13 after a step. 110 layers at 2 images a batch amplify such
    // differences about 100× a step at the usual rate (measured: 1.4e-11 after two steps,
    // 5e-9 after three), about 30× at a fifth of it; micro-batches of 4 images condition BN
    // better still (2e-10 after three steps against 7e-11).
    let lr = if name == "resnet110v2" { LR / 5.0 } else { LR };
    // Schemes that run the same micro-batches share one reference.
    let mut references = HashMap::new();
    for &(s, batch) in schemes {
        let config = train(batch, DType::F64, lr);
        let m = s.micro_batches_per_step();
        let want = references
            .entry((m, m * batch / s.parts))
            .or_insert_with(|| reference_with(model, &s, config.clone()));
        check_against(model, RunConfig::new(config, s), want);
    }
}

fn tiles(r: usize, c: usize) -> gems::ops::tiles::Grid {
    gems::ops::tiles::Grid { rows: r, cols: c }
}

#[test]
fn spatial_grids_match_single_on_resnet110v2() {
    let alone = |g| (Scheme::single(1).with_spatial(g), 4);
    spatial(
        "resnet110v2",
        35,
        &[
            alone(tiles(1, 2)),
            alone(tiles(2, 1)),
            alone(tiles(2, 2)),
            alone(tiles(3, 1)),
        ],
    );
}

#[test]
fn spatial_combinations_match_single_on_resnet110v2() {
    let scheme = |kind, p, m, replicas, dp| Scheme::new(kind, p, m, replicas, dp, Order::GPipe);
    spatial(
        "resnet110v2",
        35,
        &[
            (scheme(Kind::Mp, 2, 2, 1, 1).with_spatial(tiles(2, 2)), 4),
            (
                Scheme::new(Kind::Mp, 3, 2, 1, 1, Order::OneFOneB).with_spatial(tiles(1, 2)),
                4,
            ),
            (scheme(Kind::Mast, 2, 1, 2, 1).with_spatial(tiles(2, 1)), 2),
            (scheme(Kind::Mast, 3, 1, 2, 1).with_spatial(tiles(1, 2)), 2),
            (scheme(Kind::Dp, 1, 1, 1, 2).with_spatial(tiles(1, 2)), 2),
        ],
    );
}

#[test]
fn spatial_with_recompute_matches_single() {
    // Checkpointing (what lets 2x2 tiles reach 8192² in 80 GB): the recomputed runs exchange
    // their halos again in backward, on every tile in the same order.
    let g = &models::build("resnet110v2", 35, 4).unwrap();
    let mut config = train(4, DType::F64, LR / 5.0);
    let (want, _) = reference(g, &Scheme::single(1), 4, DType::F64, LR / 5.0);
    config.saves = gems::graph::policy::SavePolicy::checkpointed(g.nodes.len());
    let got = run_with(g, Scheme::single(1).with_spatial(tiles(2, 2)), config);
    for params in &got.params {
        for (_, id, v) in params {
            let w = &want[id];
            let diff = v
                .iter()
                .zip(w)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            let scale = w.iter().map(|x| x.abs()).fold(0.0, f64::max);
            assert!(
                diff <= 1e-9 * scale + 1e-12,
                "param {id}: {:e}",
                diff / scale
            );
        }
    }
}

#[test]
fn spatial_matches_single_on_resnet50() {
    // The 7×7 stride-2 stem and the padded 3×3 stride-2 max pool, on a side of 45.
    spatial(
        "resnet50",
        45,
        &[
            (Scheme::single(1).with_spatial(tiles(2, 2)), 2),
            (Scheme::single(1).with_spatial(tiles(3, 1)), 2),
            (
                Scheme::new(Kind::Mp, 2, 1, 1, 1, Order::GPipe).with_spatial(tiles(1, 2)),
                2,
            ),
        ],
    );
}

#[test]
fn spatial_matches_single_on_amoebanet_d() {
    // Multi-branch cells, average pools that do not count padding, the factorized reduce's
    // one-pixel shift.
    spatial(
        "amoebanet_d_3x8",
        63,
        &[
            (Scheme::single(1).with_spatial(tiles(2, 2)), 2),
            (
                Scheme::new(Kind::Mp, 2, 1, 1, 1, Order::GPipe).with_spatial(tiles(1, 2)),
                2,
            ),
        ],
    );
}

#[test]
fn spatial_matches_single_on_unet() {
    // Decoders on tiles: each 2×2/2 transposed convolution reads a halo where a tile's first
    // output row is odd. At 40², 3 rows of tiles split every map unevenly, and 2x2 splits
    // the 5×5 bottom unevenly.
    let mp = Scheme::new(Kind::Mp, 2, 1, 1, 1, Order::GPipe);
    spatial(
        "unet_d3_w4",
        40,
        &[
            (Scheme::single(1).with_spatial(tiles(2, 2)), 2),
            (Scheme::single(1).with_spatial(tiles(3, 1)), 2),
            (mp.with_spatial(tiles(2, 2)), 2),
            (mp.with_spatial(tiles(3, 1)), 2),
        ],
    );
}

#[test]
fn spatial_matches_single_on_unet_resnet18() {
    // Nearest upsampling on tiles (an adaptive pool to twice the side), from maps smaller
    // than the grid (whole on every tile) back into tiles.
    let mp = Scheme::new(Kind::Mp, 2, 1, 1, 1, Order::GPipe);
    spatial(
        "unet_resnet18",
        64,
        &[
            (Scheme::single(1).with_spatial(tiles(2, 2)), 2),
            (Scheme::single(1).with_spatial(tiles(3, 1)), 2),
            (mp.with_spatial(tiles(2, 2)), 2),
            (mp.with_spatial(tiles(3, 1)), 2),
        ],
    );
}

#[test]
fn spatial_matches_single_on_unet_resnet34() {
    // The smallest side the encoder takes (it halves the side five times): 3 rows of tiles
    // split the 16² to 4² maps unevenly and leave the 2² and 1² bottom whole on every tile,
    // 2x2 only the 1² bottom. BN over the 1² maps of a micro-batch of 2 or 4 images is so
    // ill-conditioned that the tiles' rounding differences (the loss equal to 1e-15 and the
    // parameters to 1e-12 after a step) grow past 1e-9 in three steps (measured on 3x1: 2e-2
    // at 2 images, 1.5e-9 at 4, 1.5e-12 at 8; one device whose one class weight is one ulp
    // off drifts 3e-9 at 2 images), so micro-batches of 8.
    let mp = Scheme::new(Kind::Mp, 2, 1, 1, 1, Order::GPipe);
    spatial(
        "unet_resnet34",
        32,
        &[
            (Scheme::single(1).with_spatial(tiles(2, 2)), 8),
            (Scheme::single(1).with_spatial(tiles(3, 1)), 8),
            (mp.with_spatial(tiles(2, 2)), 8),
        ],
    );
    // A first stage of two whose tiles stop at the 2² maps (half its FLOPs) is refused.
    let g = models::build("unet_resnet34", 32, 4).unwrap();
    let c = RunConfig::new(train(8, DType::F64, LR), mp.with_spatial(tiles(3, 1)));
    let e = Layout::new(&g, &c).err().expect("refused").to_string();
    assert!(
        e.contains("stops paying") && e.contains("encoder.layer3.0.conv1"),
        "{e}"
    );
}

/// Transposed convolutions of other geometries (padding, output padding, a kernel smaller
/// than the stride, which leaves rows no input reaches), padding and cropping, and adaptive
/// pools whose sizes divide or share no factor, all on tiles of odd sides.
#[test]
fn decoder_ops_of_every_geometry_match_single_on_tiles() {
    use gems::graph::{GraphBuilder, Output};
    use gems::ops::conv::{Conv2d, ConvTranspose2d};
    use gems::ops::shape::Pad2d;
    use gems::ops::Op;
    let up = |c_out, k, stride, pad, output_padding| ConvTranspose2d {
        c_out,
        kernel: (k, k),
        stride: (stride, stride),
        pad: (pad, pad),
        output_padding: (output_padding, output_padding),
        groups: 1,
        bias: true,
    };
    let (mut b, x) = GraphBuilder::new("decoder", "Decoder", gems::Shape::new([3, 19, 19]));
    let x = b.conv("conv1", x, Conv2d::new(6, 3, 1, 1)).unwrap();
    let x = b.conv_transpose("up1", x, up(5, 3, 2, 1, 1)).unwrap(); // 38²
    let x = b.conv("conv2", x, Conv2d::new(6, 3, 2, 1)).unwrap(); // 19²
    let x = b.conv_transpose("up2", x, up(4, 2, 3, 0, 0)).unwrap(); // 56²
    let x = b.adaptive_avg_pool("half", x, (28, 28)).unwrap();
    let crop = Pad2d {
        top: -1,
        bottom: 2,
        left: 1,
        right: -2,
    };
    let x = b.op("pad", Op::Pad2d(crop), &[x]).unwrap(); // 29×27
    let x = b.adaptive_avg_pool("pool", x, (10, 9)).unwrap();
    let x = b.conv_transpose("up3", x, up(4, 4, 2, 1, 0)).unwrap(); // 20×18
    let x = b.global_avg_pool("gap", x).unwrap();
    let logits = b.linear("fc", x, 4, true).unwrap();
    let g = b.finish(vec![Output::new(logits)]).unwrap();
    for grid in [tiles(2, 2), tiles(3, 1)] {
        let s = Scheme::single(1).with_spatial(grid);
        let layout = Layout::new(&g, &RunConfig::new(train(2, DType::F64, LR), s)).unwrap();
        let region = layout.tiled.expect("a spatial stage");
        assert!(region.end.is_none(), "{region}");
        check_at(&g, s, 2, LR);
    }
}

/// A small U-Net whose resampling is bilinear (`align_corners` as given), to sizes no scale
/// factor gives (23² → 11×12 shrinking, 5×6 → 11×12, 11×12 → 23²), with dropout in the
/// encoder and the decoder.
fn bilinear_unet(align_corners: bool) -> Graph {
    use gems::graph::{GraphBuilder, Output};
    use gems::ops::conv::Conv2d;
    use gems::ops::pool::Window;
    let (mut b, x) = GraphBuilder::new("bilinear-unet", "UNet", gems::Shape::new([3, 23, 23]));
    let conv = |b: &mut GraphBuilder, name: &str, x, c_out| {
        let x = b.conv(name, x, Conv2d::new(c_out, 3, 1, 1))?;
        b.batchnorm_relu(&format!("{name}.bn"), x)
    };
    let x = conv(&mut b, "inc", x, 6).unwrap();
    let skip1 = b.dropout("inc.drop", x, 0.25).unwrap();
    let x = b
        .resize_bilinear("down1", skip1, (11, 12), align_corners)
        .unwrap();
    let x = conv(&mut b, "conv1", x, 8).unwrap();
    let skip2 = b.dropout("conv1.drop", x, 0.25).unwrap();
    let x = b.max_pool("down2", skip2, Window::square(2, 2, 0)).unwrap();
    let x = conv(&mut b, "bottom", x, 8).unwrap();
    let x = b
        .resize_bilinear("up2", x, (11, 12), align_corners)
        .unwrap();
    let x = b.concat("up2.cat", &[skip2, x]).unwrap();
    let x = conv(&mut b, "up2.conv", x, 6).unwrap();
    let x = b.dropout("up2.drop", x, 0.1).unwrap();
    let x = b
        .resize_bilinear("up1", x, (23, 23), align_corners)
        .unwrap();
    let x = b.concat("up1.cat", &[skip1, x]).unwrap();
    let x = conv(&mut b, "up1.conv", x, 6).unwrap();
    let x = b.global_avg_pool("gap", x).unwrap();
    let logits = b.linear("fc", x, 4, true).unwrap();
    b.finish(vec![Output::new(logits)]).unwrap()
}

/// Bilinear resizing and dropout on tiles of odd sides, with and without align_corners: each
/// tile computes its output from the rows and columns its taps read and draws its part of
/// one device's dropout masks, so the whole net stays on tiles and trains as one device does.
#[test]
fn bilinear_unet_with_dropout_matches_single_on_tiles() {
    for align_corners in [true, false] {
        let g = bilinear_unet(align_corners);
        for grid in [tiles(2, 2), tiles(3, 1)] {
            let s = Scheme::single(1).with_spatial(grid);
            let layout = Layout::new(&g, &RunConfig::new(train(2, DType::F64, LR), s)).unwrap();
            let region = layout.tiled.expect("a spatial stage");
            assert!(region.end.is_none(), "{region}");
            check_at(&g, s, 2, LR);
        }
    }
    let mp = Scheme::new(Kind::Mp, 2, 1, 1, 1, Order::GPipe);
    check_at(&bilinear_unet(true), mp.with_spatial(tiles(2, 2)), 2, LR);
}

/// The old single-device trainer's loop, written out over the graph API: the whole batch in
/// one forward and backward, BN statistics committed after forward, SGD. Returns the steps'
/// losses and the final parameters.
fn hand_rolled(g: &Graph, c: &TrainConfig, steps: usize) -> (Vec<f64>, Vec<Vec<f64>>) {
    let data = gems::data::open(&c.data, g.image_size(), g.classes(), c.seed).unwrap();
    let device = Device::open(c.device, c.precision, c.conv, "cpu:0", 0, None).unwrap();
    let mut params = Params::init(g, &device, c.dtype, c.seed).unwrap();
    let mut sgd = Sgd::new(&params, &device, c.sgd).unwrap();
    let b = c.batch_size;
    let mut losses = Vec::new();
    for step in 0..steps {
        let (pixels, labels) = data.train.batch((step * b) as u64, b).unwrap();
        let x = device
            .input(batched(b, g.input_shape()), pixels, c.activations())
            .unwrap();
        params.zero_grads(&device).unwrap();
        let keep: Vec<_> = g.outputs.iter().map(|o| o.value).collect();
        let seed = gems::core::rng::splitmix64(c.seed ^ step as u64);
        let (logits, mut tape) = graph::forward(
            g,
            &mut params,
            &device,
            vec![(g.input, x)],
            0..g.nodes.len(),
            &keep,
            Some(&c.saves),
            false,
            seed,
            None,
        )
        .unwrap();
        let running = std::mem::take(&mut tape.running);
        graph::commit_running(g, &mut params, &device, &running).unwrap();
        let mut total = 0.0;
        let mut seeds = Vec::new();
        for (out, logits) in g.outputs.iter().zip(logits) {
            let ce = loss::softmax_cross_entropy(&device, &logits, &labels, None, Norm::PerSample)
                .unwrap();
            total += out.weight * ce.loss;
            let grad = ce.backward(&device, out.weight, c.activations()).unwrap();
            seeds.push((out.value, grad));
        }
        graph::backward(g, &mut params, &device, tape, seeds, &[], None, false).unwrap();
        sgd.step(&mut params, &device, c.schedule.lr(step), 1.0)
            .unwrap();
        losses.push(total);
    }
    let values = params
        .values
        .iter()
        .map(|v| v.to_f64_vec().unwrap())
        .collect();
    (losses, values)
}

#[test]
fn single_scheme_equals_the_trainer_bit_for_bit() {
    let g = model("resnet20v2", 4);
    let r = run(
        &g,
        Scheme::new(Kind::Single, 1, 1, 1, 1, Order::GPipe),
        4,
        DType::F32,
        LR,
    );
    let (losses, values) = hand_rolled(&g, &train(4, DType::F32, LR), STEPS);
    assert_eq!(r.losses.len(), STEPS);
    for (a, b) in r.losses.iter().zip(&losses) {
        assert_eq!(a.to_bits(), b.to_bits());
    }
    assert_eq!(r.params.len(), 1);
    for (_, id, v) in &r.params[0] {
        assert_eq!(v, &values[*id], "param {id}");
    }
}

/// A folder of 32² images in three classes of 10, 14 and 18 noisy images, each class around
/// its own colour; held out at 0.3 with seed 11, 14 of them (3, 5 and 6).
fn held_out_folder(name: &str) -> DataConfig {
    let dir = std::env::temp_dir().join(format!("gems-schemes-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    for (c, n) in [10u32, 14, 18].into_iter().enumerate() {
        let class = dir.join(format!("class{c}"));
        std::fs::create_dir_all(&class).unwrap();
        for i in 0..n {
            let img = image::RgbImage::from_fn(32, 32, |x, y| {
                let noise = (x * 31 + y * 17 + i * 101) % 64;
                let mut px = [noise as u8; 3];
                px[c] += 160;
                image::Rgb(px)
            });
            img.save(class.join(format!("{i}.png"))).unwrap();
        }
    }
    DataConfig {
        source: SourceSpec::Folder(dir),
        val: 0.3,
        ..DataConfig::default()
    }
}

/// Trains `s` for the steps of [`train`] on [`held_out_folder`], evaluating after every
/// step; returns the evaluations (after how many steps, what) and the final weights'
/// evaluation by a single-device session, in micro-batches of the same size, that took them
/// up from the spread session's checkpoint.
fn spread_and_single_evaluations(
    s: Scheme,
    batch: usize,
    data: &DataConfig,
) -> (Vec<(usize, Evaluation)>, Evaluation) {
    let g = model("resnet20v2", 3);
    let mut config = train(batch, DType::F64, LR);
    config.data = data.clone();
    let mut spread = session(&g, RunConfig::new(config.clone(), s));
    let mut evaluations = Vec::new();
    for _ in 0..STEPS {
        spread.step().unwrap_or_else(|e| panic!("{s:?}: {e}"));
        let e = spread
            .evaluate_held_out(None)
            .unwrap_or_else(|e| panic!("{s:?}: {e}"));
        evaluations.push((spread.steps_done(), e));
    }
    let steps: Vec<usize> = evaluations.iter().map(|(done, _)| *done).collect();
    assert_eq!(steps, (1..=STEPS).collect::<Vec<_>>(), "{s:?}");
    let path = std::env::temp_dir().join(format!(
        "gems-schemes-eval-{}-{}-{}-{}.safetensors",
        s.stages,
        s.replicas,
        s.dp,
        std::process::id()
    ));
    spread.save(&path).unwrap();
    config.batch_size = batch / s.parts;
    let mut single = session(&g, RunConfig::new(config, Scheme::single(1)));
    single.restore(&path).unwrap();
    std::fs::remove_file(&path).ok();
    // The same weights to the last bit.
    let mut flat: Vec<(usize, Vec<f64>)> = spread
        .parameters()
        .unwrap()
        .into_iter()
        .flatten()
        .map(|(_, id, v)| (id, v))
        .collect();
    flat.sort_by_key(|(id, _)| *id);
    flat.dedup_by_key(|(id, _)| *id);
    let mine: Vec<(usize, Vec<f64>)> = single.parameters().unwrap()[0]
        .iter()
        .map(|(_, id, v)| (*id, v.clone()))
        .collect();
    assert_eq!(
        flat, mine,
        "{s:?}: the checkpoint carries the weights exactly"
    );
    let want = single.evaluate_held_out(None).unwrap();
    (evaluations, want)
}

#[test]
fn spread_evaluation_equals_single_device_evaluation_of_the_same_weights() {
    let data = held_out_folder("equal");
    for (s, batch) in [
        (Scheme::new(Kind::Mp, 2, 2, 1, 1, Order::GPipe), 6),
        (Scheme::new(Kind::Mp, 3, 1, 1, 1, Order::OneFOneB), 3),
        (Scheme::new(Kind::Mast, 2, 1, 2, 1, Order::GPipe), 3),
        (Scheme::new(Kind::Mast, 2, 1, 2, 2, Order::GPipe), 3),
    ] {
        let (spread, want) = spread_and_single_evaluations(s, batch, &data);
        let (_, got) = spread.last().unwrap();
        assert_eq!(got.confusion, want.confusion, "{s:?}");
        assert_eq!(got.accuracy, want.accuracy, "{s:?}");
        assert_eq!(got.samples, want.samples, "{s:?}");
        assert_eq!(got.classes, want.classes, "{s:?}");
        assert!(
            (got.loss - want.loss).abs() <= 1e-12 * want.loss,
            "{s:?}: loss {} against {}",
            got.loss,
            want.loss
        );
    }
}

/// Evaluation on tiles: each tile scores the pixels it owns and the tile group sums the
/// counts, so a U-Net's confusion counts, loss and per-sample results under 2x2 and 3x1 tiles
/// (of 40², whose maps no grid divides evenly) are the single device's for the same weights,
/// and no rank ever holds the other tiles' logits: the most bytes a rank had in transit at
/// once stay below them.
#[test]
fn spatial_evaluation_equals_single_device_evaluation_without_gathering_logits() {
    let (side, classes, batch, samples) = (40, 3, 4, 7);
    let g = models::build("unet_d3_w4", side, classes).unwrap();
    // Trained until it predicts every class somewhere.
    let steps = 6;
    let mut config = train(batch, DType::F64, 0.1);
    config.schedule.total = steps;
    let mut single = session(&g, RunConfig::new(config.clone(), Scheme::single(1)));
    for _ in 0..steps {
        single.step().unwrap();
    }
    let path = std::env::temp_dir().join(format!(
        "gems-schemes-tiled-eval-{}.safetensors",
        std::process::id()
    ));
    single.save(&path).unwrap();
    let data = DataConfig {
        task: Task::Segment,
        ..config.data.clone()
    };
    let held_out = gems::data::open(&data, side, classes, config.seed)
        .unwrap()
        .val
        .unwrap();
    // Every third pixel's class kept, as prediction maps keep them.
    let want = single.predict(&held_out, Some(samples), 3).unwrap();
    assert_eq!(want.samples, samples);
    assert!((0..classes).all(|c| want.confusion.iter().any(|row| row[c] > 0)));
    for grid in [tiles(2, 2), tiles(3, 1)] {
        let s = Scheme::single(1).with_spatial(grid);
        let mut tiled = session(&g, RunConfig::new(config.clone(), s));
        tiled.restore(&path).unwrap();
        let got = tiled.predict(&held_out, Some(samples), 3).unwrap();
        assert_eq!(got.confusion, want.confusion, "{grid}");
        assert_eq!(got.accuracy, want.accuracy, "{grid}");
        assert!(
            (got.loss - want.loss).abs() <= 1e-12 * want.loss,
            "{grid}: loss {} against {}",
            got.loss,
            want.loss
        );
        assert_eq!(got.per_sample.len(), want.per_sample.len(), "{grid}");
        for (a, b) in got.per_sample.iter().zip(&want.per_sample) {
            let p = a.position;
            assert_eq!(
                (p, a.label, a.predicted, &a.scores, &a.map),
                (b.position, b.label, b.predicted, &b.scores, &b.map),
                "{grid}: sample {p}"
            );
            assert!(
                (a.loss - b.loss).abs() <= 1e-12 * b.loss,
                "{grid}: sample {p}: loss {} against {}",
                a.loss,
                b.loss
            );
        }
        // Logits gathered onto a rank would arrive as the other tiles' parts, all at once.
        let bytes = |px: usize| (px * classes * batch * DType::F64.size()) as u64;
        for (rank, m) in tiled.memory().unwrap().iter().enumerate() {
            let (h, w) = grid.owned(rank, (side, side)).size();
            let others = bytes(side * side - h * w);
            let in_transit = m.category_peaks.get(gems::memory::Category::Communication);
            assert!(
                in_transit < others,
                "{grid}: rank {rank} had {in_transit} bytes in transit, the other tiles' \
                 logits are {others}"
            );
        }
    }
    std::fs::remove_file(&path).ok();
}

#[test]
fn spread_evaluation_scores_every_held_out_sample_once() {
    let data = held_out_folder("once");
    let d = gems::data::open(&data, 32, 3, 11).unwrap();
    let val = d.val.unwrap();
    let n = val.samples().unwrap();
    let mut per_class = vec![0; 3];
    for l in val.labels(0, n).unwrap() {
        per_class[l as usize] += 1;
    }
    // Micro-batches of 3: the last of 2, and 5 of them shared out unevenly: 2, 2, 1 to three
    // groups, and 2, 2, 1, 0 to four.
    assert_eq!((n, &per_class[..]), (14, &[3, 5, 6][..]));
    for s in [
        Scheme::new(Kind::Mp, 2, 1, 1, 3, Order::GPipe),
        Scheme::new(Kind::Dp, 1, 1, 1, 4, Order::GPipe),
    ] {
        let (spread, want) = spread_and_single_evaluations(s, 3, &data);
        for (done, e) in &spread {
            assert_eq!(e.samples, n, "{s:?} after step {done}");
            assert_eq!(e.per_class(), per_class, "{s:?} after step {done}");
        }
        assert_eq!(spread.last().unwrap().1.confusion, want.confusion, "{s:?}");
    }
}
