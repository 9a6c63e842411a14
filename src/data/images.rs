//! Images held in memory, without labels: what a caller asks a trained model to predict.

use super::{Image, Mask, Source, Task, CHANNELS, UNLABELLED};
use crate::{Error, Result};

/// A caller's decoded images ([`Image`]: planes in [0, 1]) as a source: every label and
/// every pixel of every mask is [`UNLABELLED`], so they take no part in a score.
pub struct Images {
    images: Vec<Image>,
    classes: Vec<String>,
    task: Task,
}

impl Images {
    /// `images` for a model of `classes` that serves `task`; refuses an image whose pixels
    /// are not [`CHANNELS`] planes of its size.
    pub fn new(images: Vec<Image>, classes: Vec<String>, task: Task) -> Result<Images> {
        for (i, img) in images.iter().enumerate() {
            if img.height == 0 || img.width == 0 {
                return Err(Error::Config(format!("image {i} is empty")));
            }
            if img.pixels.len() != CHANNELS * img.height * img.width {
                return Err(Error::Config(format!(
                    "image {i} has {} values, not {CHANNELS} planes of {}×{}",
                    img.pixels.len(),
                    img.height,
                    img.width
                )));
            }
        }
        Ok(Images {
            images,
            classes,
            task,
        })
    }

    fn image(&self, index: usize) -> Result<&Image> {
        self.images
            .get(index)
            .ok_or_else(|| Error::Internal(format!("image {index} of {}", self.images.len())))
    }
}

impl Source for Images {
    fn samples(&self) -> Option<usize> {
        Some(self.images.len())
    }

    fn classes(&self) -> &[String] {
        &self.classes
    }

    fn label(&self, _index: usize) -> Result<u32> {
        Ok(UNLABELLED)
    }

    fn read(&self, index: usize) -> Result<Image> {
        self.image(index).cloned()
    }

    fn describe(&self, index: usize) -> String {
        format!("image {index}")
    }

    fn task(&self) -> Task {
        self.task
    }

    fn mask(&self, index: usize) -> Result<Mask> {
        let img = self.image(index)?;
        Ok(Mask {
            height: img.height,
            width: img.width,
            labels: vec![UNLABELLED; img.height * img.width],
        })
    }
}
