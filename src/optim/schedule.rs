//! Learning-rate schedules with optional linear warm-up.

use std::f64::consts::PI;
use std::fmt;
use std::str::FromStr;

#[derive(Clone, Copy, Debug, PartialEq)]
/// How the learning rate falls after warm-up.
pub enum Decay {
    /// It stays at the base rate.
    Constant,
    /// Multiply by `gamma` every `every` steps.
    Step {
        /// Steps between multiplications.
        every: usize,
        /// The factor.
        gamma: f64,
    },
    /// Half a cosine from the base rate to zero over the steps after warm-up.
    Cosine,
}

impl FromStr for Decay {
    type Err = String;
    /// `constant`, `cosine`, `step:EVERY:GAMMA`.
    fn from_str(s: &str) -> Result<Self, String> {
        let parts: Vec<&str> = s.split(':').collect();
        match parts.as_slice() {
            ["constant"] => Ok(Decay::Constant),
            ["cosine"] => Ok(Decay::Cosine),
            ["step", every, gamma] => {
                let every: usize = every
                    .parse()
                    .map_err(|_| format!("step schedule: '{every}' is not a step count"))?;
                let gamma: f64 = gamma
                    .parse()
                    .map_err(|_| format!("step schedule: '{gamma}' is not a factor"))?;
                if every == 0 {
                    return Err("step schedule: the interval must be at least 1".into());
                }
                Ok(Decay::Step { every, gamma })
            }
            _ => Err(format!(
                "unknown schedule '{s}' (constant, cosine, step:EVERY:GAMMA)"
            )),
        }
    }
}

impl fmt::Display for Decay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Decay::Constant => write!(f, "constant"),
            Decay::Cosine => write!(f, "cosine"),
            Decay::Step { every, gamma } => write!(f, "step:{every}:{gamma}"),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
/// The learning rate of each step: linear warm-up, then a decay.
pub struct LrSchedule {
    /// The rate after warm-up.
    pub base: f64,
    /// The decay after warm-up.
    pub decay: Decay,
    /// Steps of linear warm-up from base/warmup to base.
    pub warmup: usize,
    /// Steps of the whole run (the cosine reaches zero at the end).
    pub total: usize,
}

impl LrSchedule {
    /// The rate at `step` (0-based).
    pub fn lr(&self, step: usize) -> f64 {
        if step < self.warmup {
            return self.base * (step + 1) as f64 / self.warmup as f64;
        }
        let t = step - self.warmup;
        match self.decay {
            Decay::Constant => self.base,
            Decay::Step { every, gamma } => self.base * gamma.powi((t / every) as i32),
            Decay::Cosine => {
                let span = self.total.saturating_sub(self.warmup).max(1) as f64;
                self.base * 0.5 * (1.0 + (PI * (t as f64 / span).min(1.0)).cos())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules() {
        let s = LrSchedule {
            base: 0.1,
            decay: Decay::Step {
                every: 10,
                gamma: 0.5,
            },
            warmup: 0,
            total: 100,
        };
        assert_eq!(s.lr(0), 0.1);
        assert_eq!(s.lr(9), 0.1);
        assert_eq!(s.lr(10), 0.05);
        assert_eq!(s.lr(25), 0.025);
        let c = LrSchedule {
            base: 1.0,
            decay: Decay::Cosine,
            warmup: 4,
            total: 104,
        };
        assert_eq!(c.lr(0), 0.25);
        assert_eq!(c.lr(3), 1.0);
        assert_eq!(c.lr(4), 1.0);
        assert!((c.lr(54) - 0.5).abs() < 1e-12);
        assert!(c.lr(103) < 1e-3);
        assert_eq!(
            "step:30:0.1".parse::<Decay>().unwrap(),
            Decay::Step {
                every: 30,
                gamma: 0.1
            }
        );
        assert!("step:0:0.1".parse::<Decay>().is_err());
        assert!("linear".parse::<Decay>().is_err());
    }
}
