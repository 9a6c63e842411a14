//! Static shapes.

use std::fmt;

/// Dimensions, outermost first (NCHW for images).
#[derive(Clone, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
pub struct Shape(pub Vec<usize>);

impl Shape {
    /// A shape of these dimensions, outermost first.
    pub fn new(dims: impl Into<Vec<usize>>) -> Self {
        Shape(dims.into())
    }
    /// The dimensions, outermost first.
    pub fn dims(&self) -> &[usize] {
        &self.0
    }
    /// How many dimensions.
    pub fn rank(&self) -> usize {
        self.0.len()
    }
    /// Elements: the product of the dimensions.
    pub fn numel(&self) -> usize {
        self.0.iter().product()
    }
    /// Dimension `i`.
    pub fn dim(&self, i: usize) -> usize {
        self.0[i]
    }
    /// (N, C, H, W) of a rank-4 shape.
    pub fn nchw(&self) -> (usize, usize, usize, usize) {
        assert_eq!(self.rank(), 4, "expected an NCHW shape, got {self}");
        (self.0[0], self.0[1], self.0[2], self.0[3])
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d: Vec<String> = self.0.iter().map(|x| x.to_string()).collect();
        write!(f, "[{}]", d.join(", "))
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}
