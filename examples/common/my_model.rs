//! A user's own model, built with `GraphBuilder` (shared by the examples): four
//! conv → BN+ReLU blocks, each halving the map with a 2×2 max-pool, then a linear classifier.

use gems::graph::Output;
use gems::ops::conv::Conv2d;
use gems::ops::pool::Window;
use gems::{Graph, GraphBuilder, Shape};

pub fn my_model(image_size: usize, classes: usize) -> gems::Result<Graph> {
    let (mut b, mut x) = GraphBuilder::new(
        "tiny_cnn",
        "TinyCnn",
        Shape::new([3, image_size, image_size]),
    );
    for (i, width) in [16, 32, 64, 64].into_iter().enumerate() {
        x = b.block(format!("block{i}"), "ConvBlock", |b| {
            let x = b.conv("conv", x, Conv2d::new(width, 3, 1, 1))?;
            let x = b.batchnorm_relu("bn", x)?;
            b.max_pool("pool", x, Window::square(2, 2, 0))
        })?;
    }
    let x = b.global_avg_pool("avgpool", x)?;
    let x = b.flatten("flatten", x)?;
    let logits = b.linear("fc", x, classes, true)?;
    b.finish(vec![Output::new(logits)])
}
