//! Bytes: the categories device memory is accounted in, the refusal of a request over
//! capacity, and sizes as people write them.

use std::fmt;

/// What a block of device memory is for. The planner predicts bytes per category; the
/// allocator measures them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Category {
    /// Parameters.
    Weights,
    /// Parameter gradients.
    Gradients,
    /// The optimizer's state (momentum buffers).
    OptimizerState,
    /// Activations and their gradients, and what forward saves for backward.
    Activations,
    /// Scratch space a kernel leases for one call.
    Workspace,
    /// Buffers of transfers between ranks.
    Communication,
}

impl Category {
    /// Every category, in report order.
    pub const ALL: [Category; 6] = [
        Category::Weights,
        Category::Gradients,
        Category::OptimizerState,
        Category::Activations,
        Category::Workspace,
        Category::Communication,
    ];

    /// The category's name in reports (`optimizer`).
    pub fn name(self) -> &'static str {
        match self {
            Category::Weights => "weights",
            Category::Gradients => "gradients",
            Category::OptimizerState => "optimizer",
            Category::Activations => "activations",
            Category::Workspace => "workspace",
            Category::Communication => "communication",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

/// Bytes per category.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ByCategory(pub [u64; 6]);

impl ByCategory {
    /// `bytes` in category `c` and nothing else.
    pub fn only(c: Category, bytes: u64) -> ByCategory {
        let mut b = ByCategory::default();
        b.0[c.index()] = bytes;
        b
    }

    /// Bytes in category `c`.
    pub fn get(&self, c: Category) -> u64 {
        self.0[c.index()]
    }
    /// Bytes in all categories.
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }
}

impl fmt::Display for ByCategory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = Category::ALL
            .iter()
            .filter(|c| self.get(**c) > 0)
            .map(|c| format!("{} {}", c.name(), human_bytes(self.get(*c))))
            .collect();
        if parts.is_empty() {
            write!(f, "nothing")
        } else {
            write!(f, "{}", parts.join(", "))
        }
    }
}

/// A request the allocator could not serve. Names the device, the request and what is live.
#[derive(Debug, Clone, thiserror::Error)]
#[error(
    "{device}: out of memory: {category} request of {} exceeds the capacity of {} ({} live: {live})",
    human_bytes(*requested),
    human_bytes(*capacity),
    human_bytes(live.total())
)]
pub struct OutOfMemory {
    /// The device that refused.
    pub device: String,
    /// Bytes asked for.
    pub requested: u64,
    /// The category they were asked for.
    pub category: &'static str,
    /// The device's capacity in bytes.
    pub capacity: u64,
    /// What was live when it refused.
    pub live: ByCategory,
}

/// `1.5 MiB`, `12.0 GiB`.
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// Parses `2GiB`, `512MiB`, `1.5GB`, `1000000` (bytes).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a size (examples: 2GiB, 512MiB, 80GB)"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "kb" => 1e3,
        "m" | "mib" => 1024.0 * 1024.0,
        "mb" => 1e6,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "gb" => 1e9,
        "t" | "tib" => 1024f64.powi(4),
        "tb" => 1e12,
        other => {
            return Err(format!(
                "unknown size unit '{other}' in '{s}' (use B, KiB, MiB, GiB, KB, MB, GB)"
            ))
        }
    };
    if !(v.is_finite() && v >= 0.0) {
        return Err(format!("'{s}' is not a size"));
    }
    Ok((v * mult).round() as u64)
}

/// The split whose fullest rank needs least: that rank and its need, against the cap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shortfall {
    /// Pipeline stages of that split.
    pub stages: usize,
    /// Its fullest rank.
    pub rank: usize,
    /// What that rank needs, in bytes.
    pub need: u64,
    /// The capacity it exceeds, in bytes.
    pub cap: u64,
}

impl fmt::Display for Shortfall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the split into {} stages that needs least still needs {} on rank {}, {} over {}",
            self.stages,
            human_bytes(self.need),
            self.rank,
            human_bytes(self.need.saturating_sub(self.cap)),
            human_bytes(self.cap)
        )
    }
}
