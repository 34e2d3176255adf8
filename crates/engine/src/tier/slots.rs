//! Free-slot bookkeeping for tier 1: a bitmap over slots, allocation in runs of consecutive
//! slots so that a write-back batch becomes one large sequential write. Entry point:
//! [`SlotMap::alloc_run`]. Not used on the fault path (only the evictor and the program's own
//! memory calls allocate and free slots).

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
    /// Most slots allowed (the tier size).
    limit: u64,
}

impl SlotMap {
    pub fn new(limit: u64) -> SlotMap {
        SlotMap {
            limit,
            ..SlotMap::default()
        }
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
        if want == 0 {
            return None;
        }
        if self.in_use < self.len {
            // A free slot exists below len: find it from the cursor, wrapping once.
            for pass in 0..2 {
                let (from, to) = if pass == 0 {
                    (self.cursor, self.len)
                } else {
                    (0, self.cursor.min(self.len))
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
                        while n < want && s + n < self.len && !self.is_used(s + n) {
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
        // Extend the store.
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
        let mut m = SlotMap::new(10_000);
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
        let mut m = SlotMap::new(8);
        assert_eq!(m.alloc_run(8, |_| true), Some((0, 8)));
        assert_eq!(m.alloc_run(1, |_| true), None);
        m.free(3);
        assert_eq!(m.alloc_run(4, |_| true), Some((3, 1)));
    }

    #[test]
    fn failed_growth_allocates_nothing() {
        let mut m = SlotMap::new(100);
        assert_eq!(m.alloc_run(4, |_| false), None);
        assert_eq!(m.in_use(), 0);
        assert_eq!(m.len(), 0);
    }
}
