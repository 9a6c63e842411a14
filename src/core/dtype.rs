//! Element types and the numerics of mixed precision.

/// Element type of a tensor. The 16-bit types hold activations under mixed precision; their
/// arithmetic is f32 ([`DType::compute`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// IEEE single precision.
    F32,
    /// IEEE double precision.
    F64,
    /// bfloat16: f32's exponent, 8 bits of mantissa.
    BF16,
    /// IEEE half precision.
    F16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 => 8,
            DType::BF16 | DType::F16 => 2,
        }
    }
    /// Its name on the command line and in files (`f32`, `bf16`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        }
    }
    /// The type values of this type are computed and accumulated in (and workspace holds).
    pub fn compute(self) -> DType {
        match self {
            DType::F64 => DType::F64,
            _ => DType::F32,
        }
    }
    /// `x` rounded to this type (to nearest, ties to even), as f32 arithmetic sees it.
    pub fn round(self, x: f32) -> f32 {
        match self {
            DType::BF16 => half::bf16::from_f32(x).to_f32(),
            DType::F16 => half::f16::from_f32(x).to_f32(),
            DType::F32 | DType::F64 => x,
        }
    }
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(DType::F32),
            "f64" => Ok(DType::F64),
            "bf16" => Ok(DType::BF16),
            "f16" => Ok(DType::F16),
            _ => Err(format!("unknown dtype '{s}' (f32, f64, bf16, f16)")),
        }
    }
}

/// The numerics of a run: what activations are stored in and how products are computed.
/// Parameters, their gradients, optimizer state and batch statistics keep the run's dtype
/// (master weights); arithmetic and accumulation are never narrower than f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Precision {
    /// Activations in the run's dtype; f32 multiply-adds on a GPU's CUDA cores.
    #[default]
    Fp32,
    /// As fp32, but a GPU's convolution and matrix products run on the tensor cores with
    /// 10-bit mantissas (sm_80+); the CPU computes fp32.
    Tf32,
    /// Activations in bf16; convolution operands rounded to bf16 (tensor cores on a GPU).
    Bf16,
    /// Activations in f16, as bf16, with dynamic loss scaling against f16's narrow range.
    Fp16,
}

impl Precision {
    /// The dtype activations and their gradients are stored in, for parameters in `params`.
    pub fn activations(self, params: DType) -> DType {
        match self {
            Precision::Fp32 | Precision::Tf32 => params,
            Precision::Bf16 => DType::BF16,
            Precision::Fp16 => DType::F16,
        }
    }
    /// Whether gradients need a dynamic loss scale to stay inside the activation type.
    pub fn scales_loss(self) -> bool {
        self == Precision::Fp16
    }
    /// Refuses a combination that means nothing: anything but fp32 for f64 runs.
    pub fn check(self, params: DType) -> Result<(), String> {
        if params != DType::F32 && self != Precision::Fp32 {
            return Err(format!(
                "{self} precision needs f32 parameters (the run is {}); f64 runs compute in f64",
                params.name()
            ));
        }
        Ok(())
    }
}

impl std::str::FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fp32" => Ok(Precision::Fp32),
            "tf32" => Ok(Precision::Tf32),
            "bf16" => Ok(Precision::Bf16),
            "fp16" => Ok(Precision::Fp16),
            _ => Err(format!("unknown precision '{s}' (fp32, tf32, bf16, fp16)")),
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::Fp32 => "fp32",
            Precision::Tf32 => "tf32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        })
    }
}
