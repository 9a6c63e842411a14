//! Ranks as threads of one process, each with its own device. Messages are copied into
//! per-rank mailboxes; a rank that fails marks the world failed, and every rank waiting on a
//! message then returns an error naming it instead of hanging.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use super::{split_members, Comm, Message};
use crate::{Error, Result};

type Key = (u64, usize, u64); // (group id, sender's world rank, tag)

#[derive(Default)]
struct Mailbox {
    queue: Mutex<HashMap<Key, VecDeque<Message>>>,
    arrived: Condvar,
}

/// The shared state of all ranks of one run.
pub struct World {
    mailboxes: Vec<Mailbox>,
    /// The first rank that failed, and why.
    failure: Mutex<Option<(usize, String)>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl World {
    /// `ranks` ranks' shared state, and a communicator over all of them for each rank (to be
    /// moved into that rank's thread).
    pub fn new(ranks: usize) -> (Arc<World>, Vec<Box<dyn Comm>>) {
        let world = Arc::new(World {
            mailboxes: (0..ranks).map(|_| Mailbox::default()).collect(),
            failure: Mutex::new(None),
        });
        let comms = (0..ranks)
            .map(|r| {
                Box::new(LocalComm {
                    world: Arc::clone(&world),
                    id: 0,
                    members: (0..ranks).collect(),
                    rank: r,
                    splits: std::cell::Cell::new(0),
                }) as Box<dyn Comm>
            })
            .collect();
        (world, comms)
    }

    /// Marks the world failed by `rank` (the first failure is kept): every rank waiting for a
    /// message returns an error instead of waiting forever.
    pub fn fail(&self, rank: usize, why: String) {
        lock(&self.failure).get_or_insert((rank, why));
        for m in &self.mailboxes {
            let _guard = lock(&m.queue);
            m.arrived.notify_all();
        }
    }
}

/// A group of threads' ranks.
pub struct LocalComm {
    world: Arc<World>,
    id: u64,
    /// World ranks of the members, in group order.
    members: Vec<usize>,
    rank: usize,
    splits: std::cell::Cell<u64>,
}

impl Comm for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn send_message(&self, msg: Message, to: usize, tag: u64) -> Result<()> {
        let dst = *self.members.get(to).ok_or_else(|| {
            Error::Internal(format!("send to rank {to} of a group of {}", self.size()))
        })?;
        let mb = &self.world.mailboxes[dst];
        lock(&mb.queue)
            .entry((self.id, self.members[self.rank], tag))
            .or_default()
            .push_back(msg);
        mb.arrived.notify_all();
        Ok(())
    }

    fn recv_message(&self, from: usize, tag: u64) -> Result<Message> {
        let src = *self.members.get(from).ok_or_else(|| {
            Error::Internal(format!(
                "receive from rank {from} of a group of {}",
                self.size()
            ))
        })?;
        let mb = &self.world.mailboxes[self.members[self.rank]];
        let key = (self.id, src, tag);
        let mut q = lock(&mb.queue);
        loop {
            if let Some(m) = q.get_mut(&key).and_then(VecDeque::pop_front) {
                return Ok(m);
            }
            if let Some((_, why)) = lock(&self.world.failure).clone() {
                return Err(Error::Comm(format!(
                    "rank {} stops waiting for rank {src}: {why}",
                    self.members[self.rank]
                )));
            }
            q = mb
                .arrived
                .wait_timeout(q, Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Comm>> {
        // All-gather (color, key) through the group's first rank.
        let tag = super::COLLECTIVE_TAG + 3;
        let mine = Message {
            shape: crate::core::Shape::new([2]),
            storage: crate::tensor::Storage::F64(vec![color as f64, key as f64]),
        };
        let pairs: Vec<(usize, usize)> = if self.rank == 0 {
            let mut all = vec![(color, key)];
            for r in 1..self.size() {
                let m = self.recv_message(r, tag)?;
                let crate::tensor::Storage::F64(v) = m.storage else {
                    return Err(Error::Internal("split message".into()));
                };
                all.push((v[0] as usize, v[1] as usize));
            }
            let flat: Vec<f64> = all
                .iter()
                .flat_map(|&(c, k)| [c as f64, k as f64])
                .collect();
            for r in 1..self.size() {
                self.send_message(
                    Message {
                        shape: crate::core::Shape::new([flat.len()]),
                        storage: crate::tensor::Storage::F64(flat.clone()),
                    },
                    r,
                    tag,
                )?;
            }
            all
        } else {
            self.send_message(mine, 0, tag)?;
            let crate::tensor::Storage::F64(v) = self.recv_message(0, tag)?.storage else {
                return Err(Error::Internal("split message".into()));
            };
            v.chunks(2)
                .map(|p| (p[0] as usize, p[1] as usize))
                .collect()
        };
        let group = split_members(&pairs, self.rank);
        let n = self.splits.get();
        self.splits.set(n + 1);
        let id = crate::core::rng::splitmix64(
            self.id ^ crate::core::rng::splitmix64(n << 32 | color as u64),
        );
        Ok(Box::new(LocalComm {
            world: Arc::clone(&self.world),
            id,
            rank: group
                .iter()
                .position(|&r| r == self.rank)
                .expect("a member of its own color"),
            members: group.iter().map(|&r| self.members[r]).collect(),
            splits: std::cell::Cell::new(0),
        }))
    }
}

/// Runs `f` on `ranks` threads, each with its own communicator over all of them. When one
/// fails (an error or a panic), the others stop at their next wait; the error of the rank that
/// failed first is returned.
pub fn run<T: Send>(ranks: usize, f: impl Fn(Box<dyn Comm>) -> Result<T> + Sync) -> Result<Vec<T>> {
    let (world, comms) = World::new(ranks);
    let results: Vec<Result<T>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(r, comm)| {
                let (world, f) = (Arc::clone(&world), &f);
                s.spawn(move || {
                    let out = catch_panic(|| f(comm));
                    if let Err(e) = &out {
                        world.fail(r, format!("rank {r} failed: {e}"));
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Internal("rank thread lost".into())))
            })
            .collect()
    });
    root_cause(&world, results)
}

/// `f()`, with a panic turned into an error.
pub fn catch_panic<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let what = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
        Err(Error::Internal(format!(
            "panic: {}",
            what.unwrap_or_default()
        )))
    })
}

/// Every rank's result, or the error of the rank that failed first, as it raised it (not
/// those of the ranks that stopped because of it).
pub fn root_cause<T>(world: &World, mut results: Vec<Result<T>>) -> Result<Vec<T>> {
    if let Some((rank, why)) = lock(&world.failure).clone() {
        return Err(
            match results
                .get_mut(rank)
                .map(|r| std::mem::replace(r, Err(Error::Comm(String::new()))))
            {
                Some(Err(e)) => e,
                _ => Error::Comm(why),
            },
        );
    }
    results.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Device;
    use crate::{Category, DType, Shape};

    #[test]
    fn send_recv_allreduce_split() {
        let out = run(4, |c| {
            let d = Device::cpu(&format!("rank{}", c.rank()), None);
            let r = c.rank() as f64;
            // Ring: send to the next, receive from the previous.
            let t = d.upload(
                Shape::new([3]),
                &[r, r + 0.5, -r],
                DType::F64,
                Category::Activations,
            )?;
            c.send(&t, (c.rank() + 1) % 4, 7)?;
            let got = c.recv((c.rank() + 3) % 4, 7, &d, Category::Communication)?;
            assert_eq!(got.to_f64_vec().unwrap()[0], ((c.rank() + 3) % 4) as f64);
            // Sum over the world, then over pairs {0, 2} and {1, 3}.
            let mut s = d.upload(Shape::new([2]), &[r, 1.0], DType::F64, Category::Gradients)?;
            c.all_reduce_sum(&mut s, &d)?;
            let pair = c.split(c.rank() % 2, 0)?;
            let mut p = d.upload(Shape::new([1]), &[r], DType::F64, Category::Gradients)?;
            pair.all_reduce_sum(&mut p, &d)?;
            c.barrier()?;
            Ok((s.to_f64_vec()?, p.scalar()?, pair.size()))
        })
        .unwrap();
        for (r, (s, p, n)) in out.iter().enumerate() {
            assert_eq!(s, &vec![6.0, 4.0]);
            assert_eq!(*p, if r % 2 == 0 { 2.0 } else { 4.0 });
            assert_eq!(*n, 2);
        }
    }

    #[test]
    fn a_failed_rank_stops_the_others() {
        let start = std::time::Instant::now();
        let err = run(3, |c| {
            if c.rank() == 1 {
                return Err(Error::Config("disk on fire".into()));
            }
            // Would wait forever for rank 1.
            c.recv_message(1, 0).map(|_| ())
        })
        .unwrap_err();
        // The failing rank's own error, typed, not the others' "stopped waiting".
        assert!(
            matches!(&err, Error::Config(m) if m == "disk on fire"),
            "{err}"
        );
        assert!(start.elapsed() < Duration::from_secs(5));
        let err = run(2, |c| {
            if c.rank() == 0 {
                panic!("boom")
            } else {
                c.recv_message(0, 0).map(|_| ())
            }
        })
        .unwrap_err();
        assert!(err.to_string().contains("panic: boom"), "{err}");
    }
}
