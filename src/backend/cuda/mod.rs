//! The CUDA backend's kernels, as far as they go without a device: the parameter structs the
//! kernels take ([`params`], bindgen's output for `include/gems_kernels.h`) and the kernel
//! sources (`cuda/*.cu`) with their run-time compilation by NVRTC ([`kernels`]).
//!
//! The backend itself (device, allocator, launching) comes later. The kernels are compiled by
//! NVRTC for sm_80 and sm_90 in CI (tests/cuda_kernels.rs) but have not yet run on a GPU.

pub mod kernels;
#[rustfmt::skip]
#[allow(non_camel_case_types, non_snake_case, non_upper_case_globals, clippy::all)]
pub mod params;
