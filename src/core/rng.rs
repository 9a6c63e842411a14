//! Counter-based random numbers: a draw is a pure function of (seed, index), so results do
//! not depend on the order, the thread or the device that draws them.

/// splitmix64: a counter-based generator, so element i's draw does not depend on the order
/// (or the device) in which elements are visited.
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform draw in [0, 1) for element `i` under `seed`.
pub fn uniform(seed: u64, i: u64) -> f64 {
    (splitmix64(seed ^ splitmix64(i)) >> 11) as f64 / (1u64 << 53) as f64
}
