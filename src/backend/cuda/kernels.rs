//! The kernel sources (`cuda/*.cu`, one op family per file) and their compilation to PTX by
//! NVRTC for a device architecture.
//!
//! NVRTC is loaded at run time (cudarc `dynamic-loading`); a missing library is an error here,
//! never a panic. Nothing in this module needs a GPU or libcuda.

use std::path::{Path, PathBuf};

use cudarc::nvrtc::{self, CompileError, CompileOptions};

/// (family, source) of every kernel file; each source includes `gems_kernels.h`.
pub const SOURCES: &[(&str, &str)] = &[
    ("conv", include_str!("../../../cuda/conv.cu")),
    ("batchnorm", include_str!("../../../cuda/batchnorm.cu")),
    ("activation", include_str!("../../../cuda/activation.cu")),
    ("pool", include_str!("../../../cuda/pool.cu")),
    ("loss", include_str!("../../../cuda/loss.cu")),
    ("optim", include_str!("../../../cuda/optim.cu")),
    ("elementwise", include_str!("../../../cuda/elementwise.cu")),
];

/// The header of the kernels' parameter structs.
pub const HEADER: &str = include_str!("../../../include/gems_kernels.h");

/// Architectures the kernels are built for (TF32/bf16 tensor cores need sm_80 or later).
pub const ARCHS: &[&str] = &["compute_80", "compute_90"];

/// Why a kernel source did not compile.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error(
        "NVRTC (libnvrtc.so) cannot be loaded: {0}. Put a libnvrtc.so on LD_LIBRARY_PATH \
         (scripts/test.sh installs NVRTC and links it as target/nvrtc/libnvrtc.so)"
    )]
    NvrtcMissing(String),
    #[error("no kernel source named {0:?}")]
    UnknownSource(String),
    #[error("NVRTC failed to compile cuda/{name}.cu for {arch}: {error}\n{log}")]
    Compile {
        name: String,
        arch: String,
        error: String,
        log: String,
    },
}

/// The directory holding `gems_kernels.h` in this source tree.
pub fn include_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("include")
}

/// Whether libnvrtc can be loaded (without panicking when it cannot).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to open the library under cudarc's candidate names.
    unsafe { nvrtc::sys::is_culib_present() }
}

/// The source of kernel family `name`.
pub fn source(name: &str) -> Result<&'static str, KernelError> {
    SOURCES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, s)| *s)
        .ok_or_else(|| KernelError::UnknownSource(name.to_string()))
}

/// Compiles kernel family `name` to PTX for `arch` (e.g. `compute_80`), with `include` on the
/// include path. NVRTC's log comes with any error.
pub fn compile(name: &str, arch: &'static str, include: &Path) -> Result<String, KernelError> {
    let src = source(name)?;
    if !nvrtc_available() {
        return Err(KernelError::NvrtcMissing(
            "no libnvrtc under any name cudarc looks for".into(),
        ));
    }
    let opts = CompileOptions {
        arch: Some(arch),
        include_paths: vec![include.display().to_string()],
        name: Some(format!("{name}.cu")),
        options: vec!["--std=c++17".into()],
        ..Default::default()
    };
    // cudarc panics when a symbol is missing from the loaded library (an NVRTC too old for it).
    let result =
        std::panic::catch_unwind(|| nvrtc::compile_ptx_with_opts(src, opts)).map_err(|p| {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "loading NVRTC panicked".into());
            KernelError::NvrtcMissing(msg)
        })?;
    let fail = |error: String, log: String| KernelError::Compile {
        name: name.to_string(),
        arch: arch.to_string(),
        error,
        log,
    };
    match result {
        Ok(ptx) => Ok(ptx.to_src()),
        Err(CompileError::CompileError { nvrtc, log, .. }) => Err(fail(
            format!("{nvrtc:?}"),
            log.to_string_lossy().into_owned(),
        )),
        Err(e) => Err(fail(format!("{e:?}"), String::new())),
    }
}

/// The `.entry` names (kernels) of a PTX module.
pub fn entries(ptx: &str) -> Vec<String> {
    ptx.lines()
        .filter_map(|l| {
            let rest = l.trim_start().strip_prefix(".visible .entry ")?;
            Some(rest.split('(').next()?.trim().to_string())
        })
        .collect()
}
