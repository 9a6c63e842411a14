//! Tensors and the device they live on. A tensor is a shape plus a shared handle to a buffer
//! whose bytes are leased from the device's allocator, so dropping the last handle frees them.

mod device;

use std::sync::Arc;

pub use crate::backend::Storage;
pub use crate::core::{DType, Precision, Shape};
use crate::memory::Lease;
pub use device::Device;

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
    /// The tensor, if its buffer is still alive.
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
    /// Its shape, batch included.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }
    /// Its element type.
    pub fn dtype(&self) -> DType {
        self.buf.storage.dtype()
    }
    /// Its elements.
    pub fn numel(&self) -> usize {
        self.shape.numel()
    }
    /// Its size in bytes.
    pub fn bytes(&self) -> u64 {
        self.buf._lease.bytes()
    }
    /// Its elements.
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
