//! Moving tensors between ranks. A [`Comm`] is a group of ranks (MPI's communicator): point-to-
//! point sends and receives with tags, and the collectives built on them. Reductions sum in
//! rank order at the group's first rank and broadcast the result, so every member gets the
//! same bits (replicas stay identical) whatever the transport.
//!
//! Transports: `local` (ranks as threads of one process, the default) and, with the `mpi`
//! feature, `mpi` (one process per rank under `mpirun`).

pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;

use crate::memory::Category;
use crate::tensor::Device;
use crate::tensor::{Shape, Storage, Tensor};
use crate::Result;

/// What travels: a shape and the elements.
#[derive(Debug)]
pub struct Message {
    /// The tensor's shape, batch included.
    pub shape: Shape,
    /// Its elements.
    pub storage: Storage,
}

/// Tags at and above this are reserved for the collectives; every tag stays below 2²³, the
/// least upper bound MPI implementations give (MPI_TAG_UB).
pub const COLLECTIVE_TAG: u64 = 1 << 22;

/// Point-to-point messages and sub-groups between ranks: threads of a process or MPI processes. Collectives build on these.
pub trait Comm: Send {
    /// This rank's index in the group.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// Queues `msg` for rank `to` under `tag`; returns without waiting for the receiver.
    fn send_message(&self, msg: Message, to: usize, tag: u64) -> Result<()>;
    /// Waits for the message from rank `from` under `tag`. Fails, instead of waiting forever,
    /// when another rank has failed.
    fn recv_message(&self, from: usize, tag: u64) -> Result<Message>;
    /// The sub-group of the ranks that passed the same `color`, ordered by `key` (then rank).
    /// Every member of this group must call it.
    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Comm>>;

    /// Tells the transport the device this rank computes on (and its sub-groups made after
    /// this call): where MPI stages device buffers, or receives into. Threads need nothing.
    fn attach(&mut self, device: &Device) -> Result<()> {
        let _ = device;
        Ok(())
    }

    /// Sends tensor `t` to rank `to` under `tag` (see [`Comm::send_message`]).
    fn send(&self, t: &Tensor, to: usize, tag: u64) -> Result<()> {
        self.send_message(
            Message {
                shape: t.shape().clone(),
                storage: t.storage().try_clone()?,
            },
            to,
            tag,
        )
    }

    /// Receives a tensor onto `device`, its bytes leased as `category`.
    fn recv(&self, from: usize, tag: u64, device: &Device, category: Category) -> Result<Tensor> {
        let m = self.recv_message(from, tag)?;
        device.adopt(m.shape, m.storage, category)
    }

    /// Replaces `t` on every member by the element-wise sum over the group, added in rank order.
    fn all_reduce_sum(&self, t: &mut Tensor, device: &Device) -> Result<()> {
        let tag = COLLECTIVE_TAG;
        if self.rank() == 0 {
            for r in 1..self.size() {
                let other = self.recv(r, tag, device, Category::Communication)?;
                device
                    .backend()
                    .add_assign(t.storage_mut()?, other.storage())?;
            }
        } else {
            self.send(t, 0, tag)?;
        }
        self.broadcast(t, 0, device)
    }

    /// Replaces `t` (on `device`) on every member by root's.
    fn broadcast(&self, t: &mut Tensor, root: usize, device: &Device) -> Result<()> {
        let tag = COLLECTIVE_TAG + 1;
        if self.rank() == root {
            for r in (0..self.size()).filter(|&r| r != root) {
                self.send(t, r, tag)?;
            }
        } else {
            let m = self.recv_message(root, tag)?;
            if m.shape != *t.shape() || m.storage.dtype() != t.dtype() {
                return Err(crate::Error::Comm(format!(
                    "broadcast of {} into a tensor of {}",
                    m.shape,
                    t.shape()
                )));
            }
            // The tensor's lease already covers these bytes.
            *t.storage_mut()? = device.backend().adopt(m.storage)?;
        }
        Ok(())
    }

    /// Returns once every member has called it.
    fn barrier(&self) -> Result<()> {
        let empty = || Message {
            shape: Shape::new([0]),
            storage: Storage::F32(vec![]),
        };
        let tag = COLLECTIVE_TAG + 2;
        if self.rank() == 0 {
            for r in 1..self.size() {
                self.recv_message(r, tag)?;
            }
            for r in 1..self.size() {
                self.send_message(empty(), r, tag)?;
            }
        } else {
            self.send_message(empty(), 0, tag)?;
            self.recv_message(0, tag)?;
        }
        Ok(())
    }

    /// The element-wise sum of host numbers `v` over the group, added in rank order: the same
    /// bits on every member, in f64 whatever the devices compute in (counts, totals).
    fn sum_f64(&self, v: Vec<f64>) -> Result<Vec<f64>> {
        let tag = COLLECTIVE_TAG + 4;
        let len = v.len();
        let message = |v: Vec<f64>| Message {
            shape: Shape::new([v.len()]),
            storage: Storage::F64(v),
        };
        let numbers = |m: Message| match m.storage {
            Storage::F64(v) if v.len() == len => Ok(v),
            _ => Err(crate::Error::Comm(format!(
                "a sum of {len} numbers received {} of another kind or count",
                m.shape
            ))),
        };
        if self.rank() == 0 {
            let mut sum = v;
            for r in 1..self.size() {
                let other = numbers(self.recv_message(r, tag)?)?;
                sum.iter_mut().zip(other).for_each(|(s, o)| *s += o);
            }
            for r in 1..self.size() {
                self.send_message(message(sum.clone()), r, tag)?;
            }
            Ok(sum)
        } else {
            self.send_message(message(v), 0, tag)?;
            numbers(self.recv_message(0, tag)?)
        }
    }
}

/// Every member's `value`, in rank order, on every member: typed data (reports, states)
/// crossing ranks as JSON, 8 bytes to a word of a message.
pub fn all_gather<T: serde::Serialize + serde::de::DeserializeOwned>(
    comm: &dyn Comm,
    value: &T,
) -> Result<Vec<T>> {
    let tag = COLLECTIVE_TAG + 5;
    let encode = |v: &T| -> Result<Message> {
        let json =
            serde_json::to_vec(v).map_err(|e| crate::Error::Internal(format!("encoding: {e}")))?;
        let mut words = vec![json.len() as f64];
        words.extend(json.chunks(8).map(|c| {
            let mut b = [0u8; 8];
            b[..c.len()].copy_from_slice(c);
            f64::from_bits(u64::from_le_bytes(b))
        }));
        Ok(Message {
            shape: Shape::new([words.len()]),
            storage: Storage::F64(words),
        })
    };
    let decode = |m: Message| -> Result<T> {
        let bad = || crate::Error::Comm("a gathered value arrived damaged".into());
        let Storage::F64(words) = m.storage else {
            return Err(bad());
        };
        let len = *words.first().ok_or_else(bad)? as usize;
        let bytes: Vec<u8> = words[1..]
            .iter()
            .flat_map(|w| w.to_bits().to_le_bytes())
            .take(len)
            .collect();
        serde_json::from_slice(&bytes).map_err(|_| bad())
    };
    if comm.rank() == 0 {
        let mut all = vec![decode(encode(value)?)?];
        let mut raw = Vec::new();
        for r in 1..comm.size() {
            let m = comm.recv_message(r, tag)?;
            raw.push(Message {
                shape: m.shape.clone(),
                storage: m.storage.try_clone()?,
            });
            all.push(decode(m)?);
        }
        for r in 1..comm.size() {
            comm.send_message(encode(value)?, r, tag)?;
            for m in &raw {
                comm.send_message(
                    Message {
                        shape: m.shape.clone(),
                        storage: m.storage.try_clone()?,
                    },
                    r,
                    tag,
                )?;
            }
        }
        Ok(all)
    } else {
        comm.send_message(encode(value)?, 0, tag)?;
        (0..comm.size())
            .map(|_| decode(comm.recv_message(0, tag)?))
            .collect()
    }
}

/// Groups (color, key) pairs of all members into the members of `me`'s color, ordered by key
/// then rank: what every transport's `split` computes.
pub fn split_members(pairs: &[(usize, usize)], me: usize) -> Vec<usize> {
    let color = pairs[me].0;
    let mut members: Vec<usize> = (0..pairs.len()).filter(|&r| pairs[r].0 == color).collect();
    members.sort_by_key(|&r| (pairs[r].1, r));
    members
}
