//! A model of your own under MAST (two replicas over two pipeline stages, ranks as threads),
//! reading your own data source with a tenth held out, stepped one step at a time by your loop,
//! checkpointed, resumed as single-device training from the same file, and evaluated on the
//! held-out samples.
//!
//! Run: `cargo run --release --example pipeline_my_model`

#[path = "common/my_model.rs"]
mod my_model;

use std::sync::Arc;

use gems::data::Image;
use gems::{Dataset, RunConfig, Scheme, Session, Source, TrainConfig};

/// Images of stripes: class 0 horizontal, 1 vertical, 2 diagonal, with a phase and contrast
/// drawn from the index. Any type implementing `Source` can feed any scheme.
struct Stripes {
    side: usize,
    classes: Vec<String>,
}

impl Source for Stripes {
    fn samples(&self) -> Option<usize> {
        Some(600)
    }
    fn classes(&self) -> &[String] {
        &self.classes
    }
    fn label(&self, index: usize) -> gems::Result<u32> {
        Ok((index % 3) as u32)
    }
    fn read(&self, index: usize) -> gems::Result<Image> {
        let (n, class) = (self.side, index % 3);
        let phase = (index * 7919 % 8) as f32;
        let contrast = 0.5 + (index * 104729 % 50) as f32 / 100.0;
        let plane: Vec<f32> = (0..n * n)
            .map(|p| {
                let (y, x) = ((p / n) as f32, (p % n) as f32);
                let t = match class {
                    0 => y,
                    1 => x,
                    _ => x + y,
                };
                0.5 + 0.5 * contrast * ((t + phase) * std::f32::consts::PI / 4.0).sin()
            })
            .collect();
        Ok(Image {
            height: n,
            width: n,
            pixels: plane.repeat(3),
        })
    }
    fn describe(&self, index: usize) -> String {
        format!("stripes #{index}")
    }
}

fn main() -> gems::Result<()> {
    let (image, batch, steps) = (32, 8, 30);
    let graph = my_model::my_model(image, 3)?;
    let source = Arc::new(Stripes {
        side: image,
        classes: ["horizontal", "vertical", "diagonal"]
            .map(String::from)
            .to_vec(),
    });
    // A tenth of the samples held out, the same tenth every time.
    let data = || Dataset::from_source(source.clone(), image, 0.1, 0);
    let mut train = TrainConfig::new(batch, steps);
    train.schedule.base = 0.02;

    // MAST: replica A flows rank 0 → 1, replica B rank 1 → 0; 2·B images a step.
    let mast = Scheme::mast().stages(2).micro_batches(2);
    let mut session = Session::new(&graph, RunConfig::new(train.clone(), mast), data()?)?;
    for _ in 0..steps / 2 {
        let r = session.step()?;
        let busy: Vec<String> = r
            .ranks
            .iter()
            .map(|k| format!("{:.0}%", 100.0 * k.busy / k.seconds))
            .collect();
        println!(
            "mast step {:>2}: loss {:.4}, ranks busy {}",
            r.step + 1,
            r.loss,
            busy.join(" ")
        );
    }
    let file = std::env::temp_dir().join(format!(
        "pipeline_my_model-{}.safetensors",
        std::process::id()
    ));
    session.save(&file)?;
    println!("checkpoint: {}", file.display());
    drop(session);

    // The same micro-batches on one device: M = η·m = 4 micro-batches of B/m images a step.
    let mut single = train.clone();
    single.batch_size = 4 * batch / 2;
    let mut session = Session::new(&graph, RunConfig::new(single, Scheme::single(4)), data()?)?;
    session.restore(&file)?;
    println!("resumed as single at step {}", session.steps_done());
    let mut last = f64::NAN;
    while session.steps_done() < steps {
        let r = session.step()?;
        println!("single step {:>2}: loss {:.4}", r.step + 1, r.loss);
        last = r.loss;
    }
    std::fs::remove_file(&file).ok();
    println!("final loss {last:.4}");
    let held_out = session.evaluate_held_out(None)?;
    println!(
        "held out: {} samples, accuracy {:.1}%",
        held_out.samples,
        100.0 * held_out.accuracy
    );
    Ok(())
}
