//! One process per rank under `mpirun` (feature `mpi`). Sends are non-blocking: the encoded
//! message is handed to MPI_Isend and freed once the request completes, so a rank never waits
//! for its receiver (the schedules assume buffered sends; two ranks sending to each other at
//! once, as MAST's replicas do, would otherwise deadlock in rendezvous mode). Messages carry
//! their shape and dtype in a small header.
//!
//! Host elements travel inside the header's message. Device elements (the CUDA backend's)
//! follow it in pieces under the same tag (MPI keeps one sender's messages of one tag in
//! order), and take one of two paths ([`DevicePath`]):
//!
//! - CUDA-aware MPI (`MPIX_Query_cuda_support()` says so, looked up at run time so that any
//!   MPI library loads): once the stream has written it, the device buffer itself is handed
//!   to MPI_Isend, and a receive lands in device memory;
//! - otherwise, staged through pinned host buffers of the device's pool: the device-to-host
//!   copies of all pieces are queued on the copy stream at once, and each piece is handed to
//!   MPI as soon as its copy's event completes, so piece k travels while piece k+1 is copied;
//!   a receive copies each piece to the device on the copy stream while the next one arrives.
//!
//! `GEMS_MPI_CUDA_AWARE=1` (or `0`) overrides the library's answer; `GEMS_MPI_CHUNK_BYTES`
//! sets the staged pieces' size (4 MiB).

use std::any::Any;
use std::cell::RefCell;
use std::ffi::c_void;
use std::rc::Rc;

use mpi::datatype::{AsDatatype, Buffer, BufferMut, Collection, Equivalence, Pointer, PointerMut};
use mpi::request::{Request, StaticScope};
use mpi::topology::{Color, Communicator, SimpleCommunicator};
use mpi::traits::{Destination, Source};

use super::{Comm, Message};
use crate::tensor::{DType, Device, Shape, Storage};
use crate::{Error, Result};

/// How device buffers cross MPI.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DevicePath {
    /// Handed to MPI as they are: the library reads and writes device memory.
    Direct,
    /// Copied through pinned host buffers, piece by piece, overlapping the copies with MPI.
    Staged,
}

impl DevicePath {
    /// The path this process takes, and why: `GEMS_MPI_CUDA_AWARE` when set, else the MPI
    /// library's `MPIX_Query_cuda_support()`, else staged.
    pub fn chosen() -> (DevicePath, String) {
        match std::env::var("GEMS_MPI_CUDA_AWARE").as_deref() {
            Ok("1") => return (DevicePath::Direct, "GEMS_MPI_CUDA_AWARE=1".into()),
            Ok("0") => return (DevicePath::Staged, "GEMS_MPI_CUDA_AWARE=0".into()),
            _ => {}
        }
        match query_cuda_support() {
            Some(true) => (DevicePath::Direct, "MPIX_Query_cuda_support() = 1".into()),
            Some(false) => (DevicePath::Staged, "MPIX_Query_cuda_support() = 0".into()),
            None => (
                DevicePath::Staged,
                "the MPI library has no MPIX_Query_cuda_support".into(),
            ),
        }
    }

    /// The line a run reports: `MPI: CUDA-aware (...)` or `MPI: staged through pinned host
    /// buffers (...)`.
    pub fn describe() -> String {
        let (path, why) = DevicePath::chosen();
        match path {
            DevicePath::Direct => format!("MPI: CUDA-aware ({why}): device buffers go to MPI"),
            DevicePath::Staged => {
                format!("MPI: staged through pinned host buffers ({why})")
            }
        }
    }
}

/// OpenMPI's `MPIX_Query_cuda_support()` (mpi-ext.h), found with dlsym so that a library
/// without it still loads; `None` where it is absent.
fn query_cuda_support() -> Option<bool> {
    // SAFETY: a lookup in the symbols already loaded (libmpi is linked into the binary); the
    // function takes nothing and returns an int.
    unsafe {
        let f = libc::dlsym(libc::RTLD_DEFAULT, c"MPIX_Query_cuda_support".as_ptr());
        if f.is_null() {
            return None;
        }
        let query: extern "C" fn() -> std::os::raw::c_int = std::mem::transmute(f);
        Some(query() != 0)
    }
}

/// Staged pieces' size: `GEMS_MPI_CHUNK_BYTES`, else 4 MiB.
fn staged_piece() -> usize {
    std::env::var("GEMS_MPI_CHUNK_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&b: &usize| b > 0)
        .unwrap_or(4 << 20)
        .min(MAX_PIECE)
}

/// The largest piece one MPI call carries (its count is a C int).
const MAX_PIECE: usize = 1 << 30;

/// (offset, length) of the pieces of `total` bytes in pieces of `piece`.
fn pieces(total: usize, piece: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..total)
        .step_by(piece)
        .map(move |o| (o, piece.min(total - o)))
}

/// Bytes MPI reads or writes: host memory, pinned memory, or (CUDA-aware MPI) device memory,
/// which Rust never dereferences.
struct Wire {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the pointer and count describe `len` bytes of MPI_UINT8_T that the caller keeps
// alive (and untouched) until the MPI call or request that uses them completes.
unsafe impl Pointer for Wire {
    fn pointer(&self) -> *const c_void {
        self.ptr as *const c_void
    }
}
// SAFETY: as for Pointer.
unsafe impl PointerMut for Wire {
    fn pointer_mut(&mut self) -> *mut c_void {
        self.ptr as *mut c_void
    }
}
// SAFETY: pieces are at most MAX_PIECE bytes, which a C int counts.
unsafe impl Collection for Wire {
    fn count(&self) -> mpi::Count {
        mpi::Count::try_from(self.len).expect("a piece of at most 2^30 bytes")
    }
}
// SAFETY: bytes.
unsafe impl AsDatatype for Wire {
    type Out = <u8 as Equivalence>::Out;
    fn as_datatype(&self) -> Self::Out {
        u8::equivalent_datatype()
    }
}
// SAFETY: see the impls above.
unsafe impl Buffer for Wire {}
// SAFETY: see the impls above.
unsafe impl BufferMut for Wire {}

/// A send in flight, the wire it reads, and what owns those bytes, freed once the request
/// completes.
struct InFlight {
    request: Request<'static, Wire, StaticScope>,
    wire: *mut Wire,
    _keep: Box<dyn Any>,
}

/// This process's rank among the processes of an MPI communicator, as a [`Comm`].
pub struct MpiComm {
    comm: SimpleCommunicator,
    in_flight: RefCell<Vec<InFlight>>,
    /// The device this rank computes on, once attached: where device messages are staged or
    /// received.
    device: Option<Device>,
    path: DevicePath,
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
            device: None,
            path: DevicePath::chosen().0,
        }
    }

    /// How this communicator moves device buffers.
    pub fn device_path(&self) -> DevicePath {
        self.path
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
                    wire: f.wire,
                    _keep: f._keep,
                }),
                // SAFETY: the request that read this wire has completed; it came from
                // Box::into_raw in post and is freed exactly once. Its bytes' owner goes too.
                None => drop((unsafe { Box::from_raw(f.wire) }, f._keep)),
            }
        }
        self.in_flight.borrow_mut().extend(still);
    }

    /// Hands `wire` to MPI_Isend; `keep` (what owns its bytes) lives until the send completes.
    fn post(&self, wire: Wire, keep: Box<dyn Any>, to: usize, tag: u64) {
        let wire = Box::into_raw(Box::new(wire));
        // SAFETY: the wire stays alive (leaked) until reap sees its request complete.
        let data: &'static Wire = unsafe { &*wire };
        let request = self
            .comm
            .process_at_rank(to as i32)
            .immediate_send_with_tag(StaticScope, data, tag as i32);
        self.in_flight.borrow_mut().push(InFlight {
            request,
            wire,
            _keep: keep,
        });
    }

    /// Sends host bytes `b`.
    fn post_bytes(&self, b: Box<[u8]>, to: usize, tag: u64) {
        let wire = Wire {
            ptr: b.as_ptr() as *mut u8,
            len: b.len(),
        };
        self.post(wire, Box::new(b), to, tag);
    }

    /// Device storage `s`'s elements after their header: the device buffer itself
    /// (CUDA-aware MPI) or pieces staged through a pinned buffer.
    fn send_device(&self, d: &Device, shape: Shape, s: Storage, to: usize, tag: u64) -> Result<()> {
        let total = s.len() * s.dtype().size();
        let dtype = s.dtype();
        let be = d.backend();
        match self.path {
            DevicePath::Direct => {
                // The stream has written it (the kernels, and the copy `Comm::send` made).
                be.synchronize()?;
                let base = s.device_address().expect("device storage");
                self.post_bytes(header(&shape, dtype, MAX_PIECE.min(total)), to, tag);
                let keep = Rc::new(s);
                for (offset, len) in pieces(total, MAX_PIECE) {
                    let ptr = (base + offset as u64) as *mut u8;
                    self.post(Wire { ptr, len }, Box::new(keep.clone()), to, tag);
                }
            }
            DevicePath::Staged => {
                let piece = staged_piece();
                let mut pinned = d.pinned(s.len(), dtype)?;
                let host = pinned.host_bytes_mut()?;
                // Every piece's copy queued at once on the copy stream, each with its event.
                let mut copies = Vec::new();
                for (offset, len) in pieces(total, piece) {
                    let e = be.copy_out_bytes(&s, offset, &mut host[offset..offset + len])?;
                    copies.push((offset, len, e));
                }
                let base = host.as_mut_ptr();
                self.post_bytes(header(&shape, dtype, piece), to, tag);
                let keep = Rc::new(pinned);
                for (offset, len, copied) in copies {
                    // The piece is in the pinned buffer only once its copy's event completes.
                    copied.synchronize()?;
                    // SAFETY: inside the pinned buffer, which `keep` holds until the send ends.
                    let ptr = unsafe { base.add(offset) };
                    self.post(Wire { ptr, len }, Box::new(keep.clone()), to, tag);
                    self.reap(false);
                }
                // Every copy has read the device buffer: it may go.
                drop(s);
            }
        }
        Ok(())
    }

    /// Receives the `piece`-byte pieces of a device message of `shape` and `dtype` from
    /// `from`: into device memory (CUDA-aware MPI, or staged through a pinned buffer) when a
    /// device is attached, else into host memory.
    fn recv_pieces(
        &self,
        shape: Shape,
        dtype: DType,
        piece: usize,
        from: usize,
        tag: u64,
    ) -> Result<Message> {
        let numel = shape.numel();
        let total = numel * dtype.size();
        let source = self.comm.process_at_rank(from as i32);
        let receive = |ptr: *mut u8, len: usize| {
            source.receive_into_with_tag(&mut Wire { ptr, len }, tag as i32);
        };
        let mut storage = match &self.device {
            Some(d) => d.backend().empty(numel, dtype)?,
            None => Storage::from_le_bytes(&vec![0; total], dtype),
        };
        match (&self.device, storage.device_address()) {
            (Some(d), Some(base)) if self.path == DevicePath::Direct => {
                // The allocation's own work (a fill, under poison) lands first.
                d.backend().synchronize()?;
                for (offset, len) in pieces(total, piece) {
                    receive((base + offset as u64) as *mut u8, len);
                }
            }
            (Some(d), Some(_)) => {
                let be = d.backend();
                let mut pinned = d.pinned(numel, dtype)?;
                let host = pinned.host_bytes_mut()?;
                let mut last = None;
                for (offset, len) in pieces(total, piece) {
                    let part = &mut host[offset..offset + len];
                    receive(part.as_mut_ptr(), len);
                    // On the copy stream while the next piece arrives.
                    last = Some(be.copy_in_bytes(part, &mut storage, offset)?);
                }
                if let Some(e) = last {
                    // The copies are ordered on their stream: the last one ends them all.
                    be.wait(&e)?;
                    // The pinned buffer goes back to the pool only once they have read it.
                    e.synchronize()?;
                }
            }
            _ => {
                let host = storage.host_bytes_mut()?;
                for (offset, len) in pieces(total, piece) {
                    receive(host[offset..].as_mut_ptr(), len);
                }
            }
        }
        Ok(Message { shape, storage })
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

/// [rank, dims..., dtype code, piece bytes] as little-endian u64s; piece 0: the elements
/// follow in this message, else in messages of that many bytes (the last one shorter).
fn header(shape: &Shape, dtype: DType, piece: usize) -> Box<[u8]> {
    let mut out = Vec::with_capacity(8 * (shape.rank() + 3));
    out.extend((shape.rank() as u64).to_le_bytes());
    for &d in shape.dims() {
        out.extend((d as u64).to_le_bytes());
    }
    out.extend(wire_code(dtype).to_le_bytes());
    out.extend((piece as u64).to_le_bytes());
    out.into_boxed_slice()
}

/// A message of host elements: its header, then the elements.
fn encode(m: Message) -> Result<Box<[u8]>> {
    let mut out = header(&m.shape, m.storage.dtype(), 0).into_vec();
    out.extend(m.storage.to_le_bytes()?);
    Ok(out.into_boxed_slice())
}

/// A header's shape, dtype and piece size, and where the elements start.
fn decode_header(b: &[u8]) -> Result<(Shape, DType, usize, usize)> {
    let word = |i: usize| -> Result<u64> {
        b.get(8 * i..8 * i + 8)
            .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
            .ok_or_else(|| Error::Comm("a message shorter than its header".into()))
    };
    let rank = word(0)? as usize;
    if rank > 16 {
        return Err(Error::Comm(format!("a message header of rank {rank}")));
    }
    let dims = (1..=rank)
        .map(|i| word(i).map(|d| d as usize))
        .collect::<Result<Vec<_>>>()?;
    let code = word(rank + 1)?;
    let dtype = [DType::F32, DType::F64, DType::BF16, DType::F16]
        .into_iter()
        .find(|&d| wire_code(d) == code)
        .ok_or_else(|| Error::Comm(format!("a message of unknown dtype code {code}")))?;
    let piece = word(rank + 2)? as usize;
    Ok((Shape(dims), dtype, piece, 8 * (rank + 3)))
}

/// A message of host elements (piece 0) from its bytes.
fn decode(b: &[u8]) -> Result<Message> {
    let (shape, dtype, piece, start) = decode_header(b)?;
    if piece != 0 {
        return Err(Error::Comm("a header without its elements".into()));
    }
    let storage = Storage::from_le_bytes(&b[start..], dtype);
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
        match &self.device {
            Some(d) if msg.storage.device_address().is_some() && !msg.storage.is_empty() => {
                self.send_device(d, msg.shape, msg.storage, to, tag)?
            }
            _ => self.post_bytes(encode(msg)?, to, tag),
        }
        self.reap(false);
        Ok(())
    }

    fn recv_message(&self, from: usize, tag: u64) -> Result<Message> {
        let (bytes, _) = self
            .comm
            .process_at_rank(from as i32)
            .receive_vec_with_tag::<u8>(tag as i32);
        let (shape, dtype, piece, _) = decode_header(&bytes)?;
        match piece {
            0 => decode(&bytes),
            _ => self.recv_pieces(shape, dtype, piece, from, tag),
        }
    }

    fn attach(&mut self, device: &Device) -> Result<()> {
        self.device = Some(device.clone());
        Ok(())
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Comm>> {
        let comm = self
            .comm
            .split_by_color_with_key(Color::with_value(color as i32), key as i32)
            .ok_or_else(|| Error::Comm("MPI_Comm_split gave no communicator".into()))?;
        Ok(Box::new(MpiComm {
            comm,
            in_flight: RefCell::new(Vec::new()),
            device: self.device.clone(),
            path: self.path,
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
        // A device message's header: the elements follow in pieces, not in it.
        let h = header(&Shape::new([2, 3]), DType::BF16, 1000);
        let (shape, dtype, piece, start) = decode_header(&h).unwrap();
        assert_eq!(
            (shape, dtype, piece, start),
            (Shape::new([2, 3]), DType::BF16, 1000, 40)
        );
        assert!(decode(&h).is_err());
        let cut: Vec<_> = pieces(2500, 1000).collect();
        assert_eq!(cut, [(0, 1000), (1000, 1000), (2000, 500)]);
        assert_eq!(pieces(0, 1000).count(), 0);
    }
}
