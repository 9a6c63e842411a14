//! cuDNN convolutions (`--conv cudnn`): forward, backward-data and backward-filter of NCHW f32
//! tensors through cuDNN 9's convolution API, on the device's one stream.
//!
//! Each pass's algorithm is chosen once per geometry, when the engine first asks how much
//! workspace the convolution needs ([`Cudnn::workspace`], before its first forward): cuDNN times
//! every algorithm on zero-filled scratch operands leased from the device's allocator
//! (`cudnnFind*AlgorithmEx`) and the fastest usable one is kept. Where the scratch does not fit
//! beside what is live, or none of a pass's timed algorithms is usable (cuDNN can report them
//! all failing to run in its search), cuDNN's heuristics choose without timing. The workspace the engine then
//! leases for each pass is the most any of the three chosen algorithms needs. Choices are shared
//! by every instance on the same GPU in the process, so that two runs of one configuration (a
//! reference and an offloaded run, say) compute with the same algorithms.
//!
//! Usable means: cuDNN ran it, its workspace fits [`WORKSPACE_LIMIT`], its math is the
//! precision's, and with `--conv cudnn-deterministic` it is deterministic. FP32 allows only `CUDNN_FMA_MATH` (cuDNN's default math may use TF32 tensor
//! cores on Ampere and newer); TF32 allows tensor-op (and default or FMA) math but not
//! `CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION`, which may round inputs to FP16.
//!
//! Results follow the `Backend` contract: y and dx are overwritten (β = 0), dw accumulates
//! (β = 1).
//!
//! Mixed precision is not run here: cuDNN takes x, w and y in one type, and the engine keeps
//! f32 master weights beside bf16/f16 activations. `--conv cudnn` with `--precision bf16|fp16`
//! is refused when the device opens ([`super::check_conv`]), and a 16-bit tensor reaching
//! these convolutions is a configuration error, never a panic.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::ptr::null_mut;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

use cudarc::cudnn::{result as dnn, sys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use super::{alloc_zeros, dim32, driver_error, libs};
use crate::backend::{ChannelGeom, ConvGeom};
use crate::core::Precision;
use crate::memory::{human_bytes, Allocator, Category};
use crate::{Error, Result};

/// The most workspace one convolution's algorithms may use. cuDNN's fastest algorithms on large
/// images (FFT, non-fused Winograd) can ask for gigabytes that the memory plan does not hold;
/// implicit GEMM needs next to none.
pub const WORKSPACE_LIMIT: usize = 256 << 20;

/// How much slower than the fastest algorithm a deterministic one may be and still be chosen.
/// Deterministic algorithms (no atomic adds) give bit-identical results run after run, which the
/// GPU checks of offload and recompute rely on; a few percent is a fair price for that.
const DETERMINISM_SLACK: f32 = 1.05;

const SUCCESS: u32 = sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS as u32;
const DETERMINISTIC: u32 = sys::cudnnDeterminism_t::CUDNN_DETERMINISTIC as u32;

impl From<dnn::CudnnError> for Error {
    fn from(e: dnn::CudnnError) -> Error {
        let detail = last_error_message();
        Error::Device(if detail.is_empty() {
            format!("cuDNN: {:?}", e.0)
        } else {
            format!("cuDNN: {:?}: {detail}", e.0)
        })
    }
}

/// cuDNN's message about the last error on this thread (empty where it has none).
fn last_error_message() -> String {
    type GetLastErrorString = unsafe extern "C" fn(*mut std::ffi::c_char, usize);
    let mut msg = [0 as std::ffi::c_char; 512];
    // SAFETY: an error came from cuDNN, so it is loaded. The function is looked up rather than
    // called through cudarc, which panics on a missing symbol; with the signature of cudnn.h,
    // it writes at most `max_size` bytes.
    unsafe {
        match sys::culib().get::<GetLastErrorString>(b"cudnnGetLastErrorString\0") {
            Ok(f) => f(msg.as_mut_ptr(), msg.len() - 1),
            Err(_) => return String::new(),
        }
    }
    // SAFETY: the buffer was zeroed and cuDNN was given all but its last byte, so it ends in NUL.
    let text = unsafe { std::ffi::CStr::from_ptr(msg.as_ptr()) };
    text.to_string_lossy().trim().to_string()
}

/// cuDNN's version (90800 is 9.8.0) once it is loaded; an error saying where it was looked for
/// when it is missing, or which version it is when that is not 9.
pub fn load() -> Result<usize> {
    let lib = libs::get("cudnn");
    // cudarc panics on a library it cannot open, so look before the first call.
    // SAFETY: only tries to open the library under cudarc's candidate names.
    if lib.is_none_or(|l| l.path.is_none()) || !unsafe { sys::is_culib_present() } {
        let why = match lib {
            Some(l) if l.path.is_some() => format!(
                "{} was found, but cudarc cannot open it under its names (libcudnn.so, \
                 libcudnn.so.9, ...)",
                l.path
                    .as_deref()
                    .unwrap_or(std::path::Path::new("?"))
                    .display()
            ),
            _ => lib
                .and_then(|l| l.problem.clone())
                .unwrap_or_else(|| "libcudnn.so.9 not found".into()),
        };
        return Err(Error::Device(format!(
            "cuDNN 9 cannot be loaded for cuDNN convolutions: {why}. Install cuDNN 9 (NVIDIA's packages \
             or the nvidia-cudnn Python wheel), name the folder holding libcudnn.so.9 in \
             GEMS_CUDA_LIB_DIRS, or use the native kernels"
        )));
    }
    // SAFETY: takes nothing; present in every cuDNN.
    let version = unsafe { sys::cudnnGetVersion() };
    // cudarc's bindings are cuDNN 9's (a symbol missing from another version would panic).
    if !(90000..100000).contains(&version) {
        return Err(Error::Device(format!(
            "the cuDNN found is version {}; cuDNN convolutions need cuDNN 9 (libcudnn.so.9)",
            version_string(version)
        )));
    }
    Ok(version)
}

/// `90800` as `9.8.0`.
pub fn version_string(v: usize) -> String {
    format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100)
}

/// The three passes of a convolution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pass {
    Forward,
    BackwardData,
    BackwardFilter,
}

impl Pass {
    const ALL: [Pass; 3] = [Pass::Forward, Pass::BackwardData, Pass::BackwardFilter];

    fn name(self) -> &'static str {
        match self {
            Pass::Forward => "forward",
            Pass::BackwardData => "backward-data",
            Pass::BackwardFilter => "backward-filter",
        }
    }

    /// How many algorithms cuDNN has for the pass.
    fn count(self) -> usize {
        use sys::cudnnConvolutionBwdDataAlgo_t::CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT as DATA;
        use sys::cudnnConvolutionBwdFilterAlgo_t::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT as FILTER;
        use sys::cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_COUNT as FWD;
        match self {
            Pass::Forward => FWD as usize,
            Pass::BackwardData => DATA as usize,
            Pass::BackwardFilter => FILTER as usize,
        }
    }
}

/// The layout shared by `cudnnConvolution{Fwd,BwdData,BwdFilter}AlgoPerf_t`, with the enums as
/// plain integers: a code that these bindings do not know stays a number instead of an invalid
/// Rust enum.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct Perf {
    algo: u32,
    status: u32,
    /// Milliseconds (negative where cuDNN did not time it).
    time: f32,
    memory: usize,
    determinism: u32,
    math: u32,
    reserved: [c_int; 3],
}

// The casts of `*mut Perf` to the three perf types rest on this (all are #[repr(C)] with the
// same fields in the same order).
const _: () = {
    use std::mem::{align_of, size_of};
    assert!(size_of::<Perf>() == size_of::<sys::cudnnConvolutionFwdAlgoPerf_t>());
    assert!(size_of::<Perf>() == size_of::<sys::cudnnConvolutionBwdDataAlgoPerf_t>());
    assert!(size_of::<Perf>() == size_of::<sys::cudnnConvolutionBwdFilterAlgoPerf_t>());
    assert!(align_of::<Perf>() == align_of::<sys::cudnnConvolutionFwdAlgoPerf_t>());
};

/// `$v` as the first of `$ty`'s listed variants with that value, or an error.
macro_rules! from_u32 {
    ($v:expr, $what:literal, $ty:ident: $($variant:ident),+ $(,)?) => {{
        use sys::$ty::*;
        [$($variant),+]
            .into_iter()
            .find(|&t| t as u32 == $v)
            .ok_or_else(|| Error::Internal(format!("cuDNN returned {} {}", $what, $v)))
    }};
}

fn fwd_algo(a: u32) -> Result<sys::cudnnConvolutionFwdAlgo_t> {
    from_u32!(a, "forward algorithm", cudnnConvolutionFwdAlgo_t:
        CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM,
        CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
        CUDNN_CONVOLUTION_FWD_ALGO_GEMM,
        CUDNN_CONVOLUTION_FWD_ALGO_DIRECT,
        CUDNN_CONVOLUTION_FWD_ALGO_FFT,
        CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING,
        CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD,
        CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED)
}

fn data_algo(a: u32) -> Result<sys::cudnnConvolutionBwdDataAlgo_t> {
    from_u32!(a, "backward-data algorithm", cudnnConvolutionBwdDataAlgo_t:
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_0,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_1,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED)
}

fn filter_algo(a: u32) -> Result<sys::cudnnConvolutionBwdFilterAlgo_t> {
    from_u32!(a, "backward-filter algorithm", cudnnConvolutionBwdFilterAlgo_t:
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING)
}

fn math_type(m: u32) -> Result<sys::cudnnMathType_t> {
    from_u32!(m, "math type", cudnnMathType_t:
        CUDNN_DEFAULT_MATH,
        CUDNN_TENSOR_OP_MATH,
        CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION,
        CUDNN_FMA_MATH)
}

/// The algorithm one pass runs, and what it costs.
#[derive(Clone, Copy, Debug, Default)]
struct Choice {
    algo: u32,
    math: u32,
    /// Bytes of workspace.
    workspace: usize,
    /// cuDNN's time in milliseconds (`None`: chosen by its heuristics).
    ms: Option<f32>,
    deterministic: bool,
}

impl Choice {
    /// `FWD_ALGO_IMPLICIT_PRECOMP_GEMM (fma, 0.412 ms, 1.5 MiB workspace)`.
    fn describe(&self, pass: Pass) -> String {
        let name = match pass {
            Pass::Forward => fwd_algo(self.algo).map(|a| format!("{a:?}")),
            Pass::BackwardData => data_algo(self.algo).map(|a| format!("{a:?}")),
            Pass::BackwardFilter => filter_algo(self.algo).map(|a| format!("{a:?}")),
        }
        .unwrap_or_else(|_| format!("algorithm {}", self.algo));
        let math = match math_type(self.math) {
            Ok(sys::cudnnMathType_t::CUDNN_FMA_MATH) => "fma",
            Ok(sys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH) => "tensor-op",
            Ok(sys::cudnnMathType_t::CUDNN_DEFAULT_MATH) => "default math",
            _ => "other math",
        };
        let time = self
            .ms
            .map_or("by heuristics".to_string(), |t| format!("{t:.3} ms"));
        format!(
            "{} ({math}, {time}, {} workspace{})",
            name.trim_start_matches("CUDNN_CONVOLUTION_"),
            human_bytes(self.workspace as u64),
            if self.deterministic {
                ""
            } else {
                ", non-deterministic"
            }
        )
    }
}

/// Choices by (GPU, precision, deterministic only, geometry), shared by every instance in the
/// process.
type Key = (usize, Precision, bool, ConvGeom);
static CHOSEN: LazyLock<Mutex<HashMap<Key, [Choice; 3]>>> = LazyLock::new(Default::default);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock only means another thread panicked; the maps stay consistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A cuDNN handle, destroyed on drop.
struct Handle(sys::cudnnHandle_t);

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: created by cudnnCreate and destroyed once here. An error (none is documented
        // for a valid handle) is not worth a panic in a destructor.
        let _ = unsafe { dnn::destroy_handle(self.0) };
    }
}

/// The descriptors of one geometry: input, filter, output and the convolution.
struct Descriptors {
    x: sys::cudnnTensorDescriptor_t,
    w: sys::cudnnFilterDescriptor_t,
    y: sys::cudnnTensorDescriptor_t,
    conv: sys::cudnnConvolutionDescriptor_t,
}

impl Descriptors {
    fn new(g: &ConvGeom) -> Result<Descriptors> {
        for (what, numel) in [
            ("input", g.n * g.c_in * g.h * g.w),
            ("output", g.n * g.c_out * g.h_out * g.w_out),
        ] {
            if numel > i32::MAX as usize {
                return Err(Error::Config(format!(
                    "cuDNN's convolutions index tensors with 32-bit ints, and this {what} has \
                     {numel} elements; use the native kernels or a smaller batch"
                )));
            }
        }
        let (float, nchw) = (
            sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
            sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW,
        );
        let i = dim32;
        let y_dims = [
            i(g.n, "batch")?,
            i(g.c_out, "channels")?,
            i(g.h_out, "height")?,
            i(g.w_out, "width")?,
        ];
        // Null until created, so that drop destroys only what exists.
        let mut d = Descriptors {
            x: null_mut(),
            w: null_mut(),
            y: null_mut(),
            conv: null_mut(),
        };
        d.x = dnn::create_tensor_descriptor()?;
        d.y = dnn::create_tensor_descriptor()?;
        d.w = dnn::create_filter_descriptor()?;
        d.conv = dnn::create_convolution_descriptor()?;
        // SAFETY: the descriptors were just created; everything else is plain values.
        unsafe {
            let x_dims = [
                i(g.n, "batch")?,
                i(g.c_in, "channels")?,
                i(g.h, "height")?,
                i(g.w, "width")?,
            ];
            dnn::set_tensor4d_descriptor(d.x, nchw, float, x_dims)?;
            dnn::set_tensor4d_descriptor(d.y, nchw, float, y_dims)?;
            let w_dims = [
                i(g.c_out, "channels")?,
                i(g.c_in / g.groups.max(1), "channels")?,
                i(g.kh, "kernel")?,
                i(g.kw, "kernel")?,
            ];
            dnn::set_filter4d_descriptor(d.w, float, nchw, w_dims)?;
            dnn::set_convolution2d_descriptor(
                d.conv,
                i(g.pad.0, "padding")?,
                i(g.pad.1, "padding")?,
                i(g.stride.0, "stride")?,
                i(g.stride.1, "stride")?,
                i(g.dilation.0, "dilation")?,
                i(g.dilation.1, "dilation")?,
                sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                float,
            )?;
            dnn::set_convolution_group_count(d.conv, i(g.groups, "groups")?)?;
        }
        // cuDNN's output size must be the engine's.
        let mut out = [0 as c_int; 4];
        let [on, oc, oh, ow] = &mut out;
        // SAFETY: the descriptors are set; the four outputs are ints on the stack.
        unsafe { sys::cudnnGetConvolution2dForwardOutputDim(d.conv, d.x, d.w, on, oc, oh, ow) }
            .result()?;
        if out != y_dims {
            return Err(Error::Internal(format!(
                "cuDNN computes a {out:?} output for {g:?}, the engine {y_dims:?}"
            )));
        }
        Ok(d)
    }
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: each non-null descriptor was created by this struct and is destroyed once;
        // errors are ignored as in `Handle`.
        unsafe {
            if !self.x.is_null() {
                let _ = dnn::destroy_tensor_descriptor(self.x);
            }
            if !self.y.is_null() {
                let _ = dnn::destroy_tensor_descriptor(self.y);
            }
            if !self.w.is_null() {
                let _ = dnn::destroy_filter_descriptor(self.w);
            }
            if !self.conv.is_null() {
                let _ = dnn::destroy_convolution_descriptor(self.conv);
            }
        }
    }
}

/// One geometry: its descriptors and choices, or why it cannot run.
struct Plan {
    /// Order of first use, for reports.
    seq: usize,
    ready: std::result::Result<(Descriptors, [Choice; 3]), String>,
}

struct State {
    handle: Handle,
    plans: HashMap<ConvGeom, Plan>,
    /// Batch-normalization descriptors by (n, c, hw), created on first use.
    bn: HashMap<BnKey, BnDescriptors>,
    /// How many batch-normalization calls (forward and backward) cuDNN has run.
    bn_calls: usize,
}

// SAFETY: cuDNN handles and descriptors may be used from any host thread, one thread at a time
// (cuDNN's thread-safety rule); every use goes through the Mutex around the State.
unsafe impl Send for State {}

/// Elements of x, w and y.
fn sizes(g: &ConvGeom) -> (usize, usize, usize) {
    (
        g.n * g.c_in * g.h * g.w,
        g.c_out * g.col_rows(),
        g.n * g.c_out * g.h_out * g.w_out,
    )
}

/// A one-line description of `g`: `n8 c64 56x56 -> c64 56x56, k3x3 s1x1 p1x1 d1x1 g1`.
fn shape(g: &ConvGeom) -> String {
    format!(
        "n{} c{} {}x{} -> c{} {}x{}, k{}x{} s{}x{} p{}x{} d{}x{} g{}",
        g.n,
        g.c_in,
        g.h,
        g.w,
        g.c_out,
        g.h_out,
        g.w_out,
        g.kh,
        g.kw,
        g.stride.0,
        g.stride.1,
        g.pad.0,
        g.pad.1,
        g.dilation.0,
        g.dilation.1,
        g.groups
    )
}

/// A batch-normalization geometry: (n, c, hw).
type BnKey = (usize, usize, usize);

/// Whether cuDNN runs batch normalization of `g` (n × c × hw) here: more than one value per
/// channel (the engine's statistics come from cuDNN's unbiased running variance, see
/// [`Cudnn::batchnorm_forward_train`], which one value leaves undefined) and a tensor cuDNN's
/// 32-bit ints index. Elsewhere the handwritten kernels run it.
pub fn batchnorm_supported(g: &ChannelGeom) -> bool {
    let m = g.n * g.hw;
    m > 1 && g.c > 0 && i32::try_from(g.n * g.c * g.hw).is_ok() && i32::try_from(g.hw).is_ok()
}

/// The descriptors of one batch-normalization geometry: x (and y, dy, dx) as an NCHW tensor
/// n × c × hw × 1, and the per-channel tensor 1 × c × 1 × 1 of gamma, beta, their gradients
/// and the statistics (what `cudnnDeriveBNTensorDescriptor` derives for spatial mode).
struct BnDescriptors {
    x: sys::cudnnTensorDescriptor_t,
    channel: sys::cudnnTensorDescriptor_t,
}

impl BnDescriptors {
    fn new(&(n, c, hw): &BnKey) -> Result<BnDescriptors> {
        let (float, nchw) = (
            sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
            sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW,
        );
        let i = dim32;
        let x_dims = [i(n, "batch")?, i(c, "channels")?, i(hw, "plane")?, 1];
        let c_dims = [1, i(c, "channels")?, 1, 1];
        // Null until created, so that drop destroys only what exists.
        let mut d = BnDescriptors {
            x: null_mut(),
            channel: null_mut(),
        };
        d.x = dnn::create_tensor_descriptor()?;
        d.channel = dnn::create_tensor_descriptor()?;
        // SAFETY: the descriptors were just created; everything else is plain values.
        unsafe {
            dnn::set_tensor4d_descriptor(d.x, nchw, float, x_dims)?;
            dnn::set_tensor4d_descriptor(d.channel, nchw, float, c_dims)?;
        }
        Ok(d)
    }
}

impl Drop for BnDescriptors {
    fn drop(&mut self) {
        // SAFETY: each non-null descriptor was created by this struct and is destroyed once;
        // errors are ignored as in `Handle`.
        unsafe {
            if !self.x.is_null() {
                let _ = dnn::destroy_tensor_descriptor(self.x);
            }
            if !self.channel.is_null() {
                let _ = dnn::destroy_tensor_descriptor(self.channel);
            }
        }
    }
}

/// cuDNN's convolutions on one device's stream.
pub struct Cudnn {
    stream: Arc<CudaStream>,
    /// The device's allocator, which the scratch of algorithm searches is leased from.
    allocator: Arc<Allocator>,
    precision: Precision,
    /// Deterministic algorithms only (`--conv cudnn-deterministic`).
    deterministic: bool,
    version: usize,
    state: Mutex<State>,
}

impl Cudnn {
    /// cuDNN on `stream`, computing in `precision`; an error saying what is missing when cuDNN
    /// 9 cannot be loaded.
    pub fn new(
        stream: Arc<CudaStream>,
        precision: Precision,
        deterministic: bool,
        allocator: Arc<Allocator>,
    ) -> Result<Cudnn> {
        let version = load()?;
        libs::load_cudnn_sublibraries();
        stream.context().bind_to_thread().map_err(driver_error)?;
        let handle = Handle(dnn::create_handle()?);
        // SAFETY: the handle and the stream are live; cuDNN's stream type is the driver's.
        unsafe { dnn::set_stream(handle.0, stream.cu_stream() as sys::cudaStream_t) }?;
        Ok(Cudnn {
            stream,
            allocator,
            precision,
            deterministic,
            version,
            state: Mutex::new(State {
                handle,
                plans: HashMap::new(),
                bn: HashMap::new(),
                bn_calls: 0,
            }),
        })
    }

    /// `cuDNN 9.8.0`.
    pub fn describe(&self) -> String {
        format!("cuDNN {}", version_string(self.version))
    }

    /// One line per convolution geometry run so far, in order: the algorithm of each pass;
    /// then, where batch normalization ran through cuDNN, one line saying so.
    pub fn algorithms(&self) -> Vec<String> {
        let s = lock(&self.state);
        let mut plans: Vec<_> = s.plans.iter().collect();
        plans.sort_by_key(|(_, p)| p.seq);
        let bn = (s.bn_calls > 0).then(|| {
            format!(
                "batch norm: cuDNN (spatial), {} shape{}, {} call{} (fused BN+ReLU and eval: \
                 handwritten kernels)",
                s.bn.len(),
                if s.bn.len() == 1 { "" } else { "s" },
                s.bn_calls,
                if s.bn_calls == 1 { "" } else { "s" },
            )
        });
        plans
            .into_iter()
            .map(|(g, p)| match &p.ready {
                Ok((_, choices)) => {
                    let passes: Vec<String> = Pass::ALL
                        .iter()
                        .zip(choices)
                        .map(|(pass, c)| format!("{} {}", pass.name(), c.describe(*pass)))
                        .collect();
                    format!("{}: {}", shape(g), passes.join("; "))
                }
                Err(e) => format!("{}: not run: {e}", shape(g)),
            })
            .chain(bn)
            .collect()
    }

    /// Workspace elements (f32) the passes of `g` need; chooses their algorithms the first
    /// time. A geometry cuDNN cannot run needs none here, and its passes say why.
    pub fn workspace(&self, g: &ConvGeom) -> usize {
        let mut s = lock(&self.state);
        self.prepare(&mut s, g);
        match &s.plans[g].ready {
            Ok((_, choices)) => choices
                .iter()
                .map(|c| c.workspace)
                .max()
                .unwrap_or(0)
                .div_ceil(4),
            Err(_) => 0,
        }
    }

    /// y = conv(x, w).
    pub fn forward(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        ws: &mut CudaSlice<f32>,
        g: &ConvGeom,
    ) -> Result<()> {
        self.run(Pass::Forward, g, (x, w), y, ws)
    }

    /// dx = the gradient of the input from dy and w.
    pub fn backward_data(
        &self,
        dy: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        dx: &mut CudaSlice<f32>,
        ws: &mut CudaSlice<f32>,
        g: &ConvGeom,
    ) -> Result<()> {
        self.run(Pass::BackwardData, g, (w, dy), dx, ws)
    }

    /// dw += the gradient of the filter from x and dy.
    pub fn backward_filter(
        &self,
        x: &CudaSlice<f32>,
        dy: &CudaSlice<f32>,
        dw: &mut CudaSlice<f32>,
        ws: &mut CudaSlice<f32>,
        g: &ConvGeom,
    ) -> Result<()> {
        self.run(Pass::BackwardFilter, g, (x, dy), dw, ws)
    }

    /// Batch normalization's training forward through `cudnnBatchNormalizationForwardTraining`
    /// (spatial mode: statistics over n × hw per channel): y, and the batch mean and the
    /// BIASED batch variance per channel in `mean` and `var`, as the `Backend` contract and
    /// the handwritten kernels give them. No running statistics are touched (the runtime
    /// commits them separately, from `mean` and `var`).
    ///
    /// cuDNN hands out the batch variance in two forms only: 1/sqrt(var + eps) (its "saved
    /// inverse variance") and, blended into its running variance, the UNBIASED variance
    /// Σ(x - mean)² / (m - 1), m = n hw. Recovering var from the first, 1/invstd² - eps,
    /// cancels catastrophically where var is small beside eps. So `mean` and `var` are passed
    /// as cuDNN's "running" buffers with an exponential-average factor of 1 (running = batch:
    /// they are zeroed first, as 0 · NaN would poison the blend), and var is then scaled by
    /// (m - 1)/m with `cudnnScaleTensor`. That costs two f32 roundings beyond cuDNN's own
    /// variance (the factor (m - 1)/m rounded to f32, and the product): a few units in the last
    /// place of var, where the handwritten kernel rounds a double-accumulated variance once.
    /// y is computed by cuDNN from its own statistics (not read back from `var`).
    ///
    /// `save` (2c f32, scratch leased by the caller) receives cuDNN's saved mean and inverse
    /// standard deviation, which nothing reads afterwards: the engine's backward gets `mean`
    /// and `var` again and recomputes invstd from them.
    #[allow(clippy::too_many_arguments)]
    pub fn batchnorm_forward_train(
        &self,
        x: &CudaSlice<f32>,
        gamma: &CudaSlice<f32>,
        beta: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        mean: &mut CudaSlice<f32>,
        var: &mut CudaSlice<f32>,
        save: &mut CudaSlice<f32>,
        eps: f64,
        g: &ChannelGeom,
    ) -> Result<()> {
        let numel = g.n * g.c * g.hw;
        bn_lengths(
            "forward",
            g,
            &[
                (x.len(), numel),
                (y.len(), numel),
                (gamma.len(), g.c),
                (beta.len(), g.c),
                (mean.len(), g.c),
                (var.len(), g.c),
                (save.len(), 2 * g.c),
            ],
        )?;
        let m = g.n * g.hw;
        let mut s = lock(&self.state);
        self.bind()?;
        let key = (g.n, g.c, g.hw);
        if let std::collections::hash_map::Entry::Vacant(e) = s.bn.entry(key) {
            e.insert(BnDescriptors::new(&key)?);
        }
        let (h, d) = (&s.handle, &s.bn[&key]);
        self.stream.memset_zeros(mean).map_err(driver_error)?;
        self.stream.memset_zeros(var).map_err(driver_error)?;
        let (one, zero) = (1.0f32, 0.0f32);
        // Biased from unbiased: × (m - 1)/m, the factor rounded once to f32.
        let unbias = ((m - 1) as f64 / m as f64) as f32;
        let (xp, _gx) = x.device_ptr(&self.stream);
        let (gp, _gg) = gamma.device_ptr(&self.stream);
        let (bp, _gb) = beta.device_ptr(&self.stream);
        let (yp, _gy) = y.device_ptr_mut(&self.stream);
        let (mp, _gm) = mean.device_ptr_mut(&self.stream);
        let (vp, _gv) = var.device_ptr_mut(&self.stream);
        let (sp, _gs) = save.device_ptr_mut(&self.stream);
        let save_mean = sp as *mut c_void;
        // The second half of `save`: c f32 after the first.
        let save_inv = (sp + (4 * g.c) as u64) as *mut c_void;
        // SAFETY: the descriptors describe g, and every buffer holds as many f32 as they say
        // (checked above); alpha, beta and the scale point to f32 on the stack, as cuDNN wants
        // for float data. All on the handle's stream, the backend's only one.
        unsafe {
            sys::cudnnBatchNormalizationForwardTraining(
                h.0,
                sys::cudnnBatchNormMode_t::CUDNN_BATCHNORM_SPATIAL,
                (&one as *const f32).cast(),
                (&zero as *const f32).cast(),
                d.x,
                xp as *const c_void,
                d.x,
                yp as *mut c_void,
                d.channel,
                gp as *const c_void,
                bp as *const c_void,
                1.0,
                mp as *mut c_void,
                vp as *mut c_void,
                eps,
                save_mean,
                save_inv,
            )
            .result()?;
            sys::cudnnScaleTensor(
                h.0,
                d.channel,
                vp as *mut c_void,
                (&unbias as *const f32).cast(),
            )
            .result()?;
        }
        drop(s);
        self.count_bn();
        Ok(())
    }

    /// Batch normalization's backward through `cudnnBatchNormalizationBackward` (spatial
    /// mode): dx is overwritten (alphaDataDiff 1, betaDataDiff 0); dgamma and dbeta ACCUMULATE
    /// (alphaParamDiff 1, betaParamDiff 1), as the `Backend` contract wants. cuDNN takes the
    /// statistics as the batch mean and the inverse standard deviation: `inv_std` holds
    /// 1/sqrtf(var + eps) per channel, computed by the caller from the engine's biased `var`
    /// exactly as the handwritten kernels compute it, so the gradient is that of the
    /// statistics the forward stored.
    #[allow(clippy::too_many_arguments)]
    pub fn batchnorm_backward(
        &self,
        x: &CudaSlice<f32>,
        dy: &CudaSlice<f32>,
        gamma: &CudaSlice<f32>,
        mean: &CudaSlice<f32>,
        inv_std: &CudaSlice<f32>,
        dx: &mut CudaSlice<f32>,
        dgamma: &mut CudaSlice<f32>,
        dbeta: &mut CudaSlice<f32>,
        eps: f64,
        g: &ChannelGeom,
    ) -> Result<()> {
        let numel = g.n * g.c * g.hw;
        bn_lengths(
            "backward",
            g,
            &[
                (x.len(), numel),
                (dy.len(), numel),
                (dx.len(), numel),
                (gamma.len(), g.c),
                (mean.len(), g.c),
                (inv_std.len(), g.c),
                (dgamma.len(), g.c),
                (dbeta.len(), g.c),
            ],
        )?;
        let mut s = lock(&self.state);
        self.bind()?;
        let key = (g.n, g.c, g.hw);
        if let std::collections::hash_map::Entry::Vacant(e) = s.bn.entry(key) {
            e.insert(BnDescriptors::new(&key)?);
        }
        let (h, d) = (&s.handle, &s.bn[&key]);
        let (one, zero) = (1.0f32, 0.0f32);
        let (one, zero) = (
            (&one as *const f32).cast::<c_void>(),
            (&zero as *const f32).cast::<c_void>(),
        );
        let (xp, _gx) = x.device_ptr(&self.stream);
        let (dyp, _gdy) = dy.device_ptr(&self.stream);
        let (gp, _gg) = gamma.device_ptr(&self.stream);
        let (mp, _gm) = mean.device_ptr(&self.stream);
        let (ip, _gi) = inv_std.device_ptr(&self.stream);
        let (dxp, _gdx) = dx.device_ptr_mut(&self.stream);
        let (dgp, _gdg) = dgamma.device_ptr_mut(&self.stream);
        let (dbp, _gdb) = dbeta.device_ptr_mut(&self.stream);
        // SAFETY: as in the forward: the descriptors describe g and the buffers their sizes
        // (checked above); the four blend factors point to f32 on the stack.
        unsafe {
            sys::cudnnBatchNormalizationBackward(
                h.0,
                sys::cudnnBatchNormMode_t::CUDNN_BATCHNORM_SPATIAL,
                one,
                zero,
                one,
                one,
                d.x,
                xp as *const c_void,
                d.x,
                dyp as *const c_void,
                d.x,
                dxp as *mut c_void,
                d.channel,
                gp as *const c_void,
                dgp as *mut c_void,
                dbp as *mut c_void,
                eps,
                mp as *const c_void,
                ip as *const c_void,
            )
        }
        .result()?;
        drop(s);
        self.count_bn();
        Ok(())
    }

    fn count_bn(&self) {
        lock(&self.state).bn_calls += 1;
    }

    fn bind(&self) -> Result<()> {
        self.stream.context().bind_to_thread().map_err(driver_error)
    }

    /// The math searched with: FMA only for FP32, tensor cores (TF32) allowed for TF32.
    fn base_math(&self) -> sys::cudnnMathType_t {
        match self.precision {
            Precision::Fp32 | Precision::Bf16 | Precision::Fp16 => {
                sys::cudnnMathType_t::CUDNN_FMA_MATH
            }
            Precision::Tf32 => sys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
        }
    }

    /// Whether an algorithm's math keeps to the precision (see the module's documentation).
    fn allows(&self, math: u32) -> bool {
        use sys::cudnnMathType_t::*;
        let ok: &[sys::cudnnMathType_t] = match self.precision {
            Precision::Fp32 | Precision::Bf16 | Precision::Fp16 => &[CUDNN_FMA_MATH],
            Precision::Tf32 => &[CUDNN_TENSOR_OP_MATH, CUDNN_DEFAULT_MATH, CUDNN_FMA_MATH],
        };
        ok.iter().any(|&m| m as u32 == math)
    }

    /// Makes the plan of `g` (descriptors and choices, or the error) if there is none yet.
    fn prepare(&self, s: &mut State, g: &ConvGeom) {
        if s.plans.contains_key(g) {
            return;
        }
        let seq = s.plans.len();
        let ready = self.plan(&s.handle, g).map_err(|e| e.to_string());
        s.plans.insert(*g, Plan { seq, ready });
    }

    fn plan(&self, h: &Handle, g: &ConvGeom) -> Result<(Descriptors, [Choice; 3])> {
        self.bind()?;
        let d = Descriptors::new(g)?;
        let key = (
            self.stream.context().ordinal(),
            self.precision,
            self.deterministic,
            *g,
        );
        let known = lock(&CHOSEN).get(&key).copied();
        let choices = match known {
            Some(c) => c,
            None => {
                let c = self.choose(h, &d, g)?;
                // The first instance to choose for a key wins, so that all of them agree.
                *lock(&CHOSEN).entry(key).or_insert(c)
            }
        };
        Ok((d, choices))
    }

    /// Times every algorithm of each pass (or, without room for the scratch, ranks them by
    /// cuDNN's heuristics) and keeps, per pass, the first usable one in order of preference.
    fn choose(&self, h: &Handle, d: &Descriptors, g: &ConvGeom) -> Result<[Choice; 3]> {
        // SAFETY: the descriptor is live.
        unsafe { dnn::set_convolution_math_type(d.conv, self.base_math()) }?;
        let timed = self.measure(h, d, g)?;
        let mut choices = [Choice::default(); 3];
        for (i, (pass, c)) in Pass::ALL.into_iter().zip(&mut choices).enumerate() {
            let mut why = Vec::new();
            // Timed first; where no timed algorithm is usable (cuDNN reports some failing to
            // run in its search), cuDNN's heuristics.
            let tries = timed
                .as_ref()
                .map(|(perfs, limit)| (perfs[i].clone(), true, *limit))
                .into_iter()
                .chain([(heuristics(h, d, pass)?, false, WORKSPACE_LIMIT)]);
            let mut found = None;
            for (perfs, measured, limit) in tries {
                why.push(format!(
                    "{}: {}",
                    if measured { "timed" } else { "by heuristics" },
                    self.offered(pass, &perfs, measured, limit)
                ));
                found = self.pick(h, d, pass, perfs, measured, limit)?;
                if found.is_some() {
                    break;
                }
            }
            *c =
                found.ok_or_else(|| {
                    Error::Device(format!(
                    "cuDNN has no {} algorithm in {} math{} within {} of workspace for {} ({}); \
                     use the native kernels",
                    pass.name(),
                    self.precision,
                    if self.deterministic { ", deterministic," } else { "" },
                    human_bytes(WORKSPACE_LIMIT as u64),
                    shape(g),
                    why.join("; "),
                ))
                })?;
        }
        Ok(choices)
    }

    /// cuDNN's timings of every algorithm of the three passes, run on zero-filled scratch
    /// operands with the returned bytes of workspace at most; `None` when the scratch does not
    /// fit in the device's capacity beside what is live, or a search fails (the heuristics
    /// then choose).
    fn measure(
        &self,
        h: &Handle,
        d: &Descriptors,
        g: &ConvGeom,
    ) -> Result<Option<([Vec<Perf>; 3], usize)>> {
        let (nx, nw, ny) = sizes(g);
        let bytes = |n: usize| (4 * n) as u64;
        let Ok(_operands) = self
            .allocator
            .lease(bytes(nx + nw + ny), Category::Workspace)
        else {
            return Ok(None);
        };
        let stats = self.allocator.stats();
        let room = stats
            .capacity
            .map_or(u64::MAX, |c| c.saturating_sub(stats.live.total()));
        let limit = WORKSPACE_LIMIT.min(usize::try_from(room).unwrap_or(usize::MAX));
        let Ok(_workspace) = self.allocator.lease(limit as u64, Category::Workspace) else {
            return Ok(None);
        };
        let (Ok(mut x), Ok(mut w), Ok(mut y), Ok(mut ws)) = (
            alloc_zeros::<f32>(&self.stream, nx),
            alloc_zeros::<f32>(&self.stream, nw),
            alloc_zeros::<f32>(&self.stream, ny),
            alloc_zeros::<u8>(&self.stream, limit),
        ) else {
            return Ok(None);
        };
        // Raw addresses for the C calls. Event tracking is off on the backend's context, so
        // the guards cudarc returns with them record nothing; the buffers outlive the searches,
        // which block the host until they are done.
        let (xp, wp, yp) = (
            x.device_ptr_mut(&self.stream).0 as *mut c_void,
            w.device_ptr_mut(&self.stream).0 as *mut c_void,
            y.device_ptr_mut(&self.stream).0 as *mut c_void,
        );
        let wsp = if limit == 0 {
            null_mut()
        } else {
            ws.device_ptr_mut(&self.stream).0 as *mut c_void
        };
        let mut perfs: [Vec<Perf>; 3] = Default::default();
        for (pass, out) in Pass::ALL.into_iter().zip(&mut perfs) {
            let mut buf = vec![Perf::default(); pass.count()];
            let (want, mut got) = (pass.count() as c_int, 0 as c_int);
            let p = buf.as_mut_ptr();
            // SAFETY: the descriptors are live and describe the scratch buffers (x, w and y
            // stand in for dx, dw and dy); `buf` holds `want` structs of the perf layout
            // (checked above); the workspace holds `limit` bytes.
            let status = unsafe {
                match pass {
                    Pass::Forward => sys::cudnnFindConvolutionForwardAlgorithmEx(
                        h.0,
                        d.x,
                        xp,
                        d.w,
                        wp,
                        d.conv,
                        d.y,
                        yp,
                        want,
                        &mut got,
                        p.cast(),
                        wsp,
                        limit,
                    ),
                    Pass::BackwardData => sys::cudnnFindConvolutionBackwardDataAlgorithmEx(
                        h.0,
                        d.w,
                        wp,
                        d.y,
                        yp,
                        d.conv,
                        d.x,
                        xp,
                        want,
                        &mut got,
                        p.cast(),
                        wsp,
                        limit,
                    ),
                    Pass::BackwardFilter => sys::cudnnFindConvolutionBackwardFilterAlgorithmEx(
                        h.0,
                        d.x,
                        xp,
                        d.y,
                        yp,
                        d.conv,
                        d.w,
                        wp,
                        want,
                        &mut got,
                        p.cast(),
                        wsp,
                        limit,
                    ),
                }
            };
            if status.result().is_err() {
                return Ok(None);
            }
            buf.truncate(got.clamp(0, want) as usize);
            *out = buf;
        }
        Ok(Some((perfs, limit)))
    }

    /// What cuDNN offered for `pass` and why each was refused (or `none`), for the error that
    /// says no algorithm is usable: `ALGO_0 status 3; ALGO_1 tensor-op math; ...`.
    fn offered(&self, pass: Pass, perfs: &[Perf], measured: bool, limit: usize) -> String {
        let list: Vec<String> = perfs
            .iter()
            .map(|p| {
                let choice = Choice {
                    algo: p.algo,
                    math: p.math,
                    workspace: p.memory,
                    ms: measured.then_some(p.time),
                    deterministic: p.determinism == DETERMINISTIC,
                };
                let why = if p.status != SUCCESS {
                    format!("status {}", p.status)
                } else if p.memory > limit {
                    "workspace".into()
                } else if !self.allows(p.math) {
                    "math".into()
                } else if measured && p.time < 0.0 {
                    "untimed".into()
                } else if self.deterministic && p.determinism != DETERMINISTIC {
                    "non-deterministic".into()
                } else {
                    "workspace in this math".into()
                };
                format!("{} refused: {why}", choice.describe(pass))
            })
            .collect();
        if list.is_empty() {
            "none offered".into()
        } else {
            list.join("; ")
        }
    }

    /// The first usable algorithm of `perfs` in order of preference: fastest first (or in
    /// cuDNN's ranking, for heuristics), with the best deterministic one moved to the front
    /// when it is within [`DETERMINISM_SLACK`] of the fastest (heuristics: always).
    fn pick(
        &self,
        h: &Handle,
        d: &Descriptors,
        pass: Pass,
        perfs: Vec<Perf>,
        measured: bool,
        limit: usize,
    ) -> Result<Option<Choice>> {
        let mut ranked: Vec<Perf> = perfs
            .into_iter()
            .filter(|p| {
                p.status == SUCCESS
                    && p.memory <= limit
                    && self.allows(p.math)
                    && (!measured || p.time >= 0.0)
                    && (!self.deterministic || p.determinism == DETERMINISTIC)
            })
            .collect();
        if measured {
            ranked.sort_by(|a, b| a.time.total_cmp(&b.time));
        }
        if let Some(i) = ranked.iter().position(|p| p.determinism == DETERMINISTIC) {
            if !measured || ranked[i].time <= ranked[0].time * DETERMINISM_SLACK {
                let p = ranked.remove(i);
                ranked.insert(0, p);
            }
        }
        for p in ranked {
            // The workspace as cuDNN states it for the math the pass will run with.
            let need = workspace_size(h, d, pass, &p)?.max(p.memory);
            if need <= limit {
                return Ok(Some(Choice {
                    algo: p.algo,
                    math: p.math,
                    workspace: need,
                    ms: measured.then_some(p.time),
                    deterministic: p.determinism == DETERMINISTIC,
                }));
            }
        }
        Ok(None)
    }

    /// Runs `pass` of `g`: inputs (x, w), (w, dy) or (x, dy) into y, dx or dw.
    fn run(
        &self,
        pass: Pass,
        g: &ConvGeom,
        (a, b): (&CudaSlice<f32>, &CudaSlice<f32>),
        out: &mut CudaSlice<f32>,
        ws: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (nx, nw, ny) = sizes(g);
        let want = match pass {
            Pass::Forward => [nx, nw, ny],
            Pass::BackwardData => [nw, ny, nx],
            Pass::BackwardFilter => [nx, ny, nw],
        };
        if [a.len(), b.len(), out.len()] != want {
            return Err(Error::Internal(format!(
                "cuDNN {} of {}: buffers of {:?} elements, {want:?} expected",
                pass.name(),
                shape(g),
                [a.len(), b.len(), out.len()]
            )));
        }
        let mut s = lock(&self.state);
        self.prepare(&mut s, g);
        let (h, plan) = (&s.handle, &s.plans[g]);
        let (d, choices) = plan.ready.as_ref().map_err(|e| Error::Device(e.clone()))?;
        let c = choices[pass as usize];
        if ws.num_bytes() < c.workspace {
            return Err(Error::Internal(format!(
                "cuDNN {} of {}: a workspace of {} bytes, {} needed",
                pass.name(),
                shape(g),
                ws.num_bytes(),
                c.workspace
            )));
        }
        self.bind()?;
        // SAFETY: the descriptor is live; the math type is one cuDNN reported.
        unsafe { dnn::set_convolution_math_type(d.conv, math_type(c.math)?) }?;
        let (one, zero) = (1.0f32, 0.0f32);
        let alpha = (&one as *const f32).cast::<c_void>();
        // dw accumulates (the Backend contract); y and dx are overwritten.
        let beta = if pass == Pass::BackwardFilter {
            alpha
        } else {
            (&zero as *const f32).cast::<c_void>()
        };
        let (ap, _ga) = a.device_ptr(&self.stream);
        let (bp, _gb) = b.device_ptr(&self.stream);
        let (op, _go) = out.device_ptr_mut(&self.stream);
        let (ap, bp, op) = (ap as *const c_void, bp as *const c_void, op as *mut c_void);
        let (wsp, ws_bytes) = if ws.is_empty() {
            (null_mut(), 0)
        } else {
            let bytes = ws.num_bytes();
            (ws.device_ptr_mut(&self.stream).0 as *mut c_void, bytes)
        };
        // SAFETY: the descriptors describe g, and the buffers hold as many elements as g says
        // (checked above); the workspace holds at least what the algorithm needs; alpha and
        // beta point to f32 on the stack, as cuDNN wants for float data. All on the handle's
        // stream, the backend's only one.
        unsafe {
            match pass {
                Pass::Forward => dnn::convolution_forward(
                    h.0,
                    alpha,
                    d.x,
                    ap,
                    d.w,
                    bp,
                    d.conv,
                    fwd_algo(c.algo)?,
                    wsp,
                    ws_bytes,
                    beta,
                    d.y,
                    op,
                ),
                Pass::BackwardData => dnn::convolution_backward_data(
                    h.0,
                    alpha,
                    d.w,
                    ap,
                    d.y,
                    bp,
                    d.conv,
                    data_algo(c.algo)?,
                    wsp,
                    ws_bytes,
                    beta,
                    d.x,
                    op,
                ),
                Pass::BackwardFilter => dnn::convolution_backward_filter(
                    h.0,
                    alpha,
                    d.x,
                    ap,
                    d.y,
                    bp,
                    d.conv,
                    filter_algo(c.algo)?,
                    wsp,
                    ws_bytes,
                    beta,
                    d.w,
                    op,
                ),
            }
        }?;
        Ok(())
    }
}

impl Drop for Cudnn {
    fn drop(&mut self) {
        // The handle (dropped after this) is destroyed with its context current.
        let _ = self.bind();
    }
}

/// An error unless each (length, expected) pair agrees.
fn bn_lengths(pass: &str, g: &ChannelGeom, pairs: &[(usize, usize)]) -> Result<()> {
    if pairs.iter().any(|(got, want)| got != want) {
        return Err(Error::Internal(format!(
            "cuDNN batch-norm {pass} of {g:?}: buffers of {:?} elements, {:?} expected",
            pairs.iter().map(|p| p.0).collect::<Vec<_>>(),
            pairs.iter().map(|p| p.1).collect::<Vec<_>>()
        )));
    }
    Ok(())
}

/// cuDNN's ranking of the algorithms of `pass`, without running them.
fn heuristics(h: &Handle, d: &Descriptors, pass: Pass) -> Result<Vec<Perf>> {
    let mut buf = vec![Perf::default(); pass.count()];
    let (want, mut got) = (pass.count() as c_int, 0 as c_int);
    let p = buf.as_mut_ptr();
    // SAFETY: the descriptors are live; `buf` holds `want` structs of the perf layout.
    unsafe {
        match pass {
            Pass::Forward => sys::cudnnGetConvolutionForwardAlgorithm_v7(
                h.0,
                d.x,
                d.w,
                d.conv,
                d.y,
                want,
                &mut got,
                p.cast(),
            ),
            Pass::BackwardData => sys::cudnnGetConvolutionBackwardDataAlgorithm_v7(
                h.0,
                d.w,
                d.y,
                d.conv,
                d.x,
                want,
                &mut got,
                p.cast(),
            ),
            Pass::BackwardFilter => sys::cudnnGetConvolutionBackwardFilterAlgorithm_v7(
                h.0,
                d.x,
                d.y,
                d.conv,
                d.w,
                want,
                &mut got,
                p.cast(),
            ),
        }
    }
    .result()?;
    buf.truncate(got.clamp(0, want) as usize);
    Ok(buf)
}

/// Bytes of workspace `p`'s algorithm needs in `p`'s math.
fn workspace_size(h: &Handle, d: &Descriptors, pass: Pass, p: &Perf) -> Result<usize> {
    // SAFETY: the handle and descriptors are live; the enums are converted from cuDNN's own
    // values.
    unsafe {
        dnn::set_convolution_math_type(d.conv, math_type(p.math)?)?;
        Ok(match pass {
            Pass::Forward => dnn::get_convolution_forward_workspace_size(
                h.0,
                d.x,
                d.w,
                d.conv,
                d.y,
                fwd_algo(p.algo)?,
            )?,
            Pass::BackwardData => dnn::get_convolution_backward_data_workspace_size(
                h.0,
                d.w,
                d.y,
                d.conv,
                d.x,
                data_algo(p.algo)?,
            )?,
            Pass::BackwardFilter => dnn::get_convolution_backward_filter_workspace_size(
                h.0,
                d.x,
                d.y,
                d.conv,
                d.w,
                filter_algo(p.algo)?,
            )?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cudnn_loads_or_says_where_it_looked() {
        match load() {
            Ok(v) => assert!(v >= 90000, "{v}"),
            Err(e) => {
                let e = e.to_string();
                assert!(
                    e.contains("cuDNN") && e.contains("GEMS_CUDA_LIB_DIRS"),
                    "unclear error: {e}"
                );
            }
        }
    }

    #[test]
    fn versions_and_shapes_read_well() {
        assert_eq!(version_string(90800), "9.8.0");
        assert_eq!(version_string(91002), "9.10.2");
        let g = ConvGeom {
            n: 8,
            c_in: 64,
            h: 56,
            w: 56,
            c_out: 128,
            kh: 3,
            kw: 3,
            stride: (2, 2),
            pad: (1, 1),
            dilation: (1, 1),
            groups: 1,
            h_out: 28,
            w_out: 28,
        };
        assert_eq!(
            shape(&g),
            "n8 c64 56x56 -> c128 28x28, k3x3 s2x2 p1x1 d1x1 g1"
        );
        let c = Choice {
            algo: 1,
            math: sys::cudnnMathType_t::CUDNN_FMA_MATH as u32,
            workspace: 3 << 20,
            ms: Some(0.25),
            deterministic: true,
        };
        assert_eq!(
            c.describe(Pass::Forward),
            "FWD_ALGO_IMPLICIT_PRECOMP_GEMM (fma, 0.250 ms, 3.00 MiB workspace)"
        );
        assert!(c
            .describe(Pass::BackwardFilter)
            .starts_with("BWD_FILTER_ALGO_1"));
        let nd = Choice {
            deterministic: false,
            ms: None,
            ..c
        };
        assert!(nd
            .describe(Pass::BackwardData)
            .ends_with("by heuristics, 3.00 MiB workspace, non-deterministic)"));
    }
}
