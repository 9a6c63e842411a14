//! Prepares a sequence of batches ahead of the training loop on worker threads, at most
//! `depth` batches ahead of the one the loop is waiting for, handed out in order. The sequence
//! is a function of the batch's index, so an open-ended run reserves nothing per step. The loop's
//! time blocked on data is measured, so a run reports whether its loader kept up.

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::pipeline::Pipeline;
use crate::{Error, Result};

/// A prepared batch: NCHW pixels and targets.
pub struct Batch {
    /// The batch's images, NCHW.
    pub pixels: Vec<f32>,
    /// Their targets ([`Pipeline::targets`]): a class per image, or per pixel when segmenting.
    pub labels: Vec<u32>,
    /// How long [`Loader::next_batch`] waited for it.
    pub waited: Duration,
}

struct State {
    /// Requests handed to workers so far.
    claimed: usize,
    /// The request the loop takes next.
    next: usize,
    ready: BTreeMap<usize, Result<Batch>>,
    stop: bool,
}

/// Batch i's (first position, images), or `None` past the last batch.
pub type Requests = Box<dyn Fn(usize) -> Option<(u64, usize)> + Send + Sync>;

struct Shared {
    pipeline: Arc<Pipeline>,
    /// (first position, images) of batch i, in the order the loop takes them; `None` past the
    /// last.
    requests: Requests,
    depth: usize,
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A worker that panicked while holding the lock left nothing half-written.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn work(&self) {
        loop {
            let mut s = self.lock();
            while !s.stop && s.claimed >= s.next + self.depth {
                s = self.changed.wait(s).unwrap_or_else(|p| p.into_inner());
            }
            let i = s.claimed;
            let request = (self.requests)(i);
            let Some((first, n)) = request.filter(|_| !s.stop) else {
                return;
            };
            s.claimed += 1;
            drop(s);
            let batch = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.pipeline.batch(first, n)
            }))
            .unwrap_or_else(|_| {
                Err(Error::Data(format!(
                    "decoding positions {first}..{} failed unexpectedly",
                    first + n as u64
                )))
            })
            .map(|(pixels, labels)| Batch {
                pixels,
                labels,
                waited: Duration::ZERO,
            });
            self.lock().ready.insert(i, batch);
            self.changed.notify_all();
        }
    }
}

/// Prepares batches ahead of the training loop on worker threads (see the module).
pub struct Loader {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

impl Loader {
    /// Starts `workers` threads preparing `requests` ((first position, images) of batch i) of
    /// `pipeline`, at most `depth` batches ahead.
    pub fn new(
        pipeline: Arc<Pipeline>,
        requests: Requests,
        workers: usize,
        depth: usize,
    ) -> Loader {
        let shared = Arc::new(Shared {
            pipeline,
            requests,
            depth: depth.max(1),
            state: Mutex::new(State {
                claimed: 0,
                next: 0,
                ready: BTreeMap::new(),
                stop: false,
            }),
            changed: Condvar::new(),
        });
        let workers = (0..workers.max(1))
            .map(|_| {
                let s = shared.clone();
                std::thread::spawn(move || s.work())
            })
            .collect();
        Loader { shared, workers }
    }

    /// The next batch in request order, waiting for it if need be.
    pub fn next_batch(&mut self) -> Result<Batch> {
        let start = Instant::now();
        let sh = &self.shared;
        let mut s = sh.lock();
        let i = s.next;
        if (sh.requests)(i).is_none() {
            return Err(Error::Internal(
                "the loader has handed out every batch".into(),
            ));
        }
        let batch = loop {
            if let Some(b) = s.ready.remove(&i) {
                break b;
            }
            if rayon::current_thread_index().is_none() {
                s = sh.changed.wait(s).unwrap_or_else(|p| p.into_inner());
                continue;
            }
            // A CPU run waits here on one of the pool's workers, perhaps its only one: what a
            // source runs on the pool to make this batch needs that worker too.
            drop(s);
            rayon::yield_now();
            let (held, _) = sh
                .changed
                .wait_timeout(sh.lock(), Duration::from_millis(1))
                .unwrap_or_else(|p| p.into_inner());
            s = held;
        };
        s.next += 1;
        drop(s);
        sh.changed.notify_all();
        batch.map(|b| Batch {
            waited: start.elapsed(),
            ..b
        })
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.changed.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{
        transform::{Normalize, Transform},
        Image, Source,
    };
    use rayon::prelude::*;

    /// Images whose pixels are summed on a pool, as a source decoding in parallel would.
    struct Parallel(Vec<String>, Arc<rayon::ThreadPool>);

    impl Source for Parallel {
        fn samples(&self) -> Option<usize> {
            None
        }
        fn classes(&self) -> &[String] {
            &self.0
        }
        fn label(&self, _: usize) -> Result<u32> {
            Ok(0)
        }
        fn read(&self, index: usize) -> Result<Image> {
            let value = self.1.install(|| {
                (0..64)
                    .into_par_iter()
                    .map(|i| (i * index) as f32)
                    .sum::<f32>()
            });
            Ok(Image {
                height: 2,
                width: 2,
                pixels: vec![value; 12],
            })
        }
        fn describe(&self, index: usize) -> String {
            format!("image {index}")
        }
    }

    #[test]
    fn waiting_on_the_pools_only_worker_lets_a_source_use_the_pool() {
        let pool = Arc::new(
            rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build()
                .unwrap(),
        );
        let source = Arc::new(Parallel(vec!["0".into()], pool.clone()));
        let transform = Transform {
            augment: false,
            normalize: Normalize::Unit,
            resize: false,
        };
        let pipeline = Arc::new(Pipeline::new(source, 2, transform, 0, false, false));
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut loader = Loader::new(pipeline, Box::new(|i| Some((i as u64, 1))), 1, 1);
            let sums: Vec<f32> = pool.install(|| {
                (0..3)
                    .map(|_| loader.next_batch().map(|b| b.pixels[0]))
                    .collect::<Result<_>>()
            })?;
            let _ = done.send(sums);
            Ok::<(), Error>(())
        });
        let sums = finished.recv_timeout(Duration::from_secs(60));
        assert_eq!(sums, Ok(vec![0.0, 2016.0, 4032.0]), "the loader hung");
    }
}
