//! A folder of labelled images in the ImageFolder convention: one sub-folder per class (the
//! class names, sorted), holding PNG, JPEG or TIFF files at any depth. Files directly in the
//! top folder are not samples (a README or a labels file may live there). And [`Pairs`]:
//! images and their masks, to segment.

use std::path::{Path, PathBuf};

use super::{Image, Mask, Source, Task, UNLABELLED};
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
        if classes == ["images", "masks"] {
            return Err(Error::Data(format!(
                "{} is laid out for segmentation (images/ and masks/), not as one sub-folder \
                 per class: a classifier would learn \"images\" against \"masks\"; segment it \
                 with a segmentation model (a unet)",
                dir.display()
            )));
        }
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

/// Decodes the image at `path` as RGB planes.
fn decode_rgb(path: &Path) -> Result<Image> {
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
        decode_rgb(&self.file(index)?.0)
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

/// Images and their masks, to segment: `DIR/images/<stem>.<png|jpg|jpeg|tif|tiff>`, each with
/// `DIR/masks/<stem>.png`, an 8-bit grayscale PNG of the image's size whose values are class
/// indices (255: unlabelled), and the class names in `DIR/classes.txt`, one a line in index
/// order.
pub struct Pairs {
    classes: Vec<String>,
    /// (image, mask), by stem.
    pairs: Vec<(PathBuf, PathBuf)>,
    /// Pairs left out at opening because a header could not be read (`skip_bad`).
    pub skipped: Vec<(PathBuf, String)>,
}

/// The mask value of a pixel without a label.
const MASK_UNLABELLED: u8 = 255;

impl Pairs {
    /// Lists `dir`'s pairs, reading each file's header. Refuses, naming the file: an image
    /// without a mask or a mask without an image, a file of another kind, a mask that is not
    /// 8-bit grayscale or whose size differs from its image's. With `skip_bad`, a pair whose
    /// header does not read is left out (with its reason in `skipped`).
    pub fn open(dir: &Path, skip_bad: bool) -> Result<Pairs> {
        let classes = Pairs::class_names(dir)?;
        let images = stems(&dir.join("images"), &["png", "jpg", "jpeg", "tif", "tiff"])?;
        let mut masks = stems(&dir.join("masks"), &["png"])?;
        let mut pairs = Vec::new();
        let mut skipped = Vec::new();
        for (stem, image) in images {
            let mask = masks.remove(&stem).ok_or_else(|| Error::BadInput {
                path: image.clone(),
                why: format!("has no mask: masks/{stem}.png is missing"),
            })?;
            match (header(&image), header(&mask)) {
                (Ok(size), Ok(of_mask)) => {
                    check_mask(&mask, size, of_mask)?;
                    pairs.push((image, mask));
                }
                (Err(e), _) | (_, Err(e)) if skip_bad => skipped.push((image, e.to_string())),
                (Err(e), _) | (_, Err(e)) => return Err(e),
            }
        }
        if let Some(mask) = masks.into_values().next() {
            return Err(Error::BadInput {
                path: mask,
                why: "has no image in images/ (with the same stem)".into(),
            });
        }
        if pairs.is_empty() {
            return Err(Error::Data(format!(
                "{} holds no readable image and mask pair",
                dir.display()
            )));
        }
        Ok(Pairs {
            classes,
            pairs,
            skipped,
        })
    }

    /// The class names of `dir/classes.txt`, one a line (at most 255: 255 marks unlabelled).
    pub fn class_names(dir: &Path) -> Result<Vec<String>> {
        if !dir.join("images").is_dir() && !dir.join("masks").is_dir() {
            let classes = Folder::class_names(dir)?;
            return Err(Error::Data(format!(
                "{} is laid out for classification (one sub-folder per class: {}), not as \
                 images/, masks/ and classes.txt: a segmentation model needs a mask per image",
                dir.display(),
                classes.join(", ")
            )));
        }
        let path = dir.join("classes.txt");
        let text = crate::core::files::read_text(&path)?;
        let classes: Vec<String> = text.lines().map(|l| l.trim().to_string()).collect();
        let bad = |why: String| {
            Err(Error::BadInput {
                path: path.clone(),
                why,
            })
        };
        if let Some(line) = classes.iter().position(String::is_empty) {
            return bad(format!(
                "line {} is empty: every line names a class",
                line + 1
            ));
        }
        if classes.is_empty() || classes.len() > MASK_UNLABELLED as usize {
            return bad(format!(
                "names {} classes; masks hold 1 to 255 (value 255 marks unlabelled pixels)",
                classes.len()
            ));
        }
        for (i, c) in classes.iter().enumerate() {
            if let Some(j) = classes[..i].iter().position(|o| o == c) {
                return bad(format!("lines {} and {} both name {c}", j + 1, i + 1));
            }
        }
        Ok(classes)
    }

    fn pair(&self, index: usize) -> Result<&(PathBuf, PathBuf)> {
        self.pairs.get(index).ok_or_else(|| {
            Error::Internal(format!("pair {index} asked of {} pairs", self.pairs.len()))
        })
    }
}

/// The files of `dir` by stem; refuses one with an extension not in `kinds` and two files of
/// one stem.
fn stems(dir: &Path, kinds: &[&str]) -> Result<std::collections::BTreeMap<String, PathBuf>> {
    let mut found = Vec::new();
    walk(dir, &mut found)?;
    let mut out = std::collections::BTreeMap::new();
    for path in found {
        let ext = path
            .extension()
            .map(|e| e.to_string_lossy().to_ascii_lowercase());
        if !ext.is_some_and(|e| kinds.contains(&e.as_str())) || path.parent() != Some(dir) {
            return Err(Error::BadInput {
                path,
                why: format!(
                    "is not a .{} file directly in its folder",
                    kinds.join(", .")
                ),
            });
        }
        let stem = path
            .file_stem()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        if let Some(other) = out.insert(stem, path.clone()) {
            return Err(Error::BadInput {
                path,
                why: format!(
                    "has the stem of {} too: which is the image?",
                    other.display()
                ),
            });
        }
    }
    Ok(out)
}

/// Refuses a mask that is not 8-bit grayscale or not the size of its image.
fn check_mask(mask: &Path, image: (u32, u32), own: (u32, u32)) -> Result<()> {
    let colour = image::ImageDecoder::color_type(&decoder(mask)?);
    if colour != image::ColorType::L8 {
        return Err(Error::BadInput {
            path: mask.to_path_buf(),
            why: format!("is {colour:?}, not an 8-bit grayscale PNG of class indices"),
        });
    }
    if own != image {
        return Err(Error::BadInput {
            path: mask.to_path_buf(),
            why: format!(
                "is {}×{}, its image {}×{}: a mask labels its image's pixels one for one",
                own.0, own.1, image.0, image.1
            ),
        });
    }
    Ok(())
}

fn decoder(path: &Path) -> Result<impl image::ImageDecoder> {
    reader(path)?
        .into_decoder()
        .map_err(|e| Error::Data(format!("{} is not a readable image: {e}", path.display())))
}

impl Source for Pairs {
    fn samples(&self) -> Option<usize> {
        Some(self.pairs.len())
    }

    fn classes(&self) -> &[String] {
        &self.classes
    }

    /// The class at the centre of the mask (decoding the mask).
    fn label(&self, index: usize) -> Result<u32> {
        let m = self.mask(index)?;
        Ok(m.labels[m.height / 2 * m.width + m.width / 2])
    }

    fn read(&self, index: usize) -> Result<Image> {
        decode_rgb(&self.pair(index)?.0)
    }

    fn describe(&self, index: usize) -> String {
        self.pair(index)
            .map(|f| f.0.display().to_string())
            .unwrap_or_else(|e| e.to_string())
    }

    fn task(&self) -> Task {
        Task::Segment
    }

    /// Refuses a value that is neither a class nor 255, naming the file and the value.
    fn mask(&self, index: usize) -> Result<Mask> {
        let path = &self.pair(index)?.1;
        let img = reader(path)?
            .decode()
            .map_err(|e| Error::Data(format!("{} is not a readable image: {e}", path.display())))?;
        let image::DynamicImage::ImageLuma8(img) = img else {
            return Err(Error::BadInput {
                path: path.clone(),
                why: "is not an 8-bit grayscale PNG of class indices".into(),
            });
        };
        let classes = self.classes.len();
        let labels = img
            .as_raw()
            .iter()
            .map(|&v| match v {
                MASK_UNLABELLED => Ok(UNLABELLED),
                v if (v as usize) < classes => Ok(v as u32),
                v => Err(Error::BadInput {
                    path: path.clone(),
                    why: format!(
                        "holds the value {v}, but classes.txt names {classes} classes (0 to {}; \
                         255 marks unlabelled pixels)",
                        classes - 1
                    ),
                }),
            })
            .collect::<Result<_>>()?;
        Ok(Mask {
            height: img.height() as usize,
            width: img.width() as usize,
            labels,
        })
    }
}
