//! `gems models`: the zoo, what each model costs, and a model's block tree.

use gems::memory::human_bytes;
use gems::{models, RunConfig, Scheme, TrainConfig};

use crate::cli::ModelsArgs;

pub fn list(a: ModelsArgs) -> anyhow::Result<()> {
    if let Some(name) = a.graph {
        let g = models::build(&name, a.image_size, a.classes)?;
        println!(
            "{} at {}², {} classes: {} parameters\n",
            g.name,
            a.image_size,
            a.classes,
            g.parameter_count()
        );
        println!("blocks:\n{}", g.block_tree());
        println!("adjacency list:\n{}", g.adjacency_list());
        return Ok(());
    }
    println!(
        "models at {}×{}, {} classes, {} activations:",
        a.image_size,
        a.image_size,
        a.classes,
        a.dtype.name()
    );
    let cap = a
        .device_memory
        .map(|c| format!("batch in {}", human_bytes(c)))
        .unwrap_or_default();
    println!(
        "{:<16} {:>12} {:>14} {:>18} {:>16}",
        "model", "parameters", "GFLOPs/image", "activations/image", cap
    );
    for name in models::LISTED {
        match models::build(name, a.image_size, a.classes) {
            Ok(g) => {
                let fits = match a.device_memory {
                    Some(cap) => {
                        let mut one = RunConfig::new(TrainConfig::new(1, 1), Scheme::single(1));
                        one.train.dtype = a.dtype;
                        // A model the planner cannot meter says why in its row, the rest
                        // are still listed.
                        match gems::fit::largest_batch(&g, &one, cap, 1 << 20) {
                            Ok(0) => "none".to_string(),
                            Ok(b) => b.to_string(),
                            Err(e) => format!("n/a: {e}"),
                        }
                    }
                    None => String::new(),
                };
                println!(
                    "{:<16} {:>12} {:>14.3} {:>18} {:>16}",
                    name,
                    g.parameter_count(),
                    g.flops_per_sample() as f64 / 1e9,
                    human_bytes(g.saved_bytes_per_sample(a.dtype)),
                    fits
                )
            }
            Err(e) => println!("{name:<16} {e}"),
        }
    }
    Ok(())
}
