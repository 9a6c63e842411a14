//! Shapes, element types and tensors. A tensor is a shape plus a shared handle to a buffer
//! whose bytes are leased from the device's allocator, so dropping the last handle frees them.

use std::fmt;
use std::sync::Arc;

use cudarc::driver::CudaSlice;

use crate::backend::cuda;
use crate::memory::host::HostBuffer;
use crate::memory::Lease;

#[cfg(target_endian = "big")]
compile_error!("gems stores tensors as little-endian bytes: big-endian hosts are not supported");

/// Element type of a tensor. The 16-bit types hold activations under mixed precision; their
/// arithmetic is f32 ([`DType::compute`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    F64,
    BF16,
    F16,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 => 8,
            DType::BF16 | DType::F16 => 2,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        }
    }
    /// The type values of this type are computed and accumulated in (and workspace holds).
    pub fn compute(self) -> DType {
        match self {
            DType::F64 => DType::F64,
            _ => DType::F32,
        }
    }
    /// `x` rounded to this type (to nearest, ties to even), as f32 arithmetic sees it.
    pub fn round(self, x: f32) -> f32 {
        match self {
            DType::BF16 => half::bf16::from_f32(x).to_f32(),
            DType::F16 => half::f16::from_f32(x).to_f32(),
            DType::F32 | DType::F64 => x,
        }
    }
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(DType::F32),
            "f64" => Ok(DType::F64),
            "bf16" => Ok(DType::BF16),
            "f16" => Ok(DType::F16),
            _ => Err(format!("unknown dtype '{s}' (f32, f64, bf16, f16)")),
        }
    }
}

/// The numerics of a run: what activations are stored in and how products are computed.
/// Parameters, their gradients, optimizer state and batch statistics keep the run's dtype
/// (master weights); arithmetic and accumulation are never narrower than f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Precision {
    /// Activations in the run's dtype; f32 multiply-adds on a GPU's CUDA cores.
    #[default]
    Fp32,
    /// As fp32, but a GPU's convolution and matrix products run on the tensor cores with
    /// 10-bit mantissas (sm_80+); the CPU computes fp32.
    Tf32,
    /// Activations in bf16; convolution operands rounded to bf16 (tensor cores on a GPU).
    Bf16,
    /// Activations in f16, as bf16, with dynamic loss scaling against f16's narrow range.
    Fp16,
}

impl Precision {
    /// The dtype activations and their gradients are stored in, for parameters in `params`.
    pub fn activations(self, params: DType) -> DType {
        match self {
            Precision::Fp32 | Precision::Tf32 => params,
            Precision::Bf16 => DType::BF16,
            Precision::Fp16 => DType::F16,
        }
    }
    /// Whether gradients need a dynamic loss scale to stay inside the activation type.
    pub fn scales_loss(self) -> bool {
        self == Precision::Fp16
    }
    /// Refuses a combination that means nothing: anything but fp32 for f64 runs.
    pub fn check(self, params: DType) -> Result<(), String> {
        if params != DType::F32 && self != Precision::Fp32 {
            return Err(format!(
                "--precision {self} needs f32 parameters (the run is {}); f64 runs compute in f64",
                params.name()
            ));
        }
        Ok(())
    }
}

impl std::str::FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fp32" => Ok(Precision::Fp32),
            "tf32" => Ok(Precision::Tf32),
            "bf16" => Ok(Precision::Bf16),
            "fp16" => Ok(Precision::Fp16),
            _ => Err(format!("unknown precision '{s}' (fp32, tf32, bf16, fp16)")),
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::Fp32 => "fp32",
            Precision::Tf32 => "tf32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        })
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
    BF16(Vec<half::bf16>),
    F16(Vec<half::f16>),
    /// Elements that are counted but never stored: the metering backend's, which replays a
    /// run's allocations to predict its memory exactly.
    Virtual(DType, usize),
    /// f32 elements in a CUDA device's memory, ordered on the stream the slice belongs to.
    CudaF32(CudaSlice<f32>),
    /// bf16 or f16 elements (as their bits) in a CUDA device's memory.
    Cuda16(DType, CudaSlice<u16>),
    /// Elements in a pooled host block (the host tier's pinned buffers).
    Host(HostBuffer),
}

impl Storage {
    pub fn dtype(&self) -> DType {
        match self {
            Storage::F32(_) => DType::F32,
            Storage::F64(_) => DType::F64,
            Storage::BF16(_) => DType::BF16,
            Storage::F16(_) => DType::F16,
            Storage::Virtual(d, _) => *d,
            Storage::CudaF32(_) => DType::F32,
            Storage::Cuda16(d, _) => *d,
            Storage::Host(h) => h.dtype,
        }
    }
    pub fn len(&self) -> usize {
        match self {
            Storage::F32(v) => v.len(),
            Storage::F64(v) => v.len(),
            Storage::BF16(v) => v.len(),
            Storage::F16(v) => v.len(),
            Storage::Virtual(_, n) => *n,
            Storage::CudaF32(s) => s.len(),
            Storage::Cuda16(_, s) => s.len(),
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
            Storage::BF16(v) => Storage::BF16(v.clone()),
            Storage::F16(v) => Storage::F16(v.clone()),
            Storage::Virtual(d, n) => Storage::Virtual(*d, *n),
            Storage::CudaF32(s) => Storage::CudaF32(cuda::duplicate(s)?),
            Storage::Cuda16(d, s) => Storage::Cuda16(*d, cuda::duplicate(s)?),
            Storage::Host(h) => h.to_storage()?,
        })
    }
    /// The bytes of elements in host memory (an error for device memory).
    pub fn host_bytes(&self) -> crate::Result<&[u8]> {
        match self {
            Storage::F32(v) => Ok(bytemuck::cast_slice(v)),
            Storage::F64(v) => Ok(bytemuck::cast_slice(v)),
            Storage::BF16(v) => Ok(bytemuck::cast_slice(v)),
            Storage::F16(v) => Ok(bytemuck::cast_slice(v)),
            Storage::Host(h) => h.bytes(),
            _ => Err(not_in_host_memory(self)),
        }
    }
    pub fn host_bytes_mut(&mut self) -> crate::Result<&mut [u8]> {
        match self {
            Storage::F32(v) => Ok(bytemuck::cast_slice_mut(v)),
            Storage::F64(v) => Ok(bytemuck::cast_slice_mut(v)),
            Storage::BF16(v) => Ok(bytemuck::cast_slice_mut(v)),
            Storage::F16(v) => Ok(bytemuck::cast_slice_mut(v)),
            Storage::Host(h) => h.bytes_mut(),
            _ => Err(not_in_host_memory(self)),
        }
    }
    /// The elements as f64, copied to the host.
    pub fn to_f64_vec(&self) -> crate::Result<Vec<f64>> {
        Ok(match self {
            Storage::F64(v) => v.clone(),
            Storage::Virtual(_, n) => vec![0.0; *n],
            Storage::Host(h) => h.to_storage()?.to_f64_vec()?,
            device => device
                .to_host()?
                .widened()
                .iter()
                .map(|&x| x as f64)
                .collect(),
        })
    }
    /// The elements in host memory: a copy of device storage, else `self` duplicated.
    pub fn to_host(&self) -> crate::Result<Storage> {
        Ok(match self {
            Storage::CudaF32(s) => Storage::F32(cuda::download(s)?),
            Storage::Cuda16(d, s) => {
                Storage::from_le_bytes(bytemuck::cast_slice(&cuda::download(s)?), *d)
            }
            Storage::Host(h) => h.to_storage()?,
            host => host.try_clone()?,
        })
    }
    /// Host f32, bf16 or f16 elements as f32 (exact); empty for other storage.
    fn widened(&self) -> Vec<f32> {
        match self {
            Storage::F32(v) => v.clone(),
            Storage::BF16(v) => v.iter().map(|x| x.to_f32()).collect(),
            Storage::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
            _ => Vec::new(),
        }
    }
    /// The elements as little-endian bytes (files and the wire).
    pub fn to_le_bytes(&self) -> crate::Result<Vec<u8>> {
        Ok(match self {
            Storage::Virtual(d, n) => vec![0; d.size() * n],
            Storage::F32(_) | Storage::F64(_) | Storage::BF16(_) | Storage::F16(_) => {
                // Little-endian hosts only (x86-64, aarch64): the bytes are the elements.
                self.host_bytes()?.to_vec()
            }
            device => device.to_host()?.host_bytes()?.to_vec(),
        })
    }
    /// Elements of `dtype` from little-endian bytes (a trailing partial element is ignored).
    pub fn from_le_bytes(bytes: &[u8], dtype: DType) -> Storage {
        fn elements<T: bytemuck::Pod>(bytes: &[u8]) -> Vec<T> {
            let whole = bytes.len() / std::mem::size_of::<T>() * std::mem::size_of::<T>();
            bytemuck::pod_collect_to_vec(&bytes[..whole])
        }
        match dtype {
            DType::F32 => Storage::F32(elements(bytes)),
            DType::F64 => Storage::F64(elements(bytes)),
            DType::BF16 => Storage::BF16(elements(bytes)),
            DType::F16 => Storage::F16(elements(bytes)),
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
