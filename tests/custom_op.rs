//! An op defined outside the crate (examples/common/scaled_swish.rs) is a first-class op: the
//! exported gradient check passes it and catches a wrong backward, it trains under a pipeline
//! exactly as on one device (f64: 1e-9), on tiles of each sample too, and the planner counts what it saves: the analytic
//! memory model equals the metered run, which equals the real run.

#[path = "../examples/common/scaled_swish.rs"]
mod scaled_swish;

use gems::graph::Output;
use gems::ops::conv::Conv2d;
use gems::ops::tiles::TileRule;
use gems::ops::{check_gradients, Backward, Ctx, Custom, Operator, ParamSpec, Saved, SavesFor};
use gems::plan::footprint::{self, Footprint, StageMemory};
use gems::plan::Layout;
use gems::{fit, Dataset, Graph, GraphBuilder, Order, RunConfig, Scheme, Session, TrainConfig};
use gems::{DType, Precision, Shape, Tensor};
use scaled_swish::ScaledSwish;

/// conv → scaled Swish → conv → scaled Swish → pooled classifier: each Swish's input is saved
/// by the Swish alone (a convolution keeps its input, not its output).
fn model(op: Custom) -> Graph {
    let (mut b, x) = GraphBuilder::new("swish", "Swish", Shape::new([3, 12, 12]));
    let x = b.conv("conv1", x, Conv2d::new(6, 3, 1, 1)).unwrap();
    let x = b.custom("act1", op.clone(), &[x]).unwrap();
    let x = b.conv("conv2", x, Conv2d::new(8, 3, 2, 1)).unwrap();
    let x = b.custom("act2", op, &[x]).unwrap();
    let x = b.global_avg_pool("pool", x).unwrap();
    let logits = b.linear("fc", x, 3, true).unwrap();
    b.finish(vec![Output::new(logits)]).unwrap()
}

fn swish() -> Custom {
    Custom::new("scaled-swish", ScaledSwish)
}

/// [`ScaledSwish`] with one thing changed: its input gradient scaled by 1.001, or its saves
/// reported as nothing.
struct Broken {
    scale_dx: f64,
    hide_saves: bool,
}

impl Operator for Broken {
    fn infer(&self, inputs: &[&Shape]) -> Result<Shape, String> {
        ScaledSwish.infer(inputs)
    }
    fn params(&self, inputs: &[&Shape]) -> Vec<ParamSpec> {
        ScaledSwish.params(inputs)
    }
    fn forward(
        &self,
        ctx: &Ctx,
        xs: &[&Tensor],
        params: &mut [Tensor],
    ) -> gems::Result<(Tensor, Saved)> {
        ScaledSwish.forward(ctx, xs, params)
    }
    fn backward(
        &self,
        ctx: &Ctx,
        b: Backward,
        params: &[Tensor],
        grads: &mut [Tensor],
    ) -> gems::Result<Vec<Option<Tensor>>> {
        let dx = ScaledSwish.backward(ctx, b, params, grads)?.swap_remove(0);
        let dx = dx.expect("an input gradient");
        let scaled: Vec<f64> = dx.to_f64_vec()?.iter().map(|v| v * self.scale_dx).collect();
        let out = ctx.host_output(dx.shape().clone(), &dx, |o| {
            o.copy_from_slice(&scaled);
            Ok(())
        })?;
        Ok(vec![Some(out)])
    }
    fn flops(&self, inputs: &[&Shape], output: &Shape) -> u64 {
        ScaledSwish.flops(inputs, output)
    }
    fn saves(&self, inputs: &[&Shape]) -> SavesFor {
        match self.hide_saves {
            true => SavesFor::default(),
            false => ScaledSwish.saves(inputs),
        }
    }
    fn on_tiles(&self) -> TileRule {
        ScaledSwish.on_tiles()
    }
}

#[test]
fn gradient_check_passes_the_op_and_catches_a_wrong_backward() {
    for (shape, batch) in [(vec![3, 5, 4], 2), (vec![2, 3, 3], 3)] {
        let check = check_gradients(&ScaledSwish, &[Shape::new(shape)], batch, 1).unwrap();
        assert!(check.passed(), "{check}");
        assert_eq!(check.gradients.len(), 2, "input and beta");
    }
    let wrong = Broken {
        scale_dx: 1.001,
        hide_saves: false,
    };
    let check = check_gradients(&wrong, &[Shape::new([3, 5, 4])], 2, 1).unwrap();
    assert!(!check.passed(), "a 0.1% error passed:\n{check}");
    let worst = check.worst().unwrap();
    assert_eq!(worst.of, "input 0");
    assert!(worst.relative > 1e-4, "{check}");
}

/// Every rank's parameters and each step's loss after 3 f64 steps of `scheme` on batches of 4.
fn train(g: &Graph, scheme: Scheme) -> (Vec<f64>, Vec<(usize, Vec<f64>)>) {
    let t = TrainConfig {
        dtype: DType::F64,
        seed: 3,
        ..TrainConfig::new(4, 3)
    };
    let data = Dataset::synthetic(g.image_size(), g.classes(), 3);
    let mut s = Session::new(g, RunConfig::new(t, scheme), data).unwrap();
    let losses = (0..3).map(|_| s.step().unwrap().loss).collect();
    let params = s
        .parameters()
        .unwrap()
        .into_iter()
        .flatten()
        .map(|(_, id, v)| (id, v))
        .collect();
    (losses, params)
}

#[test]
fn trains_under_mp_exactly_as_on_one_device() {
    let g = model(swish());
    assert_eq!(g.nodes[1].op.describe(), "scaled-swish");
    assert!(
        g.params.iter().any(|p| p.name == "act1.beta"),
        "checkpoint names"
    );
    let (want_losses, want) = train(&g, Scheme::single(2));
    let mp = Scheme::mp()
        .stages(2)
        .micro_batches(2)
        .order(Order::OneFOneB);
    let (losses, got) = train(&g, mp);
    for (a, b) in losses.iter().zip(&want_losses) {
        assert!((a - b).abs() <= 1e-9 * b.abs(), "loss {a} vs {b}");
    }
    assert_eq!(got.len(), want.len(), "every parameter on some rank");
    for (id, v) in &got {
        let w = &want.iter().find(|(i, _)| i == id).unwrap().1;
        let scale = w.iter().map(|x| x.abs()).fold(0.0, f64::max);
        for (a, b) in v.iter().zip(w) {
            assert!(
                (a - b).abs() <= 1e-9 * scale,
                "{}: {a} vs {b}",
                g.params[*id].name
            );
        }
    }
}

#[test]
fn runs_on_tiles_exactly_as_on_one_device() {
    // Pointwise on tiles of each sample: β's gradient is each tile's share, summed over them.
    let g = model(swish());
    let (want_losses, want) = train(&g, Scheme::single(1));
    let grid = gems::ops::tiles::Grid { rows: 2, cols: 1 };
    let (losses, got) = train(&g, Scheme::single(1).with_spatial(grid));
    for (a, b) in losses.iter().zip(&want_losses) {
        assert!((a - b).abs() <= 1e-9 * b.abs(), "loss {a} vs {b}");
    }
    for (id, v) in &got {
        let w = &want.iter().find(|(i, _)| i == id).unwrap().1;
        let scale = w.iter().map(|x| x.abs()).fold(0.0, f64::max);
        for (a, b) in v.iter().zip(w) {
            assert!(
                (a - b).abs() <= 1e-9 * scale,
                "{}: {a} vs {b}",
                g.params[*id].name
            );
        }
    }
}

#[test]
fn trains_in_mixed_precision_and_is_metered_exactly() {
    // bf16 activations (the op's outputs take its input's dtype), f32 parameters and gradients.
    let g = model(swish());
    let t = TrainConfig {
        precision: Precision::Bf16,
        ..TrainConfig::new(4, 3)
    };
    let c = RunConfig::new(t, Scheme::single(2));
    let metered = fit::per_rank(&g, &c).unwrap();
    let mut s = Session::new(&g, c, Dataset::synthetic(12, 3, 0)).unwrap();
    for _ in 0..3 {
        let r = s.step().unwrap();
        assert!(r.loss.is_finite() && !r.skipped, "{}", r.loss);
    }
    let real = &s.memory().unwrap()[0];
    assert_eq!(
        metered[0].peak, real.peak,
        "{} vs {}",
        metered[0].at_peak, real.at_peak
    );
    assert_eq!(metered[0].at_peak, real.at_peak);
}

/// The analytic model (from each op's `saves`) against the metered run, and the metered run
/// against the real one, for `g` under MP-Basic over 2 stages; also the model's saved bytes.
fn memory_agrees(g: &Graph) -> Result<(), String> {
    let scheme = Scheme::mp().stages(2).micro_batches(2);
    let c = RunConfig::new(TrainConfig::new(4, 1), scheme);
    let layout = Layout::new(g, &c).unwrap();
    let fp = Footprint::new(
        &layout.graph,
        2,
        c.train.dtype,
        c.train.activations(),
        gems::backend::meter::ConvWorkspace::Cpu,
    )
    .unwrap();
    let stages: Vec<_> = layout
        .partition
        .stages
        .iter()
        .map(|r| fp.stage(r.clone()))
        .collect();
    let predicted = footprint::rank_bytes(&scheme, &footprint::moments(&layout.schedule), &stages);
    let metered = fit::per_rank(g, &c).unwrap();
    let data = Dataset::synthetic(g.image_size(), g.classes(), 0);
    let mut s = Session::new(g, c, data).unwrap();
    s.step().unwrap();
    let measured = s.memory().unwrap();
    for (rank, (m, real)) in metered.iter().zip(&measured).enumerate() {
        if predicted[rank] != m.peak {
            return Err(format!(
                "rank {rank}: analytic {} vs metered {}",
                predicted[rank], m.peak
            ));
        }
        if m.peak != real.peak || m.at_peak != real.at_peak {
            return Err(format!(
                "rank {rank}: metered {} ({}) vs real {} ({})",
                m.peak, m.at_peak, real.peak, real.at_peak
            ));
        }
    }
    Ok(())
}

#[test]
fn the_planner_counts_what_the_op_saves() {
    let g = model(swish());
    memory_agrees(&g).unwrap();
    // Each Swish keeps its input, which nothing else keeps: 6·12² + 8·6² elements a sample.
    let without = {
        let (mut b, x) = GraphBuilder::new("plain", "Plain", Shape::new([3, 12, 12]));
        let x = b.conv("conv1", x, Conv2d::new(6, 3, 1, 1)).unwrap();
        let x = b.conv("conv2", x, Conv2d::new(8, 3, 2, 1)).unwrap();
        let x = b.global_avg_pool("pool", x).unwrap();
        let logits = b.linear("fc", x, 3, true).unwrap();
        b.finish(vec![Output::new(logits)]).unwrap()
    };
    let f32 = DType::F32;
    assert_eq!(
        g.saved_bytes_per_sample(f32) - without.saved_bytes_per_sample(f32),
        ((6 * 12 * 12 + 8 * 6 * 6) * 4) as u64
    );
    // An op that keeps its input but says it keeps nothing is caught.
    let hiding = Custom::new(
        "hiding",
        Broken {
            scale_dx: 1.0,
            hide_saves: true,
        },
    );
    let e = memory_agrees(&model(hiding)).unwrap_err();
    assert!(e.contains("analytic"), "{e}");
}
