//! An op's backward against central finite differences in f64 on random inputs, and its f32
//! forward against its f64 forward: the check every built-in op passes, for ops defined
//! outside the crate too.

use std::fmt;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{batched, Backward, Ctx, Init, Operator, Saved};
use crate::memory::Category;
use crate::tensor::{DType, Device, Shape, Tensor};
use crate::{Error, Result};

/// Finite-difference step: truncation error ~h², rounding ~1e-16/h, both far below 1e-6.
const H: f64 = 1e-5;
/// Elements per tensor compared (all of them when smaller).
const PROBES: usize = 48;
/// The largest relative error of a correct f64 gradient.
pub const GRADIENT_TOLERANCE: f64 = 1e-6;
/// The largest relative difference of a correct f32 forward from the f64 one.
pub const F32_TOLERANCE: f64 = 1e-5;

/// One gradient compared with finite differences on the probed elements.
#[derive(Clone, Debug, PartialEq)]
pub struct GradientError {
    /// Which gradient: `input 0`, `parameter weight`.
    pub of: String,
    /// ‖analytic − numeric‖ / max(‖analytic‖, ‖numeric‖).
    pub relative: f64,
    /// Backward's values on the probed elements.
    pub analytic: Vec<f64>,
    /// The finite differences on the same elements.
    pub numeric: Vec<f64>,
}

impl GradientError {
    /// Whether it is within [`GRADIENT_TOLERANCE`] and not zero on every probe (a gradient
    /// that is never computed would otherwise pass where the numeric one is small).
    pub fn passed(&self) -> bool {
        self.relative <= GRADIENT_TOLERANCE && self.analytic.iter().any(|v| v.abs() > 1e-8)
    }
}

/// What [`check_gradients`] found.
#[derive(Clone, Debug, PartialEq)]
pub struct GradientCheck {
    /// Every input's gradient, then every trainable parameter's.
    pub gradients: Vec<GradientError>,
    /// The f32 forward's relative difference from the f64 forward, training and evaluating
    /// (the larger).
    pub f32_forward: f64,
}

impl GradientCheck {
    /// The gradient with the largest relative error (`None` for an op with no gradients).
    pub fn worst(&self) -> Option<&GradientError> {
        self.gradients
            .iter()
            .max_by(|a, b| a.relative.total_cmp(&b.relative))
    }
    /// Whether every gradient passed ([`GradientError::passed`]) and the f32 forward is within
    /// [`F32_TOLERANCE`].
    pub fn passed(&self) -> bool {
        self.gradients.iter().all(GradientError::passed) && self.f32_forward <= F32_TOLERANCE
    }
}

impl fmt::Display for GradientCheck {
    /// One line per gradient with its error, the probes of the failing ones, and the f32
    /// forward's difference.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for g in &self.gradients {
            let verdict = if g.passed() { "ok" } else { "FAILED" };
            writeln!(
                f,
                "gradient of {}: relative error {:e} {verdict}",
                g.of, g.relative
            )?;
            if !g.passed() {
                writeln!(f, "  analytic {:?}\n  numeric  {:?}", g.analytic, g.numeric)?;
            }
        }
        write!(f, "f32 forward differs from f64 by {:e}", self.f32_forward)
    }
}

/// Checks `op`'s backward on a batch of `batch` samples of the per-sample `inputs` shapes:
/// the gradients of every input and trainable parameter of L = Σ r·y (r random) against
/// central finite differences in f64 on the CPU, on up to 48 elements of each, and the f32
/// forward against the f64 one. Inputs are distinct values away from 0 (no ties, no kinks
/// within the step), parameters uniform in (-1, 1) (buffers that start at one, variances, in
/// (0.5, 1.5)), all drawn from `seed`. An error only where the op fails to run.
///
/// ```
/// use gems::ops::{activation::Relu, check_gradients};
/// use gems::Shape;
/// let check = check_gradients(&Relu, &[Shape::new([3, 4, 4])], 2, 1).unwrap();
/// assert!(check.passed(), "{check}");
/// ```
pub fn check_gradients(
    op: &dyn Operator,
    inputs: &[Shape],
    batch: usize,
    seed: u64,
) -> Result<GradientCheck> {
    let case = Case::new(op, inputs, batch, seed)?;
    let d = Device::cpu("gradient check", None);
    let (y, saved, ps) = case.forward(&case.inputs, &case.params, DType::F64, true)?;
    drop(y);
    let dy = d.upload(
        case.out_shape.clone(),
        &case.r,
        DType::F64,
        Category::Activations,
    )?;
    let mut grads: Vec<Tensor> = case.param_shapes[..case.trainable]
        .iter()
        .map(|sh| d.zeros(sh.clone(), DType::F64, Category::Gradients))
        .collect::<Result<_>>()?;
    let need = vec![true; case.inputs.len()];
    let ctx = Ctx {
        device: &d,
        training: true,
        seed: SEED,
        tiles: None,
    };
    let b = Backward {
        saved,
        dy,
        inputs: &case.in_shapes,
        need: &need,
        weights: true,
    };
    let dxs = op.backward(&ctx, b, &ps, &mut grads)?;

    let mut rng = ChaCha8Rng::seed_from_u64(seed.wrapping_add(1));
    let mut gradients = Vec::new();
    let mut compare = |of: String,
                       analytic: Vec<f64>,
                       objective: &mut dyn FnMut(usize, f64) -> Result<f64>|
     -> Result<()> {
        let idx = probes(analytic.len(), &mut rng);
        let analytic: Vec<f64> = idx.iter().map(|&i| analytic[i]).collect();
        let numeric = idx
            .iter()
            .map(|&i| Ok((objective(i, H)? - objective(i, -H)?) / (2.0 * H)))
            .collect::<Result<Vec<f64>>>()?;
        gradients.push(GradientError {
            of,
            relative: rel_error(&analytic, &numeric),
            analytic,
            numeric,
        });
        Ok(())
    };
    if dxs.len() != case.inputs.len() {
        return Err(Error::Internal(format!(
            "backward returned {} input gradients for {} inputs",
            dxs.len(),
            case.inputs.len()
        )));
    }
    for (k, dx) in dxs.iter().enumerate() {
        let dx = dx
            .as_ref()
            .ok_or_else(|| Error::Internal(format!("backward gave no gradient of input {k}")))?
            .to_f64_vec()?;
        compare(format!("input {k}"), dx, &mut |i, h| {
            let mut xs = case.inputs.clone();
            xs[k][i] += h;
            case.objective(&xs, &case.params)
        })?;
    }
    for (k, g) in grads.iter().enumerate() {
        compare(
            format!("parameter {}", case.suffixes[k]),
            g.to_f64_vec()?,
            &mut |i, h| {
                let mut ps = case.params.clone();
                ps[k][i] += h;
                case.objective(&case.inputs, &ps)
            },
        )?;
    }
    let mut f32_forward: f64 = 0.0;
    for training in [true, false] {
        let y64 = case.forward(&case.inputs, &case.params, DType::F64, training)?;
        let y32 = case.forward(&case.inputs, &case.params, DType::F32, training)?;
        f32_forward = f32_forward.max(rel_error(&y32.0.to_f64_vec()?, &y64.0.to_f64_vec()?));
    }
    Ok(GradientCheck {
        gradients,
        f32_forward,
    })
}

/// The seed every forward of a check runs with (the same dropout mask each time).
const SEED: u64 = 42;

/// An op with random inputs, parameters and output projection.
struct Case<'a> {
    op: &'a dyn Operator,
    in_shapes: Vec<Shape>,
    inputs: Vec<Vec<f64>>,
    param_shapes: Vec<Shape>,
    suffixes: Vec<&'static str>,
    trainable: usize,
    params: Vec<Vec<f64>>,
    out_shape: Shape,
    /// The projection r of the scalar L = Σ r·y.
    r: Vec<f64>,
}

impl<'a> Case<'a> {
    fn new(op: &'a dyn Operator, per_sample: &[Shape], batch: usize, seed: u64) -> Result<Self> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let refs: Vec<&Shape> = per_sample.iter().collect();
        let out = op.infer(&refs).map_err(Error::Shape)?;
        let mut specs = op.params(&refs);
        // Trainable parameters first, as a graph orders them.
        specs.sort_by_key(|s| !s.trainable);
        let in_shapes: Vec<Shape> = per_sample.iter().map(|s| batched(batch, s)).collect();
        let inputs = in_shapes
            .iter()
            .map(|s| distinct_values(s.numel(), &mut rng))
            .collect();
        let params = specs
            .iter()
            .map(|p| {
                let variance = !p.trainable && p.init == Init::Ones;
                (0..p.shape.numel())
                    .map(|_| match variance {
                        true => rng.random_range(0.5..1.5),
                        false => rng.random_range(-1.0..1.0),
                    })
                    .collect()
            })
            .collect();
        let out_shape = batched(batch, &out);
        let r = (0..out_shape.numel())
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        Ok(Case {
            op,
            in_shapes,
            inputs,
            param_shapes: specs.iter().map(|p| p.shape.clone()).collect(),
            suffixes: specs.iter().map(|p| p.suffix).collect(),
            trainable: specs.iter().filter(|p| p.trainable).count(),
            params,
            out_shape,
            r,
        })
    }

    /// Forward on a fresh CPU device in `dtype`: the output, what it saved, the parameters.
    fn forward(
        &self,
        inputs: &[Vec<f64>],
        params: &[Vec<f64>],
        dtype: DType,
        training: bool,
    ) -> Result<(Tensor, Saved, Vec<Tensor>)> {
        let d = Device::cpu("gradient check", None);
        let upload =
            |(sh, x): (&Shape, &Vec<f64>)| d.upload(sh.clone(), x, dtype, Category::Activations);
        let xs: Vec<Tensor> = self
            .in_shapes
            .iter()
            .zip(inputs)
            .map(upload)
            .collect::<Result<_>>()?;
        let mut ps: Vec<Tensor> = self
            .param_shapes
            .iter()
            .zip(params)
            .map(upload)
            .collect::<Result<_>>()?;
        let ctx = Ctx {
            device: &d,
            training,
            seed: SEED,
            tiles: None,
        };
        let refs: Vec<&Tensor> = xs.iter().collect();
        let (y, saved) = self.op.forward(&ctx, &refs, &mut ps)?;
        if y.shape() != &self.out_shape {
            return Err(Error::Shape(format!(
                "forward gave {}, infer said {}",
                y.shape(),
                self.out_shape
            )));
        }
        Ok((y, saved, ps))
    }

    /// L = Σ r·y in f64.
    fn objective(&self, inputs: &[Vec<f64>], params: &[Vec<f64>]) -> Result<f64> {
        let (y, _, _) = self.forward(inputs, params, DType::F64, true)?;
        Ok(y.to_f64_vec()?
            .iter()
            .zip(&self.r)
            .map(|(a, b)| a * b)
            .sum())
    }
}

/// Distinct values well away from 0 and from each other, so ReLU kinks and max-pool ties
/// stay farther than H from every probe.
fn distinct_values(n: usize, rng: &mut ChaCha8Rng) -> Vec<f64> {
    let mut idx: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        idx.swap(i, rng.random_range(0..=i));
    }
    idx.iter()
        .map(|&i| {
            let v = 0.05 + 2.0 * i as f64 / n as f64;
            if i % 2 == 0 {
                v
            } else {
                -v
            }
        })
        .collect()
}

/// ‖a − n‖ / max(‖a‖, ‖n‖) over the probed entries.
fn rel_error(a: &[f64], n: &[f64]) -> f64 {
    let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    let diff: Vec<f64> = a.iter().zip(n).map(|(x, y)| x - y).collect();
    let scale = norm(a).max(norm(n));
    if scale == 0.0 {
        norm(&diff)
    } else {
        norm(&diff) / scale
    }
}

fn probes(n: usize, rng: &mut ChaCha8Rng) -> Vec<usize> {
    if n <= PROBES {
        (0..n).collect()
    } else {
        (0..PROBES).map(|_| rng.random_range(0..n)).collect()
    }
}
