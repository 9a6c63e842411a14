//! The CUDA backend: f32, bf16 and f16 tensors in device memory, the handwritten kernels of
//! `cuda/*.cu` (compiled at run time by NVRTC to the device's machine code and cached on
//! disk), cuBLAS for linear layers, and cuDNN for convolutions when asked ([`ConvImpl::Cudnn`],
//! [`cudnn`]).
//!
//! Mixed precision: activations and their gradients may be bf16 or f16
//! (`Storage::Cuda16`, their bits in a `CudaSlice<u16>`); every kernel is stamped `op_f32`,
//! `op_bf16`, `op_f16` and the stamp is picked by the activation storage's dtype (`Ty`).
//! Parameters, their gradients, optimizer state, batch statistics, softmax probabilities and
//! workspace stay f32 in every stamp. Convolutions of bf16/f16 tensors run on the matching
//! tensor cores whatever the precision; f32 tensors run f32 or tf32 kernels as the precision
//! says. Linear layers widen 16-bit operands into f32 workspace, multiply in f32 (cuBLAS SGEMM)
//! and round the output once, as the CPU reference computes them. cuDNN runs f32 only.
//!
//! Everything runs in order on one stream per device. Device memory comes from the driver's
//! stream-ordered pool with its release threshold raised to the maximum, so freed blocks stay
//! cached for the next step instead of going back to the driver; the engine's [`Allocator`]
//! accounts every byte against the device's capacity before the pool is asked. Small scratch
//! buffers a kernel needs (BN's per-channel sums, the loss's labels) are leased as workspace.
//!
//! The libraries are loaded at run time, so the same binary runs without a GPU: without a
//! usable driver, [`Cuda::new`] returns an error saying what is missing ([`libs`] finds them).

pub mod cudnn;
pub mod kernels;
pub mod libs;
#[rustfmt::skip]
#[allow(non_camel_case_types, non_snake_case, non_upper_case_globals, clippy::all)]
// Generated from include/gems_kernels.h field for field (tests/cuda_kernels.rs checks it).
#[allow(missing_docs)]
pub mod params;

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::{self, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    self, sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut,
    DeviceRepr, LaunchConfig, PushKernelArg,
};

use super::{
    AdamStep, Backend, ChannelGeom, ConvGeom, Event, GroupGeom, LossGeom, MaskGeom, Nonlinearity,
    PoolGeom, ResizeGeom, SgdStep, POISON,
};
use crate::backend::host::{Block, HostPool};
use crate::backend::Storage;
use crate::core::{DType, Precision};
use crate::memory::{Allocator, Category, Lease};
use crate::{Error, Result};

// SAFETY: the parameter structs are plain C structs (bindgen's #[repr(C)] output), passed to
// kernels by value exactly as declared in include/gems_kernels.h.
unsafe impl DeviceRepr for params::GemsConvGeom {}
unsafe impl DeviceRepr for params::GemsPoolGeom {}
unsafe impl DeviceRepr for params::GemsChannelGeom {}
unsafe impl DeviceRepr for params::GemsBatchNorm {}
unsafe impl DeviceRepr for params::GemsBnRunning {}
unsafe impl DeviceRepr for params::GemsGroupNorm {}
unsafe impl DeviceRepr for params::GemsSgdStep {}
unsafe impl DeviceRepr for params::GemsAdamStep {}
unsafe impl DeviceRepr for params::GemsDropout {}
unsafe impl DeviceRepr for params::GemsLoss {}
unsafe impl DeviceRepr for params::GemsCopyChannels {}
unsafe impl DeviceRepr for params::GemsResizeGeom {}

/// Which kernels run convolutions on a GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ConvImpl {
    /// The handwritten implicit-GEMM kernels of cuda/conv.cu.
    #[default]
    Native,
    /// cuDNN 9, its algorithms chosen by timing them once per shape.
    Cudnn,
    /// cuDNN 9 with deterministic algorithms only (no atomic adds): results bit-identical run
    /// after run, as PyTorch's `cudnn.deterministic`, at some speed on small shapes.
    CudnnDeterministic,
}

impl ConvImpl {
    /// Whether convolutions go through cuDNN.
    pub fn is_cudnn(self) -> bool {
        self != ConvImpl::Native
    }
}

impl std::str::FromStr for ConvImpl {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "native" => Ok(ConvImpl::Native),
            "cudnn" => Ok(ConvImpl::Cudnn),
            "cudnn-deterministic" => Ok(ConvImpl::CudnnDeterministic),
            _ => Err(format!(
                "unknown convolution path '{s}' (native, cudnn, cudnn-deterministic)"
            )),
        }
    }
}

impl std::fmt::Display for ConvImpl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ConvImpl::Native => "native",
            ConvImpl::Cudnn => "cudnn",
            ConvImpl::CudnnDeterministic => "cudnn-deterministic",
        })
    }
}

/// What `gems info` reports of one GPU.
#[derive(Clone, Debug)]
pub struct GpuInfo {
    /// The driver's index of the GPU.
    pub ordinal: usize,
    /// Its name (`NVIDIA H100 80GB HBM3`).
    pub name: String,
    /// (major, minor) compute capability.
    pub compute_capability: (i32, i32),
    /// Streaming multiprocessors.
    pub multiprocessors: i32,
    /// Device memory in bytes.
    pub total_memory: u64,
    /// Device memory free when asked, in bytes.
    pub free_memory: u64,
    /// The SM clock's peak in kHz, the memory clock's peak in kHz and the memory bus's width
    /// in bits, as the driver reports them (`None` where it reports none).
    pub clocks: Option<(i32, i32, i32)>,
}

impl GpuInfo {
    /// The card's peak f32 arithmetic (FMA on the CUDA cores, not the tensor cores) in FLOP/s:
    /// multiprocessors × f32 lanes per multiprocessor × 2 × the SM clock.
    pub fn peak_fp32_flops(&self) -> Option<f64> {
        let lanes = match self.compute_capability {
            (6, 0) | (7, _) | (8, 0) => 64.0,
            (6, _) | (8, _) | (9, _) | (10.., _) => 128.0,
            _ => return None,
        };
        let (sm_khz, _, _) = self.clocks?;
        Some(f64::from(self.multiprocessors) * lanes * 2.0 * f64::from(sm_khz) * 1e3)
    }

    /// The card's peak memory bandwidth in bytes/s: two transfers per memory clock over the
    /// bus.
    pub fn peak_bandwidth(&self) -> Option<f64> {
        let (_, mem_khz, bus_bits) = self.clocks?;
        Some(2.0 * f64::from(mem_khz) * 1e3 * f64::from(bus_bits) / 8.0)
    }
}

fn driver_error(e: driver::DriverError) -> Error {
    Error::Device(format!("CUDA driver: {e}"))
}

fn blas_error(e: cublas::result::CublasError) -> Error {
    Error::Device(format!("cuBLAS: {e:?}"))
}

/// The driver, initialised; an error naming what is missing otherwise.
fn driver() -> Result<()> {
    let lib = libs::get("driver");
    // SAFETY: only tries to open the library under cudarc's candidate names.
    if !unsafe { sys::is_culib_present() } {
        let why = lib
            .and_then(|l| l.problem.clone())
            .unwrap_or_else(|| "libcuda.so.1 not found".into());
        return Err(Error::Device(format!(
            "no usable CUDA driver: {why}. Install the NVIDIA driver, or name the folder \
             holding libcuda.so.1 in GEMS_CUDA_LIB_DIRS"
        )));
    }
    Ok(())
}

/// How many GPUs the driver sees (an error when there is no driver).
pub fn device_count() -> Result<usize> {
    libs::load();
    driver()?;
    let n = CudaContext::device_count().map_err(driver_error)?;
    Ok(n.max(0) as usize)
}

/// Every GPU the driver sees.
pub fn devices() -> Result<Vec<GpuInfo>> {
    (0..device_count()?)
        .map(|ordinal| {
            let ctx = CudaContext::new(ordinal).map_err(driver_error)?;
            let (free, total) = ctx.mem_get_info().map_err(driver_error)?;
            Ok(GpuInfo {
                ordinal,
                name: ctx.name().map_err(driver_error)?,
                compute_capability: ctx.compute_capability().map_err(driver_error)?,
                multiprocessors: ctx
                    .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                    .map_err(driver_error)?,
                total_memory: total as u64,
                free_memory: free as u64,
                clocks: {
                    use sys::CUdevice_attribute::*;
                    let a = |which| ctx.attribute(which).ok().filter(|&v| v > 0);
                    a(CU_DEVICE_ATTRIBUTE_CLOCK_RATE)
                        .zip(a(CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE))
                        .zip(a(CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH))
                        .map(|((sm, mem), bus)| (sm, mem, bus))
                },
            })
        })
        .collect()
}

/// What the kernels are compiled to for a GPU of compute capability `cc`
/// ([`kernels::target_for`] with the architectures the loaded NVRTC knows).
fn target_for(cc: (i32, i32)) -> Result<kernels::Target> {
    let known = kernels::known_archs().map_err(|e| Error::Device(e.to_string()))?;
    kernels::target_for(cc, &known).map_err(Error::Device)
}

/// Why `--conv cudnn` refuses bf16 and f16 activations.
pub const CUDNN_16BIT: &str =
    "cuDNN's convolutions run fp32/tf32; use the native kernels with bf16/fp16 activations";

/// Refuses what the GPU backend cannot run together: cuDNN's convolutions with 16-bit
/// activations (`--precision bf16|fp16`). Needs no GPU, so a run can check it first.
pub fn check_conv(precision: Precision, conv: ConvImpl) -> Result<()> {
    match (conv, precision) {
        (ConvImpl::Cudnn | ConvImpl::CudnnDeterministic, Precision::Bf16 | Precision::Fp16) => {
            Err(Error::Config(CUDNN_16BIT.into()))
        }
        _ => Ok(()),
    }
}

/// Bytes of device memory left to the CUDA libraries' own allocations (cuBLAS workspace,
/// loaded modules) when the capacity is the free memory.
pub const RESERVE: u64 = 512 << 20;

/// What a GPU with `free` bytes free offers the engine: the free memory less [`RESERVE`], or
/// `limit` where that is smaller.
pub fn capacity(free: u64, limit: Option<u64>) -> u64 {
    let usable = free.saturating_sub(RESERVE);
    limit.map_or(usable, |l| l.min(usable))
}

/// One GPU: its context, the stream everything runs on, the loaded kernels and cuBLAS.
pub struct Cuda {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Host-tier copies that overlap compute (offload modes async and pinned-async).
    copy_stream: Arc<CudaStream>,
    functions: HashMap<String, CudaFunction>,
    blas: CudaBlas,
    /// Where scratch buffers are leased (the device's allocator).
    allocator: Arc<Allocator>,
    precision: Precision,
    multiprocessors: u32,
    /// What the kernels were compiled to.
    target: kernels::Target,
    /// cuDNN, where it runs the convolutions (`--conv cudnn`).
    cudnn: Option<cudnn::Cudnn>,
}

impl Cuda {
    /// Opens GPU `ordinal`, compiles (or loads from the cache) every kernel for its
    /// architecture, opens cuDNN when `conv` asks for it, and returns the backend and the
    /// device's free memory in bytes.
    pub fn new(
        ordinal: usize,
        precision: Precision,
        conv: ConvImpl,
        allocator: Arc<Allocator>,
    ) -> Result<(Cuda, u64)> {
        check_conv(precision, conv)?;
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::Device(format!(
                "no CUDA device {ordinal}: the driver sees {count}"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(driver_error)?;
        // One stream per device orders all work, so cudarc's per-buffer events are not needed.
        // SAFETY: nothing has been allocated on this context through cudarc yet.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(driver_error)?;
        let copy_stream = ctx.new_stream().map_err(driver_error)?;
        keep_freed_memory_cached(&ctx)?;
        let target = target_for(ctx.compute_capability().map_err(driver_error)?)?;
        let mut functions = HashMap::new();
        for (family, _) in kernels::SOURCES {
            let compiled =
                kernels::module(family, target).map_err(|e| Error::Device(e.to_string()))?;
            let module = ctx.load_module(compiled.image()).map_err(driver_error)?;
            for entry in compiled.entries() {
                let f = module.load_function(&entry).map_err(driver_error)?;
                functions.insert(entry, f);
            }
        }
        // cudarc panics on a library it cannot open: say what is missing first.
        if let Some(libs::Library {
            path: None,
            problem,
            ..
        }) = libs::get("cublas")
        {
            return Err(Error::Device(format!(
                "cuBLAS not found: {}",
                problem.as_deref().unwrap_or_default()
            )));
        }
        let blas = CudaBlas::new(stream.clone()).map_err(blas_error)?;
        let math = match precision {
            // bf16 and fp16 runs multiply their f32 tensors (linear layers) in fp32.
            Precision::Fp32 | Precision::Bf16 | Precision::Fp16 => {
                cublas::sys::cublasMath_t::CUBLAS_DEFAULT_MATH
            }
            Precision::Tf32 => cublas::sys::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH,
        };
        // SAFETY: the handle is live; the mode is a valid enumerator.
        unsafe { cublas::sys::cublasSetMathMode(*blas.handle(), math) }
            .result()
            .map_err(blas_error)?;
        let multiprocessors = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(driver_error)? as u32;
        let cudnn = match conv {
            ConvImpl::Native => None,
            ConvImpl::Cudnn | ConvImpl::CudnnDeterministic => Some(cudnn::Cudnn::new(
                stream.clone(),
                precision,
                conv == ConvImpl::CudnnDeterministic,
                Arc::clone(&allocator),
            )?),
        };
        let (free, _) = ctx.mem_get_info().map_err(driver_error)?;
        Ok((
            Cuda {
                ctx,
                stream,
                copy_stream,
                functions,
                blas,
                allocator,
                precision,
                multiprocessors,
                target,
                cudnn,
            },
            free as u64,
        ))
    }

    fn function(&self, name: &str) -> Result<&CudaFunction> {
        self.functions
            .get(name)
            .ok_or_else(|| Error::Internal(format!("no kernel {name} in cuda/*.cu")))
    }

    /// 1-d grid-stride launch over `numel` elements: 256 threads a block, at most 32 blocks
    /// per multiprocessor (any grid covers every element).
    fn grid_1d(&self, numel: usize) -> LaunchConfig {
        let blocks = numel
            .div_ceil(256)
            .clamp(1, 32 * self.multiprocessors as usize);
        LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// One block of `threads` per item (channel, row, plane).
    fn per_item(items: usize, threads: u32) -> Result<LaunchConfig> {
        Ok(LaunchConfig {
            grid_dim: (dim32(items, "grid")? as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        })
    }

    /// `numel` f32 of scratch, leased as workspace for as long as the lease is held.
    fn scratch<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        numel: usize,
    ) -> Result<(CudaSlice<T>, Lease)> {
        let lease = self.allocator.lease(
            (numel * std::mem::size_of::<T>()) as u64,
            Category::Workspace,
        )?;
        Ok((alloc_zeros(&self.stream, numel)?, lease))
    }

    /// The convolution kernel of `pass` for activations of type `t`: f32 tensors run the
    /// f32 (CUDA cores) or tf32 (tensor cores) stamp as the precision says; bf16 and f16
    /// tensors run their own stamp (bf16 or f16 tensor cores) whatever the precision.
    fn conv_kernel(&self, pass: &str, t: Ty) -> String {
        let suffix = match (t.0, self.precision) {
            (DType::F32, Precision::Tf32) => "tf32",
            (d, _) => d.name(),
        };
        format!("conv2d_{pass}_{suffix}")
    }

    /// The device's name, architecture, precision and convolution path, for reports.
    pub fn describe(&self) -> String {
        let conv = match &self.cudnn {
            Some(c) => format!("{} convolutions", c.describe()),
            None => "native convolutions".into(),
        };
        format!(
            "cuda:{} {} ({}, {} SMs, {}, {conv})",
            self.ctx.ordinal(),
            self.ctx.name().unwrap_or_else(|_| "GPU".into()),
            self.target,
            self.multiprocessors,
            self.precision
        )
    }
}

/// Splits of the long K of backward-filter (every output pixel of the batch), so that enough
/// blocks run to fill `multiprocessors`; each split writes its own partial sums.
fn filter_splits(g: &ConvGeom, multiprocessors: u32) -> usize {
    let (m, n, k) = (g.c_out / g.groups, g.col_rows(), g.n * g.h_out * g.w_out);
    let tiles = m.div_ceil(64) * n.div_ceil(64) * g.groups;
    let wanted = (4 * multiprocessors as usize).div_ceil(tiles.max(1));
    // At least 8 K-steps of 16 per split, and gridDim.z = groups · splits < 65536.
    let most = (k.div_ceil(16) / 8)
        .clamp(1, 256)
        .min(65535 / g.groups.max(1));
    wanted.clamp(1, most.max(1))
}

/// Workspace elements of the native kernels' convolutions of `g` on a GPU of
/// `multiprocessors`: backward-filter's partial sums.
pub fn native_conv_workspace(g: &ConvGeom, multiprocessors: u32) -> usize {
    filter_splits(g, multiprocessors) * g.c_out * g.col_rows()
}

/// Raises the release threshold of the device's default memory pool to the maximum: memory
/// freed in one step is kept for the next instead of being handed back to the driver.
fn keep_freed_memory_cached(ctx: &Arc<CudaContext>) -> Result<()> {
    ctx.bind_to_thread().map_err(driver_error)?;
    if !ctx.has_async_alloc() {
        return Ok(());
    }
    let mut pool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    // SAFETY: the pool handle is written by the driver; the attribute takes a u64.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
            .result()
            .map_err(driver_error)?;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
        .result()
        .map_err(driver_error)?;
    }
    Ok(())
}

fn alloc_zeros<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    numel: usize,
) -> Result<CudaSlice<T>> {
    if numel == 0 {
        return stream.null().map_err(driver_error);
    }
    stream.alloc_zeros(numel).map_err(driver_error)
}

/// `numel` elements left as the device memory held them, for [`Backend::empty`].
fn alloc_unfilled<T: DeviceRepr>(stream: &Arc<CudaStream>, numel: usize) -> Result<CudaSlice<T>> {
    if numel == 0 {
        return stream.null().map_err(driver_error);
    }
    // SAFETY: the memory is unset; its caller overwrites every element before reading it.
    unsafe { stream.alloc(numel) }.map_err(driver_error)
}

/// The elements of `s`, copied to the host (waits for the work queued before).
pub fn download<T: DeviceRepr + Default + Clone + Unpin>(s: &CudaSlice<T>) -> Result<Vec<T>> {
    if s.is_empty() {
        return Ok(Vec::new());
    }
    s.stream().clone_dtoh(s).map_err(driver_error)
}

/// A device copy of `s`, on its stream.
pub fn duplicate<T: DeviceRepr>(s: &CudaSlice<T>) -> Result<CudaSlice<T>> {
    if s.is_empty() {
        return s.stream().null().map_err(driver_error);
    }
    s.stream().clone_dtod(s).map_err(driver_error)
}

/// The device address of bytes `offset..offset + len` of device storage `s`, and `len`
/// (an error for host storage or a range outside it).
fn device_range(s: &Storage, offset: usize, len: usize) -> Result<(sys::CUdeviceptr, usize)> {
    let base = s.device_address().ok_or_else(|| not_on_device(s))?;
    let size = s.len() * s.dtype().size();
    if offset.checked_add(len).is_none_or(|end| end > size) {
        return Err(Error::Internal(format!(
            "bytes {offset}..{} of a device buffer of {size}",
            offset.saturating_add(len)
        )));
    }
    Ok((base + offset as u64, len))
}

fn dev(s: &Storage) -> Result<&CudaSlice<f32>> {
    match s {
        Storage::CudaF32(v) => Ok(v),
        other => Err(not_on_device(other)),
    }
}

fn dev_mut(s: &mut Storage) -> Result<&mut CudaSlice<f32>> {
    match s {
        Storage::CudaF32(v) => Ok(v),
        other => Err(not_on_device(other)),
    }
}

/// cuDNN runs f32 tensors only (its convolutions take one type for x, w and y, and the
/// weights stay f32): a clear error for bf16 or f16 activations.
fn cudnn_types(tensors: &[&Storage]) -> Result<()> {
    match tensors.iter().find(|s| s.dtype() != DType::F32) {
        Some(s) => Err(Error::Config(format!(
            "{CUDNN_16BIT} (got {} tensors)",
            s.dtype().name()
        ))),
        None => Ok(()),
    }
}

/// A copy between storages of different element types is a bug in the caller.
fn same_dtype(src: &Storage, dst: &Storage) -> Result<()> {
    if src.dtype() != dst.dtype() {
        return Err(Error::Internal(format!(
            "a copy of {} elements into {} storage",
            src.dtype().name(),
            dst.dtype().name()
        )));
    }
    Ok(())
}

/// The activation type of a launch: which stamp of a kernel runs (`op_f32`, `op_bf16`,
/// `op_f16`) and the storage its `T*` arguments must have. Parameters, statistics and
/// workspace are f32 in every stamp and pass through [`dev`] as before.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Ty(DType);

impl Ty {
    /// The element type of activation storage `s`: f32, bf16 or f16 in device memory.
    fn of(s: &Storage) -> Result<Ty> {
        match s {
            Storage::CudaF32(_) | Storage::Cuda16(..) => Ok(Ty(s.dtype())),
            other => Err(not_on_device(other)),
        }
    }

    /// The stamp of `op` for this type: `op_f32`, `op_bf16` or `op_f16`.
    fn kernel(self, op: &str) -> String {
        format!("{op}_{}", self.0.name())
    }

    /// `s` as a `const T*` argument; an error unless it holds this type.
    fn arg(self, s: &Storage) -> Result<Act<'_>> {
        match s {
            Storage::CudaF32(v) if self.0 == DType::F32 => Ok(Act::F32(v)),
            Storage::Cuda16(d, v) if *d == self.0 => Ok(Act::Half(v)),
            other => Err(self.mismatch(other)),
        }
    }

    /// `s` as a `T*` argument the kernel writes; an error unless it holds this type.
    fn arg_mut(self, s: &mut Storage) -> Result<ActMut<'_>> {
        if s.dtype() != self.0 {
            return Err(self.mismatch(s));
        }
        match s {
            Storage::CudaF32(v) => Ok(ActMut::F32(v)),
            Storage::Cuda16(_, v) => Ok(ActMut::Half(v)),
            other => Err(self.mismatch(other)),
        }
    }

    fn mismatch(self, s: &Storage) -> Error {
        match s {
            Storage::CudaF32(_) | Storage::Cuda16(..) => Error::Internal(format!(
                "a {} kernel got {} elements for one of its {} tensors",
                self.0.name(),
                s.dtype().name(),
                self.0.name()
            )),
            other => not_on_device(other),
        }
    }
}

/// An activation tensor passed to a kernel's `const T*`: f32 elements, or bf16/f16 ones as
/// the u16 slice of their bits. The kernels' gems_bf16 and gems_f16 are 2-byte structs of
/// one `unsigned short`, so a pointer to the u16 elements is a pointer to T.
#[derive(Clone, Copy)]
enum Act<'a> {
    F32(&'a CudaSlice<f32>),
    Half(&'a CudaSlice<u16>),
}

/// An activation tensor passed to a kernel's `T*` (written).
enum ActMut<'a> {
    F32(&'a mut CudaSlice<f32>),
    Half(&'a mut CudaSlice<u16>),
}

// SAFETY: each pushes the slice's device pointer exactly as cudarc's own impls for
// `&CudaSlice<T>` and `&mut CudaSlice<T>` do (they are what runs); the kernel's parameter is
// a pointer to the elements' type (see `Act`).
unsafe impl<'a, 'b: 'a> PushKernelArg<Act<'b>> for driver::LaunchArgs<'a> {
    fn arg(&mut self, arg: Act<'b>) -> &mut Self {
        match arg {
            Act::F32(s) => self.arg(s),
            Act::Half(s) => self.arg(s),
        }
    }
}

// SAFETY: as for `Act`.
unsafe impl<'a, 'b: 'a> PushKernelArg<ActMut<'b>> for driver::LaunchArgs<'a> {
    fn arg(&mut self, arg: ActMut<'b>) -> &mut Self {
        match arg {
            ActMut::F32(s) => self.arg(s),
            ActMut::Half(s) => self.arg(s),
        }
    }
}

fn not_on_device(s: &Storage) -> Error {
    Error::Internal(format!(
        "the CUDA backend got {} elements that are not in device memory",
        s.dtype().name()
    ))
}

/// A dimension as the kernels' 32-bit int.
fn dim32(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| {
        Error::Config(format!(
            "{what} of {v} exceeds the CUDA kernels' 32-bit dimensions"
        ))
    })
}

fn conv_params(g: &ConvGeom) -> Result<params::GemsConvGeom> {
    Ok(params::GemsConvGeom {
        n: dim32(g.n, "batch")?,
        c_in: dim32(g.c_in, "channels")?,
        h: dim32(g.h, "height")?,
        w: dim32(g.w, "width")?,
        c_out: dim32(g.c_out, "channels")?,
        kh: dim32(g.kh, "kernel")?,
        kw: dim32(g.kw, "kernel")?,
        stride_h: dim32(g.stride.0, "stride")?,
        stride_w: dim32(g.stride.1, "stride")?,
        pad_h: dim32(g.pad.0, "padding")?,
        pad_w: dim32(g.pad.1, "padding")?,
        dilation_h: dim32(g.dilation.0, "dilation")?,
        dilation_w: dim32(g.dilation.1, "dilation")?,
        groups: dim32(g.groups, "groups")?,
        h_out: dim32(g.h_out, "height")?,
        w_out: dim32(g.w_out, "width")?,
    })
}

/// The resize kernels' parameters for `g`, whose windows are checked.
fn resize_params(g: &ResizeGeom) -> Result<params::GemsResizeGeom> {
    g.check()?;
    let (i, o) = (&g.input, &g.output);
    Ok(params::GemsResizeGeom {
        n: dim32(g.n, "batch")?,
        c: dim32(g.c, "channels")?,
        h: dim32(g.h, "height")?,
        w: dim32(g.w, "width")?,
        h_out: dim32(g.h_out, "height")?,
        w_out: dim32(g.w_out, "width")?,
        align_corners: g.align_corners as i32,
        in_row: dim32(i.row, "row")?,
        in_col: dim32(i.col, "column")?,
        in_h: dim32(i.h, "height")?,
        in_w: dim32(i.w, "width")?,
        out_row: dim32(o.row, "row")?,
        out_col: dim32(o.col, "column")?,
        out_h: dim32(o.h, "height")?,
        out_w: dim32(o.w, "width")?,
    })
}

fn pool_params(g: &PoolGeom) -> Result<params::GemsPoolGeom> {
    Ok(params::GemsPoolGeom {
        n: dim32(g.n, "batch")?,
        c: dim32(g.c, "channels")?,
        h: dim32(g.h, "height")?,
        w: dim32(g.w, "width")?,
        kh: dim32(g.kh, "kernel")?,
        kw: dim32(g.kw, "kernel")?,
        stride_h: dim32(g.stride.0, "stride")?,
        stride_w: dim32(g.stride.1, "stride")?,
        pad_h: dim32(g.pad.0, "padding")?,
        pad_w: dim32(g.pad.1, "padding")?,
        h_out: dim32(g.h_out, "height")?,
        w_out: dim32(g.w_out, "width")?,
    })
}

fn bn_params(eps: f64, g: &ChannelGeom) -> Result<params::GemsBatchNorm> {
    Ok(params::GemsBatchNorm {
        geom: channel_params(g)?,
        eps,
    })
}

fn group_params(eps: f64, g: &GroupGeom) -> Result<params::GemsGroupNorm> {
    Ok(params::GemsGroupNorm {
        n: dim32(g.n, "batch")?,
        c: dim32(g.c, "channels")?,
        groups: dim32(g.groups, "groups")?,
        hw: dim32(g.hw, "plane")?,
        eps,
    })
}

fn channel_params(g: &ChannelGeom) -> Result<params::GemsChannelGeom> {
    Ok(params::GemsChannelGeom {
        n: dim32(g.n, "batch")?,
        c: dim32(g.c, "channels")?,
        hw: dim32(g.hw, "plane")?,
    })
}

/// A (ceil(N / 64), ceil(M / 64), z) grid of 256-thread blocks: the conv kernels' tiling.
fn conv_grid(m: usize, n: usize, z: usize) -> Result<LaunchConfig> {
    let (gx, gy) = (n.div_ceil(64), m.div_ceil(64));
    if gy > 65535 || z > 65535 || gx > i32::MAX as usize {
        return Err(Error::Config(format!(
            "a convolution of {m} x {n} outputs in {z} groups is too large for one launch"
        )));
    }
    Ok(LaunchConfig {
        grid_dim: (gx as u32, gy as u32, z as u32),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Launches kernel `$name` with `$cfg` and the arguments in order.
macro_rules! launch {
    ($self:ident, $name:expr, $cfg:expr; $($arg:expr),* $(,)?) => {{
        let f = $self.function(&$name)?;
        let mut builder = $self.stream.launch_builder(f);
        $( builder.arg($arg); )*
        // SAFETY: the arguments match the kernel's parameters in cuda/*.cu in number, type
        // and order, and every buffer holds as many elements as the geometry says (the ops
        // allocate them from the same shapes).
        unsafe { builder.launch($cfg) }.map(drop).map_err(driver_error)
    }};
}

impl Backend for Cuda {
    fn name(&self) -> String {
        self.describe()
    }

    fn zeros(&self, numel: usize, dtype: DType) -> Result<Storage> {
        match dtype {
            DType::F32 => Ok(Storage::CudaF32(alloc_zeros(&self.stream, numel)?)),
            DType::BF16 | DType::F16 => {
                Ok(Storage::Cuda16(dtype, alloc_zeros(&self.stream, numel)?))
            }
            DType::F64 => Err(unsupported(dtype)),
        }
    }

    fn empty(&self, numel: usize, dtype: DType) -> Result<Storage> {
        if POISON {
            let mut s = self.zeros(numel, dtype)?;
            if numel > 0 {
                self.fill(&mut s, f64::NAN)?;
            }
            return Ok(s);
        }
        match dtype {
            DType::F32 => Ok(Storage::CudaF32(alloc_unfilled(&self.stream, numel)?)),
            DType::BF16 | DType::F16 => {
                Ok(Storage::Cuda16(dtype, alloc_unfilled(&self.stream, numel)?))
            }
            DType::F64 => Err(unsupported(dtype)),
        }
    }

    fn upload(&self, data: &[f64], dtype: DType) -> Result<Storage> {
        // Rounded once from f64, as the CPU backend's upload.
        match dtype {
            DType::F32 => self.adopt(Storage::F32(data.iter().map(|&x| x as f32).collect())),
            DType::BF16 => self.adopt(Storage::BF16(
                data.iter().map(|&x| half::bf16::from_f64(x)).collect(),
            )),
            DType::F16 => self.adopt(Storage::F16(
                data.iter().map(|&x| half::f16::from_f64(x)).collect(),
            )),
            DType::F64 => Err(unsupported(dtype)),
        }
    }

    fn adopt(&self, s: Storage) -> Result<Storage> {
        match s {
            Storage::F32(v) => Ok(Storage::CudaF32(self.to_device(&v)?)),
            // bf16 and f16 travel as their bits (half's types are plain u16 underneath).
            Storage::BF16(v) => Ok(Storage::Cuda16(
                DType::BF16,
                self.to_device::<u16>(bytemuck::cast_slice(&v))?,
            )),
            Storage::F16(v) => Ok(Storage::Cuda16(
                DType::F16,
                self.to_device::<u16>(bytemuck::cast_slice(&v))?,
            )),
            Storage::CudaF32(v) => Ok(Storage::CudaF32(self.onto_stream(v)?)),
            Storage::Cuda16(d, v) => Ok(Storage::Cuda16(d, self.onto_stream(v)?)),
            other => Err(unsupported(other.dtype())),
        }
    }

    fn host_zeros(
        &self,
        numel: usize,
        dtype: DType,
        pool: Option<&Arc<HostPool>>,
    ) -> Result<Storage> {
        match (dtype, pool) {
            (DType::F64, _) => Err(unsupported(dtype)),
            (DType::F32, None) => Ok(Storage::F32(vec![0.0; numel])),
            (DType::BF16, None) => Ok(Storage::BF16(vec![half::bf16::ZERO; numel])),
            (DType::F16, None) => Ok(Storage::F16(vec![half::f16::ZERO; numel])),
            // The block is sized by the dtype's bytes and carries the dtype.
            (_, Some(p)) => Ok(Storage::Host(p.take(numel, dtype, |bytes| {
                if bytes == 0 {
                    return Ok(Block::Pageable(Vec::new()));
                }
                // SAFETY: a plain page-locked allocation of `bytes` bytes (no flags: the host
                // reads these back in checks, which write-combined memory makes slow).
                unsafe { self.ctx.alloc_pinned_with_flags::<u8>(bytes, 0) }
                    .map(Block::Pinned)
                    .map_err(driver_error)
            })?)),
        }
    }

    fn copy_out(
        &self,
        src: &Storage,
        dst: &mut Storage,
        on_copy_stream: bool,
    ) -> Result<Option<Event>> {
        same_dtype(src, dst)?;
        let dst = dst.host_bytes_mut()?;
        match src {
            Storage::CudaF32(s) => self.download_into(s, dst, on_copy_stream),
            Storage::Cuda16(_, s) => self.download_into(s, dst, on_copy_stream),
            other => Err(not_on_device(other)),
        }
    }

    fn copy_in(
        &self,
        src: &Storage,
        dst: &mut Storage,
        on_copy_stream: bool,
    ) -> Result<Option<Event>> {
        same_dtype(src, dst)?;
        let src = src.host_bytes()?;
        match dst {
            Storage::CudaF32(d) => self.upload_into(src, d, on_copy_stream),
            Storage::Cuda16(_, d) => self.upload_into(src, d, on_copy_stream),
            other => Err(not_on_device(other)),
        }
    }

    fn copy_out_bytes(&self, src: &Storage, offset: usize, dst: &mut [u8]) -> Result<Event> {
        let (ptr, bytes) = device_range(src, offset, dst.len())?;
        let stream = self.copy_stream_for(true)?;
        if bytes > 0 {
            // SAFETY: the range lies inside `src` (device_range); the caller keeps `src` and
            // `dst` alive until the returned event.
            unsafe { driver::result::memcpy_dtoh_async(dst, ptr, stream.cu_stream()) }
                .map_err(driver_error)?;
        }
        self.copy_done(true)?
            .ok_or_else(|| Error::Internal("a copy on the copy stream recorded no event".into()))
    }

    fn copy_in_bytes(&self, src: &[u8], dst: &mut Storage, offset: usize) -> Result<Event> {
        let (ptr, bytes) = device_range(dst, offset, src.len())?;
        let stream = self.copy_stream_for(true)?;
        if bytes > 0 {
            // SAFETY: as in copy_out_bytes, the other way.
            unsafe { driver::result::memcpy_htod_async(ptr, src, stream.cu_stream()) }
                .map_err(driver_error)?;
        }
        self.copy_done(true)?
            .ok_or_else(|| Error::Internal("a copy on the copy stream recorded no event".into()))
    }

    fn wait(&self, event: &Event) -> Result<()> {
        self.stream.wait(&event.0).map_err(driver_error)
    }

    fn copy(&self, src: &Storage, dst: &mut Storage) -> Result<()> {
        same_dtype(src, dst)?;
        if src.len() != dst.len() {
            return Err(Error::Internal(format!(
                "a copy of {} elements into {}",
                src.len(),
                dst.len()
            )));
        }
        if src.is_empty() {
            return Ok(());
        }
        match (src, dst) {
            (Storage::CudaF32(s), Storage::CudaF32(d)) => self.stream.memcpy_dtod(s, d),
            (Storage::Cuda16(_, s), Storage::Cuda16(_, d)) => self.stream.memcpy_dtod(s, d),
            (Storage::CudaF32(_) | Storage::Cuda16(..), other) => return Err(not_on_device(other)),
            (other, _) => return Err(not_on_device(other)),
        }
        .map_err(driver_error)
    }

    fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(driver_error)
    }

    fn conv2d_workspace(&self, g: &ConvGeom) -> usize {
        match &self.cudnn {
            Some(c) => c.workspace(g),
            None => native_conv_workspace(g, self.multiprocessors),
        }
    }

    fn conv_algorithms(&self) -> Vec<String> {
        self.cudnn
            .as_ref()
            .map(|c| c.algorithms())
            .unwrap_or_default()
    }

    fn conv2d_forward(
        &self,
        x: &Storage,
        w: &Storage,
        y: &mut Storage,
        ws: &mut Storage,
        g: &ConvGeom,
    ) -> Result<()> {
        if let Some(c) = &self.cudnn {
            cudnn_types(&[x, &*y])?;
            return c.forward(dev(x)?, dev(w)?, dev_mut(y)?, dev_mut(ws)?, g);
        }
        let t = Ty::of(x)?;
        let p = conv_params(g)?;
        let cfg = conv_grid(g.c_out / g.groups, g.n * g.h_out * g.w_out, g.groups)?;
        launch!(self, self.conv_kernel("forward", t), cfg;
            t.arg(x)?, dev(w)?, t.arg_mut(y)?, &p)
    }

    fn conv2d_backward_data(
        &self,
        dy: &Storage,
        w: &Storage,
        dx: &mut Storage,
        ws: &mut Storage,
        g: &ConvGeom,
    ) -> Result<()> {
        if let Some(c) = &self.cudnn {
            cudnn_types(&[dy, &*dx])?;
            return c.backward_data(dev(dy)?, dev(w)?, dev_mut(dx)?, dev_mut(ws)?, g);
        }
        let t = Ty::of(dy)?;
        let p = conv_params(g)?;
        let cfg = conv_grid(g.c_in / g.groups, g.n * g.h * g.w, g.groups)?;
        launch!(self, self.conv_kernel("backward_data", t), cfg;
            t.arg(dy)?, dev(w)?, t.arg_mut(dx)?, &p)
    }

    fn conv2d_backward_filter(
        &self,
        x: &Storage,
        dy: &Storage,
        dw: &mut Storage,
        ws: &mut Storage,
        g: &ConvGeom,
    ) -> Result<()> {
        if let Some(c) = &self.cudnn {
            cudnn_types(&[x, dy])?;
            return c.backward_filter(dev(x)?, dev(dy)?, dev_mut(dw)?, dev_mut(ws)?, g);
        }
        let t = Ty::of(x)?;
        let p = conv_params(g)?;
        let splits = filter_splits(g, self.multiprocessors);
        let numel = g.c_out * g.col_rows();
        let partial = dev_mut(ws)?;
        if partial.len() < splits * numel {
            return Err(Error::Internal(format!(
                "backward-filter workspace of {} elements, {} needed",
                partial.len(),
                splits * numel
            )));
        }
        let cfg = conv_grid(g.c_out / g.groups, g.col_rows(), g.groups * splits)?;
        launch!(self, self.conv_kernel("backward_filter", t), cfg;
            t.arg(x)?, t.arg(dy)?, &mut *partial, &p)?;
        let (numel64, splits32) = (numel as i64, splits as i32);
        launch!(self, "conv2d_reduce_splits_f32", self.grid_1d(numel);
            &*partial, dev_mut(dw)?, &numel64, &splits32)
    }

    fn add_channel_bias(&self, y: &mut Storage, bias: &Storage, g: &ChannelGeom) -> Result<()> {
        let (t, p) = (Ty::of(y)?, channel_params(g)?);
        launch!(self, t.kernel("add_channel_bias"), self.grid_1d(g.n * g.c * g.hw);
            t.arg_mut(y)?, dev(bias)?, &p)
    }

    fn channel_sum(&self, dy: &Storage, db: &mut Storage, g: &ChannelGeom) -> Result<()> {
        let (t, p) = (Ty::of(dy)?, channel_params(g)?);
        launch!(self, t.kernel("channel_sum"), Self::per_item(g.c, 256)?;
            t.arg(dy)?, dev_mut(db)?, &p)
    }

    fn batchnorm_forward_train(
        &self,
        x: &Storage,
        gamma: &Storage,
        beta: &Storage,
        y: &mut Storage,
        mean: &mut Storage,
        var: &mut Storage,
        eps: f64,
        g: &ChannelGeom,
    ) -> Result<()> {
        if let Some(c) = self.cudnn_bn(&[x, &*y], g) {
            let (mut save, _lease) = self.scratch::<f32>(2 * g.c)?;
            return c.batchnorm_forward_train(
                dev(x)?,
                dev(gamma)?,
                dev(beta)?,
                dev_mut(y)?,
                dev_mut(mean)?,
                dev_mut(var)?,
                &mut save,
                eps,
                g,
            );
        }
        self.bn_train("batchnorm_apply", x, gamma, beta, y, mean, var, eps, g)
    }

    fn batchnorm_forward_eval(
        &self,
        x: &Storage,
        gamma: &Storage,
        beta: &Storage,
        mean: &Storage,
        var: &Storage,
        y: &mut Storage,
        eps: f64,
        g: &ChannelGeom,
    ) -> Result<()> {
        let (t, bn) = (Ty::of(x)?, bn_params(eps, g)?);
        launch!(self, t.kernel("batchnorm_apply"), self.grid_1d(g.n * g.c * g.hw);
            t.arg(x)?, dev(gamma)?, dev(beta)?, dev(mean)?, dev(var)?, t.arg_mut(y)?, &bn)
    }

    fn batchnorm_backward(
        &self,
        x: &Storage,
        dy: &Storage,
        gamma: &Storage,
        mean: &Storage,
        var: &Storage,
        dx: &mut Storage,
        dgamma: &mut Storage,
        dbeta: &mut Storage,
        eps: f64,
        g: &ChannelGeom,
    ) -> Result<()> {
        if let Some(c) = self.cudnn_bn(&[x, dy, &*dx], g) {
            let inv_std = self.inv_std(var, eps, g)?;
            return c.batchnorm_backward(
                dev(x)?,
                dev(dy)?,
                dev(gamma)?,
                dev(mean)?,
                &inv_std.0,
                dev_mut(dx)?,
                dev_mut(dgamma)?,
                dev_mut(dbeta)?,
                eps,
                g,
            );
        }
        self.bn_backward(None, x, dy, gamma, mean, var, dx, dgamma, dbeta, eps, g)
    }

    fn batchnorm_statistics(&self, x: &Storage, g: &ChannelGeom) -> Result<Vec<(f64, f64)>> {
        let (t, bn) = (Ty::of(x)?, bn_params(0.0, g)?);
        let (mut mean, _m) = self.scratch::<f32>(g.c)?;
        let (mut var, _v) = self.scratch::<f32>(g.c)?;
        launch!(self, t.kernel("batchnorm_stats"), Self::per_item(g.c, 512)?;
            t.arg(x)?, &mut mean, &mut var, &bn)?;
        let (mean, var) = (download(&mean)?, download(&var)?);
        Ok(mean
            .iter()
            .zip(&var)
            .map(|(&m, &v)| (m as f64, v as f64))
            .collect())
    }

    fn batchnorm_backward_sums(
        &self,
        x: &Storage,
        dy: &Storage,
        relu_beta: Option<&Storage>,
        gamma: &Storage,
        mean: &Storage,
        var: &Storage,
        eps: f64,
        g: &ChannelGeom,
    ) -> Result<Vec<(f64, f64)>> {
        let (t, bn) = (Ty::of(x)?, bn_params(eps, g)?);
        let reduce = Self::per_item(g.c, 512)?;
        // The reduce kernels also add the sums into dγ and dβ: zeroed scratch takes them.
        let (mut dgamma, _g) = self.scratch::<f32>(g.c)?;
        let (mut dbeta, _b) = self.scratch::<f32>(g.c)?;
        let (mut sums, _s) = self.scratch::<f32>(2 * g.c)?;
        match relu_beta {
            None => launch!(self, t.kernel("batchnorm_backward_reduce"), reduce;
                t.arg(x)?, t.arg(dy)?, dev(mean)?, dev(var)?, &mut dgamma, &mut dbeta,
                &mut sums, &bn)?,
            Some(beta) => launch!(self, t.kernel("batchnorm_backward_reduce_relu"), reduce;
                t.arg(x)?, dev(gamma)?, dev(beta)?, t.arg(dy)?, dev(mean)?, dev(var)?,
                &mut dgamma, &mut dbeta, &mut sums, &bn)?,
        }
        let sums = download(&sums)?;
        Ok(sums.chunks(2).map(|s| (s[0] as f64, s[1] as f64)).collect())
    }

    fn batchnorm_backward_dx(
        &self,
        x: &Storage,
        dy: &Storage,
        relu_beta: Option<&Storage>,
        gamma: &Storage,
        mean: &Storage,
        var: &Storage,
        sums: &[(f64, f64)],
        count: usize,
        dx: &mut Storage,
        eps: f64,
        g: &ChannelGeom,
    ) -> Result<()> {
        let (t, bn) = (Ty::of(x)?, bn_params(eps, g)?);
        // The dx kernels divide the sums by x's own count (n·hw): sums scaled by n·hw / count
        // give the whole batch's means.
        let scale = (g.n * g.hw) as f64 / count as f64;
        let scaled: Vec<f32> = sums
            .iter()
            .flat_map(|&(a, b)| [(a * scale) as f32, (b * scale) as f32])
            .collect();
        let sums = self.to_device(&scaled)?;
        let elementwise = self.grid_1d(g.n * g.c * g.hw);
        match relu_beta {
            None => launch!(self, t.kernel("batchnorm_backward_dx"), elementwise;
                t.arg(x)?, t.arg(dy)?, dev(gamma)?, dev(mean)?, dev(var)?, &sums,
                t.arg_mut(dx)?, &bn),
            Some(beta) => launch!(self, t.kernel("batchnorm_backward_dx_relu"), elementwise;
                t.arg(x)?, dev(gamma)?, dev(beta)?, t.arg(dy)?, dev(mean)?, dev(var)?,
                &sums, t.arg_mut(dx)?, &bn),
        }
    }

    fn batchnorm_relu_forward_train(
        &self,
        x: &Storage,
        gamma: &Storage,
        beta: &Storage,
        y: &mut Storage,
        mean: &mut Storage,
        var: &mut Storage,
        eps: f64,
        g: &ChannelGeom,
    ) -> Result<()> {
        self.bn_train("batchnorm_apply_relu", x, gamma, beta, y, mean, var, eps, g)
    }

    fn batchnorm_relu_backward(
        &self,
        x: &Storage,
        dy: &Storage,
        gamma: &Storage,
        beta: &Storage,
        mean: &Storage,
        var: &Storage,
        dx: &mut Storage,
        dgamma: &mut Storage,
        dbeta: &mut Storage,
        eps: f64,
        g: &ChannelGeom,
    ) -> Result<()> {
        self.bn_backward(
            Some(beta),
            x,
            dy,
            gamma,
            mean,
            var,
            dx,
            dgamma,
            dbeta,
            eps,
            g,
        )
    }

    fn batchnorm_update_running(
        &self,
        running_mean: &mut Storage,
        running_var: &mut Storage,
        mean: &Storage,
        var: &Storage,
        momentum: f64,
        count: usize,
    ) -> Result<()> {
        let c = dev(mean)?.len();
        let r = params::GemsBnRunning {
            c: dim32(c, "channels")?,
            count: count as i64,
            momentum,
        };
        let cfg = LaunchConfig {
            grid_dim: (c.div_ceil(256).max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(self, "batchnorm_update_running_f32", cfg;
            dev_mut(running_mean)?, dev_mut(running_var)?, dev(mean)?, dev(var)?, &r)
    }

    fn groupnorm_forward(
        &self,
        x: &Storage,
        gamma: &Storage,
        beta: &Storage,
        y: &mut Storage,
        mean: &mut Storage,
        var: &mut Storage,
        eps: f64,
        g: &GroupGeom,
    ) -> Result<()> {
        let (t, p) = (Ty::of(x)?, group_params(eps, g)?);
        launch!(self, t.kernel("groupnorm_stats"), Self::per_item(g.n * g.groups, 512)?;
            t.arg(x)?, dev_mut(mean)?, dev_mut(var)?, &p)?;
        launch!(self, t.kernel("groupnorm_apply"), self.grid_1d(g.n * g.c * g.hw);
            t.arg(x)?, dev(gamma)?, dev(beta)?, dev(mean)?, dev(var)?, t.arg_mut(y)?, &p)
    }

    fn groupnorm_backward(
        &self,
        x: &Storage,
        dy: &Storage,
        gamma: &Storage,
        mean: &Storage,
        var: &Storage,
        dx: &mut Storage,
        dgamma: &mut Storage,
        dbeta: &mut Storage,
        eps: f64,
        g: &GroupGeom,
    ) -> Result<()> {
        let (t, p) = (Ty::of(x)?, group_params(eps, g)?);
        let (mut sums, _lease) = self.scratch::<f32>(2 * g.n * g.groups)?;
        launch!(self, t.kernel("groupnorm_backward_reduce"), Self::per_item(g.n * g.groups, 512)?;
            t.arg(x)?, t.arg(dy)?, dev(gamma)?, dev(mean)?, dev(var)?, &mut sums, &p)?;
        launch!(self, t.kernel("groupnorm_param_grads"), Self::per_item(g.c, 512)?;
            t.arg(x)?, t.arg(dy)?, dev(mean)?, dev(var)?, dev_mut(dgamma)?, dev_mut(dbeta)?, &p)?;
        launch!(self, t.kernel("groupnorm_backward_dx"), self.grid_1d(g.n * g.c * g.hw);
            t.arg(x)?, t.arg(dy)?, dev(gamma)?, dev(mean)?, dev(var)?, &sums, t.arg_mut(dx)?, &p)
    }

    fn nonlinearity_forward(&self, f: Nonlinearity, x: &Storage, y: &mut Storage) -> Result<()> {
        let (t, n) = (Ty::of(x)?, x.len() as i64);
        let name = t.kernel(&format!("{}_forward", f.name()));
        launch!(self, name, self.grid_1d(x.len()); t.arg(x)?, t.arg_mut(y)?, &n)
    }

    fn nonlinearity_backward(
        &self,
        f: Nonlinearity,
        x: &Storage,
        dy: &Storage,
        dx: &mut Storage,
    ) -> Result<()> {
        let (t, n) = (Ty::of(x)?, x.len() as i64);
        let name = t.kernel(&format!("{}_backward", f.name()));
        launch!(self, name, self.grid_1d(x.len()); t.arg(x)?, t.arg(dy)?, t.arg_mut(dx)?, &n)
    }

    fn relu_forward(&self, x: &Storage, y: &mut Storage) -> Result<()> {
        let (t, n) = (Ty::of(x)?, x.len() as i64);
        launch!(self, t.kernel("relu_forward"), self.grid_1d(x.len()); t.arg(x)?, t.arg_mut(y)?, &n)
    }

    fn relu_backward(&self, y: &Storage, dy: &Storage, dx: &mut Storage) -> Result<()> {
        let (t, n) = (Ty::of(y)?, y.len() as i64);
        launch!(self, t.kernel("relu_backward"), self.grid_1d(y.len());
            t.arg(y)?, t.arg(dy)?, t.arg_mut(dx)?, &n)
    }

    fn add(&self, a: &Storage, b: &Storage, y: &mut Storage) -> Result<()> {
        let (t, n) = (Ty::of(a)?, a.len() as i64);
        launch!(self, t.kernel("add"), self.grid_1d(a.len()); t.arg(a)?, t.arg(b)?, t.arg_mut(y)?, &n)
    }

    fn add_relu(&self, a: &Storage, b: &Storage, y: &mut Storage) -> Result<()> {
        let (t, n) = (Ty::of(a)?, a.len() as i64);
        launch!(self, t.kernel("add_relu"), self.grid_1d(a.len()); t.arg(a)?, t.arg(b)?, t.arg_mut(y)?, &n)
    }

    fn add_assign(&self, y: &mut Storage, x: &Storage) -> Result<()> {
        let (t, n) = (Ty::of(x)?, x.len() as i64);
        launch!(self, t.kernel("add_assign"), self.grid_1d(x.len()); t.arg_mut(y)?, t.arg(x)?, &n)
    }

    fn mul(&self, x: &Storage, mask: &Storage, y: &mut Storage) -> Result<()> {
        let (t, n) = (Ty::of(x)?, x.len() as i64);
        launch!(self, t.kernel("mul"), self.grid_1d(x.len()); t.arg(x)?, t.arg(mask)?, t.arg_mut(y)?, &n)
    }

    fn dropout_mask(&self, mask: &mut Storage, p: f64, seed: u64, g: &MaskGeom) -> Result<()> {
        g.check(mask.len())?;
        let t = Ty::of(mask)?;
        let i64 = |v: usize| v as i64;
        let d = params::GemsDropout {
            numel: i64(mask.len()),
            p,
            seed,
            h: i64(g.h),
            w: i64(g.w),
            row: i64(g.window.row),
            col: i64(g.window.col),
            win_h: i64(g.window.h),
            win_w: i64(g.window.w),
        };
        let cfg = self.grid_1d(mask.len());
        launch!(self, t.kernel("dropout_mask"), cfg; t.arg_mut(mask)?, &d)
    }

    fn max_pool_forward(&self, x: &Storage, y: &mut Storage, g: &PoolGeom) -> Result<()> {
        let (t, p) = (Ty::of(x)?, pool_params(g)?);
        launch!(self, t.kernel("max_pool_forward"), self.grid_1d(g.n * g.c * g.h_out * g.w_out);
            t.arg(x)?, t.arg_mut(y)?, &p)
    }

    fn max_pool_backward(
        &self,
        x: &Storage,
        dy: &Storage,
        dx: &mut Storage,
        g: &PoolGeom,
    ) -> Result<()> {
        let (t, p) = (Ty::of(x)?, pool_params(g)?);
        launch!(self, t.kernel("max_pool_backward"), self.grid_1d(g.n * g.c * g.h * g.w);
            t.arg(x)?, t.arg(dy)?, t.arg_mut(dx)?, &p)
    }

    fn avg_pool_forward(&self, x: &Storage, y: &mut Storage, g: &PoolGeom) -> Result<()> {
        let (t, p) = (Ty::of(x)?, pool_params(g)?);
        launch!(self, t.kernel("avg_pool_forward"), self.grid_1d(g.n * g.c * g.h_out * g.w_out);
            t.arg(x)?, t.arg_mut(y)?, &p)
    }

    fn avg_pool_backward(&self, dy: &Storage, dx: &mut Storage, g: &PoolGeom) -> Result<()> {
        let (t, p) = (Ty::of(dy)?, pool_params(g)?);
        launch!(self, t.kernel("avg_pool_backward"), self.grid_1d(g.n * g.c * g.h * g.w);
            t.arg(dy)?, t.arg_mut(dx)?, &p)
    }

    fn adaptive_avg_pool_forward(&self, x: &Storage, y: &mut Storage, g: &PoolGeom) -> Result<()> {
        let (t, p) = (Ty::of(x)?, pool_params(g)?);
        if (g.h_out, g.w_out) == (1, 1) {
            // The global average: one block reduces each contiguous plane.
            return launch!(self, t.kernel("global_avg_pool_forward"), Self::per_item(g.n * g.c, 256)?;
                t.arg(x)?, t.arg_mut(y)?, &p);
        }
        launch!(self, t.kernel("adaptive_avg_pool_forward"), self.grid_1d(g.n * g.c * g.h_out * g.w_out);
            t.arg(x)?, t.arg_mut(y)?, &p)
    }

    fn adaptive_avg_pool_backward(
        &self,
        dy: &Storage,
        dx: &mut Storage,
        g: &PoolGeom,
    ) -> Result<()> {
        let (t, p) = (Ty::of(dy)?, pool_params(g)?);
        let name = if (g.h_out, g.w_out) == (1, 1) {
            "global_avg_pool_backward"
        } else {
            "adaptive_avg_pool_backward"
        };
        launch!(self, t.kernel(name), self.grid_1d(g.n * g.c * g.h * g.w);
            t.arg(dy)?, t.arg_mut(dx)?, &p)
    }

    fn resize_bilinear_forward(&self, x: &Storage, y: &mut Storage, g: &ResizeGeom) -> Result<()> {
        let (t, p) = (Ty::of(x)?, resize_params(g)?);
        launch!(self, t.kernel("resize_bilinear_forward"), self.grid_1d(g.n * g.c * g.output.h * g.output.w);
            t.arg(x)?, t.arg_mut(y)?, &p)
    }

    fn resize_bilinear_backward(
        &self,
        dy: &Storage,
        dx: &mut Storage,
        g: &ResizeGeom,
    ) -> Result<()> {
        let (t, p) = (Ty::of(dy)?, resize_params(g)?);
        launch!(self, t.kernel("resize_bilinear_backward"), self.grid_1d(g.n * g.c * g.input.h * g.input.w);
            t.arg(dy)?, t.arg_mut(dx)?, &p)
    }

    fn linear_forward(
        &self,
        x: &Storage,
        w: &Storage,
        y: &mut Storage,
        n: usize,
        d_in: usize,
        d_out: usize,
    ) -> Result<()> {
        // Row-major Y (n × out) = X Wᵀ is column-major Yᵀ (out × n) = W' Xᵀ, where W (out × in,
        // row-major) read column-major is Wᵀ, transposed back by OP_T.
        let cfg = gemm_config((true, false), (d_out, n, d_in), (d_in, d_in, d_out), 0.0)?;
        // bf16 and f16 activations: computed in f32 from the widened x, y rounded once.
        let x = self.widen(x)?;
        let mut y = self.wide_out(y)?;
        // SAFETY: the buffers hold n·in, out·in and n·out elements, as the shapes say.
        unsafe { self.blas.gemm(cfg, dev(w)?, x.get(), y.get_mut()) }.map_err(blas_error)?;
        self.narrow(y)
    }

    fn linear_backward(
        &self,
        x: &Storage,
        w: &Storage,
        dy: &Storage,
        dx: Option<&mut Storage>,
        dw: &mut Storage,
        n: usize,
        d_in: usize,
        d_out: usize,
    ) -> Result<()> {
        // bf16 and f16 activations: computed in f32 from widened copies, dx rounded once; dw
        // (f32) accumulates directly.
        let dy = self.widen(dy)?;
        if let Some(dx) = dx {
            // dX (n × in) = dY W: column-major dXᵀ (in × n) = Wᵀ dYᵀ, both as stored.
            let cfg = gemm_config((false, false), (d_in, n, d_out), (d_in, d_out, d_in), 0.0)?;
            let mut dx = self.wide_out(dx)?;
            // SAFETY: as in linear_forward.
            unsafe { self.blas.gemm(cfg, dev(w)?, dy.get(), dx.get_mut()) }.map_err(blas_error)?;
            self.narrow(dx)?;
        }
        // dW (out × in) += dYᵀ X: column-major dWᵀ (in × out) += Xᵀ dY, dY read transposed.
        let cfg = gemm_config((false, true), (d_in, d_out, n), (d_in, d_out, d_in), 1.0)?;
        let x = self.widen(x)?;
        // SAFETY: as in linear_forward.
        unsafe { self.blas.gemm(cfg, x.get(), dy.get(), dev_mut(dw)?) }.map_err(blas_error)
    }

    fn copy_channels(
        &self,
        src: &Storage,
        dst: &mut Storage,
        src_c: (usize, usize),
        dst_c: (usize, usize),
        count: usize,
        n: usize,
        hw: usize,
    ) -> Result<()> {
        let t = Ty::of(src)?;
        let p = params::GemsCopyChannels {
            n: dim32(n, "batch")?,
            hw: dim32(hw, "plane")?,
            src_c: dim32(src_c.0, "channels")?,
            src_off: dim32(src_c.1, "channels")?,
            dst_c: dim32(dst_c.0, "channels")?,
            dst_off: dim32(dst_c.1, "channels")?,
            count: dim32(count, "channels")?,
        };
        launch!(self, t.kernel("copy_channels"), self.grid_1d(n * count * hw);
            t.arg(src)?, t.arg_mut(dst)?, &p)
    }

    fn softmax_cross_entropy(
        &self,
        logits: &Storage,
        labels: &[u32],
        weights: &[f64],
        probs: &mut Storage,
        g: &LossGeom,
    ) -> Result<f64> {
        let l = loss_params(g, 1.0)?;
        let (labels, _l1) = self.place_values(labels)?;
        let (weights, _l2) = self.place_values(&weights_f32(weights))?;
        let blocks = g.places().div_ceil(256).max(1);
        let (mut partial, _l3) = self.scratch::<f32>(blocks)?;
        let t = Ty::of(logits)?;
        launch!(self, t.kernel("softmax_cross_entropy"), Self::per_item(blocks, 256)?;
            t.arg(logits)?, &labels, &weights, dev_mut(probs)?, &mut partial, &l)?;
        // The blocks' sums added in f64 on the host, in block order: the same bits every run.
        Ok(download(&partial)?.iter().map(|&b| b as f64).sum())
    }

    fn softmax_cross_entropy_backward(
        &self,
        probs: &Storage,
        labels: &[u32],
        weights: &[f64],
        dlogits: &mut Storage,
        scale: f64,
        g: &LossGeom,
    ) -> Result<()> {
        let l = loss_params(g, scale)?;
        let (labels, _l1) = self.place_values(labels)?;
        let (weights, _l2) = self.place_values(&weights_f32(weights))?;
        let t = Ty::of(dlogits)?;
        launch!(self, t.kernel("softmax_cross_entropy_backward"), self.grid_1d(g.places());
            dev(probs)?, &labels, &weights, t.arg_mut(dlogits)?, &l)
    }

    fn sgd_update(
        &self,
        w: &mut Storage,
        grad: &Storage,
        momentum_buf: &mut Storage,
        step: &SgdStep,
    ) -> Result<()> {
        let w = dev_mut(w)?;
        let s = params::GemsSgdStep {
            numel: w.len() as i64,
            lr: step.lr,
            momentum: step.momentum,
            weight_decay: step.weight_decay,
            grad_scale: step.grad_scale,
            dampening: 0.0,
            nesterov: step.nesterov as i32,
            first_step: 0,
        };
        let cfg = self.grid_1d(w.len());
        launch!(self, "sgd_f32", cfg; w, dev(grad)?, dev_mut(momentum_buf)?, &s)
    }

    fn adam_update(
        &self,
        w: &mut Storage,
        grad: &Storage,
        exp_avg: &mut Storage,
        exp_avg_sq: &mut Storage,
        step: &AdamStep,
    ) -> Result<()> {
        let w = dev_mut(w)?;
        let (step_size, bc2_sqrt) = step.bias_corrections();
        let (weight_decay, decay) = step.decay_terms();
        let s = params::GemsAdamStep {
            numel: w.len() as i64,
            beta1: step.betas.0,
            beta2: step.betas.1,
            eps: step.eps,
            weight_decay,
            decay,
            step_size,
            bc2_sqrt,
            grad_scale: step.grad_scale,
        };
        let cfg = self.grid_1d(w.len());
        launch!(self, "adam_f32", cfg; w, dev(grad)?, dev_mut(exp_avg)?, dev_mut(exp_avg_sq)?, &s)
    }

    fn all_finite(&self, s: &Storage) -> Result<bool> {
        if s.is_empty() {
            return Ok(true);
        }
        // One flag on the device, zeroed (alloc_zeros), set by any inf or NaN; one u32 read back.
        let (mut found, _lease) = self.scratch::<u32>(1)?;
        match s {
            Storage::CudaF32(v) => {
                let n = v.len() as i64;
                launch!(self, "nonfinite_f32", self.grid_1d(v.len()); v, &n, &mut found)?;
            }
            Storage::Cuda16(d, v) => {
                // Widened (exactly: inf and NaN stay inf and NaN) a chunk at a time, so the
                // workspace stays small whatever the tensor.
                let (mut wide, _wide) = self.scratch::<f32>(v.len().min(NONFINITE_CHUNK))?;
                let cast = format!("cast_{}_f32", d.name());
                for start in (0..v.len()).step_by(NONFINITE_CHUNK) {
                    let len = NONFINITE_CHUNK.min(v.len() - start);
                    let (part, n) = (v.slice(start..start + len), len as i64);
                    launch!(self, cast, self.grid_1d(len); &part, &mut wide, &n)?;
                    launch!(self, "nonfinite_f32", self.grid_1d(len); &wide, &n, &mut found)?;
                }
            }
            other => return Err(not_on_device(other)),
        }
        Ok(download(&found)?[0] == 0)
    }

    fn fill(&self, s: &mut Storage, value: f64) -> Result<()> {
        // The value as f32, rounded to a 16-bit type by the store (as the CPU's T::of, then
        // its rounding at the store).
        let (t, n, v) = (Ty::of(s)?, s.len() as i64, value as f32);
        let cfg = self.grid_1d(s.len());
        launch!(self, t.kernel("fill"), cfg; t.arg_mut(s)?, &v, &n)
    }
}

impl Cuda {
    /// cuDNN, where it runs the plain batch normalization of `g` (training forward and
    /// backward): with `--conv cudnn`, on f32 activations, for a geometry cuDNN runs here
    /// ([`cudnn::batchnorm_supported`]). Elsewhere, and always for the eval forward and the
    /// fused BN+ReLU (forward and backward), the handwritten kernels of cuda/batchnorm.cu run:
    /// cuDNN's BN+ReLU (`cudnnBatchNormalizationForwardTrainingEx` with an activation) keeps
    /// y for its backward, while the engine's fused op keeps only x and recomputes the mask.
    fn cudnn_bn(&self, activations: &[&Storage], g: &ChannelGeom) -> Option<&cudnn::Cudnn> {
        let f32s = activations.iter().all(|s| matches!(s, Storage::CudaF32(_)));
        self.cudnn
            .as_ref()
            .filter(|_| f32s && cudnn::batchnorm_supported(g))
    }

    /// 1/sqrtf(var + eps) per channel, for cuDNN's backward, in leased scratch (held as long
    /// as the returned lease). Computed by the handwritten `batchnorm_apply_f32` on a 1 × c × 1
    /// batch of ones with gamma 1, beta 0 and mean 0, so that it is exactly the scale the
    /// handwritten kernels compute (gamma / sqrtf(var + eps), correctly rounded sqrt and
    /// division, here with gamma = 1), then fmaf(1, scale, 0 - 0 · scale) = scale. cuDNN then
    /// multiplies it by gamma: one rounding more than the handwritten kernels' single division.
    fn inv_std(&self, var: &Storage, eps: f64, g: &ChannelGeom) -> Result<(CudaSlice<f32>, Lease)> {
        let one = ChannelGeom {
            n: 1,
            c: g.c,
            hw: 1,
        };
        let (mut ones, _ones) = self.scratch::<f32>(g.c)?;
        let (value, c64) = (1.0f32, g.c as i64);
        launch!(self, "fill_f32", self.grid_1d(g.c); &mut ones, &value, &c64)?;
        let (zeros, _zeros) = self.scratch::<f32>(g.c)?;
        let (mut inv, lease) = self.scratch::<f32>(g.c)?;
        let bn = bn_params(eps, &one)?;
        launch!(self, "batchnorm_apply_f32", self.grid_1d(g.c);
            &ones, &ones, &zeros, &zeros, dev(var)?, &mut inv, &bn)?;
        Ok((inv, lease))
    }

    /// Batch statistics in one pass, then `apply` (the plain normalization or the one fused
    /// with ReLU; the stamp is added from x's type).
    #[allow(clippy::too_many_arguments)]
    fn bn_train(
        &self,
        apply: &str,
        x: &Storage,
        gamma: &Storage,
        beta: &Storage,
        y: &mut Storage,
        mean: &mut Storage,
        var: &mut Storage,
        eps: f64,
        g: &ChannelGeom,
    ) -> Result<()> {
        let (t, bn) = (Ty::of(x)?, bn_params(eps, g)?);
        launch!(self, t.kernel("batchnorm_stats"), Self::per_item(g.c, 512)?;
            t.arg(x)?, dev_mut(mean)?, dev_mut(var)?, &bn)?;
        launch!(self, t.kernel(apply), self.grid_1d(g.n * g.c * g.hw);
            t.arg(x)?, dev(gamma)?, dev(beta)?, dev(mean)?, dev(var)?, t.arg_mut(y)?, &bn)
    }

    /// BN's backward: per-channel sums (added to dgamma, dbeta), then dx. With the fused op's
    /// `beta` (`relu_with`), dy counts only where the fused output was positive.
    #[allow(clippy::too_many_arguments)]
    fn bn_backward(
        &self,
        relu_with: Option<&Storage>,
        x: &Storage,
        dy: &Storage,
        gamma: &Storage,
        mean: &Storage,
        var: &Storage,
        dx: &mut Storage,
        dgamma: &mut Storage,
        dbeta: &mut Storage,
        eps: f64,
        g: &ChannelGeom,
    ) -> Result<()> {
        let (t, bn) = (Ty::of(x)?, bn_params(eps, g)?);
        let (reduce, elementwise) = (Self::per_item(g.c, 512)?, self.grid_1d(g.n * g.c * g.hw));
        let (mut sums, _lease) = self.scratch::<f32>(2 * g.c)?;
        match relu_with {
            None => {
                launch!(self, t.kernel("batchnorm_backward_reduce"), reduce;
                    t.arg(x)?, t.arg(dy)?, dev(mean)?, dev(var)?, dev_mut(dgamma)?,
                    dev_mut(dbeta)?, &mut sums, &bn)?;
                launch!(self, t.kernel("batchnorm_backward_dx"), elementwise;
                    t.arg(x)?, t.arg(dy)?, dev(gamma)?, dev(mean)?, dev(var)?, &sums,
                    t.arg_mut(dx)?, &bn)
            }
            Some(beta) => {
                launch!(self, t.kernel("batchnorm_backward_reduce_relu"), reduce;
                    t.arg(x)?, dev(gamma)?, dev(beta)?, t.arg(dy)?, dev(mean)?, dev(var)?,
                    dev_mut(dgamma)?, dev_mut(dbeta)?, &mut sums, &bn)?;
                launch!(self, t.kernel("batchnorm_backward_dx_relu"), elementwise;
                    t.arg(x)?, dev(gamma)?, dev(beta)?, t.arg(dy)?, dev(mean)?, dev(var)?,
                    &sums, t.arg_mut(dx)?, &bn)
            }
        }
    }

    /// Host elements copied into a new buffer on this device's stream.
    fn to_device<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        v: &[T],
    ) -> Result<CudaSlice<T>> {
        if v.is_empty() {
            return alloc_zeros(&self.stream, 0);
        }
        self.stream.clone_htod(v).map_err(driver_error)
    }

    /// A device buffer as one ordered on this device's stream: itself when it is, else a copy.
    fn onto_stream<T: DeviceRepr>(&self, v: CudaSlice<T>) -> Result<CudaSlice<T>> {
        if **v.stream() == *self.stream {
            return Ok(v);
        }
        // Another device's buffer (another rank's message): once its stream has written it,
        // copy it onto ours, and let the copy finish before the original is freed on its own
        // stream.
        v.stream().synchronize().map_err(driver_error)?;
        let mine = if v.is_empty() {
            self.stream.null().map_err(driver_error)?
        } else {
            self.stream.clone_dtod(&v).map_err(driver_error)?
        };
        self.synchronize()?;
        Ok(mine)
    }

    /// Copies device elements `src` into host bytes `dst` (see [`Backend::copy_out`]).
    fn download_into<T>(
        &self,
        src: &CudaSlice<T>,
        dst: &mut [u8],
        on_copy_stream: bool,
    ) -> Result<Option<Event>> {
        if dst.len() != src.num_bytes() {
            return Err(Error::Internal(format!(
                "a copy of {} device bytes into {} host bytes",
                src.num_bytes(),
                dst.len()
            )));
        }
        if dst.is_empty() {
            return Ok(None);
        }
        let stream = self.copy_stream_for(on_copy_stream)?;
        let (ptr, _no_record) = src.device_ptr(stream);
        // SAFETY: `dst` holds exactly the source's bytes; it stays alive until the copy is
        // complete (the caller keeps both until the returned event, or we synchronize).
        unsafe { driver::result::memcpy_dtoh_async(dst, ptr, stream.cu_stream()) }
            .map_err(driver_error)?;
        self.copy_done(on_copy_stream)
    }

    /// Copies host bytes `src` into device elements `dst` (see [`Backend::copy_in`]).
    fn upload_into<T>(
        &self,
        src: &[u8],
        dst: &mut CudaSlice<T>,
        on_copy_stream: bool,
    ) -> Result<Option<Event>> {
        if src.len() != dst.num_bytes() {
            return Err(Error::Internal(format!(
                "a copy of {} host bytes into {} device bytes",
                src.len(),
                dst.num_bytes()
            )));
        }
        if src.is_empty() {
            return Ok(None);
        }
        let stream = self.copy_stream_for(on_copy_stream)?;
        let (ptr, _no_record) = dst.device_ptr_mut(stream);
        // SAFETY: as in download_into, the other way.
        unsafe { driver::result::memcpy_htod_async(ptr, src, stream.cu_stream()) }
            .map_err(driver_error)?;
        self.copy_done(on_copy_stream)
    }

    /// The f32 elements of activation `s` for cuBLAS: f32 storage itself, or bf16 or f16
    /// widened (exactly) into workspace leased for as long as the result lives.
    fn widen<'a>(&self, s: &'a Storage) -> Result<Wide<'a>> {
        match s {
            Storage::CudaF32(v) => Ok(Wide::Direct(v)),
            Storage::Cuda16(d, v) => {
                let (mut wide, lease) = self.scratch::<f32>(v.len())?;
                let n = v.len() as i64;
                launch!(self, format!("cast_{}_f32", d.name()), self.grid_1d(v.len());
                    v, &mut wide, &n)?;
                Ok(Wide::Widened {
                    wide,
                    _lease: lease,
                })
            }
            other => Err(not_on_device(other)),
        }
    }

    /// Where cuBLAS writes activation output `s`: f32 storage itself, or f32 workspace that
    /// [`Cuda::narrow`] rounds into the bf16 or f16 storage. Overwritten outputs only (β = 0):
    /// the workspace does not hold the output's old values.
    fn wide_out<'a>(&self, s: &'a mut Storage) -> Result<WideOut<'a>> {
        match s {
            Storage::CudaF32(v) => Ok(WideOut::Direct(v)),
            Storage::Cuda16(d, v) => {
                let (wide, lease) = self.scratch::<f32>(v.len())?;
                Ok(WideOut::Staged {
                    wide,
                    _lease: lease,
                    dtype: *d,
                    out: v,
                })
            }
            other => Err(not_on_device(other)),
        }
    }

    /// Rounds a staged output into its bf16 or f16 storage (to nearest even, once).
    fn narrow(&self, o: WideOut) -> Result<()> {
        match o {
            WideOut::Direct(_) => Ok(()),
            WideOut::Staged {
                wide, dtype, out, ..
            } => {
                let n = wide.len() as i64;
                launch!(self, format!("cast_f32_{}", dtype.name()), self.grid_1d(wide.len());
                    &wide, out, &n)
            }
        }
    }

    /// The stream a host-tier copy runs on: the copy stream, once it is ordered after the work
    /// queued so far on the compute stream (which wrote the source, or allocated the
    /// destination), or the compute stream itself.
    fn copy_stream_for(&self, on_copy_stream: bool) -> Result<&Arc<CudaStream>> {
        if !on_copy_stream {
            return Ok(&self.stream);
        }
        let queued = self.stream.record_event(None).map_err(driver_error)?;
        self.copy_stream.wait(&queued).map_err(driver_error)?;
        Ok(&self.copy_stream)
    }

    /// The event ending a copy on the copy stream, or, for a blocking copy, its completion.
    fn copy_done(&self, on_copy_stream: bool) -> Result<Option<Event>> {
        if on_copy_stream {
            let done = self.copy_stream.record_event(None).map_err(driver_error)?;
            Ok(Some(Event(Arc::new(done))))
        } else {
            self.synchronize()?;
            Ok(None)
        }
    }

    /// One value per scored place (a label or a loss weight) in device memory, leased as
    /// workspace.
    fn place_values<T: DeviceRepr>(&self, values: &[T]) -> Result<(CudaSlice<T>, Lease)> {
        let lease = self
            .allocator
            .lease(std::mem::size_of_val(values) as u64, Category::Workspace)?;
        let slice = if values.is_empty() {
            self.stream.null().map_err(driver_error)?
        } else {
            self.stream.clone_htod(values).map_err(driver_error)?
        };
        Ok((slice, lease))
    }
}

/// The loss kernels' parameters for `g`.
fn loss_params(g: &LossGeom, scale: f64) -> Result<params::GemsLoss> {
    Ok(params::GemsLoss {
        n: dim32(g.n, "batch")?,
        k: dim32(g.k, "classes")?,
        positions: dim32(g.positions, "positions")?,
        scale,
    })
}

/// The loss weights as the kernels read them (they compute in f32).
fn weights_f32(weights: &[f64]) -> Vec<f32> {
    weights.iter().map(|&w| w as f32).collect()
}

/// An activation's f32 elements for cuBLAS (see [`Cuda::widen`]).
enum Wide<'a> {
    Direct(&'a CudaSlice<f32>),
    Widened { wide: CudaSlice<f32>, _lease: Lease },
}

impl Wide<'_> {
    fn get(&self) -> &CudaSlice<f32> {
        match self {
            Wide::Direct(v) => v,
            Wide::Widened { wide, .. } => wide,
        }
    }
}

/// An activation output cuBLAS writes in f32 (see [`Cuda::wide_out`]).
enum WideOut<'a> {
    Direct(&'a mut CudaSlice<f32>),
    Staged {
        wide: CudaSlice<f32>,
        _lease: Lease,
        dtype: DType,
        out: &'a mut CudaSlice<u16>,
    },
}

impl WideOut<'_> {
    fn get_mut(&mut self) -> &mut CudaSlice<f32> {
        match self {
            WideOut::Direct(v) => v,
            WideOut::Staged { wide, .. } => wide,
        }
    }
}

/// Elements of a bf16 or f16 tensor widened at a time by `all_finite` (4 MiB of f32).
const NONFINITE_CHUNK: usize = 1 << 20;

/// cuBLAS's column-major C (m × n) = α op(A) op(B) + β C with (transpose A, transpose B),
/// (m, n, k) and leading dimensions (lda, ldb, ldc).
fn gemm_config(
    (ta, tb): (bool, bool),
    (m, n, k): (usize, usize, usize),
    (lda, ldb, ldc): (usize, usize, usize),
    beta: f32,
) -> Result<GemmConfig<f32>> {
    let op = |t: bool| {
        if t {
            cublas::sys::cublasOperation_t::CUBLAS_OP_T
        } else {
            cublas::sys::cublasOperation_t::CUBLAS_OP_N
        }
    };
    Ok(GemmConfig {
        transa: op(ta),
        transb: op(tb),
        m: dim32(m, "rows")?,
        n: dim32(n, "columns")?,
        k: dim32(k, "inner dimension")?,
        alpha: 1.0,
        lda: dim32(lda, "leading dimension")?,
        ldb: dim32(ldb, "leading dimension")?,
        beta,
        ldc: dim32(ldc, "leading dimension")?,
    })
}

fn unsupported(dtype: DType) -> Error {
    Error::Config(format!(
        "the CUDA backend stores f32, bf16 and f16 tensors, not {}; run {} models on the CPU",
        dtype.name(),
        dtype.name()
    ))
}
