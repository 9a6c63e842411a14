//! A folder of labelled images in the ImageFolder convention: one sub-folder per class (the
//! class names, sorted), holding PNG, JPEG or TIFF files at any depth. Files directly in the
//! top folder are not samples (a README or a labels file may live there).

use std::path::{Path, PathBuf};

use super::{Image, Source};
use crate::{Error, Result};

/// Labelled images in class sub-folders (see the module).
pub struct Folder {
    classes: Vec<String>,
    /// (file, label), by class then path.
    files: Vec<(PathBuf, u32)>,
    /// Files left out at opening because their header could not be read (`skip_bad`).
    pub skipped: Vec<(PathBuf, String)>,
}

impl Folder {
    /// Lists `dir`. With `skip_bad`, files whose image header does not read are left out
    /// (each with its reason in `skipped`); otherwise they fail when decoded, by name.
    pub fn open(dir: &Path, skip_bad: bool) -> Result<Folder> {
        let classes = Folder::class_names(dir)?;
        let mut files = Vec::new();
        let mut skipped = Vec::new();
        for (label, class) in classes.iter().enumerate() {
            let mut found = Vec::new();
            walk(&dir.join(class), &mut found)?;
            if found.is_empty() {
                return Err(Error::BadInput {
                    path: dir.join(class),
                    why: "is an empty class folder: every class needs images (remove the \
                          folder if it is not a class)"
                        .into(),
                });
            }
            found.sort();
            for path in found {
                match skip_bad.then(|| header(&path)) {
                    Some(Err(e)) => skipped.push((path, e.to_string())),
                    _ => files.push((path, label as u32)),
                }
            }
        }
        if let Some(label) = (0..classes.len()).find(|&l| !files.iter().any(|f| f.1 == l as u32)) {
            return Err(Error::BadInput {
                path: dir.join(&classes[label]),
                why: "holds no readable image: every class needs some".into(),
            });
        }
        Ok(Folder {
            classes,
            files,
            skipped,
        })
    }

    /// The sub-folders of `dir`, sorted: the class names.
    pub fn class_names(dir: &Path) -> Result<Vec<String>> {
        let unreadable =
            |e: std::io::Error| Error::Data(format!("cannot read {}: {e}", dir.display()));
        let mut classes = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(unreadable)? {
            let entry = entry.map_err(unreadable)?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if entry.path().is_dir() && !name.starts_with('.') {
                classes.push(name);
            }
        }
        classes.sort();
        if classes.is_empty() {
            return Err(Error::Data(format!(
                "{} has no class folders: put each class's images in a sub-folder named after it",
                dir.display()
            )));
        }
        Ok(classes)
    }
}

/// Every non-hidden file under `dir`; refuses anything else that is not a folder (a pipe, a
/// device), which reading could block on.
fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let entries = std::fs::read_dir(dir)
        .map_err(|e| Error::Data(format!("cannot read {}: {e}", dir.display())))?;
    for entry in entries {
        let path = entry
            .map_err(|e| Error::Data(format!("cannot read {}: {e}", dir.display())))?
            .path();
        let hidden = path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with('.'));
        if hidden {
            continue;
        }
        if path.is_dir() {
            walk(&path, out)?;
        } else if path.is_file() {
            out.push(path);
        } else {
            return Err(Error::BadInput {
                path,
                why: "is not a regular file (a pipe, socket, device or broken link?)".into(),
            });
        }
    }
    Ok(())
}

fn reader(path: &Path) -> Result<image::ImageReader<std::io::BufReader<std::fs::File>>> {
    image::ImageReader::open(path)
        .and_then(|r| r.with_guessed_format())
        .map_err(|e| Error::Data(format!("cannot read {}: {e}", path.display())))
}

/// Reads just the header: is this an image we can decode?
fn header(path: &Path) -> Result<(u32, u32)> {
    reader(path)?
        .into_dimensions()
        .map_err(|e| Error::Data(format!("{} is not a readable image: {e}", path.display())))
}

impl Source for Folder {
    fn samples(&self) -> Option<usize> {
        Some(self.files.len())
    }

    fn classes(&self) -> &[String] {
        &self.classes
    }

    fn label(&self, index: usize) -> Result<u32> {
        Ok(self.file(index)?.1)
    }

    fn read(&self, index: usize) -> Result<Image> {
        let path = &self.file(index)?.0;
        let img = reader(path)?
            .decode()
            .map_err(|e| Error::Data(format!("{} is not a readable image: {e}", path.display())))?
            .into_rgb8();
        Ok(Image::from_rgb8(
            img.width() as usize,
            img.height() as usize,
            img.as_raw(),
        ))
    }

    fn describe(&self, index: usize) -> String {
        self.file(index)
            .map(|f| f.0.display().to_string())
            .unwrap_or_else(|e| e.to_string())
    }
}

impl Folder {
    fn file(&self, index: usize) -> Result<&(PathBuf, u32)> {
        self.files.get(index).ok_or_else(|| {
            Error::Internal(format!("file {index} asked of {} files", self.files.len()))
        })
    }
}
