//! Device memory accounting: every device byte is leased from an [`Allocator`] that knows its
//! capacity, the live bytes by [`Category`], and the high-water mark.

use std::sync::{Arc, Mutex};

pub use crate::core::{human_bytes, parse_bytes, ByCategory, Category, OutOfMemory};

/// This machine's physical memory in bytes (`None` where the system does not say).
pub fn physical_memory() -> Option<u64> {
    // SAFETY: sysconf reads system constants and has no preconditions.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    (pages > 0 && page > 0).then(|| pages as u64 * page as u64)
}

#[derive(Debug, Default)]
struct State {
    capacity: Option<u64>,
    live: ByCategory,
    peak: u64,
    at_peak: ByCategory,
    category_peaks: ByCategory,
    /// High-water mark since the last [`Allocator::mark`].
    since_mark: u64,
}

/// Memory statistics of one device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MemoryStats {
    /// The device's capacity in bytes (`None`: unlimited).
    pub capacity: Option<u64>,
    /// Bytes live now, by category.
    pub live: ByCategory,
    /// High-water mark of live bytes.
    pub peak: u64,
    /// Live bytes by category at the moment of the peak.
    pub at_peak: ByCategory,
    /// Each category's own high-water mark (reached at different moments, so their sum may
    /// exceed `peak`): e.g. the most activation bytes ever live, whatever else was.
    pub category_peaks: ByCategory,
}

/// A device's bytes over a stretch of time (e.g. one task of a schedule): the most live at
/// once, and what was live at its end.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Held {
    /// The most bytes live at once.
    pub peak: u64,
    /// Bytes live at the end.
    pub live: u64,
}

/// Accounts leases against a capacity (`None`: unlimited).
#[derive(Debug)]
pub struct Allocator {
    name: String,
    state: Mutex<State>,
}

impl Allocator {
    /// An allocator for device `name` with `capacity` bytes (`None`: unlimited).
    pub fn new(name: impl Into<String>, capacity: Option<u64>) -> Arc<Self> {
        Arc::new(Allocator {
            name: name.into(),
            state: Mutex::new(State {
                capacity,
                ..State::default()
            }),
        })
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Bounds later leases by `capacity` (`None`: unlimited); what is live stays.
    pub fn set_capacity(&self, capacity: Option<u64>) {
        self.state().capacity = capacity;
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // A poisoned lock only means another thread panicked while counting; the numbers
        // themselves are always consistent, so keep going.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reserves `bytes` for `category`; the lease gives them back when dropped.
    pub fn lease(self: &Arc<Self>, bytes: u64, category: Category) -> Result<Lease, OutOfMemory> {
        let mut s = self.state();
        let total = s.live.total() + bytes;
        if let Some(cap) = s.capacity {
            if total > cap {
                return Err(OutOfMemory {
                    device: self.name.clone(),
                    requested: bytes,
                    category: category.name(),
                    capacity: cap,
                    live: s.live,
                });
            }
        }
        let i = category.index();
        s.live.0[i] += bytes;
        s.category_peaks.0[i] = s.category_peaks.0[i].max(s.live.0[i]);
        if total > s.peak {
            s.peak = total;
            s.at_peak = s.live;
        }
        s.since_mark = s.since_mark.max(total);
        Ok(Lease {
            allocator: Arc::clone(self),
            bytes,
            category,
        })
    }

    /// The most bytes live at once since the last mark (or the start), and the bytes live
    /// now; the next mark counts from now.
    pub fn mark(&self) -> Held {
        let mut s = self.state();
        let live = s.live.total();
        let peak = s.since_mark.max(live);
        s.since_mark = live;
        Held { peak, live }
    }

    /// Capacity, live bytes and peaks so far.
    pub fn stats(&self) -> MemoryStats {
        let s = self.state();
        MemoryStats {
            capacity: s.capacity,
            live: s.live,
            peak: s.peak,
            at_peak: s.at_peak,
            category_peaks: s.category_peaks,
        }
    }
}

/// Bytes held from an allocator; returned on drop.
#[derive(Debug)]
pub struct Lease {
    allocator: Arc<Allocator>,
    bytes: u64,
    category: Category,
}

impl Lease {
    /// The bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.allocator.state().live.0[self.category.index()] -= self.bytes;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_count_by_category_and_peak() {
        let a = Allocator::new("test", Some(1000));
        let w = a.lease(300, Category::Weights).unwrap();
        let x = a.lease(500, Category::Activations).unwrap();
        assert_eq!(a.stats().live.total(), 800);
        let err = a.lease(300, Category::Workspace).unwrap_err();
        assert_eq!(err.requested, 300);
        assert_eq!(err.live.get(Category::Activations), 500);
        assert!(
            err.to_string().contains("workspace request of 300 B"),
            "{err}"
        );
        drop(x);
        let _y = a.lease(600, Category::Workspace).unwrap();
        let s = a.stats();
        assert_eq!(s.peak, 900);
        assert_eq!(s.at_peak.get(Category::Workspace), 600);
        assert_eq!(s.at_peak.get(Category::Activations), 0);
        // Each category's own high-water mark, whenever it was reached.
        assert_eq!(s.category_peaks.get(Category::Activations), 500);
        assert_eq!(s.category_peaks.get(Category::Workspace), 600);
        drop(w);
        assert_eq!(a.stats().live.total(), 600);
        // Marks: the most since the last mark, and what is live now.
        assert_eq!(
            a.mark(),
            Held {
                peak: 900,
                live: 600
            }
        );
        let z = a.lease(100, Category::Workspace).unwrap();
        drop(z);
        assert_eq!(
            a.mark(),
            Held {
                peak: 700,
                live: 600
            }
        );
        assert_eq!(
            a.mark(),
            Held {
                peak: 600,
                live: 600
            }
        );
    }

    #[test]
    fn parses_sizes() {
        assert_eq!(parse_bytes("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_bytes("1.5 MiB").unwrap(), 1572864);
        assert_eq!(parse_bytes("80GB").unwrap(), 80_000_000_000);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("3 parsecs").is_err());
    }
}
