//! Where a tensor's elements live: host vectors, device buffers, host-tier blocks, or nothing
//! (a metering device's virtual buffers).

use cudarc::driver::CudaSlice;

use crate::backend::cuda;
use crate::backend::host::HostBuffer;
use crate::core::DType;

#[cfg(target_endian = "big")]
compile_error!("gems stores tensors as little-endian bytes: big-endian hosts are not supported");

/// Device memory holding elements. Each backend adds its variants.
#[derive(Debug)]
pub enum Storage {
    /// 32-bit floats in host memory.
    F32(Vec<f32>),
    /// 64-bit floats in host memory.
    F64(Vec<f64>),
    /// bfloat16 in host memory.
    BF16(Vec<half::bf16>),
    /// IEEE half precision in host memory.
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
    /// The element type.
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
    /// Elements held.
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
    /// Whether it holds no elements.
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
    /// The device address of the first element of device storage (`None` for host memory):
    /// what a CUDA-aware MPI is handed. Whatever reads or writes it must first wait for the
    /// work queued on the storage's stream.
    pub fn device_address(&self) -> Option<u64> {
        use cudarc::driver::DevicePtr;
        match self {
            Storage::CudaF32(s) => Some(s.device_ptr(s.stream()).0),
            Storage::Cuda16(_, s) => Some(s.device_ptr(s.stream()).0),
            _ => None,
        }
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
    /// The elements' bytes in host memory, writable (an error for device memory).
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
