//! The emulated CUDA driver (scripts/cuda_emu/, built by build.rs under the `cuda-emu` feature,
//! which every `cargo test` turns on) catches the bugs of GPU code that running work as it is
//! issued cannot: each test here plants one in the CUDA backend's own calls (or in a kernel)
//! and checks that the emulator shows it, beside the correct code, which passes.
//!
//! - (a) compute that does not wait for the copy stream's event: it reads the buffer before the
//!   copy lands (wrong values);
//! - (b) a device buffer freed while the copy stream's queued copy still reads it: the free
//!   poisons it, the copy delivers NaN;
//! - (c) conv.cu's tile loop without the `__syncthreads` that ends a tile: the race check
//!   reports the kernel, the block and the two threads (the tensor-core stamps still compute
//!   the right values in the emulator, so only the race check sees it); and two blocks of a
//!   launch storing one device element: reported (beside two blocks storing the two 16-bit
//!   halves of one word: not a race, not reported).
//! - (d) cuDNN handed a smaller workspace than the algorithm it runs needs: the emulated cuDNN
//!   (cudnn.cpp) refuses it, as cuDNN does, naming the reason.
//!
//! Found by the race check over the whole GPU suite, and kept: the finiteness flag set by
//! plain stores from several blocks (a data race in CUDA's memory model, though every store
//! wrote 1); it is now set with `atomicOr`.
//!
//! (a) and (b) run with the driver's chaos on (random delays per stream, a fixed seed), so the
//! unenforced orderings happen; each is tried a number of times and must show at least once.
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

#[test]
fn planted_a_compute_not_waiting_for_the_copy_stream_reads_stale_values() {
    let device = gpu();
    let relu = |v: &[f64]| v.iter().map(|&x| x.max(0.0)).collect::<Vec<_>>();
    let mut wrong = 0;
    for t in 0..TRIES {
        let v = values(4096, t);
        let waited = copy_in_then_relu(&device, &v, true);
        assert!(waited == relu(&v), "wrong values with the wait");
        if copy_in_then_relu(&device, &v, false) != relu(&v) {
            wrong += 1;
        }
    }
    assert!(
        wrong > 0,
        "without the event wait, {TRIES} tries all computed the right values: the emulator \
         no longer runs the copy stream apart from compute"
    );
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
fn planted_b_a_buffer_freed_while_the_copy_stream_reads_it_arrives_poisoned() {
    let device = gpu();
    let pool = HostPool::new();
    let mut poisoned = 0;
    for t in 0..TRIES {
        let v = values(4096, t);
        let kept = copy_out_then_free(&device, &pool, &v, false);
        assert!(kept == v, "wrong values with the buffer kept");
        let got = copy_out_then_free(&device, &pool, &v, true);
        if got.iter().any(|x| x.is_nan()) {
            poisoned += 1;
        } else {
            assert!(got == v, "neither the values nor poison");
        }
    }
    assert!(
        poisoned > 0,
        "freed before the copy's event, {TRIES} tries all copied the values: the emulator no \
         longer poisons memory freed under a queued copy"
    );
}

/// One line per stamp of race_test (scripts/cuda_emu/race_test.cpp) built on `program`'s
/// conv.cu.
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
    assert_eq!(clean.len(), 5, "{clean:?}");
    for line in &clean[..3] {
        assert!(
            line.contains("values right") && line.ends_with("no race"),
            "{line}"
        );
    }
    let planted = race_test("race_test_planted");
    assert_eq!(planted.len(), 5, "{planted:?}");
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
