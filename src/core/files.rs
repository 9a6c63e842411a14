//! The files a user names. Read (checkpoints, labels, policies, images): only regular files, so
//! a FIFO or a device named by mistake is refused instead of blocking or reading forever.
//! Written (checkpoints, manifests, exports, predictions, maps, metrics, timelines,
//! calibrations, slides): only where nothing but a regular file would be replaced, so a device
//! node, a pipe or a folder named by mistake is left as it was.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use super::error::{Error, Result};

/// Opens `path` for reading if it is a regular file (a symbolic link to one is), refusing
/// anything else as [`Error::BadInput`] before opening it.
pub fn open_regular(path: &Path) -> Result<File> {
    let bad = |why: String| Error::BadInput {
        path: path.to_path_buf(),
        why,
    };
    let meta = std::fs::metadata(path).map_err(|e| bad(format!("cannot read it: {e}")))?;
    if !meta.is_file() {
        let kind = match meta.file_type() {
            t if t.is_dir() => "a folder",
            _ => "not a regular file (a pipe, socket or device?)",
        };
        return Err(bad(format!("is {kind}, not a file to read")));
    }
    File::open(path).map_err(|e| bad(format!("cannot open it: {e}")))
}

/// The whole of the regular file at `path` as text (see [`open_regular`]).
pub fn read_text(path: &Path) -> Result<String> {
    let mut text = String::new();
    open_regular(path)?
        .read_to_string(&mut text)
        .map_err(|e| Error::BadInput {
            path: path.to_path_buf(),
            why: format!("cannot read it as text: {e}"),
        })?;
    Ok(text)
}

/// Refuses `path` as a file to write when something other than a regular file (or a link to
/// one) is there: a folder, a device, a pipe or a socket, which writing would replace or feed,
/// or a mount point (a file or device mounted over the path), which writing would write into.
pub fn check_output(path: &Path) -> Result<()> {
    match std::fs::metadata(path) {
        Ok(_) if is_mount_point(path) => Err(Error::BadInput {
            path: path.to_path_buf(),
            why: "is a mount point (a file or device mounted there), not a file gems may write; \
                  name a file"
                .into(),
        }),
        Ok(m) if m.is_file() => Ok(()),
        Ok(m) => Err(Error::BadInput {
            path: path.to_path_buf(),
            why: format!(
                "is {}, not a file gems may write; name a file",
                if m.is_dir() {
                    "a folder"
                } else {
                    "not a regular file (a device, pipe or socket?)"
                }
            ),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::BadInput {
            path: path.to_path_buf(),
            why: format!("cannot check it before writing: {e}"),
        }),
    }
}

/// Whether the existing `path` is where something is mounted, as containers mount a host's
/// files and devices over paths: by /proc/self/mountinfo, false where it cannot be read.
fn is_mount_point(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let (Ok(real), Ok(table)) = (path.canonicalize(), std::fs::read("/proc/self/mountinfo")) else {
        return false;
    };
    let real = real.as_os_str().as_bytes();
    table
        .split(|&b| b == b'\n')
        .filter_map(|line| line.split(|&b| b == b' ').nth(4))
        .any(|at| unescape_octal(at) == real)
}

/// A mountinfo field with its escapes (`\040` for a space: a backslash and 3 octal digits)
/// decoded.
fn unescape_octal(field: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(field.len());
    let mut i = 0;
    while i < field.len() {
        let code = field
            .get(i + 1..i + 4)
            .filter(|_| field[i] == b'\\')
            .and_then(|d| u8::from_str_radix(std::str::from_utf8(d).ok()?, 8).ok());
        match code {
            Some(c) => {
                out.push(c);
                i += 4;
            }
            None => {
                out.push(field[i]);
                i += 1;
            }
        }
    }
    out
}

/// Creates (or truncates) the regular file at `path` for writing, after [`check_output`].
pub fn create_output(path: &Path) -> Result<File> {
    check_output(path)?;
    File::create(path).map_err(|e| Error::BadInput {
        path: path.to_path_buf(),
        why: format!("cannot write it: {e}"),
    })
}

/// Writes `bytes` to the regular file at `path` in one go (see [`create_output`]).
pub fn write_output(path: &Path, bytes: &[u8]) -> Result<()> {
    create_output(path)?
        .write_all(bytes)
        .map_err(|e| Error::BadInput {
            path: path.to_path_buf(),
            why: format!("cannot write it: {e}"),
        })
}

/// Writes interleaved 8-bit RGB pixels, `width` × `height`, as a PNG file (see
/// [`write_output`]).
pub fn write_png(path: &Path, rgb: &[u8], width: u32, height: u32) -> Result<()> {
    let mut png = std::io::Cursor::new(Vec::new());
    image::write_buffer_with_format(
        &mut png,
        rgb,
        width,
        height,
        image::ExtendedColorType::Rgb8,
        image::ImageFormat::Png,
    )
    .map_err(|e| Error::BadInput {
        path: path.to_path_buf(),
        why: format!("cannot encode it as PNG: {e}"),
    })?;
    write_output(path, png.get_ref())
}

/// The temporary file [`write_atomically`] writes `path` through in this process:
/// `.<name>.<pid>.tmp` beside it, so two processes writing one path never share one.
fn temporary(path: &Path) -> Result<PathBuf> {
    let name = path.file_name().ok_or_else(|| Error::BadInput {
        path: path.to_path_buf(),
        why: "is not a file path".into(),
    })?;
    let dir = path.parent().unwrap_or(Path::new(""));
    Ok(dir.join(format!(
        ".{}.{}.tmp",
        name.to_string_lossy(),
        std::process::id()
    )))
}

/// Where gems keeps what it computed once for this machine (compiled kernels, GPU
/// calibrations): `GEMS_CACHE_DIR`, else `$XDG_CACHE_HOME/gems`, else `~/.cache/gems`.
pub fn cache_root() -> Option<PathBuf> {
    std::env::var_os("GEMS_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("gems")))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/gems")))
}

/// The name of the file that `name`, a temporary file of [`write_atomically`] (an interrupted
/// write's leftover), was to become; `None` for any other name.
pub fn temporary_target(name: &str) -> Option<&str> {
    let inner = name.strip_prefix('.')?.strip_suffix(".tmp")?;
    let (target, pid) = inner.rsplit_once('.')?;
    (!target.is_empty() && !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()))
        .then_some(target)
}

/// Writes `bytes` to a temporary file beside `path` (unique to this process), syncs it, and
/// renames it over `path`, so a reader sees the old file or the new one, never a mix. Refuses
/// a `path` that is not a regular file (see [`check_output`]).
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    check_output(path)?;
    let tmp = temporary(path)?;
    let io = |e: std::io::Error, what: &str| Error::BadInput {
        path: path.to_path_buf(),
        why: format!("cannot {what} it: {e}"),
    };
    let written = (|| {
        let mut f = File::create(&tmp).map_err(|e| io(e, "write"))?;
        f.write_all(bytes).map_err(|e| io(e, "write"))?;
        f.sync_all().map_err(|e| io(e, "sync"))?;
        drop(f);
        std::fs::rename(&tmp, path).map_err(|e| io(e, "rename the new version over"))
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written?;
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    if let Ok(d) = File::open(dir.unwrap_or(Path::new("."))) {
        // Make the rename itself durable; not every file system supports syncing a folder.
        let _ = d.sync_all();
    }
    Ok(())
}

/// Refuses to write any of `outputs` where it would replace one of `inputs` (the same file,
/// by any path to it), before any work: a run's outputs never overwrite what it reads.
pub fn refuse_overwriting(outputs: &[PathBuf], inputs: &[PathBuf]) -> Result<()> {
    // An output that does not exist yet is its folder's canonical path and its name.
    let resolve = |p: &Path| -> Option<PathBuf> {
        p.canonicalize().ok().or_else(|| {
            let dir = p.parent().filter(|d| !d.as_os_str().is_empty());
            Some(
                dir.unwrap_or(Path::new("."))
                    .canonicalize()
                    .ok()?
                    .join(p.file_name()?),
            )
        })
    };
    let inputs: Vec<(PathBuf, &PathBuf)> = inputs
        .iter()
        .filter_map(|i| Some((resolve(i)?, i)))
        .collect();
    for out in outputs {
        let Some(o) = resolve(out) else { continue };
        if let Some((_, input)) = inputs.iter().find(|(i, _)| *i == o) {
            return Err(Error::BadInput {
                path: out.clone(),
                why: format!(
                    "would replace {}, which this run reads; write the output elsewhere",
                    input.display()
                ),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temporary_names_are_per_process_and_recognised() {
        let tmp = temporary(Path::new("ck/step-000001.safetensors")).unwrap();
        let name = tmp.file_name().unwrap().to_str().unwrap();
        assert_eq!(
            name,
            format!(".step-000001.safetensors.{}.tmp", std::process::id())
        );
        assert_eq!(temporary_target(name), Some("step-000001.safetensors"));
        for other in [
            ".x.tmp",
            "step.1.tmp",
            ".step.safetensors.tmp",
            ".a.12x.tmp",
        ] {
            assert_eq!(temporary_target(other), None, "{other}");
        }
    }

    #[test]
    fn outputs_refuse_what_is_not_a_regular_file() {
        let dir = tempfile::tempdir().unwrap();
        let folder = dir.path().join("sub");
        std::fs::create_dir(&folder).unwrap();
        assert!(write_atomically(&folder, b"x").is_err());
        assert!(folder.is_dir());
        let file = dir.path().join("f.json");
        write_atomically(&file, b"one").unwrap();
        write_atomically(&file, b"two").unwrap();
        assert_eq!(std::fs::read(&file).unwrap(), b"two");
        let leftovers = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(leftovers, 2, "no temporary file is left");
    }

    #[test]
    fn mount_points_are_read_with_their_escapes() {
        assert_eq!(unescape_octal(br"/a\040b\134c\0"), b"/a b\\c\\0");
        assert!(is_mount_point(Path::new("/")));
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        assert!(!is_mount_point(&file));
    }
}
