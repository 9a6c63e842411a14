//! One process per rank under `mpirun` (feature `mpi`). Sends are non-blocking: the encoded
//! message is handed to MPI_Isend and freed once the request completes, so a rank never waits
//! for its receiver (the schedules assume buffered sends; two ranks sending to each other at
//! once, as MAST's replicas do, would otherwise deadlock in rendezvous mode). Messages carry
//! their shape and dtype in a small header. Device buffers are host memory on the CPU backend;
//! the CUDA backend will stage them through pinned buffers unless MPI is CUDA-aware.

use std::cell::RefCell;

use mpi::request::{Request, StaticScope};
use mpi::topology::{Color, Communicator, SimpleCommunicator};
use mpi::traits::{Destination, Source};

use super::{Comm, Message};
use crate::tensor::{DType, Shape, Storage};
use crate::{Error, Result};

/// A send in flight and the buffer it reads, freed once the request completes.
struct InFlight {
    request: Request<'static, [u8], StaticScope>,
    buffer: *mut [u8],
}

/// This process's rank among the processes of an MPI communicator, as a [`Comm`].
pub struct MpiComm {
    comm: SimpleCommunicator,
    in_flight: RefCell<Vec<InFlight>>,
}

// SAFETY: a communicator is used by the one thread that made it (MPI is initialized with the
// default single-threaded level); `Send` only lets it move into that thread's runner.
unsafe impl Send for MpiComm {}

impl MpiComm {
    /// All processes of the job.
    pub fn world(universe: &mpi::environment::Universe) -> MpiComm {
        MpiComm {
            comm: universe.world(),
            in_flight: RefCell::new(Vec::new()),
        }
    }

    /// Ends the whole job, every rank, with `code` (after one rank failed).
    pub fn abort(&self, code: i32) -> ! {
        self.comm.abort(code)
    }

    /// Frees the buffers of completed sends; with `wait`, waits for all of them.
    fn reap(&self, wait: bool) {
        let mut still = Vec::new();
        for f in self.in_flight.borrow_mut().drain(..) {
            let done = if wait {
                f.request.wait();
                None
            } else {
                f.request.test().err()
            };
            match done {
                Some(request) => still.push(InFlight {
                    request,
                    buffer: f.buffer,
                }),
                // SAFETY: the request that read this buffer has completed; it came from
                // Box::into_raw in send_message and is freed exactly once.
                None => drop(unsafe { Box::from_raw(f.buffer) }),
            }
        }
        *self.in_flight.borrow_mut() = still;
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        self.reap(true);
    }
}

/// The dtypes of the wire, by their code in the header (a match, so a new dtype must be
/// given one).
fn wire_code(d: DType) -> u64 {
    match d {
        DType::F32 => 0,
        DType::F64 => 1,
        DType::BF16 => 2,
        DType::F16 => 3,
    }
}

/// [rank, dims..., dtype code] as little-endian u64s, then the elements.
fn encode(m: Message) -> Result<Box<[u8]>> {
    let mut out =
        Vec::with_capacity(8 * (m.shape.rank() + 2) + m.storage.len() * m.storage.dtype().size());
    out.extend((m.shape.rank() as u64).to_le_bytes());
    for &d in m.shape.dims() {
        out.extend((d as u64).to_le_bytes());
    }
    out.extend(wire_code(m.storage.dtype()).to_le_bytes());
    out.extend(m.storage.to_le_bytes()?);
    Ok(out.into_boxed_slice())
}

fn decode(b: &[u8]) -> Result<Message> {
    let word = |i: usize| -> Result<u64> {
        b.get(8 * i..8 * i + 8)
            .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
            .ok_or_else(|| Error::Comm("a message shorter than its header".into()))
    };
    let rank = word(0)? as usize;
    let dims = (1..=rank)
        .map(|i| word(i).map(|d| d as usize))
        .collect::<Result<Vec<_>>>()?;
    let code = word(rank + 1)?;
    let dtype = [DType::F32, DType::F64, DType::BF16, DType::F16]
        .into_iter()
        .find(|&d| wire_code(d) == code)
        .ok_or_else(|| Error::Comm(format!("a message of unknown dtype code {code}")))?;
    let storage = Storage::from_le_bytes(&b[8 * (rank + 2)..], dtype);
    let shape = Shape(dims);
    if storage.len() != shape.numel() {
        return Err(Error::Comm(format!(
            "a message of shape {shape} carries {} elements",
            storage.len()
        )));
    }
    Ok(Message { shape, storage })
}

impl Comm for MpiComm {
    fn rank(&self) -> usize {
        self.comm.rank() as usize
    }

    fn size(&self) -> usize {
        self.comm.size() as usize
    }

    fn send_message(&self, msg: Message, to: usize, tag: u64) -> Result<()> {
        let buffer = Box::into_raw(encode(msg)?);
        // SAFETY: the buffer stays alive (leaked) until reap sees its request complete.
        let data: &'static [u8] = unsafe { &*buffer };
        let request = self
            .comm
            .process_at_rank(to as i32)
            .immediate_send_with_tag(StaticScope, data, tag as i32);
        self.in_flight
            .borrow_mut()
            .push(InFlight { request, buffer });
        self.reap(false);
        Ok(())
    }

    fn recv_message(&self, from: usize, tag: u64) -> Result<Message> {
        let (bytes, _) = self
            .comm
            .process_at_rank(from as i32)
            .receive_vec_with_tag::<u8>(tag as i32);
        decode(&bytes)
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Comm>> {
        let comm = self
            .comm
            .split_by_color_with_key(Color::with_value(color as i32), key as i32)
            .ok_or_else(|| Error::Comm("MPI_Comm_split gave no communicator".into()))?;
        Ok(Box::new(MpiComm {
            comm,
            in_flight: RefCell::new(Vec::new()),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip() {
        for storage in [
            Storage::F32(vec![1.5, -2.0, 3.25, 0.0, 7.0, 8.0]),
            Storage::F64(vec![0.1, 0.2, 0.3, 0.4, 0.5, 0.6]),
            Storage::BF16(
                [1.5, -2.0, 3.25, 0.0, 7.0, 8.0]
                    .map(half::bf16::from_f32)
                    .to_vec(),
            ),
            Storage::F16(
                [1.5, -2.0, 3.25, 0.0, 7.0, 8.0]
                    .map(half::f16::from_f32)
                    .to_vec(),
            ),
        ] {
            let bytes = storage.to_le_bytes().unwrap();
            let dtype = storage.dtype();
            let m = Message {
                shape: Shape::new([2, 3]),
                storage,
            };
            let back = decode(&encode(m).unwrap()).unwrap();
            assert_eq!(back.shape, Shape::new([2, 3]));
            assert_eq!(back.storage.to_le_bytes().unwrap(), bytes);
            assert_eq!(back.storage.dtype(), dtype);
        }
        assert!(decode(&[1, 2, 3]).is_err());
    }
}
