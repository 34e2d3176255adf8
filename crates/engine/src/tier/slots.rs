//! Free-slot bookkeeping for tier 1: a bitmap over slots, allocation in runs of consecutive
//! slots so that a write-back batch becomes one large sequential write. Entry point:
//! [`SlotMap::alloc_run`]. Not used on the fault path (only the evictor and the program's own
//! memory calls allocate and free slots).
//!
//! The tier's size may change at run time ([`SlotMap::set_limit`], a host daemon's share of its
//! tier capacity): a lowered limit is kept by allocating only below it, never more slots in use
//! than it allows, and by cutting the store's free tail ([`SlotMap::shrink_to`]) once the
//! engine has moved what lay above the limit below it.

/// Which tier-1 slots are in use.
#[derive(Debug, Default)]
pub struct SlotMap {
    used: Vec<u64>,
    /// Slots that exist (the backing store has room for them).
    len: u64,
    /// Slots in use.
    in_use: u64,
    /// Where the next search starts: allocation proceeds round the file like a log.
    cursor: u64,
    /// Slots allowed now: in use at once, and as an index (the tier size).
    limit: u64,
    /// The most `limit` may be raised to.
    cap: u64,
}

impl SlotMap {
    /// A map of at most `limit` slots (the limit may later be set anywhere up to `cap`).
    pub fn new(limit: u64, cap: u64) -> SlotMap {
        SlotMap {
            limit: limit.min(cap),
            cap,
            ..SlotMap::default()
        }
    }

    /// Sets how many slots the tier may use from now on (at most the cap given at creation);
    /// returns the limit in force. Slots already in use above it stay until they are freed or
    /// their copies move below it: see [`needs_reclaim`](Self::needs_reclaim),
    /// [`take_below_limit`](Self::take_below_limit) and [`shrink_to`](Self::shrink_to).
    pub fn set_limit(&mut self, limit: u64) -> u64 {
        self.limit = limit.min(self.cap);
        self.limit
    }

    /// Slots in use beyond the limit (after it was lowered).
    pub fn over_limit(&self) -> u64 {
        self.in_use.saturating_sub(self.limit)
    }

    /// Whether the tier is not within its limit yet: more slots in use than it allows, or a
    /// store longer than it (to be cut once nothing in use lies above it).
    pub fn needs_reclaim(&self) -> bool {
        self.in_use > self.limit || self.len > self.limit
    }

    /// Whether a slot can be allocated without growing the store.
    pub fn has_room(&self) -> bool {
        if self.in_use >= self.limit {
            return false;
        }
        if self.len <= self.limit {
            // Every slot in use lies below len.
            return self.in_use < self.len;
        }
        // Lowered: slots in use above the limit do not count; look below it.
        self.free_below(self.limit)
    }

    fn free_below(&self, end: u64) -> bool {
        (0..end.div_ceil(64)).any(|w| {
            let bits = (end - w * 64).min(64);
            let mask = if bits == 64 {
                u64::MAX
            } else {
                (1 << bits) - 1
            };
            self.used[w as usize] & mask != mask
        })
    }

    /// The store size to cut the store to when it is longer than the limit: just above the
    /// highest slot in use, not below the limit. `None` when there is nothing to cut. The
    /// caller shrinks the store, then calls [`shrunk`](Self::shrunk).
    pub fn shrink_to(&self) -> Option<u64> {
        if self.len <= self.limit {
            return None;
        }
        let top = (0..self.len.div_ceil(64))
            .rev()
            .find(|&w| self.used[w as usize] != 0)
            .map_or(0, |w| {
                w * 64 + 64 - self.used[w as usize].leading_zeros() as u64
            });
        let to = top.max(self.limit);
        (to < self.len).then_some(to)
    }

    /// The store now holds `len` slots (after [`shrink_to`](Self::shrink_to)).
    pub fn shrunk(&mut self, len: u64) {
        debug_assert!(len >= self.shrink_to().unwrap_or(len));
        self.len = len;
        self.used.truncate(len.div_ceil(64) as usize);
        if let Some(w) = self.used.last_mut() {
            if !len.is_multiple_of(64) {
                *w &= (1 << (len % 64)) - 1;
            }
        }
        self.cursor = self.cursor.min(len);
    }

    pub fn in_use(&self) -> u64 {
        self.in_use
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    fn is_used(&self, s: u64) -> bool {
        self.used
            .get((s / 64) as usize)
            .is_some_and(|w| w & (1 << (s % 64)) != 0)
    }

    fn set(&mut self, s: u64, on: bool) {
        let w = (s / 64) as usize;
        if w >= self.used.len() {
            self.used.resize(w + 1, 0);
        }
        if on {
            self.used[w] |= 1 << (s % 64);
        } else {
            self.used[w] &= !(1 << (s % 64));
        }
    }

    /// Takes a free slot below the limit for a copy that moves down from above it (which gives
    /// its old slot back, so no more slots are in use than before: the limit on slots in use
    /// does not apply). `None` when every slot below the limit is in use.
    pub fn take_below_limit(&mut self) -> Option<u64> {
        let end = self.len.min(self.limit);
        let s = (0..end).find(|&s| {
            let w = self.used[(s / 64) as usize];
            w != u64::MAX && !self.is_used(s)
        })?;
        self.set(s, true);
        self.in_use += 1;
        Some(s)
    }

    /// Allocates up to `want` consecutive slots and returns `(first, count)`. It prefers free
    /// slots the store already has; when none are left it extends the store, asking `grow` for
    /// the new size first (a generous step, or, where the store cannot grow that much, just
    /// what is asked for, so that a filesystem fills to its last page). `None` when the tier is
    /// full or cannot grow.
    pub fn alloc_run(
        &mut self,
        want: u64,
        mut grow: impl FnMut(u64) -> bool,
    ) -> Option<(u64, u64)> {
        let want = want.min(self.limit.saturating_sub(self.in_use));
        if want == 0 {
            return None;
        }
        let end = self.len.min(self.limit);
        if self.in_use < self.len {
            // A free slot may exist below the end: find it from the cursor, wrapping once.
            for pass in 0..2 {
                let (from, to) = if pass == 0 {
                    (self.cursor.min(end), end)
                } else {
                    (0, self.cursor.min(end))
                };
                let mut s = from;
                while s < to {
                    let w = self.used[(s / 64) as usize];
                    if w == u64::MAX && s % 64 == 0 {
                        s += 64;
                        continue;
                    }
                    if !self.is_used(s) {
                        let mut n = 0;
                        while n < want && s + n < end && !self.is_used(s + n) {
                            self.set(s + n, true);
                            n += 1;
                        }
                        self.in_use += n;
                        self.cursor = s + n;
                        return Some((s, n));
                    }
                    s += 1;
                }
            }
        }
        // Extend the store (never past the limit).
        let n = want.min(self.limit.saturating_sub(self.len));
        if n == 0 {
            return None;
        }
        let chunk = (self.len / 8).clamp(1024, 65536).max(n);
        let mut new_len = (self.len + chunk).min(self.limit);
        if !grow(new_len) {
            new_len = self.len + n;
            if !grow(new_len) {
                return None;
            }
        }
        let first = self.len;
        self.len = new_len;
        self.used.resize(new_len.div_ceil(64) as usize, 0);
        for s in first..first + n {
            self.set(s, true);
        }
        self.in_use += n;
        self.cursor = first + n;
        Some((first, n))
    }

    /// Returns a slot to the free pool.
    pub fn free(&mut self, s: u64) {
        debug_assert!(self.is_used(s), "double free of tier slot {s}");
        if self.is_used(s) {
            self.set(s, false);
            self.in_use -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_are_consecutive_and_reused_after_free() {
        let mut m = SlotMap::new(10_000, 10_000);
        let (a, n) = m.alloc_run(100, |_| true).unwrap();
        assert_eq!((a, n), (0, 100));
        let (b, n2) = m.alloc_run(50, |_| true).unwrap();
        assert_eq!((b, n2), (100, 50));
        for s in 10..20 {
            m.free(s);
        }
        assert_eq!(m.in_use(), 140);
        m.cursor = 0;
        let (c, n3) = m.alloc_run(30, |_| true).unwrap();
        assert_eq!((c, n3), (10, 10), "a run stops at the first used slot");
    }

    #[test]
    fn full_tier_refuses() {
        let mut m = SlotMap::new(8, 8);
        assert_eq!(m.alloc_run(8, |_| true), Some((0, 8)));
        assert_eq!(m.alloc_run(1, |_| true), None);
        m.free(3);
        assert_eq!(m.alloc_run(4, |_| true), Some((3, 1)));
    }

    #[test]
    fn failed_growth_allocates_nothing() {
        let mut m = SlotMap::new(100, 100);
        assert_eq!(m.alloc_run(4, |_| false), None);
        assert_eq!(m.in_use(), 0);
        assert_eq!(m.len(), 0);
    }

    #[test]
    fn a_lowered_limit_allocates_below_it_and_cuts_the_free_tail() {
        let mut m = SlotMap::new(100, 1000);
        assert_eq!(m.alloc_run(100, |_| true), Some((0, 100)));
        assert_eq!(m.alloc_run(1, |_| true), None, "at the limit");
        assert_eq!(m.set_limit(2000), 1000, "not above the cap");
        assert_eq!(m.alloc_run(50, |_| true), Some((100, 50)));
        // Lower it to 60: 90 slots over, nothing allocated until enough are freed.
        m.set_limit(60);
        assert_eq!(m.over_limit(), 90);
        assert!(!m.has_room());
        for s in 0..100 {
            m.free(s);
        }
        assert_eq!(m.over_limit(), 0);
        assert!(m.has_room());
        // Slots 100..150 are still in use: the store can be cut to 150, not to the limit.
        assert_eq!(m.shrink_to(), Some(150));
        let (first, n) = m.alloc_run(100, |_| true).unwrap();
        assert!(first + n <= 60, "allocated below the limit: {first}+{n}");
        assert_eq!(m.in_use(), 50 + n);
        for s in 100..150 {
            m.free(s);
        }
        let to = m.shrink_to().expect("a free tail above the limit");
        assert_eq!(to, 60);
        m.shrunk(to);
        assert_eq!(m.len(), 60);
        assert_eq!(m.shrink_to(), None);
        // Raised again: the free slots left first, then the store grows as before.
        m.set_limit(500);
        assert_eq!(m.alloc_run(100, |_| true), Some((n, 60 - n)));
        assert_eq!(m.alloc_run(100, |_| true), Some((60, 100)));
        assert!(m.len() >= 160);
    }
}
