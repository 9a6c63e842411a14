//! The reference backend: f32 and f64 on the host (bf16 and f16 computed in f32, see
//! `wide`), convolutions through im2col and the `gemm` crate (3×3 stride-1 ones by
//! `winograd`, F(4×4, 3×3) or F(2×2, 3×3) by geometry; f32 products with a small left
//! operand by `skinny`'s AVX2 kernel), parallel with rayon. Every kernel is deterministic:
//! the same inputs give the same bits on the same machine.

/// `simd!(|| ...)` runs the closure compiled for AVX2 where the CPU has it (see
/// [`with_avx2`]). The closure is always inlined there: LLVM compiled a large one apart
/// otherwise, for baseline x86-64 (Winograd's input transform ran on SSE so, 13% of a
/// resnet20v2 kernel benchmark).
macro_rules! simd {
    ($f:expr $(,)?) => {
        $crate::backend::cpu::with_avx2(
            #[inline(always)]
            $f,
        )
    };
}

mod conv;
mod elementwise;
mod groupnorm;
pub use crate::core::rng::{splitmix64, uniform};
mod norm;
mod pool;
mod resize;
#[cfg(target_arch = "x86_64")]
mod skinny;
mod wide;
mod winograd;

use rayon::prelude::*;

use std::sync::Arc;

use super::{
    AdamStep, Backend, ChannelGeom, ConvGeom, Event, GroupGeom, LossGeom, MaskGeom, Nonlinearity,
    PoolGeom, ResizeGeom, SgdStep, POISON,
};
use crate::backend::host::{Block, HostPool};
use crate::backend::Storage;
use crate::core::DType;
use crate::{Error, Result};

/// The element types the CPU kernels are written over.
pub trait Float:
    num_traits::Float
    + Send
    + Sync
    + 'static
    + Default
    + std::fmt::Debug
    + std::iter::Sum
    + std::ops::AddAssign
    + std::ops::SubAssign
    + std::ops::MulAssign
{
    /// The elements of `s` as this type (an error for another dtype).
    fn view(s: &Storage) -> Result<&[Self]>;
    /// The elements of `s` as this type, writable.
    fn view_mut(s: &mut Storage) -> Result<&mut [Self]>;
    /// `x` rounded to this type.
    fn of(x: f64) -> Self;
    /// The value as f64.
    fn f64(self) -> f64;
    /// The error function (GELU's), correctly rounded to within an ulp or so (libm's).
    fn erf(self) -> Self;
}

macro_rules! impl_float {
    ($t:ty, $variant:ident, $erf:path) => {
        impl Float for $t {
            fn view(s: &Storage) -> Result<&[Self]> {
                match s {
                    Storage::$variant(v) => Ok(v),
                    other => Err(dtype_mismatch(stringify!($t), other.dtype())),
                }
            }
            fn view_mut(s: &mut Storage) -> Result<&mut [Self]> {
                match s {
                    Storage::$variant(v) => Ok(v),
                    other => Err(dtype_mismatch(stringify!($t), other.dtype())),
                }
            }
            fn of(x: f64) -> Self {
                x as $t
            }
            fn f64(self) -> f64 {
                self as f64
            }
            fn erf(self) -> Self {
                $erf(self)
            }
        }
    };
}
impl_float!(f32, F32, libm::erff);
impl_float!(f64, F64, libm::erf);

fn dtype_mismatch(want: &str, got: DType) -> Error {
    Error::Internal(format!(
        "dtype mismatch: kernel for {want} got {}",
        got.name()
    ))
}

/// Runs `$body` with `$T` bound to the compute type of `$dtype` (f64 for f64, else f32) and
/// each storage named in `[inputs]` / `[outputs]` rebound to a slice of `$T`. bf16 and f16
/// storages are widened to f32 for the body and the outputs rounded back after it.
macro_rules! compute {
    ($dtype:expr, $T:ident, [$($i:ident),*], [$($o:ident),*] => $body:expr) => {
        match $dtype {
            DType::F64 => {
                #[allow(dead_code)]
                type $T = f64;
                $(let $i = <$T as Float>::view($i)?;)*
                $(let $o = <$T as Float>::view_mut($o)?;)*
                $body
            }
            _ => {
                #[allow(dead_code)]
                type $T = f32;
                $(let $i = wide::wide($i)?; let $i: &[f32] = &$i;)*
                $(let mut $o = wide::WideMut::new($o)?;)*
                #[allow(clippy::let_unit_value)]
                let result = {
                    $(let $o = $o.slice();)*
                    $body
                };
                $($o.finish()?;)*
                result
            }
        }
    };
}

/// A matrix inside a slice: element (i, j) is `data[i·rs + j·cs]`.
#[derive(Clone, Copy)]
pub(crate) struct View<'a, T> {
    pub data: &'a [T],
    pub rs: usize,
    pub cs: usize,
}

impl<'a, T> View<'a, T> {
    /// Row-major with `ld` elements between rows.
    pub fn rows(data: &'a [T], ld: usize) -> Self {
        View {
            data,
            rs: ld,
            cs: 1,
        }
    }
    /// The transpose (no copy).
    pub fn t(self) -> Self {
        View {
            data: self.data,
            rs: self.cs,
            cs: self.rs,
        }
    }
    fn fits(&self, rows: usize, cols: usize) -> bool {
        rows == 0 || cols == 0 || (rows - 1) * self.rs + (cols - 1) * self.cs < self.data.len()
    }
}

/// A pointer shared by parallel tasks that write disjoint elements through it.
#[derive(Clone, Copy)]
pub(crate) struct SharedOut<T>(pub *mut T);
// SAFETY: the tasks sharing it write disjoint elements (each user says which).
unsafe impl<T> Send for SharedOut<T> {}
unsafe impl<T> Sync for SharedOut<T> {}

impl<T> SharedOut<T> {
    /// Through a method, so closures capture the wrapper (which is Sync), not the raw field.
    pub fn at(&self, offset: usize) -> *mut T {
        self.0.wrapping_add(offset)
    }
}

/// dst (m×n, `dst_rs` between rows) = [dst +] lhs (m×k) · rhs (k×n): f32 with a small lhs
/// by [`skinny`] where the CPU has AVX2 and FMA, else by the gemm crate.
///
/// # Safety
/// `dst` must be valid for writes at every `i·dst_rs + j` (i < m, j < n), and no other thread
/// may touch those elements during the call.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_raw<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut T,
    dst_rs: usize,
    lhs: View<T>,
    rhs: View<T>,
    accumulate: bool,
    parallel: bool,
) {
    assert!(
        lhs.fits(m, k) && rhs.fits(k, n),
        "gemm operands out of bounds"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                std::slice::from_raw_parts_mut(dst.add(i * dst_rs), n).fill(T::zero());
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>() {
        // SAFETY: T is f32 (checked above), so the views and dst are f32 in fact.
        let (lhs, rhs) = unsafe {
            (
                std::mem::transmute::<View<T>, View<f32>>(lhs),
                std::mem::transmute::<View<T>, View<f32>>(rhs),
            )
        };
        if skinny::suits(m, n, k, &rhs) {
            skinny::product(m, n, k, dst.cast(), dst_rs, lhs, rhs, accumulate, parallel);
            return;
        }
    }
    let par = if parallel {
        gemm::Parallelism::Rayon(rayon::current_num_threads())
    } else {
        gemm::Parallelism::None
    };
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        dst_rs as isize,
        accumulate,
        lhs.data.as_ptr(),
        lhs.cs as isize,
        lhs.rs as isize,
        rhs.data.as_ptr(),
        rhs.cs as isize,
        rhs.rs as isize,
        T::one(),
        T::one(),
        false,
        false,
        false,
        par,
    )
}

/// dst (m×n, `dst_rs` between rows) = [dst +] lhs (m×k) · rhs (k×n).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [T],
    dst_rs: usize,
    lhs: View<T>,
    rhs: View<T>,
    accumulate: bool,
    parallel: bool,
) {
    assert!(
        m == 0 || n == 0 || (m - 1) * dst_rs + n <= dst.len(),
        "gemm destination out of bounds"
    );
    // SAFETY: the destination is an exclusively borrowed slice that holds every written index.
    unsafe {
        gemm_raw(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            dst_rs,
            lhs,
            rhs,
            accumulate,
            parallel,
        )
    }
}

/// Runs `f` compiled for AVX2 where the CPU has it. The crate is built for baseline x86-64,
/// so the element-wise loops (BN sums, affine maps) are otherwise vectorized 128 bits wide;
/// inlined here, the same loops use 256-bit vectors. The arithmetic and its order are the
/// same (no contraction into FMAs, reductions in the order written), so are the bits.
/// Called through [`simd!`], which marks the closure `#[inline(always)]`.
#[inline(always)]
fn with_avx2<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        #[target_feature(enable = "avx2")]
        fn avx2<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        // SAFETY: the CPU has AVX2 (checked above).
        return unsafe { avx2(f) };
    }
    f()
}

/// Runs `f` on one of the CPU pool's workers (in place where this thread is one): called from
/// outside the pool, every operator would wake a worker and sleep until it finished, two futex
/// round trips per operator; from a worker, operators fork onto warm threads.
pub fn on_worker<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    match rayon::current_thread_index() {
        Some(_) => f(),
        None => rayon::scope(|_| f()),
    }
}

/// Makes glibc serve every thread from one heap. With a heap per thread, tensors allocated by
/// one rank's thread and freed by another (boundary messages) make the heaps grow and shrink
/// by mapping fresh pages: measured here, the first stage of a 2-rank pipeline computed 50%
/// slower and the run lost a quarter of its throughput. Our allocations are whole tensors, so
/// one heap's lock costs nothing measurable. It takes effect for threads that have not yet
/// allocated: call it before starting rank threads.
///
/// The heap also keeps what it has: tensors are served from it, never from their own
/// mapping, and freed memory is not handed back to the OS. A training step frees and
/// re-allocates the same sizes every step; with large tensors mapped and unmapped each time,
/// every page was faulted in and zeroed by the kernel again (resnet110v2 at 256², B = 2: 470k
/// faults and a fifth of the CPU time per step). The engine's accounting is the allocator's
/// leases, so it does not change; the process keeps its high-water mark of host memory.
pub fn tune_host_allocator() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: mallopt only changes the allocator's tuning; called once, and glibc applies
        // it to allocations made from then on.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, 1);
            libc::mallopt(libc::M_MMAP_MAX, 0);
            // -1: never trim (mallopt(3)).
            libc::mallopt(libc::M_TRIM_THRESHOLD, -1);
        }
    });
}

/// `n` copies of `value`, written by every thread for large buffers: the heap keeps its
/// blocks (see [`tune_host_allocator`]), so a reused block must be cleared, and `vec![0; n]`
/// clears it on one thread (a tenth of a resnet110v2 step at 256², measured with perf).
fn filled<T: Copy + Send + Sync>(n: usize, value: T) -> Vec<T> {
    const PARALLEL: usize = 1 << 16;
    if n < PARALLEL {
        return vec![value; n];
    }
    let mut v = Vec::with_capacity(n);
    v.spare_capacity_mut()[..n]
        .par_chunks_mut(PARALLEL)
        .for_each(|c| {
            c.iter_mut().for_each(|x| {
                x.write(value);
            })
        });
    // SAFETY: the first n elements were all written just above.
    unsafe { v.set_len(n) };
    v
}

/// `n` elements left as the heap block held them (NaN under [`POISON`]): for outputs their
/// kernel overwrites, which then skip [`filled`]'s pass over memory.
fn unfilled<T: bytemuck::Pod + Send + Sync>(n: usize, nan: T) -> Vec<T> {
    if POISON {
        return filled(n, nan);
    }
    let mut v = Vec::with_capacity(n);
    // Storage is `Vec<T>` everywhere (kernels take `&mut [T]`), so the unset elements are
    // handed out as `T` rather than `MaybeUninit<T>`, which clippy's lint is about.
    // SAFETY: every bit pattern is a valid element (Pod); the caller writes every element
    // before anything reads it (the `poison` tests check that each kernel given such storage
    // does), so no unset value is ever read.
    #[allow(clippy::uninit_vec)]
    unsafe {
        v.set_len(n)
    };
    v
}

/// `nan` under [`POISON`], else `zero`.
fn poison_or<T>(zero: T, nan: T) -> T {
    if POISON {
        nan
    } else {
        zero
    }
}

fn copy_bytes(src: &[u8], dst: &mut [u8]) -> Result<()> {
    if src.len() != dst.len() {
        return Err(Error::Internal(format!(
            "a copy of {} bytes into {}",
            src.len(),
            dst.len()
        )));
    }
    dst.copy_from_slice(src);
    Ok(())
}

/// Workspace elements of the CPU convolutions of `g` (its im2col tiles).
pub fn conv_workspace(g: &ConvGeom) -> usize {
    conv::workspace(g)
}

/// The host backend.
pub struct Cpu;

impl Backend for Cpu {
    fn name(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }

    fn zeros(&self, numel: usize, dtype: DType) -> Result<Storage> {
        Ok(match dtype {
            DType::F32 => Storage::F32(filled(numel, 0.0)),
            DType::F64 => Storage::F64(filled(numel, 0.0)),
            DType::BF16 => Storage::BF16(filled(numel, half::bf16::ZERO)),
            DType::F16 => Storage::F16(filled(numel, half::f16::ZERO)),
        })
    }

    fn empty(&self, numel: usize, dtype: DType) -> Result<Storage> {
        Ok(match dtype {
            DType::F32 => Storage::F32(unfilled(numel, f32::NAN)),
            DType::F64 => Storage::F64(unfilled(numel, f64::NAN)),
            // 16-bit outputs are widened to f32 before their kernel writes them, so they are
            // never handed out unset: filled, with NaN under test so unwritten ones still show.
            DType::BF16 => {
                Storage::BF16(filled(numel, poison_or(half::bf16::ZERO, half::bf16::NAN)))
            }
            DType::F16 => Storage::F16(filled(numel, poison_or(half::f16::ZERO, half::f16::NAN))),
        })
    }

    fn upload(&self, data: &[f64], dtype: DType) -> Result<Storage> {
        Ok(match dtype {
            DType::F32 => Storage::F32(data.iter().map(|&x| x as f32).collect()),
            DType::F64 => Storage::F64(data.to_vec()),
            DType::BF16 => Storage::BF16(data.iter().map(|&x| half::bf16::from_f64(x)).collect()),
            DType::F16 => Storage::F16(data.iter().map(|&x| half::f16::from_f64(x)).collect()),
        })
    }

    fn adopt(&self, s: Storage) -> Result<Storage> {
        match s {
            device @ (Storage::CudaF32(_) | Storage::Cuda16(..)) => device.to_host(),
            host => Ok(host),
        }
    }

    fn host_zeros(
        &self,
        numel: usize,
        dtype: DType,
        pool: Option<&Arc<HostPool>>,
    ) -> Result<Storage> {
        match pool {
            None => self.zeros(numel, dtype),
            Some(p) => {
                Ok(Storage::Host(p.take(numel, dtype, |bytes| {
                    Ok(Block::Pageable(vec![0; bytes]))
                })?))
            }
        }
    }

    /// The host tier is host memory too: a memory copy, complete at return.
    fn copy_out(&self, src: &Storage, dst: &mut Storage, _: bool) -> Result<Option<Event>> {
        copy_bytes(src.host_bytes()?, dst.host_bytes_mut()?)?;
        Ok(None)
    }

    fn copy_in(&self, src: &Storage, dst: &mut Storage, _: bool) -> Result<Option<Event>> {
        copy_bytes(src.host_bytes()?, dst.host_bytes_mut()?)?;
        Ok(None)
    }

    fn wait(&self, _: &Event) -> Result<()> {
        Ok(())
    }

    fn copy(&self, src: &Storage, dst: &mut Storage) -> Result<()> {
        if src.dtype() != dst.dtype() {
            return Err(dtype_mismatch(src.dtype().name(), dst.dtype()));
        }
        copy_bytes(src.host_bytes()?, dst.host_bytes_mut()?)
    }

    fn conv2d_workspace(&self, g: &ConvGeom) -> usize {
        conv_workspace(g)
    }

    fn conv2d_forward(
        &self,
        x: &Storage,
        w: &Storage,
        y: &mut Storage,
        ws: &mut Storage,
        g: &ConvGeom,
    ) -> Result<()> {
        let rounded = wide::rounded_operand(w, x.dtype());
        let w = rounded.as_ref().unwrap_or(w);
        compute!(x.dtype(), T, [x, w], [y, ws] => conv::forward::<T>(x, w, y, ws, g));
        Ok(())
    }

    fn conv2d_backward_data(
        &self,
        dy: &Storage,
        w: &Storage,
        dx: &mut Storage,
        ws: &mut Storage,
        g: &ConvGeom,
    ) -> Result<()> {
        let rounded = wide::rounded_operand(w, dy.dtype());
        let w = rounded.as_ref().unwrap_or(w);
        compute!(dy.dtype(), T, [dy, w], [dx, ws] => conv::backward_data::<T>(dy, w, dx, ws, g));
        Ok(())
    }

    fn conv2d_backward_filter(
        &self,
        x: &Storage,
        dy: &Storage,
        dw: &mut Storage,
        ws: &mut Storage,
        g: &ConvGeom,
    ) -> Result<()> {
        compute!(x.dtype(), T, [x, dy], [dw, ws] => conv::backward_filter::<T>(x, dy, dw, ws, g));
        Ok(())
    }

    fn add_channel_bias(&self, y: &mut Storage, bias: &Storage, g: &ChannelGeom) -> Result<()> {
        compute!(y.dtype(), T, [bias], [y] => elementwise::add_channel_bias::<T>(y, bias, g));
        Ok(())
    }

    fn channel_sum(&self, dy: &Storage, db: &mut Storage, g: &ChannelGeom) -> Result<()> {
        compute!(dy.dtype(), T, [dy], [db] => elementwise::channel_sum::<T>(dy, db, g));
        Ok(())
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
        compute!(x.dtype(), T, [x, gamma, beta], [y, mean, var] => norm::forward_train::<T>(x, gamma, beta, y, mean, var, eps, g, false));
        Ok(())
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
        compute!(x.dtype(), T, [x, gamma, beta, mean, var], [y] => norm::forward_eval::<T>(x, gamma, beta, mean, var, y, eps, g, false));
        Ok(())
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
        compute!(x.dtype(), T, [x, dy, gamma, mean, var], [dx, dgamma, dbeta] => norm::backward::<T>(x, dy, None, gamma, mean, var, dx, dgamma, dbeta, eps, g));
        Ok(())
    }

    fn batchnorm_statistics(&self, x: &Storage, g: &ChannelGeom) -> Result<Vec<(f64, f64)>> {
        Ok(compute!(x.dtype(), T, [x], [] => norm::statistics::<T>(x, g)))
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
        Ok(match relu_beta {
            Some(beta) => {
                compute!(x.dtype(), T, [x, dy, beta, gamma, mean, var], [] => norm::backward_sums::<T>(x, dy, Some(beta), gamma, mean, var, eps, g))
            }
            None => {
                compute!(x.dtype(), T, [x, dy, gamma, mean, var], [] => norm::backward_sums::<T>(x, dy, None, gamma, mean, var, eps, g))
            }
        })
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
        match relu_beta {
            Some(beta) => {
                compute!(x.dtype(), T, [x, dy, beta, gamma, mean, var], [dx] => norm::backward_dx::<T>(x, dy, Some(beta), gamma, mean, var, sums, count, dx, eps, g))
            }
            None => {
                compute!(x.dtype(), T, [x, dy, gamma, mean, var], [dx] => norm::backward_dx::<T>(x, dy, None, gamma, mean, var, sums, count, dx, eps, g))
            }
        }
        Ok(())
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
        compute!(x.dtype(), T, [x, gamma, beta], [y, mean, var] => norm::forward_train::<T>(x, gamma, beta, y, mean, var, eps, g, true));
        Ok(())
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
        compute!(x.dtype(), T, [x, dy, gamma, beta, mean, var], [dx, dgamma, dbeta] => norm::backward::<T>(x, dy, Some(beta), gamma, mean, var, dx, dgamma, dbeta, eps, g));
        Ok(())
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
        compute!(mean.dtype(), T, [mean, var], [running_mean, running_var] => norm::update_running::<T>(running_mean, running_var, mean, var, momentum, count));
        Ok(())
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
        compute!(x.dtype(), T, [x, gamma, beta], [y, mean, var] => groupnorm::forward::<T>(x, gamma, beta, y, mean, var, eps, g));
        Ok(())
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
        compute!(x.dtype(), T, [x, dy, gamma, mean, var], [dx, dgamma, dbeta] => groupnorm::backward::<T>(x, dy, gamma, mean, var, dx, dgamma, dbeta, eps, g));
        Ok(())
    }

    fn nonlinearity_forward(&self, f: Nonlinearity, x: &Storage, y: &mut Storage) -> Result<()> {
        compute!(x.dtype(), T, [x], [y] => elementwise::nonlinearity::<T>(f, x, y));
        Ok(())
    }

    fn nonlinearity_backward(
        &self,
        f: Nonlinearity,
        x: &Storage,
        dy: &Storage,
        dx: &mut Storage,
    ) -> Result<()> {
        compute!(x.dtype(), T, [x, dy], [dx] => elementwise::nonlinearity_backward::<T>(f, x, dy, dx));
        Ok(())
    }

    fn relu_forward(&self, x: &Storage, y: &mut Storage) -> Result<()> {
        compute!(x.dtype(), T, [x], [y] => elementwise::relu::<T>(x, y));
        Ok(())
    }

    fn relu_backward(&self, y: &Storage, dy: &Storage, dx: &mut Storage) -> Result<()> {
        compute!(y.dtype(), T, [y, dy], [dx] => elementwise::relu_backward::<T>(y, dy, dx));
        Ok(())
    }

    fn add(&self, a: &Storage, b: &Storage, y: &mut Storage) -> Result<()> {
        compute!(a.dtype(), T, [a, b], [y] => elementwise::zip(a, b, y, |a, b| a + b));
        Ok(())
    }

    fn add_relu(&self, a: &Storage, b: &Storage, y: &mut Storage) -> Result<()> {
        compute!(a.dtype(), T, [a, b], [y] => elementwise::add_relu(a, b, y));
        Ok(())
    }

    fn add_assign(&self, y: &mut Storage, x: &Storage) -> Result<()> {
        compute!(x.dtype(), T, [x], [y] => elementwise::add_assign::<T>(y, x));
        Ok(())
    }

    fn mul(&self, x: &Storage, mask: &Storage, y: &mut Storage) -> Result<()> {
        compute!(x.dtype(), T, [x, mask], [y] => elementwise::zip(x, mask, y, |a, b| a * b));
        Ok(())
    }

    fn dropout_mask(&self, mask: &mut Storage, p: f64, seed: u64, g: &MaskGeom) -> Result<()> {
        g.check(mask.len())?;
        compute!(mask.dtype(), T, [], [mask] => elementwise::dropout_mask::<T>(mask, p, seed, g));
        Ok(())
    }

    fn max_pool_forward(&self, x: &Storage, y: &mut Storage, g: &PoolGeom) -> Result<()> {
        compute!(x.dtype(), T, [x], [y] => pool::max_forward::<T>(x, y, g));
        Ok(())
    }

    fn max_pool_backward(
        &self,
        x: &Storage,
        dy: &Storage,
        dx: &mut Storage,
        g: &PoolGeom,
    ) -> Result<()> {
        compute!(x.dtype(), T, [x, dy], [dx] => pool::max_backward::<T>(x, dy, dx, g));
        Ok(())
    }

    fn avg_pool_forward(&self, x: &Storage, y: &mut Storage, g: &PoolGeom) -> Result<()> {
        compute!(x.dtype(), T, [x], [y] => pool::avg_forward::<T>(x, y, g));
        Ok(())
    }

    fn avg_pool_backward(&self, dy: &Storage, dx: &mut Storage, g: &PoolGeom) -> Result<()> {
        compute!(dy.dtype(), T, [dy], [dx] => pool::avg_backward::<T>(dy, dx, g));
        Ok(())
    }

    fn adaptive_avg_pool_forward(&self, x: &Storage, y: &mut Storage, g: &PoolGeom) -> Result<()> {
        compute!(x.dtype(), T, [x], [y] => pool::adaptive_avg_forward::<T>(x, y, g));
        Ok(())
    }

    fn adaptive_avg_pool_backward(
        &self,
        dy: &Storage,
        dx: &mut Storage,
        g: &PoolGeom,
    ) -> Result<()> {
        compute!(dy.dtype(), T, [dy], [dx] => pool::adaptive_avg_backward::<T>(dy, dx, g));
        Ok(())
    }

    fn resize_bilinear_forward(&self, x: &Storage, y: &mut Storage, g: &ResizeGeom) -> Result<()> {
        g.check()?;
        compute!(x.dtype(), T, [x], [y] => resize::forward::<T>(x, y, g));
        Ok(())
    }

    fn resize_bilinear_backward(
        &self,
        dy: &Storage,
        dx: &mut Storage,
        g: &ResizeGeom,
    ) -> Result<()> {
        g.check()?;
        compute!(dy.dtype(), T, [dy], [dx] => resize::backward::<T>(dy, dx, g));
        Ok(())
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
        compute!(x.dtype(), T, [x, w], [y] => gemm::<T>(n, d_out, d_in, y, d_out, View::rows(x, d_in), View::rows(w, d_in).t(), false, true));
        Ok(())
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
        if let Some(dx) = dx {
            compute!(x.dtype(), T, [dy, w], [dx] => gemm::<T>(n, d_in, d_out, dx, d_in, View::rows(dy, d_out), View::rows(w, d_in), false, true));
        }
        compute!(x.dtype(), T, [x, dy], [dw] => gemm::<T>(d_out, d_in, n, dw, d_in, View::rows(dy, d_out).t(), View::rows(x, d_in), true, true));
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
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
        compute!(src.dtype(), T, [src], [dst] => elementwise::copy_channels::<T>(src, dst, src_c, dst_c, count, n, hw));
        Ok(())
    }

    fn softmax_cross_entropy(
        &self,
        logits: &Storage,
        labels: &[u32],
        weights: &[f64],
        probs: &mut Storage,
        g: &LossGeom,
    ) -> Result<f64> {
        compute!(logits.dtype(), T, [logits], [probs] => Ok(elementwise::softmax_cross_entropy::<T>(logits, labels, weights, probs, g)))
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
        compute!(probs.dtype(), T, [probs], [dlogits] => elementwise::softmax_cross_entropy_backward::<T>(probs, labels, weights, dlogits, scale, g));
        Ok(())
    }

    fn sgd_update(
        &self,
        w: &mut Storage,
        grad: &Storage,
        momentum_buf: &mut Storage,
        step: &SgdStep,
    ) -> Result<()> {
        compute!(grad.dtype(), T, [grad], [w, momentum_buf] => elementwise::sgd::<T>(w, grad, momentum_buf, step));
        Ok(())
    }

    fn adam_update(
        &self,
        w: &mut Storage,
        grad: &Storage,
        exp_avg: &mut Storage,
        exp_avg_sq: &mut Storage,
        step: &AdamStep,
    ) -> Result<()> {
        compute!(grad.dtype(), T, [grad], [w, exp_avg, exp_avg_sq] => elementwise::adam::<T>(w, grad, exp_avg, exp_avg_sq, step));
        Ok(())
    }

    fn fill(&self, s: &mut Storage, value: f64) -> Result<()> {
        compute!(s.dtype(), T, [], [s] => s.par_iter_mut().for_each(|v| *v = T::of(value)));
        Ok(())
    }

    fn all_finite(&self, s: &Storage) -> Result<bool> {
        compute!(s.dtype(), T, [s], [] => Ok(s.par_iter().all(|v| v.is_finite())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tests see unwritten elements as NaN: the `poison` feature is on in every `cargo test`,
    /// on both sides of `filled`'s parallel threshold and in every dtype.
    #[test]
    fn unfilled_storage_is_poisoned_under_test() {
        for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
            for n in [3, 1 << 17] {
                let s = Cpu.empty(n, dtype).unwrap();
                assert_eq!(s.len(), n);
                assert!(
                    s.to_f64_vec().unwrap().iter().all(|v| v.is_nan()),
                    "{dtype:?}"
                );
            }
        }
    }
}
