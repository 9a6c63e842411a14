//! Shapes, element types and tensors. A tensor is a shape plus a shared handle to a buffer
//! whose bytes are leased from the device's allocator, so dropping the last handle frees them.

use std::fmt;
use std::sync::Arc;

use cudarc::driver::CudaSlice;

use crate::backend::cuda;
use crate::memory::host::HostBuffer;
use crate::memory::Lease;

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    F64,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 => 8,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
        }
    }
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(DType::F32),
            "f64" => Ok(DType::F64),
            _ => Err(format!("unknown dtype '{s}' (f32, f64)")),
        }
    }
}

/// Dimensions, outermost first (NCHW for images).
#[derive(Clone, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
pub struct Shape(pub Vec<usize>);

impl Shape {
    pub fn new(dims: impl Into<Vec<usize>>) -> Self {
        Shape(dims.into())
    }
    pub fn dims(&self) -> &[usize] {
        &self.0
    }
    pub fn rank(&self) -> usize {
        self.0.len()
    }
    pub fn numel(&self) -> usize {
        self.0.iter().product()
    }
    pub fn dim(&self, i: usize) -> usize {
        self.0[i]
    }
    /// (N, C, H, W) of a rank-4 shape.
    pub fn nchw(&self) -> (usize, usize, usize, usize) {
        assert_eq!(self.rank(), 4, "expected an NCHW shape, got {self}");
        (self.0[0], self.0[1], self.0[2], self.0[3])
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d: Vec<String> = self.0.iter().map(|x| x.to_string()).collect();
        write!(f, "[{}]", d.join(", "))
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Device memory holding elements. Each backend adds its variants.
#[derive(Debug)]
pub enum Storage {
    F32(Vec<f32>),
    F64(Vec<f64>),
    /// Elements that are counted but never stored: the metering backend's, which replays a
    /// run's allocations to predict its memory exactly.
    Virtual(DType, usize),
    /// f32 elements in a CUDA device's memory, ordered on the stream the slice belongs to.
    CudaF32(CudaSlice<f32>),
    /// Elements in a pooled host block (the host tier's pinned buffers).
    Host(HostBuffer),
}

impl Storage {
    pub fn dtype(&self) -> DType {
        match self {
            Storage::F32(_) => DType::F32,
            Storage::F64(_) => DType::F64,
            Storage::Virtual(d, _) => *d,
            Storage::CudaF32(_) => DType::F32,
            Storage::Host(h) => h.dtype,
        }
    }
    pub fn len(&self) -> usize {
        match self {
            Storage::F32(v) => v.len(),
            Storage::F64(v) => v.len(),
            Storage::Virtual(_, n) => *n,
            Storage::CudaF32(s) => s.len(),
            Storage::Host(h) => h.numel,
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// A copy in the same memory (host or device).
    pub fn try_clone(&self) -> crate::Result<Storage> {
        Ok(match self {
            Storage::F32(v) => Storage::F32(v.clone()),
            Storage::F64(v) => Storage::F64(v.clone()),
            Storage::Virtual(d, n) => Storage::Virtual(*d, *n),
            Storage::CudaF32(s) => Storage::CudaF32(cuda::duplicate(s)?),
            Storage::Host(h) => h.to_storage()?,
        })
    }
    /// The bytes of elements in host memory (an error for device memory).
    pub fn host_bytes(&self) -> crate::Result<&[u8]> {
        match self {
            Storage::F32(v) => Ok(bytemuck::cast_slice(v)),
            Storage::F64(v) => Ok(bytemuck::cast_slice(v)),
            Storage::Host(h) => h.bytes(),
            _ => Err(not_in_host_memory(self)),
        }
    }
    pub fn host_bytes_mut(&mut self) -> crate::Result<&mut [u8]> {
        match self {
            Storage::F32(v) => Ok(bytemuck::cast_slice_mut(v)),
            Storage::F64(v) => Ok(bytemuck::cast_slice_mut(v)),
            Storage::Host(h) => h.bytes_mut(),
            _ => Err(not_in_host_memory(self)),
        }
    }
    /// The elements as f64, copied to the host.
    pub fn to_f64_vec(&self) -> crate::Result<Vec<f64>> {
        let widen = |v: &[f32]| v.iter().map(|&x| x as f64).collect();
        Ok(match self {
            Storage::F32(v) => widen(v),
            Storage::F64(v) => v.clone(),
            Storage::Virtual(_, n) => vec![0.0; *n],
            Storage::CudaF32(s) => widen(&cuda::download(s)?),
            Storage::Host(h) => h.to_storage()?.to_f64_vec()?,
        })
    }
    /// The elements as little-endian bytes (files and the wire).
    pub fn to_le_bytes(&self) -> crate::Result<Vec<u8>> {
        let f32_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect();
        Ok(match self {
            Storage::F32(v) => f32_bytes(v),
            Storage::F64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Storage::Virtual(d, n) => vec![0; d.size() * n],
            Storage::CudaF32(s) => f32_bytes(&cuda::download(s)?),
            Storage::Host(h) => h.bytes()?.to_vec(),
        })
    }
    /// Elements of `dtype` from little-endian bytes (a trailing partial element is ignored).
    pub fn from_le_bytes(bytes: &[u8], dtype: DType) -> Storage {
        match dtype {
            DType::F32 => Storage::F32(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            DType::F64 => Storage::F64(
                bytes
                    .chunks_exact(8)
                    .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
                    .collect(),
            ),
        }
    }
}

fn not_in_host_memory(s: &Storage) -> crate::Error {
    crate::Error::Internal(format!(
        "{} elements of {} are not in host memory",
        s.len(),
        s.dtype().name()
    ))
}

#[derive(Debug)]
pub(crate) struct Buffer {
    pub(crate) storage: Storage,
    pub(crate) _lease: Lease,
}

/// A [`Tensor`] that does not keep its buffer alive; it keeps its [`Tensor::buffer_key`] from
/// being reused.
#[derive(Clone, Debug)]
pub struct WeakTensor {
    shape: Shape,
    buf: std::sync::Weak<Buffer>,
}

impl WeakTensor {
    pub fn upgrade(&self) -> Option<Tensor> {
        self.buf.upgrade().map(|buf| Tensor {
            shape: self.shape.clone(),
            buf,
        })
    }
}

/// A shape and a shared buffer. Cloning shares the buffer (no copy); writing needs the only
/// handle, which the runtime guarantees for outputs, gradients and parameters.
#[derive(Clone, Debug)]
pub struct Tensor {
    shape: Shape,
    buf: Arc<Buffer>,
}

impl Tensor {
    pub(crate) fn from_buffer(shape: Shape, storage: Storage, lease: Lease) -> Tensor {
        debug_assert_eq!(shape.numel(), storage.len());
        Tensor {
            shape,
            buf: Arc::new(Buffer {
                storage,
                _lease: lease,
            }),
        }
    }
    pub fn shape(&self) -> &Shape {
        &self.shape
    }
    pub fn dtype(&self) -> DType {
        self.buf.storage.dtype()
    }
    pub fn numel(&self) -> usize {
        self.shape.numel()
    }
    pub fn bytes(&self) -> u64 {
        self.buf._lease.bytes()
    }
    pub fn storage(&self) -> &Storage {
        &self.buf.storage
    }
    /// Mutable storage; fails if the buffer is shared, since a write would be seen by others.
    pub fn storage_mut(&mut self) -> crate::Result<&mut Storage> {
        Arc::get_mut(&mut self.buf)
            .map(|b| &mut b.storage)
            .ok_or_else(|| crate::Error::Internal("write to a shared tensor".into()))
    }
    /// The same buffer seen with another shape of the same size.
    pub fn reshape(&self, shape: Shape) -> crate::Result<Tensor> {
        if shape.numel() != self.numel() {
            return Err(crate::Error::Shape(format!(
                "cannot reshape {} into {}",
                self.shape, shape
            )));
        }
        Ok(Tensor {
            shape,
            buf: Arc::clone(&self.buf),
        })
    }
    /// A handle that does not keep the buffer's memory alive.
    pub fn downgrade(&self) -> WeakTensor {
        WeakTensor {
            shape: self.shape.clone(),
            buf: Arc::downgrade(&self.buf),
        }
    }
    /// Identifies the buffer (views of one buffer share it) while any handle to it, strong or
    /// weak, exists.
    pub fn buffer_key(&self) -> usize {
        Arc::as_ptr(&self.buf) as usize
    }
    /// Elements as f64 (a copy to the host); for tests, checks and reports.
    pub fn to_f64_vec(&self) -> crate::Result<Vec<f64>> {
        self.buf.storage.to_f64_vec()
    }
    /// The single element of a one-element tensor.
    pub fn scalar(&self) -> crate::Result<f64> {
        debug_assert_eq!(self.numel(), 1);
        Ok(self.to_f64_vec()?[0])
    }
}
