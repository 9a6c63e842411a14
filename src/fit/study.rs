//! GEMS's offload study (`gems bench offload`): an epoch of each model kept on the device,
//! offloaded in each copy mode, and as `--offload auto` chooses under a cap.

use crate::backend::CopyMode;
use crate::fit::choose_offload;
use crate::graph::policy::{Keep, SavePolicy};
use crate::graph::Graph;
use crate::memory::human_bytes;
use crate::plan::offload::HostLink;
use crate::plan::{RunConfig, TrainConfig};
use crate::runtime::Session;
use crate::schemes::Scheme;
use crate::Result;

/// One line of the offload study: a way of keeping saved activations, and what an epoch cost.
#[derive(Clone, Debug, serde::Serialize)]
pub struct OffloadRun {
    /// The model.
    pub model: String,
    /// `baseline`, a copy mode (everything offloaded), or `auto` (the planner's choice under
    /// a cap 40% below the baseline's peak).
    pub variant: String,
    /// Seconds for the epoch (after one warm-up step), or why it did not run.
    pub seconds: std::result::Result<f64, String>,
    /// The device's peak in bytes.
    pub device_peak: u64,
    /// The host tier's peak in bytes.
    pub host_peak: u64,
}

/// GEMS's offload study on `device`: for each model, an epoch of `images` images in batches of
/// `batch` (the last batch may be short of a whole one: whole batches are run and the time is
/// scaled to `images`), kept on the device, offloaded in each copy mode, and as
/// `--offload auto` chooses under a cap 40% below the baseline's measured peak.
pub fn offload_study(
    base: &TrainConfig,
    models: &[Graph],
    images: usize,
    link: &HostLink,
) -> Result<Vec<OffloadRun>> {
    let mut runs = Vec::new();
    for g in models {
        let config = base.clone();
        let nodes = g.nodes.len();
        let steps = images.div_ceil(config.batch_size);
        let epoch = |c: TrainConfig| -> Result<(f64, u64, u64)> {
            let data = crate::data::open(&c.data, g.image_size(), g.classes(), c.seed)?;
            let batch = c.batch_size;
            let mut t = Session::new(g, RunConfig::new(c, Scheme::single(1)), data)?;
            t.step()?;
            let mut seconds = 0.0;
            for _ in 0..steps {
                seconds += t.step()?.seconds;
            }
            let scale = images as f64 / (steps * batch) as f64;
            let peak = t.memory()?[0].peak;
            Ok((seconds * scale, peak, t.device_summary()?.host.peak))
        };
        let mut record = |variant: String, r: Result<(f64, u64, u64)>| {
            let (seconds, device_peak, host_peak) = match r {
                Ok((s, d, h)) => (Ok(s), d, h),
                Err(e) => (Err(e.to_string()), 0, 0),
            };
            runs.push(OffloadRun {
                model: g.name.clone(),
                variant,
                seconds,
                device_peak,
                host_peak,
            });
        };
        let baseline = epoch(TrainConfig {
            saves: SavePolicy::keep_all(),
            ..config.clone()
        });
        let base_peak = baseline.as_ref().map(|r| r.1).unwrap_or(0);
        record("baseline".into(), baseline);
        for mode in [
            CopyMode::Naive,
            CopyMode::Pinned,
            CopyMode::Async,
            CopyMode::PinnedAsync,
        ] {
            let c = TrainConfig {
                saves: SavePolicy::all(nodes, Keep::Host, 2),
                offload_copy: mode,
                ..config.clone()
            };
            record(mode.to_string(), epoch(c));
        }
        let cap = base_peak * 6 / 10;
        let auto = RunConfig::new(config.clone(), Scheme::single(1));
        let chosen = choose_offload(g, &auto, cap, link, 2).and_then(|chosen| {
            epoch(TrainConfig {
                saves: chosen.policy,
                device_memory: Some(cap),
                offload_copy: CopyMode::PinnedAsync,
                ..config.clone()
            })
        });
        record(format!("auto (cap {})", human_bytes(cap)), chosen);
    }
    Ok(runs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_offload_study_runs_every_variant_and_auto_fits_its_cap() {
        let base = TrainConfig::new(4, 1);
        let g = crate::models::build("resnet20v2", 32, 2).unwrap();
        let runs = offload_study(&base, &[g], 10, &HostLink::CPU).unwrap();
        let names: Vec<&str> = runs.iter().map(|r| r.variant.as_str()).collect();
        assert_eq!(
            &names[..5],
            ["baseline", "naive", "pinned", "async", "pinned-async"]
        );
        assert!(names[5].starts_with("auto (cap "), "{names:?}");
        let baseline = &runs[0];
        for r in &runs {
            assert!(r.seconds.is_ok(), "{}: {:?}", r.variant, r.seconds);
            if r.variant != "baseline" {
                assert!(r.device_peak < baseline.device_peak, "{r:?}");
                assert!(r.host_peak > 0, "{r:?}");
            }
        }
        assert!(
            runs[5].device_peak <= baseline.device_peak * 6 / 10,
            "{:?}",
            runs[5]
        );
    }
}
