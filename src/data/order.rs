//! The order samples are used in: an endless sequence of epochs, each a permutation of the
//! samples drawn from (seed, epoch). Position `p` of the sequence is sample
//! `permute(p mod n)` of epoch `p / n`. The permutation is a keyed Feistel network with cycle
//! walking, so any position is computed on its own in O(1), on any rank, with no table.
//!
//! Sharding follows from positions: a step consumes consecutive positions and hands disjoint
//! runs of them to the data-parallel groups and micro-batches (see the executor), so over any
//! n consecutive positions every sample is used exactly once, whatever the number of groups.

use crate::core::rng::splitmix64;

/// Rounds of the Feistel network (4 make it a good pseudo-random permutation).
const ROUNDS: u64 = 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
/// Shuffled epochs: position p of the order is sample `sample(p)`, each epoch a new pseudo-random permutation drawn from the seed.
pub struct Epochs {
    /// Samples per epoch (at least 1).
    pub len: usize,
    /// Seeds the permutations.
    pub seed: u64,
    /// Identity order within each epoch (evaluation) instead of a permutation.
    pub sequential: bool,
}

impl Epochs {
    /// The sample at position `pos` of the sequence.
    pub fn sample(&self, pos: u64) -> usize {
        let n = self.len as u64;
        let (epoch, i) = (pos / n, pos % n);
        if self.sequential || n == 1 {
            return i as usize;
        }
        let key = splitmix64(self.seed ^ splitmix64(epoch));
        // A permutation of [0, 2^bits) with bits even, walked until it lands below n; the
        // domain is under 4n, so a few steps on average.
        let bits = (64 - (n - 1).leading_zeros()).max(2).next_multiple_of(2);
        let mut x = i;
        loop {
            x = feistel(x, bits / 2, key);
            if x < n {
                return x as usize;
            }
        }
    }
}

/// A bijection on [0, 2^(2·half)).
fn feistel(x: u64, half: u32, key: u64) -> u64 {
    let mask = (1u64 << half) - 1;
    let (mut left, mut right) = (x >> half, x & mask);
    for round in 0..ROUNDS {
        let f = splitmix64(key ^ splitmix64(round ^ (right << 8))) & mask;
        (left, right) = (right, left ^ f);
    }
    (left << half) | right
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_epoch_is_a_permutation() {
        for len in [1, 2, 3, 7, 64, 1000, 4097] {
            let e = Epochs {
                len,
                seed: 11,
                sequential: false,
            };
            for epoch in 0..3u64 {
                let mut seen = vec![false; len];
                for i in 0..len as u64 {
                    let s = e.sample(epoch * len as u64 + i);
                    assert!(!seen[s], "len {len}: sample {s} twice in epoch {epoch}");
                    seen[s] = true;
                }
            }
        }
    }

    #[test]
    fn order_depends_on_seed_and_epoch_only() {
        let e = Epochs {
            len: 500,
            seed: 3,
            sequential: false,
        };
        let epoch = |e: &Epochs, k: u64| -> Vec<usize> {
            (0..500).map(|i| e.sample(k * 500 + i)).collect()
        };
        assert_eq!(epoch(&e, 0), epoch(&e.clone(), 0));
        assert_ne!(epoch(&e, 0), epoch(&e, 1));
        assert_ne!(epoch(&e, 0), epoch(&Epochs { seed: 4, ..e }, 0));
        assert_ne!(epoch(&e, 0), (0..500).collect::<Vec<_>>());
        let seq = Epochs {
            sequential: true,
            ..e
        };
        assert_eq!(epoch(&seq, 2), (0..500).collect::<Vec<_>>());
    }
}
