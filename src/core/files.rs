//! Opening the files a user names (checkpoints, labels, policies, images): only regular files,
//! so a FIFO or a device named by mistake is refused instead of blocking or reading forever.

use std::fs::File;
use std::io::Read;
use std::path::Path;

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
