//! The emulated CUDA driver (scripts/cuda_emu/, built by build.rs under the `cuda-emu` feature,
//! which every `cargo test` turns on) catches the bugs of GPU code that running work as it is
//! issued cannot: each test here plants one in the CUDA backend's own calls (or in a kernel, or
//! a call of a kernel or of cuBLAS) and checks that the emulator reports it, beside the correct
//! code, which passes.
//!
//! - (a) compute that does not wait for the copy stream's event: the ordering check reports
//!   the kernel reading bytes a copy queued before it on the copy stream has not yet written;
//! - (b) a device buffer freed while the copy stream's queued copy still reads it: the ordering
//!   check reports the free (and the free poisons the buffer, so the copy would deliver NaN);
//! - (c) conv.cu's tile loop without the `__syncthreads` that ends a tile: the race check
//!   reports the kernel, the block and the two threads (the tensor-core stamps still compute
//!   the right values in the emulator, so only the race check sees it); and two blocks of a
//!   launch storing one device element: reported (beside two blocks storing the two 16-bit
//!   halves of one word: not a race, not reported).
//! - (d) cuDNN handed a smaller workspace than the algorithm it runs needs: the emulated cuDNN
//!   (cudnn.cpp) refuses it, as cuDNN does, naming the reason.
//! - (e) block_sum without the `__syncthreads` between its scratch's writes and reads (in
//!   batchnorm_stats): the race check reports it;
//! - (f) fill writing one element past its output (a planted copy of elementwise.cu), and the
//!   real fill launched through the driver over one element more than its buffer holds: the
//!   memory check reports the kernel, block, thread, address and the allocation it overran;
//!   SGEMM handed a leading dimension its buffer does not hold: the emulated cuBLAS refuses it;
//! - (g) add called with its output overlapping its input one block further on: the race check
//!   reports block 0 reading what block 1 writes in the launch.
//!
//! Found by the race check over the whole GPU suite, and kept: the finiteness flag set by
//! plain stores from several blocks (a data race in CUDA's memory model, though every store
//! wrote 1); it is now set with `atomicOr`.
//!
//! (a) and (b) run with the driver's chaos on (random delays per stream, a fixed seed), so the
//! unenforced orderings happen; each is tried a number of times and must show at least once. A
//! report fails every later synchronisation of its process, so the tests that expect one run
//! in a process of their own (the test binary run again on one test, [`child`]).
#![cfg(feature = "cuda-emu")]

use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Once};

use gems::backend::cuda::ConvImpl;
use gems::backend::host::HostPool;
use gems::tensor::Device;
use gems::tensor::{DType, Precision, Storage};

/// Tries of a planted ordering bug; each shows it with a fair chance under chaos.
const TRIES: usize = 30;

fn gpu() -> Device {
    static CHAOS: Once = Once::new();
    // Before the driver first reads it (the first device); delays of up to 2 ms per operation.
    CHAOS.call_once(|| std::env::set_var("GEMS_EMU_CHAOS", "18,2000"));
    Device::cuda("cuda:0", 0, Precision::Fp32, ConvImpl::Native, None)
        .unwrap_or_else(|e| panic!("the emulated CUDA driver did not open: {e}"))
}

/// `n` values exact in f32, about half of them negative, shifted by `seed`.
fn values(n: usize, seed: usize) -> Vec<f64> {
    (0..n)
        .map(|i| ((i * 7 + seed * 13) % 23) as f64 / 16.0 - 0.6875)
        .collect()
}

/// Host values copied in on the copy stream, then ReLU on the compute stream, waiting for the
/// copy's event as the offload path does, or not (planted bug a). The ReLU's output.
fn copy_in_then_relu(device: &Device, host: &[f64], wait: bool) -> Vec<f64> {
    let be = device.backend();
    let src = Storage::F32(host.iter().map(|&v| v as f32).collect());
    let mut x = be.zeros(host.len(), DType::F32).unwrap();
    let copied = be
        .copy_in(&src, &mut x, true)
        .unwrap()
        .expect("a copy-stream event");
    if wait {
        be.wait(&copied).unwrap();
    }
    let mut y = be.zeros(host.len(), DType::F32).unwrap();
    be.relu_forward(&x, &mut y).unwrap();
    copied.synchronize().unwrap();
    y.to_f64_vec().unwrap()
}

/// The planted variant a child runs (see [`child`]); absent in the parent.
const CHILD: &str = "GEMS_TEST_CHILD";

/// Runs this test binary again on test `name` alone, with `GEMS_TEST_CHILD=variant` and `env`:
/// whether it passed, and its output.
fn child(name: &str, variant: &str, env: &[(&str, &str)]) -> (bool, String) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads", "1"])
        .env(CHILD, variant)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text.into_owned())
}

/// In the parent (no `GEMS_TEST_CHILD`): runs test `name` as a child in variants "right" (must
/// pass) and "planted" (must fail, its output holding every one of `reported`), and returns
/// None. In a child: Some(whether the variant is the planted one).
fn planted_in_child(name: &str, reported: &[&str]) -> Option<bool> {
    if let Ok(v) = std::env::var(CHILD) {
        return Some(v == "planted");
    }
    let (ok, text) = child(name, "right", &[]);
    assert!(ok, "the right code failed:\n{text}");
    let (ok, text) = child(name, "planted", &[]);
    assert!(!ok, "the planted bug passed:\n{text}");
    for r in reported {
        assert!(text.contains(r), "the report lacks {r:?}:\n{text}");
    }
    None
}

#[test]
fn planted_a_compute_not_waiting_for_the_copy_stream_is_reported() {
    let name = "planted_a_compute_not_waiting_for_the_copy_stream_is_reported";
    let Some(planted) = planted_in_child(
        name,
        &[
            "ordering check: relu_forward_f32: block (",
            "which a copy to the device queued before the launch on another stream writes and has \
             not yet done",
        ],
    ) else {
        return;
    };
    let device = gpu();
    let relu = |v: &[f64]| v.iter().map(|&x| x.max(0.0)).collect::<Vec<_>>();
    for t in 0..TRIES {
        let v = values(4096, t);
        assert!(
            copy_in_then_relu(&device, &v, !planted) == relu(&v),
            "wrong values"
        );
    }
}

/// A device buffer copied out on the copy stream into pinned host memory; the buffer is freed
/// once the copy's event completes, or at once (planted bug b: its free is queued on the
/// compute stream, which does not wait for the copy). The host's copy.
fn copy_out_then_free(device: &Device, pool: &Arc<HostPool>, v: &[f64], early: bool) -> Vec<f64> {
    let be = device.backend();
    let src = be.upload(v, DType::F32).unwrap();
    let mut host = be.host_zeros(v.len(), DType::F32, Some(pool)).unwrap();
    let copied = be
        .copy_out(&src, &mut host, true)
        .unwrap()
        .expect("a copy-stream event");
    if early {
        drop(src);
        copied.synchronize().unwrap();
    } else {
        copied.synchronize().unwrap();
        drop(src);
    }
    host.to_f64_vec().unwrap()
}

#[test]
fn planted_b_a_buffer_freed_while_the_copy_stream_reads_it_is_reported() {
    let name = "planted_b_a_buffer_freed_while_the_copy_stream_reads_it_is_reported";
    let Some(planted) = planted_in_child(
        name,
        &[
            "ordering check: the 16384-byte allocation at",
            "is freed while a copy from the device queued before the free on another stream, \
             which reads it, has not yet done",
        ],
    ) else {
        return;
    };
    let device = gpu();
    let pool = HostPool::new();
    for t in 0..TRIES {
        let v = values(4096, t);
        assert!(
            copy_out_then_free(&device, &pool, &v, planted) == v,
            "wrong values"
        );
    }
}

/// The lines of race_test (scripts/cuda_emu/race_test.cpp) built on cuda/*.cu ("race_test")
/// or on the planted copies ("race_test_planted").
fn race_test(program: &str) -> Vec<String> {
    let path = Path::new(env!("GEMS_CUDA_EMU_DIR")).join(program);
    let out = Command::new(&path).output().unwrap();
    assert!(out.status.success(), "{}: {out:?}", path.display());
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(String::from)
        .collect()
}

#[test]
fn planted_c_a_missing_syncthreads_in_the_conv_tile_loop_is_reported_as_a_race() {
    let clean = race_test("race_test");
    assert_eq!(clean.len(), 9, "{clean:?}");
    for line in &clean[..3] {
        assert!(
            line.contains("values right") && line.ends_with("no race"),
            "{line}"
        );
    }
    let planted = race_test("race_test_planted");
    assert_eq!(planted.len(), 9, "{planted:?}");
    for (line, stamp) in planted.iter().zip(["f32", "tf32", "bf16"]) {
        let kernel = format!("conv2d_forward_{stamp}");
        assert!(
            line.contains(&format!("race check: {kernel}: block (")) && line.contains("thread "),
            "the race check missed the planted race: {line}"
        );
    }
}

/// The check of device memory (race_test's last two lines, in both builds): two blocks of a
/// launch storing one 16-bit element is reported; two blocks storing the two halves of one
/// 4-byte word is not (they write different bytes).
#[test]
fn two_blocks_writing_one_device_element_are_reported_and_adjacent_ones_are_not() {
    for program in ["race_test", "race_test_planted"] {
        let lines = race_test(program);
        assert!(
            lines[3].starts_with("two_blocks_one_element: race check: two_blocks_one_element: blocks 0 (thread 0) and 1 (thread 0) both write device address"),
            "{program}: the race check missed two blocks writing one element: {}",
            lines[3]
        );
        assert_eq!(lines[4], "two_blocks_adjacent_halves: no race", "{program}");
    }
}

#[test]
fn planted_e_block_sum_without_its_barrier_is_reported_as_a_race() {
    assert_eq!(race_test("race_test")[5], "batchnorm_stats_f32: no race");
    let line = &race_test("race_test_planted")[5];
    assert!(
        line.starts_with(
            "batchnorm_stats_f32: race check: batchnorm_stats_f32: block (0, 0, 0): thread "
        ) && line.contains("the __shared__ word")
            && line.ends_with("between two barriers"),
        "the race check missed block_sum's missing barrier: {line}"
    );
}

#[test]
fn planted_f_a_kernel_writing_one_element_past_its_output_is_reported() {
    assert_eq!(race_test("race_test")[6], "fill_f32: no race");
    let line = &race_test("race_test_planted")[6];
    assert!(
        line.starts_with("fill_f32: memory check: fill_f32: block (")
            && line.contains("writes 4 bytes at")
            && line.contains("offset 4000 of the 4000-byte allocation at")
            && line.ends_with("4 bytes past its end"),
        "the memory check missed the store past fill's output: {line}"
    );
}

#[test]
fn planted_g_one_block_reading_what_another_writes_is_reported_as_a_race() {
    for program in ["race_test", "race_test_planted"] {
        let lines = race_test(program);
        assert!(
            lines[7].starts_with(
                "add_f32_overlapping: race check: add_f32_overlapping: block 0 reads, and block 1 \
                 (thread "
            ) && lines[7].ends_with("in one launch"),
            "{program}: the race check missed the overlapping add: {}",
            lines[7]
        );
        assert_eq!(lines[8], "add_f32_disjoint: no race", "{program}");
    }
}

/// The real fill_f32 launched through the emulated driver over `numel` elements of a buffer of
/// 1000: the synchronisation's result.
fn fill_through_the_driver(numel: i64) -> Result<(), cudarc::driver::DriverError> {
    use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
    let ctx = CudaContext::new(0)?;
    let stream = ctx.new_stream()?;
    // The emulated driver finds kernels by name in any PTX.
    let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(".entry fill_f32".to_string()))?;
    let f = module.load_function("fill_f32")?;
    let mut y = stream.alloc_zeros::<f32>(1000)?;
    let value = 1.0f32;
    let mut launch = stream.launch_builder(&f);
    launch.arg(&mut y).arg(&value).arg(&numel);
    let cfg = LaunchConfig {
        grid_dim: (4, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: fill_f32(float* s, float value, int64_t numel) takes these arguments; the
    // planted call's numel overruns the buffer, which the emulator checks before each access.
    unsafe { launch.launch(cfg) }?;
    stream.synchronize()
}

#[test]
fn planted_f_a_launch_over_more_elements_than_its_buffer_is_reported() {
    let name = "planted_f_a_launch_over_more_elements_than_its_buffer_is_reported";
    let Some(planted) = planted_in_child(
        name,
        &[
            "memory check: fill_f32: block (3, 0, 0) thread 232 writes 4 bytes at",
            "outside every device allocation: offset 4000 of the 4000-byte allocation at",
            "4 bytes past its end",
        ],
    ) else {
        return;
    };
    fill_through_the_driver(if planted { 1001 } else { 1000 }).unwrap();
}

/// SGEMM through the emulated cuBLAS on 4x4 matrices in buffers of 16 floats, with `lda` as
/// A's leading dimension: the status.
fn sgemm_with_lda(lda: i32) -> Result<(), cudarc::cublas::result::CublasError> {
    use cudarc::cublas::{result, sys, CudaBlas};
    use cudarc::driver::{CudaContext, DevicePtr, DevicePtrMut};
    let stream = CudaContext::new(0).unwrap().new_stream().unwrap();
    let blas = CudaBlas::new(stream.clone()).unwrap();
    let a = stream.alloc_zeros::<f32>(16).unwrap();
    let b = stream.alloc_zeros::<f32>(16).unwrap();
    let mut c = stream.alloc_zeros::<f32>(16).unwrap();
    let (one, zero) = (1.0f32, 0.0f32);
    let n = sys::cublasOperation_t::CUBLAS_OP_N;
    let (pa, _ga) = a.device_ptr(&stream);
    let (pb, _gb) = b.device_ptr(&stream);
    let (pc, _gc) = c.device_ptr_mut(&stream);
    // SAFETY: live buffers of 16 floats; the planted call's lda reaches past A's, which the
    // emulated cuBLAS checks before it queues the product.
    let status = unsafe {
        result::sgemm(
            *blas.handle(),
            n,
            n,
            4,
            4,
            4,
            &one,
            pa as *const f32,
            lda,
            pb as *const f32,
            4,
            &zero,
            pc as *mut f32,
            4,
        )
    };
    stream.synchronize().unwrap();
    status
}

#[test]
fn planted_f_sgemm_with_a_leading_dimension_past_its_buffer_is_refused() {
    assert!(sgemm_with_lda(4).is_ok());
    let err = sgemm_with_lda(5).unwrap_err();
    assert!(format!("{err:?}").contains("INVALID_VALUE"), "{err:?}");
}

/// The race check is read when the driver loads: the test runs itself again in a process of
/// its own with it on.
const RACE_CHILD: &str = "GEMS_TEST_RACE_CHILD";

#[test]
fn the_finiteness_flag_set_from_several_blocks_is_not_a_race() {
    if std::env::var_os(RACE_CHILD).is_none() {
        let name = "the_finiteness_flag_set_from_several_blocks_is_not_a_race";
        let out = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--nocapture", "--test-threads", "1"])
            .env(RACE_CHILD, "1")
            .env("GEMS_EMU_RACECHECK", "1")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && text.contains("race check on"),
            "{text}"
        );
        return;
    }
    let device = gpu();
    // Infinities in every block of 256 (and NaN once), so many warps of many blocks vote.
    let host: Vec<f64> = (0..64 * 256)
        .map(|i| match i % 256 {
            3 => f64::INFINITY,
            _ if i == 1000 => f64::NAN,
            _ => 1.0,
        })
        .collect();
    let x = device.backend().upload(&host, DType::F32).unwrap();
    let finite = device.backend().all_finite(&x);
    assert!(!finite.unwrap());
}

/// A 3×3 convolution's forward through cuDNN's GEMM algorithm (which needs a workspace), given
/// `short` bytes less workspace than cuDNN states: the status.
fn cudnn_gemm_forward(short: usize) -> cudarc::cudnn::sys::cudnnStatus_t {
    use cudarc::cudnn::{result as dnn, sys};
    use cudarc::driver::{CudaContext, DevicePtrMut};
    use sys::cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_GEMM as GEMM;
    use sys::cudnnDataType_t::CUDNN_DATA_FLOAT as F32;
    use sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW as NCHW;
    let stream = CudaContext::new(0).unwrap().new_stream().unwrap();
    let buf = |n: usize| stream.alloc_zeros::<f32>(n).unwrap();
    let (mut x, mut w, mut y) = (buf(2 * 3 * 8 * 8), buf(4 * 3 * 3 * 3), buf(2 * 4 * 8 * 8));
    // SAFETY: the descriptors describe the buffers just allocated; alpha and beta are f32 on
    // the stack; the calls are cuDNN's documented ones on live handles.
    unsafe {
        let h = dnn::create_handle().unwrap();
        dnn::set_stream(h, stream.cu_stream() as sys::cudaStream_t).unwrap();
        let (xd, yd) = (
            dnn::create_tensor_descriptor().unwrap(),
            dnn::create_tensor_descriptor().unwrap(),
        );
        let (wd, cd) = (
            dnn::create_filter_descriptor().unwrap(),
            dnn::create_convolution_descriptor().unwrap(),
        );
        dnn::set_tensor4d_descriptor(xd, NCHW, F32, [2, 3, 8, 8]).unwrap();
        dnn::set_tensor4d_descriptor(yd, NCHW, F32, [2, 4, 8, 8]).unwrap();
        dnn::set_filter4d_descriptor(wd, F32, NCHW, [4, 3, 3, 3]).unwrap();
        let mode = sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION;
        dnn::set_convolution2d_descriptor(cd, 1, 1, 1, 1, 1, 1, mode, F32).unwrap();
        let need = dnn::get_convolution_forward_workspace_size(h, xd, wd, cd, yd, GEMM).unwrap();
        assert!(need > short, "GEMM needs {need} bytes of workspace");
        let mut ws = stream.alloc_zeros::<u8>(need).unwrap();
        let (one, zero) = (1.0f32, 0.0f32);
        let ptr = |p: u64| p as *mut std::ffi::c_void;
        let status = sys::cudnnConvolutionForward(
            h,
            (&one as *const f32).cast(),
            xd,
            ptr(x.device_ptr_mut(&stream).0),
            wd,
            ptr(w.device_ptr_mut(&stream).0),
            cd,
            GEMM,
            ptr(ws.device_ptr_mut(&stream).0),
            need - short,
            (&zero as *const f32).cast(),
            yd,
            ptr(y.device_ptr_mut(&stream).0),
        );
        status
    }
}

#[test]
fn planted_d_a_cudnn_workspace_smaller_than_its_algorithm_needs_is_refused() {
    use cudarc::cudnn::sys::cudnnStatus_t::*;
    assert_eq!(cudnn_gemm_forward(0), CUDNN_STATUS_SUCCESS);
    assert_eq!(
        cudnn_gemm_forward(4),
        CUDNN_STATUS_BAD_PARAM_SIZE_INSUFFICIENT
    );
}
