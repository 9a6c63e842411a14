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
            s = sh.changed.wait(s).unwrap_or_else(|p| p.into_inner());
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
