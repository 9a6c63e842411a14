//! A device: a backend and the allocator every byte of it is leased from, with its host tier.

use std::sync::Arc;

use crate::backend::host::{HostPool, PoolStats};
use crate::backend::meter;
use crate::backend::{cpu, cuda, Backend, CopyMode, DeviceKind, Event};
use crate::memory::{Allocator, Category, MemoryStats};
use crate::tensor::{DType, Shape, Storage, Tensor};
use crate::Result;

struct DeviceInner {
    allocator: Arc<Allocator>,
    /// The host tier: where offloaded tensors wait for backward.
    host: Arc<Allocator>,
    copies: CopyMode,
    /// Pinned blocks of the host tier, reused across steps.
    pool: Arc<HostPool>,
    /// Copies on the copy stream not known to be complete, with the tensor each one reads,
    /// kept alive (not freed, not reused) until the copy has read it.
    in_flight: std::sync::Mutex<Vec<(Event, Tensor)>>,
    backend: Box<dyn Backend>,
}

impl DeviceInner {
    fn new(allocator: Arc<Allocator>, backend: Box<dyn Backend>) -> Arc<DeviceInner> {
        let host = Allocator::new(format!("{} host", allocator.name()), None);
        Arc::new(DeviceInner {
            allocator,
            host,
            copies: CopyMode::default(),
            pool: HostPool::new(),
            in_flight: Default::default(),
            backend,
        })
    }
}

/// A backend and the allocator every byte of it is leased from. Cheap to clone.
#[derive(Clone)]
pub struct Device {
    inner: Arc<DeviceInner>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Device({})", self.inner.allocator.name())
    }
}

impl Device {
    /// The CPU backend, with an emulated capacity (`None`: unlimited).
    pub fn cpu(name: &str, capacity: Option<u64>) -> Device {
        cpu::tune_host_allocator();
        Device {
            inner: DeviceInner::new(Allocator::new(name, capacity), Box::new(cpu::Cpu)),
        }
    }

    /// The device of `kind` that rank `rank` of a run computes on, named `name`, with
    /// `capacity` bytes at most; on a GPU, convolutions run with `conv` in `precision`.
    pub fn open(
        kind: DeviceKind,
        precision: crate::tensor::Precision,
        conv: cuda::ConvImpl,
        name: &str,
        rank: usize,
        capacity: Option<u64>,
    ) -> Result<Device> {
        match kind {
            DeviceKind::Cpu if conv != cuda::ConvImpl::Native => Err(crate::Error::Config(
                format!("{conv} convolutions run on a GPU, and this run computes on the CPU"),
            )),
            DeviceKind::Cpu => Ok(Device::cpu(name, capacity)),
            DeviceKind::Cuda { ordinal } => {
                cuda::check_conv(precision, conv)?;
                let count = cuda::device_count()?;
                if ordinal >= count {
                    return Err(crate::Error::Device(format!(
                        "no CUDA device {ordinal}: the driver sees {count}"
                    )));
                }
                Device::cuda(name, (ordinal + rank) % count, precision, conv, capacity)
            }
        }
    }

    /// GPU `ordinal` with kernels of `precision`, convolutions by `conv`. Its capacity is the
    /// device's free memory less [`cuda::RESERVE`], or `capacity` when that is smaller.
    pub fn cuda(
        name: &str,
        ordinal: usize,
        precision: crate::tensor::Precision,
        conv: cuda::ConvImpl,
        capacity: Option<u64>,
    ) -> Result<Device> {
        // The backend leases its scratch from the allocator, which needs the capacity, which
        // needs the device opened: open it with an unbounded allocator, then set the bound.
        let allocator = Allocator::new(name, None);
        let (backend, free) = cuda::Cuda::new(ordinal, precision, conv, Arc::clone(&allocator))?;
        allocator.set_capacity(Some(cuda::capacity(free, capacity)));
        Ok(Device {
            inner: DeviceInner::new(allocator, Box::new(backend)),
        })
    }

    /// A device that counts the allocations of a backend with `workspace`'s convolution
    /// workspace, and computes nothing.
    pub fn meter(name: &str, capacity: Option<u64>, workspace: meter::ConvWorkspace) -> Device {
        Device {
            inner: DeviceInner::new(
                Allocator::new(name, capacity),
                Box::new(meter::Meter { workspace }),
            ),
        }
    }

    /// The device's name (`cpu:0`).
    pub fn name(&self) -> &str {
        self.inner.allocator.name()
    }

    /// The kernels it runs.
    pub fn backend(&self) -> &dyn Backend {
        &*self.inner.backend
    }

    /// Its memory: capacity, live bytes and peaks.
    pub fn memory(&self) -> MemoryStats {
        self.inner.allocator.stats()
    }

    /// Its bytes since the last mark: the most live at once, and what is live now.
    pub fn mark(&self) -> crate::memory::Held {
        self.inner.allocator.mark()
    }

    /// The same device with a host tier of `capacity` bytes (`None`: unlimited) that tensors
    /// travel to and from by `copies`; set before the device is shared.
    pub fn with_host_tier(mut self, capacity: Option<u64>, copies: CopyMode) -> Result<Device> {
        let name = format!("{} host", self.name());
        let inner = Arc::get_mut(&mut self.inner).ok_or_else(|| {
            crate::Error::Internal("the host tier is set before a device is shared".into())
        })?;
        inner.host = Allocator::new(name, capacity);
        inner.copies = copies;
        Ok(self)
    }

    /// The host tier's memory.
    pub fn host_memory(&self) -> MemoryStats {
        self.inner.host.stats()
    }

    /// How the pinned pool served the host tier.
    pub fn host_pool(&self) -> PoolStats {
        self.inner.pool.stats()
    }

    /// A host buffer of `numel` elements of `dtype` from the host tier's pool (pinned where
    /// the backend has DMA), not leased: a message staged between the device and the wire.
    /// It goes back to the pool when dropped.
    pub fn pinned(&self, numel: usize, dtype: DType) -> Result<Storage> {
        self.backend()
            .host_zeros(numel, dtype, Some(&self.inner.pool))
    }

    /// A copy of `t` in the host tier, counted as activations there. With a copy stream it may
    /// still be on its way: the copy back ([`Device::from_host`]) is ordered after it.
    pub fn to_host(&self, t: &Tensor) -> Result<Tensor> {
        self.reap(false)?;
        let lease = self.inner.host.lease(t.bytes(), Category::Activations)?;
        let mode = self.inner.copies;
        let pool = mode.pinned().then_some(&self.inner.pool);
        let mut host = self.backend().host_zeros(t.numel(), t.dtype(), pool)?;
        if let Some(e) = self
            .backend()
            .copy_out(t.storage(), &mut host, mode.on_copy_stream())?
        {
            self.in_flight().push((e, t.clone()));
        }
        Ok(Tensor::from_buffer(t.shape().clone(), host, lease))
    }

    /// A device copy of host-tier tensor `t`, counted as activations, and the event work that
    /// reads it must [`Backend::wait`] for (`None`: it is there already).
    pub fn from_host(&self, t: &Tensor) -> Result<(Tensor, Option<Event>)> {
        self.reap(false)?;
        let mut d = self.empty(t.shape().clone(), t.dtype(), Category::Activations)?;
        let e = self.backend().copy_in(
            t.storage(),
            d.storage_mut()?,
            self.inner.copies.on_copy_stream(),
        )?;
        if let Some(e) = &e {
            self.in_flight().push((e.clone(), t.clone()));
        }
        Ok((d, e))
    }

    /// Waits for every copy in flight and lets go of what they read.
    pub fn settle(&self) -> Result<()> {
        self.reap(true)
    }

    /// Lets go of the tensors whose copies are complete (all of them, waiting, with `all`).
    fn reap(&self, all: bool) -> Result<()> {
        let mut done = Vec::new();
        {
            let mut in_flight = self.in_flight();
            for (e, t) in std::mem::take(&mut *in_flight) {
                if all || e.is_complete() {
                    done.push((e, t));
                } else {
                    in_flight.push((e, t));
                }
            }
        }
        for (e, t) in done {
            e.synchronize()?;
            drop(t);
        }
        Ok(())
    }

    fn in_flight(&self) -> std::sync::MutexGuard<'_, Vec<(Event, Tensor)>> {
        // The list stays consistent whatever a panicking holder was doing.
        self.inner
            .in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// A zero-filled tensor whose bytes count as `category`.
    pub fn zeros(&self, shape: Shape, dtype: DType, category: Category) -> Result<Tensor> {
        self.leased(shape, dtype, category, |b, n| b.zeros(n, dtype))
    }

    /// A tensor whose bytes count as `category`, for a kernel that writes every element:
    /// not filled ([`Backend::empty`]), leased as [`Device::zeros`] leases.
    pub fn empty(&self, shape: Shape, dtype: DType, category: Category) -> Result<Tensor> {
        self.leased(shape, dtype, category, |b, n| b.empty(n, dtype))
    }

    fn leased(
        &self,
        shape: Shape,
        dtype: DType,
        category: Category,
        alloc: impl FnOnce(&dyn Backend, usize) -> Result<Storage>,
    ) -> Result<Tensor> {
        let n = shape.numel();
        let lease = self.lease((n * dtype.size()) as u64, category)?;
        Ok(Tensor::from_buffer(shape, alloc(self.backend(), n)?, lease))
    }

    /// `bytes` of this device's memory as `category`. Where they do not fit while copies to
    /// the host tier are in flight, waits for those copies (each holds its device tensor until
    /// it has read it) and tries again: a copy stream slower than the compute then holds the
    /// compute back instead of failing it.
    fn lease(&self, bytes: u64, category: Category) -> Result<crate::memory::Lease> {
        match self.inner.allocator.lease(bytes, category) {
            Err(_) if !self.in_flight().is_empty() => {
                self.reap(true)?;
                Ok(self.inner.allocator.lease(bytes, category)?)
            }
            lease => Ok(lease?),
        }
    }

    /// A tensor over `storage` (host elements, or this device's), leased as `category`.
    pub fn adopt(&self, shape: Shape, storage: Storage, category: Category) -> Result<Tensor> {
        if shape.numel() != storage.len() {
            return Err(crate::Error::Shape(format!(
                "{} elements do not fill a tensor of shape {shape}",
                storage.len()
            )));
        }
        let lease = self.lease((storage.len() * storage.dtype().size()) as u64, category)?;
        Ok(Tensor::from_buffer(
            shape,
            self.backend().adopt(storage)?,
            lease,
        ))
    }

    /// A model input of `shape` from a prepared batch of f32 pixels, as an activation of
    /// `dtype`: moved as it is for f32 (on the CPU without a copy, to a GPU in one copy),
    /// widened for f64, rounded on the host for bf16 and f16 (half the bytes to copy).
    pub fn input(&self, shape: Shape, pixels: Vec<f32>, dtype: DType) -> Result<Tensor> {
        use half::vec::HalfFloatVecExt;
        let storage = match dtype {
            DType::F32 => Storage::F32(pixels),
            DType::F64 => Storage::F64(pixels.into_iter().map(f64::from).collect()),
            DType::BF16 => Storage::BF16(Vec::from_f32_slice(&pixels)),
            DType::F16 => Storage::F16(Vec::from_f32_slice(&pixels)),
        };
        self.adopt(shape, storage, Category::Activations)
    }

    /// A tensor holding `data` converted to `dtype`.
    pub fn upload(
        &self,
        shape: Shape,
        data: &[f64],
        dtype: DType,
        category: Category,
    ) -> Result<Tensor> {
        if shape.numel() != data.len() {
            return Err(crate::Error::Shape(format!(
                "{} values do not fill a tensor of shape {shape}",
                data.len()
            )));
        }
        let lease = self.lease((data.len() * dtype.size()) as u64, category)?;
        Ok(Tensor::from_buffer(
            shape,
            self.backend().upload(data, dtype)?,
            lease,
        ))
    }
}
