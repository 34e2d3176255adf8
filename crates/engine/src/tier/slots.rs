//! Free-slot bookkeeping for tier 1: which process holds which slot, allocation in runs of
//! consecutive slots so that a write-back batch becomes one large sequential write. Entry
//! point: [`SlotMap::alloc_run`]. Not used on the fault path (only the evictor and the
//! program's own memory calls allocate and free slots).
//!
//! # Holders: one file for a process and the children it forks
//!
//! A process that forks shares its tier file with the child: a page evicted before the fork is
//! in both processes' page tables, at the same slot. So a slot is held by a set of processes
//! (members of the process tree, at most [`MEMBERS`]), kept as one word per slot with a bit
//! per member, in memory shared across fork (`MAP_SHARED`). A member claims a free slot by
//! setting its bit in a zero word (compare-and-swap, so two processes never claim one slot),
//! gives it up by clearing its bit, and the slot is free again when no bit is left. At a fork
//! the parent adds the child's bit to every slot it holds ([`SlotMap::share`]); a member that
//! dies has its bit cleared everywhere ([`SlotMap::forget_member`]). The store's length is
//! shared too: any member may grow the file, under a lock in the same shared memory.
//!
//! The tier's size may change at run time ([`SlotMap::set_limit`], a host daemon's share of its
//! tier capacity): a lowered limit is kept by allocating only below it, never more slots in use
//! than it allows, and by cutting the store's free tail ([`SlotMap::shrink_to`]) once the
//! engine has moved what lay above the limit below it. The limit counts the slots this process
//! holds.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use crate::sys::Mapping;

/// Processes of one tree that may hold slots at once (a bit each in a slot's word).
pub const MEMBERS: u32 = 64;

/// What the members of a process tree share about the file: its length, the lock for changing
/// it, and the holder word of every slot. Lives in `MAP_SHARED` memory, so a forked child sees
/// the parent's changes and the parent the child's.
pub struct Shared {
    head: Mapping,
    words: Mapping,
    cap: u64,
}

impl Shared {
    fn new(cap: u64) -> std::io::Result<Shared> {
        Ok(Shared {
            head: Mapping::shared_anon(4096)?,
            words: Mapping::shared_anon((cap.max(1) * 8) as usize)?,
            cap,
        })
    }

    fn len(&self) -> &AtomicU64 {
        &self.head.as_slice::<AtomicU64>()[0]
    }

    /// A counter any member may draw from (tier encryption's nonces): unique across the tree.
    pub fn counter(&self) -> &AtomicU64 {
        &self.head.as_slice::<AtomicU64>()[1]
    }

    fn lock_word(&self) -> &AtomicU32 {
        &self.head.as_slice::<AtomicU32>()[4]
    }

    /// Members holding slots of this file (1 until the first fork).
    fn members(&self) -> &AtomicU32 {
        &self.head.as_slice::<AtomicU32>()[5]
    }

    /// The family's id: a random number naming this file's holders (a process and the
    /// children it forks), drawn when the file was made.
    pub fn family(&self) -> u64 {
        self.head.as_slice::<AtomicU64>()[3].load(Ordering::Acquire)
    }

    /// Slots held by any member.
    fn used(&self) -> &AtomicU64 {
        &self.head.as_slice::<AtomicU64>()[4]
    }

    fn word(&self, s: u64) -> &AtomicU64 {
        &self.words.as_slice::<AtomicU64>()[s as usize]
    }

    /// Takes the lock on the store's length (held for a grow or a shrink; a member that dies
    /// holding it would leave it held, so it is held only around one system call).
    fn lock(&self) {
        while self
            .lock_word()
            .compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            std::thread::yield_now();
        }
    }

    fn unlock(&self) {
        self.lock_word().store(0, Ordering::Release);
    }
}

/// Which tier-1 slots are in use, and which of them this process holds.
pub struct SlotMap {
    shared: Arc<Shared>,
    /// This process's bit in the holder words.
    me: u64,
    /// Slots this process holds.
    in_use: u64,
    /// Where the next search starts: allocation proceeds round the file like a log.
    cursor: u64,
    /// Slots allowed now: held at once, and as an index (the tier size).
    limit: u64,
    /// The most `limit` may be raised to.
    cap: u64,
}

impl std::fmt::Debug for SlotMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotMap")
            .field("len", &self.len())
            .field("in_use", &self.in_use)
            .field("limit", &self.limit)
            .finish()
    }
}

impl SlotMap {
    /// A map of at most `limit` slots (the limit may later be set anywhere up to `cap`), held
    /// by this process alone until it forks. Fails only when its shared memory cannot be
    /// mapped.
    pub fn new(limit: u64, cap: u64) -> std::io::Result<SlotMap> {
        let shared = Shared::new(cap)?;
        shared.members().store(1, Ordering::Relaxed);
        let mut id = [0u8; 8];
        crate::sys::random_bytes(&mut id)?;
        shared.head.as_slice::<AtomicU64>()[3].store(u64::from_le_bytes(id) | 1, Ordering::Release);
        Ok(SlotMap {
            shared: Arc::new(shared),
            me: 1,
            in_use: 0,
            cursor: 0,
            limit: limit.min(cap),
            cap,
        })
    }

    /// What this map shares with the process tree.
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// This process's member number.
    pub fn member(&self) -> u32 {
        self.me.trailing_zeros()
    }

    /// In a forked child: from now on this process is member `m`, holding the slots the parent
    /// gave it with [`share`](Self::share) (as many as the parent held: `in_use` is unchanged).
    pub fn become_member(&mut self, m: u32) {
        self.me = 1 << m;
    }

    /// Before a fork: member `m` (the child) joins the file's holders and holds every slot in
    /// `slots` too.
    pub fn share(&self, m: u32, slots: impl Iterator<Item = u64>) {
        self.shared.members().fetch_add(1, Ordering::AcqRel);
        for s in slots {
            self.shared.word(s).fetch_or(1 << m, Ordering::AcqRel);
        }
    }

    /// Member `m` is gone (it exited, or a fork that was to make it failed): it leaves the
    /// file's holders, and every slot it held is let go, freed where no other member holds it.
    /// Returns how many slots it held.
    pub fn forget_member(&self, m: u32) -> u64 {
        self.shared.members().fetch_sub(1, Ordering::AcqRel);
        let bit = 1u64 << m;
        let mut held = 0;
        for s in 0..self.len() {
            let was = self.shared.word(s).fetch_and(!bit, Ordering::AcqRel);
            if was & bit != 0 {
                held += 1;
                if was == bit {
                    self.shared.used().fetch_sub(1, Ordering::AcqRel);
                }
            }
        }
        held
    }

    /// Slots in use by any member (this process and those it forked or was forked with).
    pub fn used_by_family(&self) -> u64 {
        self.shared.used().load(Ordering::Acquire)
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
        self.in_use > self.limit || self.len() > self.limit
    }

    /// Whether a slot can be allocated without growing the store.
    pub fn has_room(&self) -> bool {
        if self.in_use >= self.limit {
            return false;
        }
        let len = self.len();
        if len <= self.limit {
            // Every slot in use lies below len.
            return self.used_by_family() < len;
        }
        // Lowered: slots in use above the limit do not count; look below it.
        self.free_below(self.limit)
    }

    fn free_below(&self, end: u64) -> bool {
        (0..end).any(|s| !self.is_used(s))
    }

    /// The store size to cut the store to when it is longer than the limit: just above the
    /// highest slot in use, not below the limit. `None` when there is nothing to cut. The
    /// caller shrinks the store, then calls [`shrunk`](Self::shrunk).
    /// While other members share the file, it is not cut (they may be growing it or
    /// claiming slots meanwhile).
    pub fn shrink_to(&self) -> Option<u64> {
        let len = self.len();
        if len <= self.limit || self.shared.members().load(Ordering::Acquire) > 1 {
            return None;
        }
        let top = (0..len)
            .rev()
            .find(|&s| self.is_used(s))
            .map_or(0, |s| s + 1);
        let to = top.max(self.limit);
        (to < len).then_some(to)
    }

    /// The store now holds `len` slots (after [`shrink_to`](Self::shrink_to)).
    pub fn shrunk(&mut self, len: u64) {
        debug_assert!(len >= self.shrink_to().unwrap_or(len));
        self.shared.len().store(len, Ordering::Release);
        self.cursor = self.cursor.min(len);
    }

    /// Slots this process holds.
    pub fn in_use(&self) -> u64 {
        self.in_use
    }

    /// Slots the store has (shared by the process tree).
    pub fn len(&self) -> u64 {
        self.shared.len().load(Ordering::Acquire)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    fn is_used(&self, s: u64) -> bool {
        s < self.shared.cap && self.shared.word(s).load(Ordering::Acquire) != 0
    }

    /// Claims free slot `s` for this process; false when a member holds it.
    fn claim(&self, s: u64) -> bool {
        let ok = self
            .shared
            .word(s)
            .compare_exchange(0, self.me, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok();
        if ok {
            self.shared.used().fetch_add(1, Ordering::AcqRel);
        }
        ok
    }

    /// Takes a free slot below the limit for a copy that moves down from above it (which gives
    /// its old slot back, so no more slots are in use than before: the limit on slots in use
    /// does not apply). `None` when every slot below the limit is in use.
    pub fn take_below_limit(&mut self) -> Option<u64> {
        let end = self.len().min(self.limit);
        let s = (0..end).find(|&s| !self.is_used(s) && self.claim(s))?;
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
        loop {
            let len = self.len();
            let end = len.min(self.limit);
            // A free slot may exist below the end: find it from the cursor, wrapping once.
            for pass in 0..2 {
                let (from, to) = if pass == 0 {
                    (self.cursor.min(end), end)
                } else {
                    (0, self.cursor.min(end))
                };
                let mut s = from;
                while s < to {
                    if !self.is_used(s) && self.claim(s) {
                        let mut n = 1;
                        while n < want && s + n < end && !self.is_used(s + n) && self.claim(s + n) {
                            n += 1;
                        }
                        self.in_use += n;
                        self.cursor = s + n;
                        return Some((s, n));
                    }
                    s += 1;
                }
            }
            // Extend the store (never past the limit), unless another member just did.
            let n = want.min(self.limit.saturating_sub(len));
            if n == 0 {
                return None;
            }
            self.shared.lock();
            if self.len() != len {
                self.shared.unlock();
                continue;
            }
            let chunk = (len / 8).clamp(1024, 65536).max(n);
            let mut new_len = (len + chunk).min(self.limit).min(self.shared.cap);
            if new_len < len + n {
                self.shared.unlock();
                return None;
            }
            if !grow(new_len) {
                new_len = len + n;
                if !grow(new_len) {
                    self.shared.unlock();
                    return None;
                }
            }
            self.shared.len().store(new_len, Ordering::Release);
            self.shared.unlock();
            // The new slots are free (no member can hold a slot beyond the old length) but
            // another member may claim some of them first: the search above takes what is left.
            self.cursor = len;
        }
    }

    /// Returns a slot to the free pool.
    /// This process lets slot `s` go; it is free once no other member holds it.
    pub fn free(&mut self, s: u64) {
        let was = self.shared.word(s).fetch_and(!self.me, Ordering::AcqRel);
        debug_assert!(was & self.me != 0, "double free of tier slot {s}");
        if was & self.me != 0 {
            self.in_use -= 1;
            if was == self.me {
                self.shared.used().fetch_sub(1, Ordering::AcqRel);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_are_consecutive_and_reused_after_free() {
        let mut m = SlotMap::new(10_000, 10_000).unwrap();
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
        let mut m = SlotMap::new(8, 8).unwrap();
        assert_eq!(m.alloc_run(8, |_| true), Some((0, 8)));
        assert_eq!(m.alloc_run(1, |_| true), None);
        m.free(3);
        assert_eq!(m.alloc_run(4, |_| true), Some((3, 1)));
    }

    #[test]
    fn failed_growth_allocates_nothing() {
        let mut m = SlotMap::new(100, 100).unwrap();
        assert_eq!(m.alloc_run(4, |_| false), None);
        assert_eq!(m.in_use(), 0);
        assert_eq!(m.len(), 0);
    }

    #[test]
    fn a_lowered_limit_allocates_below_it_and_cuts_the_free_tail() {
        let mut m = SlotMap::new(100, 1000).unwrap();
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

    #[test]
    fn a_shared_slot_is_free_only_when_its_last_holder_lets_go() {
        let mut parent = SlotMap::new(100, 100).unwrap();
        let (first, n) = parent.alloc_run(10, |_| true).unwrap();
        assert_eq!((first, n), (0, 10));
        // A fork: the child (member 5) holds what the parent holds, through the same words.
        parent.share(5, 0..10);
        let mut child = SlotMap {
            shared: parent.shared.clone(),
            me: 1 << 5,
            in_use: parent.in_use,
            cursor: parent.cursor,
            limit: parent.limit,
            cap: parent.cap,
        };
        assert_eq!(parent.used_by_family(), 10);
        // The parent lets slots 0..5 go: the child still holds them.
        for s in 0..5 {
            parent.free(s);
        }
        assert_eq!(parent.in_use(), 5);
        assert_eq!(parent.used_by_family(), 10);
        assert!((0..10).all(|s| parent.is_used(s)));
        // Neither can take a slot another holds: new runs start past them.
        let (a, _) = parent.alloc_run(1, |_| true).unwrap();
        let (b, _) = child.alloc_run(1, |_| true).unwrap();
        assert!(a >= 10 && b >= 10 && a != b, "{a} {b}");
        // The child lets slot 0 go: free now.
        child.free(0);
        assert!(!parent.is_used(0));
        assert_eq!(parent.used_by_family(), 11);
        // The child dies: what it alone held is free, what the parent holds stays.
        assert_eq!(parent.forget_member(5), 10, "slots 1..10 and its own run");
        assert_eq!(parent.used_by_family(), 6, "the parent's 5..10 and its run");
        assert!((1..5).all(|s| !parent.is_used(s)));
        assert!((5..10).all(|s| parent.is_used(s)));
        assert!(!parent.is_used(b));
    }
}
