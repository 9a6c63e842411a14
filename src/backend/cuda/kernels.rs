//! The kernel sources (`cuda/*.cu`, one op family per file) and their compilation by NVRTC for
//! a device, cached on disk by (source, target, NVRTC version).
//!
//! A GPU whose architecture NVRTC knows gets machine code (SASS, a cubin) built for exactly
//! that architecture: ptxas checks every kernel when it is compiled (CI compiles for sm_80 and
//! sm_90 this way), and the driver loads the code as it is. That also works where NVRTC is newer
//! than the driver, whose JIT would refuse the newer PTX. A GPU newer than NVRTC gets PTX for the
//! newest architecture NVRTC knows, which the driver compiles when it loads it.
//!
//! NVRTC is loaded at run time (cudarc `dynamic-loading`); a missing library is an error here,
//! never a panic. Nothing in this module needs a GPU or libcuda.

use std::ffi::{c_char, CStr, CString};
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};

use cudarc::nvrtc::{result, sys};

/// (family, source) of every kernel file; each source includes `gems_kernels.h`.
pub const SOURCES: &[(&str, &str)] = &[
    ("conv", include_str!("../../../cuda/conv.cu")),
    ("batchnorm", include_str!("../../../cuda/batchnorm.cu")),
    ("groupnorm", include_str!("../../../cuda/groupnorm.cu")),
    ("activation", include_str!("../../../cuda/activation.cu")),
    ("pool", include_str!("../../../cuda/pool.cu")),
    ("resize", include_str!("../../../cuda/resize.cu")),
    ("loss", include_str!("../../../cuda/loss.cu")),
    ("optim", include_str!("../../../cuda/optim.cu")),
    ("elementwise", include_str!("../../../cuda/elementwise.cu")),
];

/// The header of the kernels' parameter structs.
pub const HEADER: &str = include_str!("../../../include/gems_kernels.h");
/// Device-side helpers every kernel file includes.
const DEVICE_HEADER: &str = include_str!("../../../include/gems_device.h");

/// The oldest architecture the kernels run on (TF32/bf16 tensor cores need sm_80).
pub const OLDEST: u32 = 80;

/// The targets CI compiles every kernel for: machine code for the A100 and the H100/H200.
pub const CI_TARGETS: &[Target] = &[Target::Sass(80), Target::Sass(90)];

/// What the kernels are compiled to, by compute capability (90 for 9.0).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    /// Machine code for exactly this architecture (`sm_90`), checked by ptxas at compile time.
    Sass(u32),
    /// PTX for this virtual architecture (`compute_90`), compiled by the driver at load time.
    Ptx(u32),
}

impl Target {
    /// NVRTC's name for it: `sm_90` or `compute_90`.
    pub fn name(self) -> String {
        match self {
            Target::Sass(cc) => format!("sm_{cc}"),
            Target::Ptx(cc) => format!("compute_{cc}"),
        }
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Sass(_) => write!(f, "{}", self.name()),
            Target::Ptx(_) => write!(f, "{} PTX, compiled by the driver", self.name()),
        }
    }
}

/// The target for a GPU of compute capability `cc` when NVRTC knows the architectures
/// `known`: its own machine code when NVRTC knows it, else PTX for the newest architecture
/// NVRTC knows below it (the driver compiles PTX for newer GPUs, never for older ones).
pub fn target_for(cc: (i32, i32), known: &[u32]) -> Result<Target, String> {
    let have = (cc.0 * 10 + cc.1).max(0) as u32;
    if have < OLDEST {
        return Err(format!(
            "compute capability {}.{} is below 8.0; the kernels need sm_80 or newer",
            cc.0, cc.1
        ));
    }
    if known.contains(&have) {
        return Ok(Target::Sass(have));
    }
    known
        .iter()
        .copied()
        .filter(|&a| (OLDEST..have).contains(&a))
        .max()
        .map(Target::Ptx)
        .ok_or_else(|| {
            format!(
                "this NVRTC compiles for none of sm_80 to sm_{have} (it knows {known:?}); \
                 install a CUDA 12 or 13 NVRTC"
            )
        })
}

/// A kernel family compiled for one target: its PTX (which names the kernels) and, for a
/// machine-code target, the cubin that is loaded.
#[derive(Clone, Debug)]
pub struct Module {
    /// The architecture it was compiled for.
    pub target: Target,
    /// The PTX NVRTC produced.
    pub ptx: String,
    /// Machine code for `target`, when it is a real architecture.
    pub cubin: Option<Vec<u8>>,
}

impl Module {
    /// The `.entry` names (kernels) of the module.
    pub fn entries(&self) -> Vec<String> {
        self.ptx
            .lines()
            .filter_map(|l| {
                let rest = l.trim_start().strip_prefix(".visible .entry ")?;
                Some(rest.split('(').next()?.trim().to_string())
            })
            .collect()
    }

    /// What the driver loads: the cubin, else the PTX.
    pub fn image(&self) -> cudarc::nvrtc::Ptx {
        match &self.cubin {
            Some(cubin) => cudarc::nvrtc::Ptx::from_binary(cubin.clone()),
            None => cudarc::nvrtc::Ptx::from_src(self.ptx.clone()),
        }
    }
}

/// Why a kernel source did not compile.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error(
        "NVRTC (libnvrtc.so) cannot be loaded: {0}. Put a libnvrtc.so on LD_LIBRARY_PATH \
         (scripts/test.sh installs NVRTC and links it as target/nvrtc/libnvrtc.so)"
    )]
    /// NVRTC's library could not be loaded.
    NvrtcMissing(String),
    #[error("no kernel source named {0:?}")]
    /// No kernel source of that name is built in.
    UnknownSource(String),
    #[error("NVRTC failed to compile cuda/{name}.cu for {target}: {error}\n{log}")]
    /// NVRTC refused a source.
    Compile {
        /// The source (`conv` for `cuda/conv.cu`).
        name: String,
        /// The architecture asked for.
        target: String,
        /// NVRTC's error.
        error: String,
        /// The compile log.
        log: String,
    },
}

/// Whether libnvrtc can be loaded (without panicking when it cannot).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to open the library under cudarc's candidate names.
    unsafe { sys::is_culib_present() }
}

/// Runs `f` against NVRTC, which must be loadable; cudarc panics when a symbol is missing from
/// the loaded library (an NVRTC too old for it), which becomes an error.
fn with_nvrtc<T>(f: impl FnOnce() -> T) -> Result<T, KernelError> {
    if !nvrtc_available() {
        return Err(KernelError::NvrtcMissing(
            "no libnvrtc under any name cudarc looks for".into(),
        ));
    }
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "loading NVRTC panicked".into());
        KernelError::NvrtcMissing(msg)
    })
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

/// Compiles kernel family `name` for `target`. NVRTC's log comes with any error.
pub fn compile(name: &str, target: Target) -> Result<Module, KernelError> {
    let src = CString::new(self_contained(name)?)
        .map_err(|_| KernelError::UnknownSource(format!("{name} (a NUL byte in the source)")))?;
    let file = CString::new(format!("{name}.cu")).expect("family names have no NUL");
    let fail = |error: String, log: String| KernelError::Compile {
        name: name.to_string(),
        target: target.name(),
        error,
        log,
    };
    with_nvrtc(|| {
        let prog = Program(
            result::create_program(&src, Some(&file))
                .map_err(|e| fail(format!("{e:?}"), String::new()))?,
        );
        let options = [
            format!("--gpu-architecture={}", target.name()),
            "--std=c++17".into(),
        ];
        // SAFETY: `prog` is live until it is dropped at the end of this closure.
        unsafe {
            result::compile_program(prog.0, &options)
                .map_err(|e| fail(format!("{e:?}"), prog.log()))?;
            let ptx = result::get_ptx(prog.0).map_err(|e| fail(format!("{e:?}"), prog.log()))?;
            let ptx = CStr::from_ptr(ptx.as_ptr()).to_string_lossy().into_owned();
            let cubin = match target {
                Target::Sass(_) => Some(prog.cubin().map_err(|e| fail(e, prog.log()))?),
                Target::Ptx(_) => None,
            };
            Ok(Module { target, ptx, cubin })
        }
    })?
}

/// An NVRTC program, destroyed when dropped.
struct Program(sys::nvrtcProgram);

impl Program {
    /// NVRTC's log for the program (warnings, errors).
    fn log(&self) -> String {
        // SAFETY: the program is live.
        unsafe { result::get_program_log(self.0) }
            .map(|log| {
                unsafe { CStr::from_ptr(log.as_ptr()) }
                    .to_string_lossy()
                    .into_owned()
            })
            .unwrap_or_default()
    }

    /// The machine code of a program compiled for an `sm_` target.
    fn cubin(&self) -> Result<Vec<u8>, String> {
        let mut size = 0usize;
        // SAFETY: the program is live and compiled; the buffer holds `size` bytes.
        unsafe {
            sys::nvrtcGetCUBINSize(self.0, &mut size)
                .result()
                .map_err(|e| format!("{e:?}"))?;
            let mut cubin = vec![0u8; size];
            sys::nvrtcGetCUBIN(self.0, cubin.as_mut_ptr().cast::<c_char>())
                .result()
                .map_err(|e| format!("{e:?}"))?;
            Ok(cubin)
        }
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by create_program and destroyed only here.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

/// Family `name` compiled for `target`: from the disk cache when this source was compiled for
/// this target by this NVRTC before, else compiled and stored there. A cache that cannot be
/// written only costs the next run a compilation.
pub fn module(name: &str, target: Target) -> Result<Module, KernelError> {
    let stem = cache_dir().map(|d| {
        d.join(format!(
            "{name}-{}-{:016x}",
            target.name(),
            key(name, target)
        ))
    });
    if let Some(cached) = stem.as_deref().and_then(|s| read_cached(s, target)) {
        return Ok(cached);
    }
    let module = compile(name, target)?;
    if let Some(stem) = stem {
        let _ = store(&stem.with_extension("ptx"), module.ptx.as_bytes());
        if let Some(cubin) = &module.cubin {
            let _ = store(&stem.with_extension("cubin"), cubin);
        }
    }
    Ok(module)
}

fn read_cached(stem: &Path, target: Target) -> Option<Module> {
    let ptx = std::fs::read_to_string(stem.with_extension("ptx")).ok()?;
    let cubin = match target {
        Target::Sass(_) => Some(std::fs::read(stem.with_extension("cubin")).ok()?),
        Target::Ptx(_) => None,
    };
    Some(Module { target, ptx, cubin })
}

/// Writes `bytes` to `path` whole or not at all (a temporary file renamed into place).
fn store(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let stored = path
        .parent()
        .map_or(Ok(()), std::fs::create_dir_all)
        .and_then(|()| std::fs::write(&tmp, bytes))
        .and_then(|()| std::fs::rename(&tmp, path));
    if stored.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    stored
}

/// Where compiled kernels are kept: the `kernels` folder of
/// [`cache_root`](crate::core::files::cache_root).
pub fn cache_dir() -> Option<PathBuf> {
    Some(crate::core::files::cache_root()?.join("kernels"))
}

/// Identifies (source with headers, target, NVRTC version): any change compiles afresh.
fn key(name: &str, target: Target) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    self_contained(name).unwrap_or_default().hash(&mut h);
    target.hash(&mut h);
    nvrtc_version().hash(&mut h);
    h.finish()
}

/// NVRTC's (major, minor), when it can be loaded.
pub fn nvrtc_version() -> Option<(i32, i32)> {
    with_nvrtc(|| {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: nvrtcVersion writes two ints.
        let status = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
        (status == sys::nvrtcResult::NVRTC_SUCCESS).then_some((major, minor))
    })
    .ok()
    .flatten()
}

/// The architectures NVRTC compiles machine code for (90 for sm_90), when it can be loaded.
pub fn known_archs() -> Result<Vec<u32>, KernelError> {
    with_nvrtc(|| {
        let mut n = 0;
        // SAFETY: the first call writes the count, the second that many ints.
        unsafe {
            sys::nvrtcGetNumSupportedArchs(&mut n).result().ok()?;
            let mut archs = vec![0i32; n.max(0) as usize];
            sys::nvrtcGetSupportedArchs(archs.as_mut_ptr())
                .result()
                .ok()?;
            Some(archs.into_iter().map(|a| a.max(0) as u32).collect())
        }
    })?
    .ok_or_else(|| KernelError::NvrtcMissing("NVRTC did not list its architectures".into()))
}
