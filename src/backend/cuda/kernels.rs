//! The kernel sources (`cuda/*.cu`, one op family per file) and their compilation to PTX by
//! NVRTC for a device architecture, cached on disk by (source, arch, NVRTC version).
//!
//! NVRTC is loaded at run time (cudarc `dynamic-loading`); a missing library is an error here,
//! never a panic. Nothing in this module needs a GPU or libcuda.

use std::hash::{Hash, Hasher};
use std::path::PathBuf;

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
/// Device-side helpers every kernel file includes.
const DEVICE_HEADER: &str = include_str!("../../../include/gems_device.h");

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

/// The source of family `name` with its headers pasted in, so that compiling it needs no
/// files (the binary may run far from its source tree).
fn self_contained(name: &str) -> Result<String, KernelError> {
    let device = DEVICE_HEADER.replace("#include \"gems_kernels.h\"", HEADER);
    Ok(source(name)?.replace("#include \"gems_device.h\"", &device))
}

/// Compiles kernel family `name` to PTX for `arch` (e.g. `compute_80`). NVRTC's log comes with
/// any error.
pub fn compile(name: &str, arch: &'static str) -> Result<String, KernelError> {
    let src = self_contained(name)?;
    if !nvrtc_available() {
        return Err(KernelError::NvrtcMissing(
            "no libnvrtc under any name cudarc looks for".into(),
        ));
    }
    let opts = CompileOptions {
        arch: Some(arch),
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

/// The PTX of family `name` for `arch`: from the disk cache when this source was compiled
/// for this arch by this NVRTC before, else compiled and stored there. A cache that cannot be
/// written only costs the next run a compilation.
pub fn ptx(name: &str, arch: &'static str) -> Result<String, KernelError> {
    let path = cache_dir().map(|d| d.join(format!("{name}-{arch}-{:016x}.ptx", key(name, arch))));
    if let Some(ptx) = path.as_ref().and_then(|p| std::fs::read_to_string(p).ok()) {
        return Ok(ptx);
    }
    let ptx = compile(name, arch)?;
    if let Some(path) = path {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let stored = path
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| std::fs::write(&tmp, &ptx))
            .and_then(|()| std::fs::rename(&tmp, &path));
        if stored.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    }
    Ok(ptx)
}

/// Where compiled PTX is kept: `GEMS_CACHE_DIR`, else `$XDG_CACHE_HOME/gems`, else
/// `~/.cache/gems`; in its `ptx` folder.
pub fn cache_dir() -> Option<PathBuf> {
    let root = std::env::var_os("GEMS_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("gems")))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/gems")))?;
    Some(root.join("ptx"))
}

/// Identifies (source with headers, arch, NVRTC version): any change compiles afresh.
fn key(name: &str, arch: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    self_contained(name).unwrap_or_default().hash(&mut h);
    arch.hash(&mut h);
    nvrtc_version().hash(&mut h);
    h.finish()
}

/// NVRTC's (major, minor), when it can be loaded.
pub fn nvrtc_version() -> Option<(i32, i32)> {
    if !nvrtc_available() {
        return None;
    }
    // A library without the symbol makes cudarc panic, which is caught.
    std::panic::catch_unwind(|| {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: nvrtcVersion writes two ints.
        let status = unsafe { nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
        (status == nvrtc::sys::nvrtcResult::NVRTC_SUCCESS).then_some((major, minor))
    })
    .ok()
    .flatten()
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
