//! memtide's placement policy: what is hot, what to demote, how much DRAM to keep free.
//!
//! This crate is pure: no system calls, no clock reads, no allocation on the hot paths. Time is
//! passed in as nanoseconds by the caller, so the engine and the simulator drive the same code
//! and tests drive it deterministically. Entry points: [`Activeness`] (per-page history),
//! [`Sweep`] (which resident pages to deactivate, through [`SweepPages`]), [`Watermarks`] (how
//! far below the quota DRAM is kept, and [`Watermarks::relieve`], the pressure-relief loop,
//! through [`Relieve`]), [`ahead`] (how much a fault brings in), [`EpochClock`] and
//! [`health`]. The engine and the simulator each implement the two traits over their own page
//! state, so both run exactly this code (the policy `sweep`). [`Placement`] (S3-FIFO's small
//! queue before a SIEVE main queue, through [`Pages`]) is the other policy, `placement`; both
//! go by these names in the engine (`--policy`), the simulator and the docs.
//!
//! # The model
//!
//! A resident page is either *active* (mapped into the program) or *inactive* (unmapped but still
//! in DRAM, waiting to be written to tier 1). The engine only learns about an access when the
//! program faults: on first touch, on a fetch from tier 1, or when it touches an inactive page
//! (a "hint fault", which promotes it back). Each fault sets the newest bit of the page's
//! [`Activeness`]; once per epoch every history is shifted. Deactivation takes pages whose history
//! shows them idle for the longest; eviction writes the oldest inactive pages first.
#![forbid(unsafe_code)]

pub mod ahead;
pub mod health;
pub mod placement;
pub mod pool;
pub mod share;
pub mod sweep;

pub use health::{Health, HealthThresholds};
pub use placement::{Evicted, Pages, Placement, Queue, Residence};
pub use sweep::{IdleBar, Relief, Relieve, Sweep, SweepPages};

/// Size of a page, the unit of placement.
pub const PAGE_SIZE: usize = 4096;

/// A page's access history: bit 7 is the current epoch, bit 0 the epoch seven ago.
///
/// The engine sets bit 7 when it sees an access (any fault on the page) and shifts the history
/// right once per epoch. A page that was never seen accessed in the last eight epochs has
/// history 0.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Activeness(pub u8);

impl Activeness {
    /// History of a page just brought into DRAM because it was touched.
    pub const TOUCHED: Activeness = Activeness(0x80);

    /// Records an access in the current epoch.
    #[must_use]
    pub fn touch(self) -> Activeness {
        Activeness(self.0 | 0x80)
    }

    /// Ends an epoch: the history moves one step into the past.
    #[must_use]
    pub fn age(self) -> Activeness {
        Activeness(self.0 >> 1)
    }

    /// The history after `epochs` more epochs without an access: [`age`](Self::age) that many
    /// times (for callers that age lazily, when they next look at a page).
    pub fn aged(self, epochs: u64) -> Activeness {
        if epochs >= 8 {
            Activeness(0)
        } else {
            Activeness(self.0 >> epochs)
        }
    }

    /// Number of whole epochs since the last recorded access (8 when none is recorded).
    pub fn idle_epochs(self) -> u32 {
        self.0.leading_zeros()
    }

    /// Number of epochs out of the last eight in which an access was recorded.
    pub fn frequency(self) -> u32 {
        self.0.count_ones()
    }

    /// Whether the page was accessed in the current or the previous epoch: the definition of
    /// "active memory" that memtide reports.
    pub fn is_active(self) -> bool {
        self.0 & 0xC0 != 0
    }
}

/// How the engine splits a DRAM quota (in pages) between mapped pages, the inactive list and
/// free headroom.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Watermarks {
    /// The quota: resident pages (active + inactive + in flight) the tenant may keep.
    pub quota: u64,
    /// Eviction starts when resident pages exceed `quota - high_headroom`.
    pub high_headroom: u64,
    /// Eviction stops once resident pages are at or below `quota - low_headroom`.
    pub low_headroom: u64,
    /// Pages kept in the inactive list (unmapped, still in DRAM) while under pressure.
    pub inactive_target: u64,
    /// Pages written to tier 1 in one batch.
    pub batch: u64,
}

impl Watermarks {
    /// Largest write-back batch (1 MiB of 4 KiB pages).
    pub const MAX_BATCH: u64 = 256;

    /// Derives watermarks from a quota in pages. Small quotas get proportionally small lists so
    /// that the program always keeps most of its quota mapped.
    pub fn for_quota(quota: u64) -> Watermarks {
        let quota = quota.max(16);
        let batch = (quota / 16).clamp(1, Self::MAX_BATCH);
        let inactive_target = (quota / 8).max(batch);
        let high_headroom = batch;
        let low_headroom = (2 * batch).min(quota / 4).max(high_headroom);
        Watermarks {
            quota,
            high_headroom,
            low_headroom,
            inactive_target,
            batch,
        }
    }

    /// Whether eviction should run with this many resident pages.
    pub fn over_high(&self, resident: u64) -> bool {
        resident + self.high_headroom > self.quota
    }

    /// Whether this many resident pages are near enough the quota that pages are unmapped into
    /// the inactive list (so that hot ones show themselves before any is written).
    pub fn near_quota(&self, resident: u64) -> bool {
        resident + self.low_headroom + self.inactive_target >= self.quota
    }

    /// Whether eviction may stop with this many resident pages.
    pub fn under_low(&self, resident: u64) -> bool {
        resident + self.low_headroom <= self.quota
    }

    /// Resident pages above which a faulting thread waits for eviction: the quota itself plus
    /// one batch of slack for pages in flight.
    pub fn hard_limit(&self) -> u64 {
        self.quota + self.batch
    }
}

/// Decides when an epoch ends. Time is passed in (nanoseconds on any monotonic clock).
#[derive(Clone, Copy, Debug)]
pub struct EpochClock {
    interval_ns: u64,
    next_ns: Option<u64>,
    epoch: u64,
}

impl EpochClock {
    /// A clock whose epochs last `interval_ns`.
    pub fn new(interval_ns: u64) -> EpochClock {
        EpochClock {
            interval_ns: interval_ns.max(1),
            next_ns: None,
            epoch: 0,
        }
    }

    /// Number of epochs that ended up to `now_ns` (at most one per call, so a stalled caller
    /// does not age all histories to zero at once).
    pub fn tick(&mut self, now_ns: u64) -> bool {
        match self.next_ns {
            None => {
                self.next_ns = Some(now_ns + self.interval_ns);
                false
            }
            Some(next) if now_ns >= next => {
                self.epoch += 1;
                self.next_ns = Some(now_ns.max(next) + self.interval_ns);
                true
            }
            Some(_) => false,
        }
    }

    /// Epochs completed so far.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Nanoseconds from `now_ns` until the current epoch ends.
    pub fn remaining_ns(&self, now_ns: u64) -> u64 {
        self.next_ns
            .map_or(self.interval_ns, |next| next.saturating_sub(now_ns))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn touched_page_is_active_for_two_epochs() {
        let h = Activeness::default().touch();
        assert!(h.is_active());
        assert!(h.age().is_active());
        assert!(!h.age().age().is_active());
        assert_eq!(h.age().age().idle_epochs(), 2);
    }

    #[test]
    fn epoch_clock_advances_once_per_interval() {
        let mut c = EpochClock::new(100);
        assert!(!c.tick(0));
        assert!(!c.tick(99));
        assert!(c.tick(100));
        assert!(!c.tick(150));
        assert!(c.tick(1000));
        assert_eq!(c.epoch(), 2);
        assert_eq!(c.remaining_ns(1000), 100);
    }

    proptest! {
        #[test]
        fn watermarks_are_ordered(quota in 0u64..10_000_000) {
            let w = Watermarks::for_quota(quota);
            prop_assert!(w.batch >= 1 && w.batch <= Watermarks::MAX_BATCH);
            prop_assert!(w.high_headroom <= w.low_headroom);
            prop_assert!(w.low_headroom < w.quota);
            prop_assert!(w.inactive_target < w.quota);
            prop_assert!(w.hard_limit() > w.quota);
            // Whatever is under the low mark is also under the high mark.
            for r in [0, w.quota / 2, w.quota - w.low_headroom, w.quota] {
                if w.under_low(r) { prop_assert!(!w.over_high(r)); }
            }
        }

        #[test]
        fn aging_never_increases_history(h in any::<u8>()) {
            let a = Activeness(h);
            prop_assert!(a.age() <= a);
            prop_assert!(a.age().idle_epochs() >= a.idle_epochs().min(7));
            prop_assert!(a.touch().idle_epochs() == 0);
        }
    }
}
