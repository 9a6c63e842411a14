//! The bottom layer, naming no backend: element types, shapes, typed errors, counter-based
//! random numbers, byte units and categories, and opening only regular files.

mod bytes;
mod dtype;
mod error;
pub mod files;
pub mod rng;
mod shape;

pub use bytes::{human_bytes, parse_bytes, ByCategory, Category, OutOfMemory, Shortfall};
pub use dtype::{DType, Precision};
pub use error::{Error, Result, WhatFits};
pub use shape::Shape;
