//! The DRAM quota: how many pages hold DRAM, and the reservation every page takes before it
//! is brought in. A faulting thread that finds the quota used up rings the evictor's
//! [`Doorbell`] and waits for DRAM to be freed. Entry points: [`Quota::reserve`],
//! [`Doorbell`].
//!
//! # Invariants
//!
//! - `resident` counts pages holding DRAM (mapped, staged, writing, dead ring entries, or in
//!   flight); a thread reserves before it claims a page and gives back what it did not use.
//! - The quota bounds what the engine holds ([`Quota::held`]): those pages plus the pages of
//!   the compressed pool.
//! - A waiting thread never waits unboundedly: it re-checks every 10 ms, and the evictor lets
//!   threads through above the quota (`overcommit`) when it cannot make room.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use memtide_policy::Watermarks;

use crate::stats::Counters;
use crate::sys;

/// Wakes the evictor early (when DRAM runs short) and lets it sleep otherwise.
#[derive(Default)]
pub(super) struct Doorbell {
    rung: AtomicU32,
    sleeping: AtomicBool,
}

impl Doorbell {
    /// Wakes the evictor if it sleeps.
    pub(super) fn ring(&self) {
        if self.sleeping.load(Ordering::Acquire) {
            self.ring_always();
        }
    }

    /// Wakes the evictor whether or not it says it sleeps (for pause and resume).
    pub(super) fn ring_always(&self) {
        self.rung.fetch_add(1, Ordering::AcqRel);
        sys::futex_wake(&self.rung);
    }

    /// What [`wait`](Self::wait) compares against: take it before checking for work.
    pub(super) fn seen(&self) -> u32 {
        self.rung.load(Ordering::Acquire)
    }

    /// Sleeps up to `timeout_ns` unless the bell rang since `seen`.
    pub(super) fn wait(&self, seen: u32, timeout_ns: u64) {
        sys::futex_wait(&self.rung, seen, timeout_ns);
    }

    pub(super) fn set_sleeping(&self, sleeping: bool) {
        self.sleeping.store(sleeping, Ordering::Release);
    }
}

pub(super) struct Quota {
    /// The quota in pages; it may change at run time ([`set`](Self::set)).
    pages: AtomicU64,
    resident: AtomicU64,
    /// Pages of DRAM the compressed pool takes (the pool's own count, see
    /// `Pool::pages_counter`).
    pool: Arc<AtomicU64>,
    /// Bumped and woken when the evictor frees DRAM.
    freed: AtomicU32,
    waiters: AtomicU32,
    /// Set when eviction cannot make room (tier full or failing, nothing evictable): faulting
    /// threads are then admitted above the quota instead of waiting.
    overcommit: AtomicBool,
    /// Set for good when the memory is no longer tiered (after a fork fallback).
    unlimited: AtomicBool,
}

impl Quota {
    /// A quota of `pages`, bounding resident pages plus the pool's (`pool`, the pool's count
    /// of its pages; a zero that stays zero when there is no pool).
    pub(super) fn new(pages: u64, pool: Arc<AtomicU64>) -> Quota {
        Quota {
            pages: AtomicU64::new(Watermarks::for_quota(pages).quota),
            resident: AtomicU64::new(0),
            pool,
            freed: AtomicU32::new(0),
            waiters: AtomicU32::new(0),
            overcommit: AtomicBool::new(false),
            unlimited: AtomicBool::new(false),
        }
    }

    /// The watermarks of the quota now.
    pub(super) fn wm(&self) -> Watermarks {
        Watermarks::for_quota(self.pages.load(Ordering::Acquire))
    }

    /// Sets a new quota of `pages` (at least the smallest quota [`Watermarks`] allow). Faulting
    /// threads see it at once; the evictor converges to it (see `Engine::set_quota_bytes`).
    pub(super) fn set(&self, pages: u64) -> u64 {
        let q = Watermarks::for_quota(pages).quota;
        self.pages.store(q, Ordering::Release);
        q
    }

    /// Pages holding DRAM now.
    pub(super) fn resident(&self) -> u64 {
        self.resident.load(Ordering::Acquire)
    }

    /// Pages of DRAM the engine holds now: resident pages and the compressed pool's.
    pub(super) fn held(&self) -> u64 {
        self.resident() + self.pool.load(Ordering::Acquire)
    }

    /// Reserves DRAM for `n` pages, waiting for the evictor if the quota is used up.
    pub(super) fn reserve(&self, n: u64, bell: &Doorbell, c: &Counters) {
        while !self.admit(n, bell, c, true) {
            let seen = self.freed.load(Ordering::Acquire);
            Counters::bump(&c.quota_waits);
            self.waiters.fetch_add(1, Ordering::AcqRel);
            if self.held() + n > self.wm().hard_limit() && !self.overcommit.load(Ordering::Acquire)
            {
                bell.ring();
                let t0 = sys::now_ns();
                sys::futex_wait(&self.freed, seen, 10_000_000);
                Counters::add(&c.quota_wait_ns, sys::now_ns() - t0);
            }
            self.waiters.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Reserves DRAM for `n` pages if the quota has room now, without waiting: whether it
    /// did. Never beyond the hard limit, overcommitted or not: a caller that can do without
    /// the pages (a hint fault that can move its page instead of copying it) does.
    pub(super) fn try_reserve(&self, n: u64, bell: &Doorbell, c: &Counters) -> bool {
        self.admit(n, bell, c, false)
    }

    /// Takes `n` pages if they fit under the hard limit, or beyond it when `may_overrun` and
    /// the quota is overcommitted or lifted; rings the evictor once past the high mark.
    /// Whether it took them.
    fn admit(&self, n: u64, bell: &Doorbell, c: &Counters, may_overrun: bool) -> bool {
        let wm = self.wm();
        let limit = wm.hard_limit();
        let r =
            self.resident.fetch_add(n, Ordering::AcqRel) + n + self.pool.load(Ordering::Acquire);
        if wm.over_high(r) {
            bell.ring();
        }
        if r <= limit
            || may_overrun
                && (self.overcommit.load(Ordering::Acquire)
                    || self.unlimited.load(Ordering::Relaxed))
        {
            Counters::peak(&c.peak_resident_pages, r);
            if r > limit {
                Counters::add(&c.quota_overruns, n);
            }
            return true;
        }
        self.resident.fetch_sub(n, Ordering::AcqRel);
        false
    }

    /// Gives back `n` pages of DRAM (reserved and not used, or released).
    pub(super) fn unreserve(&self, n: u64) {
        if n > 0 {
            self.resident.fetch_sub(n, Ordering::AcqRel);
        }
    }

    /// Lets threads waiting for DRAM look again.
    pub(super) fn wake_waiters(&self) {
        self.freed.fetch_add(1, Ordering::AcqRel);
        if self.waiters.load(Ordering::Acquire) > 0 {
            sys::futex_wake(&self.freed);
        }
    }

    /// Admits threads above the quota (`true`) while eviction cannot make room, or stops
    /// doing so.
    pub(super) fn set_overcommit(&self, on: bool) {
        self.overcommit.store(on, Ordering::Release);
    }

    /// No quota from now on (the memory is no longer tiered).
    pub(super) fn lift(&self) {
        self.unlimited.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reservation_tried_stops_at_the_hard_limit_even_overcommitted() {
        let q = Quota::new(1024, Arc::new(AtomicU64::new(0)));
        let (bell, c) = (Doorbell::default(), Counters::default());
        let limit = q.wm().hard_limit();
        assert!(q.try_reserve(limit, &bell, &c), "room up to the hard limit");
        assert!(!q.try_reserve(1, &bell, &c), "none beyond it");
        assert_eq!(
            q.resident(),
            limit,
            "a refused reservation leaves nothing held"
        );
        // Overcommitted (eviction cannot make room), a fault that must have a page still gets
        // one; one that can do without does not.
        q.set_overcommit(true);
        q.reserve(1, &bell, &c);
        assert_eq!(q.resident(), limit + 1);
        assert!(!q.try_reserve(1, &bell, &c), "not even overcommitted");
        q.unreserve(limit + 1);
        assert!(
            q.try_reserve(1, &bell, &c),
            "room again once pages are given back"
        );
    }
}
