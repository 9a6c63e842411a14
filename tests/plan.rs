//! The planner's memory model against the allocator: each rank's predicted peak (a metered run
//! of the same task lists) equals what a real run measures, for every scheme.

use gems::plan::memory;
use gems::runtime::executor::{run_local, RunConfig};
use gems::runtime::optim::SgdConfig;
use gems::runtime::schedule::{Decay, LrSchedule};
use gems::schemes::{Kind, Order, Scheme};
use gems::train::TrainConfig;
use gems::DType;

fn config(
    model: &str,
    image: usize,
    batch: usize,
    scheme: Scheme,
    max_in_flight: Option<usize>,
) -> RunConfig {
    RunConfig {
        train: TrainConfig {
            model: model.into(),
            image_size: image,
            classes: 4,
            batch_size: batch,
            steps: 2,
            schedule: LrSchedule {
                base: 0.05,
                decay: Decay::Constant,
                warmup: 0,
                total: 2,
            },
            sgd: SgdConfig {
                momentum: 0.9,
                weight_decay: 1e-4,
                nesterov: false,
            },
            seed: 5,
            dtype: DType::F32,
            device_memory: None,
        },
        scheme,
        balance: None,
        max_in_flight,
        return_params: false,
        metered: false,
    }
}

fn scheme(
    kind: Kind,
    stages: usize,
    parts: usize,
    replicas: usize,
    dp: usize,
    order: Order,
) -> Scheme {
    Scheme {
        kind,
        stages,
        parts,
        replicas,
        dp,
        order,
    }
}

#[test]
fn predicted_peak_per_rank_matches_the_allocator() {
    let cases = [
        (scheme(Kind::Single, 1, 1, 1, 1, Order::GPipe), None),
        (scheme(Kind::Single, 1, 2, 1, 1, Order::GPipe), None),
        (scheme(Kind::Mp, 3, 3, 1, 1, Order::GPipe), None),
        (scheme(Kind::Mp, 3, 3, 1, 1, Order::OneFOneB), None),
        (scheme(Kind::Mast, 2, 2, 2, 1, Order::GPipe), None),
        (scheme(Kind::Mast, 2, 2, 2, 1, Order::GPipe), Some(2)),
        (scheme(Kind::Mast, 3, 1, 2, 1, Order::GPipe), None),
        (scheme(Kind::Master, 2, 1, 4, 1, Order::GPipe), None),
        (scheme(Kind::Mast, 2, 1, 2, 2, Order::GPipe), None),
    ];
    for (model, image) in [("resnet20v2", 32), ("amoebanet_d_3x8", 64)] {
        for (s, bound) in cases {
            let c = config(model, image, 2 * s.parts, s, bound);
            let predicted = memory::per_rank(&c).unwrap();
            let measured: Vec<_> = run_local(&c)
                .unwrap()
                .into_iter()
                .map(|r| r.memory)
                .collect();
            for (rank, (p, m)) in predicted.iter().zip(&measured).enumerate() {
                let ratio = p.peak as f64 / m.peak as f64;
                assert!(
                    (0.95..=1.05).contains(&ratio),
                    "{model} {s:?} bound {bound:?} rank {rank}: predicted {} vs measured {}",
                    p.peak,
                    m.peak
                );
                assert_eq!(
                    p.at_peak, m.at_peak,
                    "{model} {s:?} rank {rank}: by category"
                );
            }
        }
    }
}
