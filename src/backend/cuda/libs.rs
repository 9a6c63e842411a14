//! Finding the CUDA libraries (the driver, NVRTC, cuBLAS, cuDNN) where CUDA 13 and cuDNN 9 come
//! from a toolkit, the distribution, or Python packages (`nvidia-*` wheels, as PyTorch installs
//! them).
//!
//! cudarc opens each library by its bare name (`libcublas.so.13`, ...), which the dynamic loader
//! resolves on `LD_LIBRARY_PATH` and the system's cache only. So before the first CUDA call we
//! look in more places, in this order, and load what we find by its full path:
//!
//! 1. the directories in `GEMS_CUDA_LIB_DIRS` (separated by `:`),
//! 2. `$CUDA_HOME/lib64` and `$CUDA_PATH/lib64`, `/usr/local/cuda/lib64`, the driver's
//!    `/usr/local/nvidia/lib64` (containers) and `/usr/lib/x86_64-linux-gnu`,
//! 3. the `nvidia/*/lib` folders of Python's site-packages (the active virtual environment,
//!    `/opt/*/.venv`, `/usr/local/lib/python3*`, `~/.local/lib/python3*`).
//!
//! A library loaded by path answers later requests for its soname, so cudarc then finds it.
//! What was found, and where, is reported by `gems info`.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// One library and where it was found.
#[derive(Clone, Debug)]
pub struct Library {
    /// What it is for: `driver`, `nvrtc`, `cublas`, `cudnn`.
    pub role: &'static str,
    /// The file loaded, or `None` when it was not found anywhere.
    pub path: Option<PathBuf>,
    /// Why it could not be loaded (when `path` is `None`), or the loader's error for a file
    /// that was found but would not load.
    pub problem: Option<String>,
}

/// Sonames to look for, newest first (cuDNN 9 serves every CUDA 12/13 build).
const WANTED: &[(&str, &[&str])] = &[
    ("driver", &["libcuda.so.1", "libcuda.so"]),
    (
        "nvrtc",
        &[
            "libnvrtc.so.13",
            "libnvrtc.so.12",
            "libnvrtc.so.11.2",
            "libnvrtc.so",
        ],
    ),
    (
        "cublas",
        &["libcublas.so.13", "libcublas.so.12", "libcublas.so"],
    ),
    ("cudnn", &["libcudnn.so.9", "libcudnn.so"]),
];

/// Looks for every library once per process and loads those found; later calls return the
/// same report.
pub fn load() -> &'static [Library] {
    static FOUND: OnceLock<Vec<Library>> = OnceLock::new();
    FOUND.get_or_init(|| {
        let dirs = search_dirs();
        WANTED
            .iter()
            .map(|(role, names)| find(role, names, &dirs))
            .collect()
    })
}

/// The report for `role`.
pub fn get(role: &str) -> Option<&'static Library> {
    load().iter().find(|l| l.role == role)
}

/// cuDNN 9 opens its sub-libraries (libcudnn_ops.so.9, libcudnn_cnn.so.9, its engines) by
/// name when first used, which fails where the folder libcudnn.so.9 came from is on no search
/// path and the libraries carry no RUNPATH. So load them from that folder now (once); any that
/// will not load are left for cuDNN to report when it needs them.
pub fn load_cudnn_sublibraries() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        let dir = get("cudnn")
            .and_then(|l| l.path.as_deref())
            .and_then(Path::parent)
            .filter(|d| !d.as_os_str().is_empty());
        let Some(dir) = dir else { return };
        let mut pending: Vec<PathBuf> = read_dir_sorted(dir)
            .into_iter()
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("libcudnn_") && n.ends_with(".so.9"))
            })
            .collect();
        // They need one another: retry until a round loads nothing more.
        loop {
            let before = pending.len();
            pending.retain(|p| open(p).is_err());
            if pending.is_empty() || pending.len() == before {
                break;
            }
        }
    });
}

fn find(role: &'static str, names: &[&str], dirs: &[PathBuf]) -> Library {
    let mut problem = None;
    for dir in dirs {
        for name in names {
            let path = dir.join(name);
            if !path.is_file() {
                continue;
            }
            match open(&path) {
                Ok(()) => {
                    companions(role, dir);
                    return Library {
                        role,
                        path: Some(path),
                        problem: None,
                    };
                }
                Err(e) => problem = Some(format!("{}: {e}", path.display())),
            }
        }
    }
    // Last, the loader's own search (LD_LIBRARY_PATH, the system cache).
    for name in names {
        if open(Path::new(name)).is_ok() {
            return Library {
                role,
                path: Some(PathBuf::from(name)),
                problem: None,
            };
        }
    }
    Library {
        role,
        path: None,
        problem: Some(problem.unwrap_or_else(|| {
            format!(
                "none of {} in GEMS_CUDA_LIB_DIRS, the CUDA toolkit, the driver's folder, \
                 Python's nvidia packages or the loader's path",
                names.join(", ")
            )
        })),
    }
}

/// Libraries that `role`'s library opens by bare name at run time, loaded from its folder so
/// they are found even where that folder is not on the loader's path: NVRTC's builtins.
fn companions(role: &str, dir: &Path) {
    if role != "nvrtc" {
        return;
    }
    for lib in read_dir_sorted(dir) {
        let name = lib.file_name().map(|n| n.to_string_lossy().into_owned());
        if name.is_some_and(|n| n.starts_with("libnvrtc-builtins.so.")) {
            // Best effort: NVRTC reports a missing builtins library itself, by name.
            let _ = open(&lib);
        }
    }
}

/// dlopen with RTLD_GLOBAL, so the library's soname answers cudarc's later lookups. The
/// handle is kept for the life of the process on purpose.
fn open(path: &Path) -> Result<(), String> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|e| e.to_string())?;
    // SAFETY: loading a shared library runs its initializers; these are NVIDIA's libraries,
    // which are made to be loaded this way.
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a thread-local message (or null).
        let msg = unsafe { libc::dlerror() };
        return Err(if msg.is_null() {
            "dlopen failed".into()
        } else {
            // SAFETY: non-null dlerror output is a NUL-terminated string.
            unsafe { std::ffi::CStr::from_ptr(msg) }
                .to_string_lossy()
                .into_owned()
        });
    }
    Ok(())
}

/// The directories searched, in order (see the module's documentation).
pub fn search_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(list) = std::env::var_os("GEMS_CUDA_LIB_DIRS") {
        dirs.extend(std::env::split_paths(&list));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = std::env::var_os(var) {
            dirs.push(PathBuf::from(root).join("lib64"));
        }
    }
    dirs.extend(
        [
            "/usr/local/cuda/lib64",
            "/usr/local/nvidia/lib64",
            "/usr/lib/x86_64-linux-gnu",
        ]
        .map(PathBuf::from),
    );
    for site in site_packages() {
        // nvidia-*-cu12 wheels: nvidia/<lib>/lib; CUDA 13 wheels: nvidia/cu13/lib too.
        for pkg in read_dir_sorted(&site.join("nvidia")) {
            dirs.push(pkg.join("lib"));
        }
    }
    dirs.retain(|d| d.is_dir());
    dirs.dedup();
    dirs
}

fn site_packages() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = Vec::new();
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV") {
        roots.push(PathBuf::from(venv).join("lib"));
    }
    for opt in read_dir_sorted(Path::new("/opt")) {
        roots.push(opt.join(".venv/lib"));
    }
    roots.push(PathBuf::from("/usr/local/lib"));
    roots.push(PathBuf::from("/usr/lib"));
    if let Some(home) = std::env::var_os("HOME") {
        roots.push(PathBuf::from(home).join(".local/lib"));
    }
    let mut sites = Vec::new();
    for root in roots {
        for py in read_dir_sorted(&root) {
            let is_python = py
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("python3"));
            if is_python {
                sites.push(py.join("site-packages"));
                sites.push(py.join("dist-packages"));
            }
        }
    }
    sites.retain(|s| s.is_dir());
    sites
}

/// Entries of `dir` in name order (nothing when it cannot be read).
fn read_dir_sorted(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|r| r.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    v.sort();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_a_library_in_a_named_directory_and_reports_a_missing_one() {
        // libm is everywhere; looking for it under a made-up role exercises the directory walk
        // and the load by full path without needing any CUDA library.
        let dir = PathBuf::from("/usr/lib/x86_64-linux-gnu");
        let found = find("libm", &["libm.so.6"], std::slice::from_ref(&dir));
        assert_eq!(found.path, Some(dir.join("libm.so.6")));
        let missing = find("none", &["libgems-does-not-exist.so.1"], &[dir]);
        assert!(missing.path.is_none());
        let why = missing.problem.unwrap();
        assert!(why.contains("libgems-does-not-exist.so.1"), "{why}");
    }
}
