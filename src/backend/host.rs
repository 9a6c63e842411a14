//! Host-tier buffers and the pool that keeps them across steps.
//!
//! Offloaded activations wait in host memory between forward and backward. A GPU copies to and
//! from page-locked ("pinned") memory by DMA, asynchronously, at full link speed; pinning is
//! costly (a system call that locks pages), so pinned blocks are taken from a [`HostPool`] and
//! go back to it when their tensor is dropped: after the first step, offloading allocates
//! nothing. Steps repeat the same sizes, so blocks are kept by exact size.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::PinnedHostSlice;

use crate::backend::Storage;
use crate::core::DType;
use crate::Result;

/// Host memory for one tensor.
#[derive(Debug)]
pub enum Block {
    /// Ordinary memory (the CPU backend's host tier, where there is no DMA to serve).
    Pageable(Vec<u8>),
    /// Page-locked memory a GPU reads and writes by DMA.
    Pinned(PinnedHostSlice<u8>),
}

impl Block {
    /// Its size in bytes.
    pub fn len(&self) -> usize {
        match self {
            Block::Pageable(v) => v.len(),
            Block::Pinned(p) => p.len(),
        }
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Its bytes, readable (a pinned block must be mapped on the host).
    pub fn bytes(&self) -> Result<&[u8]> {
        match self {
            Block::Pageable(v) => Ok(v),
            Block::Pinned(p) => p
                .as_slice()
                .map_err(|e| crate::Error::Device(format!("pinned memory: {e}"))),
        }
    }

    /// Its bytes, writable.
    pub fn bytes_mut(&mut self) -> Result<&mut [u8]> {
        match self {
            Block::Pageable(v) => Ok(v),
            Block::Pinned(p) => p
                .as_mut_slice()
                .map_err(|e| crate::Error::Device(format!("pinned memory: {e}"))),
        }
    }
}

/// How the pool has served requests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PoolStats {
    /// Blocks allocated (the costly path).
    pub allocated: usize,
    /// Requests served with a block given back earlier.
    pub reused: usize,
    /// Bytes held by the pool, in use or free.
    pub bytes: u64,
}

/// Free blocks by size, shared by the tensors that hold blocks.
#[derive(Debug, Default)]
pub struct HostPool {
    state: Mutex<(HashMap<usize, Vec<Block>>, PoolStats)>,
}

impl HostPool {
    /// An empty pool.
    pub fn new() -> Arc<HostPool> {
        Arc::new(HostPool::default())
    }

    /// A buffer of `numel` elements of `dtype`: a free block of that size, or a new one from
    /// `alloc`.
    pub fn take(
        self: &Arc<Self>,
        numel: usize,
        dtype: DType,
        alloc: impl FnOnce(usize) -> Result<Block>,
    ) -> Result<HostBuffer> {
        let bytes = numel * dtype.size();
        let reused = {
            let mut s = self.lock();
            let block = s.0.get_mut(&bytes).and_then(Vec::pop);
            if block.is_some() {
                s.1.reused += 1;
            }
            block
        };
        let block = match reused {
            Some(b) => b,
            None => {
                let b = alloc(bytes)?;
                let mut s = self.lock();
                s.1.allocated += 1;
                s.1.bytes += bytes as u64;
                b
            }
        };
        Ok(HostBuffer {
            block: Some(block),
            pool: Arc::clone(self),
            dtype,
            numel,
        })
    }

    /// Blocks allocated and reused so far, and bytes held.
    pub fn stats(&self) -> PoolStats {
        self.lock().1
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (HashMap<usize, Vec<Block>>, PoolStats)> {
        // The map stays consistent whatever a panicking holder was doing.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A tensor's elements in a pooled host block, given back to the pool on drop.
#[derive(Debug)]
pub struct HostBuffer {
    block: Option<Block>,
    pool: Arc<HostPool>,
    /// The element type of the tensor it holds.
    pub dtype: DType,
    /// The tensor's elements.
    pub numel: usize,
}

impl HostBuffer {
    /// The elements' bytes.
    pub fn bytes(&self) -> Result<&[u8]> {
        self.block.as_ref().map_or(Ok(&[]), Block::bytes)
    }

    /// The elements' bytes, writable.
    pub fn bytes_mut(&mut self) -> Result<&mut [u8]> {
        match &mut self.block {
            Some(b) => b.bytes_mut(),
            None => Ok(&mut []),
        }
    }

    /// The elements, copied into ordinary host storage.
    pub fn to_storage(&self) -> Result<Storage> {
        Ok(Storage::from_le_bytes(self.bytes()?, self.dtype))
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if let Some(b) = self.block.take() {
            self.pool.lock().0.entry(b.len()).or_default().push(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_go_back_to_the_pool_and_are_reused_by_size() {
        let pool = HostPool::new();
        let pageable = |n| Ok(Block::Pageable(vec![0; n]));
        let mut a = pool.take(10, DType::F32, pageable).unwrap();
        a.bytes_mut().unwrap()[0] = 7;
        let b = pool.take(10, DType::F32, pageable).unwrap();
        assert_eq!(pool.stats().allocated, 2);
        drop(a);
        // Same size: the freed block comes back (with whatever it held; copies overwrite it).
        let c = pool.take(10, DType::F32, pageable).unwrap();
        assert_eq!(c.bytes().unwrap()[0], 7);
        // Another size: a new block.
        let _d = pool.take(3, DType::F64, pageable).unwrap();
        assert_eq!(
            pool.stats(),
            PoolStats {
                allocated: 3,
                reused: 1,
                bytes: 40 + 40 + 24
            }
        );
        drop((b, c));
        let _e = pool.take(10, DType::F32, |_| {
            panic!("a free block of this size exists")
        });
    }
}
