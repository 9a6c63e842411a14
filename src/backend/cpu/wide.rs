//! Mixed precision on the host. bf16 and f16 tensors are computed in f32: their elements are
//! widened (exactly) before a kernel runs, and outputs are rounded back (to nearest, ties to
//! even) after, so a value is rounded once each time it is stored, as a GPU kernel that loads
//! 16 bits, computes in f32 and stores 16 bits does. The widened copies are the reference
//! backend's scratch, like `gemm`'s packing buffers: they are host memory outside the emulated
//! device's accounting.

use std::borrow::Cow;

use half::slice::HalfFloatSliceExt;

use super::{dtype_mismatch, Float};
use crate::backend::Storage;
use crate::core::DType;
use crate::Result;

/// The f32 elements of f32, bf16 or f16 host storage: borrowed when they are f32.
pub fn wide(s: &Storage) -> Result<Cow<'_, [f32]>> {
    Ok(match s {
        Storage::F32(v) => Cow::Borrowed(v),
        Storage::BF16(v) => Cow::Owned(v.to_f32_vec()),
        Storage::F16(v) => Cow::Owned(v.to_f32_vec()),
        other => return Err(dtype_mismatch("f32", other.dtype())),
    })
}

/// f32 parameters `w` rounded to bf16 or f16 when they multiply `dtype` activations, as a
/// GPU's tensor cores take them; `None` where they are used as they are.
pub fn rounded_operand(w: &Storage, dtype: DType) -> Option<Storage> {
    match (w, dtype) {
        (Storage::F32(v), DType::BF16 | DType::F16) => {
            Some(Storage::F32(v.iter().map(|&x| dtype.round(x)).collect()))
        }
        _ => None,
    }
}

/// Writable f32 elements of f32, bf16 or f16 host storage: the storage itself when it is f32,
/// else a widened copy that [`WideMut::finish`] rounds back.
pub enum WideMut<'a> {
    F32(&'a mut [f32]),
    Narrow(&'a mut Storage, Vec<f32>),
}

impl<'a> WideMut<'a> {
    pub fn new(s: &'a mut Storage) -> Result<Self> {
        let widened = match &*s {
            Storage::F32(_) => None,
            narrow => Some(wide(narrow)?.into_owned()),
        };
        Ok(match widened {
            Some(w) => WideMut::Narrow(s, w),
            None => WideMut::F32(<f32 as Float>::view_mut(s)?),
        })
    }
    pub fn slice(&mut self) -> &mut [f32] {
        match self {
            WideMut::F32(v) => v,
            WideMut::Narrow(_, w) => w,
        }
    }
    /// Rounds the elements back into their storage.
    pub fn finish(self) -> Result<()> {
        match self {
            WideMut::F32(_) => {}
            WideMut::Narrow(Storage::BF16(v), w) => v.convert_from_f32_slice(&w),
            WideMut::Narrow(Storage::F16(v), w) => v.convert_from_f32_slice(&w),
            WideMut::Narrow(other, _) => return Err(dtype_mismatch("f32", other.dtype())),
        }
        Ok(())
    }
}
