//! Which pages leave DRAM: S3-FIFO's small queue in front of a SIEVE main queue, with unmapping
//! as the reference bit. Entry point: [`Placement`].
//!
//! # What the engine can see
//!
//! The engine learns of an access only when the program faults: on a first touch, on a page
//! it must read from tier 1, and on a page it unmapped on purpose while keeping it in DRAM
//! (*staged*: a hint fault maps it back). A mapped page is invisible. So a page's reference
//! bit is its mapping: staging a page clears the bit, a hint fault sets it again.
//!
//! # The structure
//!
//! A page that comes into DRAM joins the small FIFO queue S (10% of the quota to begin with),
//! unless it left S not long ago (it has a recent *ghost* stamp), in which case it joins the
//! main queue M.
//! Either way it is staged soon after ([`Placement::probe`]): a page the program uses again
//! shows itself by a hint fault. When pages must leave DRAM ([`Placement::evict`]):
//!
//! - while S holds more than its share, S's oldest page goes: into M if it was used after it
//!   was staged, out of DRAM otherwise, leaving a ghost stamp;
//! - otherwise SIEVE's hand walks M from its oldest end towards its newest: a mapped page is
//!   staged and keeps its place (one seen used since it was staged earns credit first, and is
//!   spared [`CREDIT_ON_USE`] passes before it is staged again), the first page still staged
//!   leaves DRAM, and the hand stays where it stopped.
//!
//! Pages touched once (a scan, a one-off lookup, a GC pass) go through S and out again
//! without disturbing M. A page in M in steady use costs a hint fault every
//! `CREDIT_ON_USE + 1` passes of the hand.
//!
//! S's share adapts, as ARC's split between recency and frequency does. Pages leaving either
//! queue keep a ghost stamp; a page that comes back soon after it left S says S was too short
//! to see it used twice (S grows by a page), one that comes back soon after it left M says M
//! was too short (S shrinks by a page, down to 0.1% of the quota, up to half of it). "Soon" is
//! within [`ADAPT_GENERATIONS`] of the sixteen ghost generations: the same number of the
//! queue's own most recent evictions for both, so the two signals weigh alike. A page that
//! left S joins M on its return (S3-FIFO's rule). One that left M starts again in S, with two
//! exceptions for one back soon:
//!
//! - if it had been seen used in M, it returns to M when it leaves S, used there or not: S's
//!   probation, sized for new pages, is shorter than the next use of a page M already knew,
//!   and without this it would pay a second miss (out of S, then back as S's ghost);
//! - while S's share is 1% of the quota or less (returns from M shrank it: the working set is
//!   about as large as DRAM), it joins M at once, as a page back from S does.
//!
//! A fixed share of 10% loses where the program's working set is as large as DRAM (every page
//! S holds on probation is one of it missing) and where hot sets shift (S too short to catch
//! new hot pages on their second use).
//!
//! Ghosts are stamps in a byte per page (the generation of the queue's evictions, modulo 256),
//! recent for about as many evictions as 90% of the quota (S3-FIFO's ghost queue size); no
//! allocation per page. The simulator drives this structure through [`Pages`] (policies
//! `placement` and `placement-exact`); the engine runs it with `--policy placement` (its default
//! is the CLOCK sweep, [`crate::Sweep`], `--policy sweep`).

use std::collections::VecDeque;

/// The queue a page in DRAM belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Queue {
    /// New pages, on probation.
    Small,
    /// Pages used more than once.
    Main,
}

/// Where a page is, as the engine knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Residence {
    /// In DRAM and mapped: used since it was last staged (or never staged).
    Mapped,
    /// In DRAM, unmapped: not used since it was staged.
    Staged,
    /// Not placement's to move now (pinned, or in flight).
    Busy,
    /// No longer in DRAM, and not by placement's choice (the program freed it, or it moved):
    /// placement drops it, without a ghost.
    Gone,
}

/// The engine's side: what a page is, and the two moves placement asks for.
pub trait Pages {
    fn residence(&mut self, i: usize) -> Residence;
    /// Unmaps page `i` into staging (it stays in DRAM); false if it cannot now.
    fn stage(&mut self, i: usize) -> bool;
    /// Takes page `i` out of DRAM (writing it to tier 1 if needed); false if it cannot now.
    fn evict(&mut self, i: usize) -> bool;
}

/// Per-page flags.
const IN_SMALL: u8 = 1;
const IN_MAIN: u8 = 2;
/// Staged by the probe since it joined S.
const PROBED: u8 = 4;
/// Out of DRAM, with a ghost stamp.
const GHOST: u8 = 8;
/// With GHOST: the page left from M (its stamp counts M's evictions, not S's). Shares
/// PROBED's bit, which only a page in DRAM has.
const FROM_MAIN: u8 = 4;
/// With IN_MAIN: seen used since it joined M. Shares GHOST's bit, which only a page out of DRAM
/// has.
const USED_IN_MAIN: u8 = 8;
/// With GHOST and FROM_MAIN: it had been seen used in M. Shares STAGED's bit, which only a page
/// in DRAM has.
const WAS_USED_IN_MAIN: u8 = 32;
/// With IN_SMALL: back soon from M, where it had been used; it returns to M when it leaves S,
/// used there or not. Shares a CREDIT bit, which only a page in M has.
const RETURNING: u8 = 64;
/// Kept by the compaction under way (see [`Placement::compact`]).
const KEPT: u8 = 16;
/// Staged by placement and not seen used since.
const STAGED: u8 = 32;
/// Passes of the hand a page in M may still skip without being staged (2 bits).
const CREDIT_SHIFT: u8 = 6;
const CREDIT: u8 = 3 << CREDIT_SHIFT;
/// Passes a page of M that was seen used skips before the hand stages it again. Each staging
/// of a page in use costs a hint fault; with 1 a hot page pays one every other pass instead of
/// every pass. On the simulator's corpus (`memtide sim --corpus`, before S's share adapted,
/// with the engine's headroom), misses against the best online policy's, geometric mean:
/// 1.045x with 0, 1.033x with 1, 1.039x with 2, 1.042x with 3; estimated time with hint faults
/// at 20 µs: 1.23x, 1.20x, 1.17x, 1.16x.
pub const CREDIT_ON_USE: u8 = 1;

/// Generations a ghost stays recent.
const GHOST_GENERATIONS: u8 = 16;
/// Generations within which a returning ghost moves S's share. On the simulator's corpus at
/// equal DRAM, misses against the best online policy's, geometric mean and worst row: 0.999x
/// and 1.63x with 1, 0.996x and 1.62x with 2, 0.988x and 1.06x with 3, 0.993x and 1.11x
/// with 4.
pub const ADAPT_GENERATIONS: u8 = 3;

/// No page (links are stored +1, so zeroed memory means "none").
const NIL: u32 = 0;

/// The placement policy over pages `0..pages`.
pub struct Placement {
    small_target: u64,
    small: VecDeque<u32>,
    /// Pages that came in and are not staged yet, oldest first.
    arrivals: VecDeque<u32>,
    /// M as a doubly linked list, head = newest; links and ends are page + 1.
    newer: Vec<u32>,
    older: Vec<u32>,
    main_head: u32,
    main_tail: u32,
    main_len: u64,
    small_len: u64,
    hand: u32,
    flags: Vec<u8>,
    stamp: Vec<u8>,
    small_evictions: u64,
    main_evictions: u64,
    generation_len: u64,
    quota: u64,
    stage_limit: u64,
}

/// What one call of [`Placement::evict`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Evicted {
    pub from_small: u64,
    pub from_main: u64,
    /// Pages moved from S to M (used after they were staged).
    pub promoted: u64,
    /// Pages the hand staged in M on its way.
    pub staged: u64,
}

impl Evicted {
    pub fn total(&self) -> u64 {
        self.from_small + self.from_main
    }
}

impl Placement {
    /// Placement for `pages` pages and a quota of `quota` pages. The per-page arrays start
    /// zeroed (untouched memory costs nothing until used).
    pub fn new(pages: usize, quota: u64) -> Placement {
        let mut p = Placement {
            small_target: 1,
            small: VecDeque::new(),
            arrivals: VecDeque::new(),
            newer: vec![NIL; pages],
            older: vec![NIL; pages],
            main_head: NIL,
            main_tail: NIL,
            main_len: 0,
            small_len: 0,
            hand: NIL,
            flags: vec![0; pages],
            stamp: vec![0; pages],
            small_evictions: 0,
            main_evictions: 0,
            generation_len: 1,
            quota: 0,
            stage_limit: u64::MAX,
        };
        p.set_quota(quota);
        p
    }

    /// Caps the pages one call of [`evict`](Self::evict) stages in M (the hand resumes where
    /// it stopped on the next call): each staging is a page move for the engine, and a call
    /// that must first stage all of M would hold DRAM-starved threads for all of them.
    pub fn set_stage_limit(&mut self, pages: u64) {
        self.stage_limit = pages.max(1);
    }

    /// A new quota (a host daemon's share changes at run time): S's share (as a fraction of
    /// the quota, as it has adapted) and the ghosts' reach follow it; pages already placed stay
    /// where they are.
    pub fn set_quota(&mut self, quota: u64) {
        let quota = quota.max(1);
        self.small_target = if self.quota == 0 {
            quota / 10
        } else {
            (self.small_target as u128 * quota as u128 / self.quota as u128) as u64
        };
        self.quota = quota;
        self.small_target = self
            .small_target
            .clamp(Self::small_min(quota), Self::small_max(quota));
        self.generation_len = (quota - quota / 10)
            .div_ceil(GHOST_GENERATIONS as u64)
            .max(1);
    }

    /// The least S's share adapts down to: 0.1% of the quota, at least a page.
    fn small_min(quota: u64) -> u64 {
        (quota / 1000).max(1)
    }

    /// The most S's share adapts up to: half the quota.
    fn small_max(quota: u64) -> u64 {
        quota.div_ceil(2)
    }

    /// How many pages S may hold before its oldest leave (it adapts; see the module
    /// documentation).
    pub fn small_target(&self) -> u64 {
        self.small_target
    }

    /// Pages in S and in M.
    pub fn small_len(&self) -> u64 {
        self.small_len
    }

    pub fn main_len(&self) -> u64 {
        self.main_len
    }

    /// Bytes of state per page (links, flags, stamp).
    pub const BYTES_PER_PAGE: u64 = 10;

    fn generation(&self) -> u8 {
        (self.small_evictions / self.generation_len) as u8
    }

    fn main_generation(&self) -> u8 {
        (self.main_evictions / self.generation_len) as u8
    }

    /// How many generations ago page `i`, a ghost, left its queue.
    fn ghost_age(&self, i: usize) -> u8 {
        let now = if self.flags[i] & FROM_MAIN != 0 {
            self.main_generation()
        } else {
            self.generation()
        };
        now.wrapping_sub(self.stamp[i])
    }

    /// Page `i` came into DRAM (a first touch or a read from tier 1) and is mapped: it joins M
    /// if it left S recently, S otherwise. Returns the queue. A page placement still holds
    /// (the engine reports arrivals after the fact: the page may have been freed and touched
    /// again meanwhile) keeps its place and is probed again.
    pub fn arrived(&mut self, i: usize) -> Queue {
        let f = self.flags[i];
        if f & (IN_SMALL | IN_MAIN) != 0 {
            self.flags[i] &= !PROBED;
            self.arrivals.push_back(i as u32);
            return if f & IN_MAIN != 0 {
                Queue::Main
            } else {
                Queue::Small
            };
        }
        let age = self.ghost_age(i);
        if f & GHOST != 0 && age < ADAPT_GENERATIONS {
            // S (or M) was too short to keep this page until its return.
            self.small_target = if f & FROM_MAIN != 0 {
                self.small_target
                    .saturating_sub(1)
                    .max(Self::small_min(self.quota))
            } else {
                (self.small_target + 1).min(Self::small_max(self.quota))
            };
        }
        let from_small = f & GHOST != 0 && f & FROM_MAIN == 0 && age < GHOST_GENERATIONS;
        let soon_from_main = f & GHOST != 0 && f & FROM_MAIN != 0 && age < ADAPT_GENERATIONS;
        // S at 1% of the quota or less: returns from M shrank it that far, and its probation is
        // shorter than such a page's next use would take.
        let small_is_short = self.small_target <= self.quota / 100;
        let ghost = from_small || soon_from_main && small_is_short;
        let returning = soon_from_main && f & WAS_USED_IN_MAIN != 0;
        if self.small.len() as u64 > 2 * self.small_len + 1024
            || self.arrivals.len() as u64 > 2 * (self.small_len + self.main_len) + 1024
        {
            self.compact();
        }
        self.arrivals.push_back(i as u32);
        if ghost {
            self.flags[i] = IN_MAIN;
            self.push_main(i);
            Queue::Main
        } else {
            self.flags[i] = IN_SMALL | if returning { RETURNING } else { 0 };
            self.small.push_back(i as u32);
            self.small_len += 1;
            Queue::Small
        }
    }

    /// Whether page `i` is in S or M.
    pub fn holds(&self, i: usize) -> bool {
        self.flags[i] & (IN_SMALL | IN_MAIN) != 0
    }

    /// Page `i` left DRAM without placement choosing it (the program freed it, or the engine
    /// dropped it): it leaves its queue and has no ghost.
    pub fn forget(&mut self, i: usize) {
        let f = self.flags[i];
        if f & IN_MAIN != 0 {
            self.unlink_main(i);
        } else if f & IN_SMALL != 0 {
            // Its S entry (and arrival entry) go stale and are skipped.
            self.small_len -= 1;
        }
        self.flags[i] = 0;
    }

    /// Stages pages that came in since the last call (up to `want`), so that a page used again
    /// shows itself. Returns how many it staged.
    pub fn probe(&mut self, pages: &mut impl Pages, want: u64) -> u64 {
        let mut staged = 0;
        while staged < want {
            let Some(i) = self.arrivals.pop_front() else {
                break;
            };
            let i = i as usize;
            let f = self.flags[i];
            if f & (IN_SMALL | IN_MAIN) == 0 || f & PROBED != 0 {
                continue;
            }
            match pages.residence(i) {
                Residence::Mapped => {
                    if pages.stage(i) {
                        staged += 1;
                        self.flags[i] |= STAGED;
                    }
                }
                Residence::Gone => {
                    self.forget(i);
                    continue;
                }
                Residence::Staged | Residence::Busy => {}
            }
            self.flags[i] |= PROBED;
        }
        staged
    }

    /// Takes up to `want` pages out of DRAM, as the module documentation describes.
    pub fn evict(&mut self, pages: &mut impl Pages, want: u64) -> Evicted {
        let mut done = Evicted::default();
        // The hand goes round M at most twice per call: once to stage, once to find.
        let mut steps_left = 2 * self.main_len + 2;
        // S's entries are looked at most once per call (busy ones go to the back).
        let mut small_left = self.small.len() as u64;
        while done.total() < want {
            if (self.small_len > self.small_target || self.main_len == 0) && small_left > 0 {
                if let Some(i) = self.small.pop_front() {
                    small_left -= 1;
                    self.evict_small(pages, i as usize, &mut done);
                    continue;
                }
            }
            if self.main_len == 0 || steps_left == 0 {
                break;
            }
            steps_left -= 1;
            let v = match self.hand {
                NIL => self.main_tail,
                h => h,
            };
            let i = (v - 1) as usize;
            // The hand moves on towards the head, wrapping to the tail.
            self.hand = self.newer[i];
            match pages.residence(i) {
                Residence::Mapped => {
                    if self.judge(pages, i) {
                        done.staged += 1;
                        if done.staged >= self.stage_limit {
                            break;
                        }
                    }
                }
                Residence::Staged => {
                    if pages.evict(i) {
                        self.unlink_main(i);
                        let used = self.flags[i] & USED_IN_MAIN != 0;
                        self.flags[i] = GHOST | FROM_MAIN | if used { WAS_USED_IN_MAIN } else { 0 };
                        self.stamp[i] = self.main_generation();
                        self.main_evictions += 1;
                        done.from_main += 1;
                    }
                }
                Residence::Busy => {}
                Residence::Gone => self.forget(i),
            }
        }
        done
    }

    /// Drops stale and repeated entries from S and the arrivals (pages forgotten, or forgotten
    /// and come back), keeping each page's oldest valid entry.
    fn compact(&mut self) {
        let flags = &mut self.flags;
        let mut keep = |q: &mut VecDeque<u32>, valid: u8| {
            q.retain(|&i| {
                let f = &mut flags[i as usize];
                let ok = *f & valid != 0 && *f & KEPT == 0;
                if ok {
                    *f |= KEPT;
                }
                ok
            });
            for &i in q.iter() {
                flags[i as usize] &= !KEPT;
            }
        };
        keep(&mut self.small, IN_SMALL);
        keep(&mut self.arrivals, IN_SMALL | IN_MAIN);
    }

    fn evict_small(&mut self, pages: &mut impl Pages, i: usize, done: &mut Evicted) {
        let f = self.flags[i];
        if f & IN_SMALL == 0 {
            return; // stale: forgotten since
        }
        match pages.residence(i) {
            Residence::Mapped if f & PROBED != 0 => {
                // Used after it was staged: into M with the credit of a use (a use in S, not
                // one in M).
                self.small_len -= 1;
                self.flags[i] = IN_MAIN;
                self.push_main(i);
                self.pass(pages, i, CREDIT_ON_USE);
                done.promoted += 1;
            }
            r @ (Residence::Mapped | Residence::Staged) if f & RETURNING != 0 => {
                // Not used in S, but used in M before it left: back to M, staged now if the
                // probe has not staged it.
                self.small_len -= 1;
                self.push_main(i);
                if r == Residence::Staged {
                    self.flags[i] = IN_MAIN | STAGED;
                } else {
                    self.flags[i] = IN_MAIN;
                    self.pass(pages, i, 0);
                }
                done.promoted += 1;
            }
            Residence::Mapped | Residence::Staged => {
                if pages.evict(i) {
                    self.small_len -= 1;
                    self.flags[i] = GHOST;
                    self.stamp[i] = self.generation();
                    self.small_evictions += 1;
                    done.from_small += 1;
                } else {
                    self.small.push_back(i as u32);
                }
            }
            Residence::Busy => {
                // Pinned or in flight: it waits at the back.
                self.small.push_back(i as u32);
            }
            Residence::Gone => {
                self.small_len -= 1;
                self.flags[i] = 0;
            }
        }
    }

    /// Page `i` of M is mapped: used since placement staged it (it earns the credit of a use,
    /// and is marked used in M), or never staged since its credit ran out. Returns whether it
    /// staged it (see [`pass`](Self::pass)).
    fn judge(&mut self, pages: &mut impl Pages, i: usize) -> bool {
        let f = self.flags[i];
        if f & STAGED != 0 {
            self.flags[i] = f & !STAGED | USED_IN_MAIN;
            return self.pass(pages, i, CREDIT_ON_USE);
        }
        self.pass(pages, i, (f & CREDIT) >> CREDIT_SHIFT)
    }

    /// The hand passes page `i` of M, mapped, with `credit` passes to skip: it spends one if it
    /// has any; otherwise it stages the page. Returns whether it staged it.
    fn pass(&mut self, pages: &mut impl Pages, i: usize, credit: u8) -> bool {
        let rest = self.flags[i] & !(STAGED | CREDIT);
        if credit > 0 {
            self.flags[i] = rest | (credit - 1) << CREDIT_SHIFT;
            return false;
        }
        self.flags[i] = rest;
        let staged = pages.stage(i);
        if staged {
            self.flags[i] |= STAGED;
        }
        staged
    }

    fn push_main(&mut self, i: usize) {
        let v = i as u32 + 1;
        self.newer[i] = NIL;
        self.older[i] = self.main_head;
        if self.main_head != NIL {
            self.newer[(self.main_head - 1) as usize] = v;
        }
        self.main_head = v;
        if self.main_tail == NIL {
            self.main_tail = v;
        }
        self.main_len += 1;
    }

    fn unlink_main(&mut self, i: usize) {
        let v = i as u32 + 1;
        let (a, b) = (self.newer[i], self.older[i]);
        if self.hand == v {
            self.hand = a;
        }
        if a == NIL {
            self.main_head = b;
        } else {
            self.older[(a - 1) as usize] = b;
        }
        if b == NIL {
            self.main_tail = a;
        } else {
            self.newer[(b - 1) as usize] = a;
        }
        self.newer[i] = NIL;
        self.older[i] = NIL;
        self.main_len -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pages as a toy engine keeps them.
    struct Toy {
        res: Vec<Residence>,
        out: Vec<usize>,
    }

    impl Toy {
        fn new(pages: usize) -> Toy {
            Toy {
                res: vec![Residence::Busy; pages],
                out: Vec::new(),
            }
        }
        /// The program touches page `i`, which is in DRAM.
        fn touch(&mut self, i: usize) {
            self.res[i] = Residence::Mapped;
        }
    }

    impl Pages for Toy {
        fn residence(&mut self, i: usize) -> Residence {
            self.res[i]
        }
        fn stage(&mut self, i: usize) -> bool {
            self.res[i] = Residence::Staged;
            true
        }
        fn evict(&mut self, i: usize) -> bool {
            self.res[i] = Residence::Busy;
            self.out.push(i);
            true
        }
    }

    fn arrive(p: &mut Placement, m: &mut Toy, i: usize) -> Queue {
        m.res[i] = Residence::Mapped;
        let q = p.arrived(i);
        p.probe(m, u64::MAX);
        q
    }

    #[test]
    fn pages_used_once_pass_through_small_and_main_is_kept() {
        // Quota 20: S's share is 2. Pages 0..4 are used again after probing.
        let mut p = Placement::new(40, 20);
        let mut m = Toy::new(40);
        for i in 0..4 {
            arrive(&mut p, &mut m, i);
            m.touch(i);
        }
        // A scan of 20 new pages, never used again, in 10 pages of DRAM.
        for i in 4..24 {
            if p.small_len() + p.main_len() >= 10 {
                assert_eq!(p.evict(&mut m, 1).total(), 1);
            }
            assert_eq!(arrive(&mut p, &mut m, i), Queue::Small);
        }
        // The four used pages went to M on their way out of S; every eviction was a scanned
        // page, oldest first.
        assert_eq!(p.main_len(), 4);
        assert_eq!(m.out, (4..18).collect::<Vec<_>>());
        // A scanned page that comes back soon joins M directly.
        assert_eq!(arrive(&mut p, &mut m, 4), Queue::Main);
    }

    #[test]
    fn sieve_hand_spares_used_pages_and_stays_where_it_stopped() {
        // Quota 10 (S's share 1); four pages in M, oldest first 0, 1, 2, 3.
        let mut p = Placement::new(8, 10);
        let mut m = Toy::new(8);
        for i in 0..4 {
            p.flags[i] = IN_MAIN;
            p.push_main(i);
            m.res[i] = Residence::Mapped;
        }
        // All four are mapped (used): the hand stages them all, wraps, and takes page 0.
        let e = p.evict(&mut m, 1);
        assert_eq!((e.from_main, e.staged), (1, 4));
        assert_eq!(m.out, [0]);
        // Page 2 is used again: the hand, now at page 1, takes it at once (still staged).
        m.touch(2);
        p.evict(&mut m, 1);
        assert_eq!(m.out, [0, 1]);
        // Next it passes page 2 (used since it was staged: it earns credit and is spared,
        // mapped, for this pass) and takes page 3.
        p.evict(&mut m, 1);
        assert_eq!(m.out, [0, 1, 3]);
        assert_eq!(m.res[2], Residence::Mapped);
        assert_eq!(p.main_len(), 1);
        // Page 2 alone: the next pass stages it, and the one after finds it still staged and
        // takes it.
        assert_eq!(CREDIT_ON_USE, 1);
        let e = p.evict(&mut m, 1);
        assert_eq!((e.from_main, e.staged), (1, 1));
        assert_eq!(m.out, [0, 1, 3, 2]);
    }

    #[test]
    fn what_the_engine_holds_or_reports_late_is_handled() {
        // Quota 20: S's share 2. Pages 0..4 come in and are staged.
        let mut p = Placement::new(8, 20);
        let mut m = Toy::new(8);
        for i in 0..4 {
            arrive(&mut p, &mut m, i);
        }
        // All in flight (busy): each S entry is looked at once, and the call gives up.
        for i in 0..4 {
            m.res[i] = Residence::Busy;
        }
        assert_eq!(p.evict(&mut m, 1).total(), 0);
        assert_eq!(p.small_len(), 4);
        // Page 0 was freed (gone): it is dropped without a ghost, and page 1 leaves.
        m.res[0] = Residence::Gone;
        for i in 1..4 {
            m.res[i] = Residence::Staged;
        }
        assert_eq!(p.evict(&mut m, 1).from_small, 1);
        assert_eq!(m.out, [1]);
        assert!(!p.holds(0));
        assert_eq!(arrive(&mut p, &mut m, 0), Queue::Small);
        // Page 2 was freed and touched again before placement heard: it keeps its place and
        // is staged again.
        m.res[2] = Residence::Mapped;
        assert_eq!(p.arrived(2), Queue::Small);
        p.probe(&mut m, u64::MAX);
        assert_eq!(m.res[2], Residence::Staged);
    }

    #[test]
    fn a_stage_limit_makes_the_hand_resume_on_the_next_call() {
        // Four mapped pages in M; at most two staged per call.
        let mut p = Placement::new(8, 10);
        let mut m = Toy::new(8);
        for i in 0..4 {
            p.flags[i] = IN_MAIN;
            p.push_main(i);
            m.res[i] = Residence::Mapped;
        }
        p.set_stage_limit(2);
        let e = p.evict(&mut m, 1);
        assert_eq!((e.from_main, e.staged), (0, 2));
        let e = p.evict(&mut m, 1);
        assert_eq!((e.from_main, e.staged), (0, 2));
        // The hand wrapped to page 0, staged on the first call and still unused.
        let e = p.evict(&mut m, 1);
        assert_eq!((e.from_main, e.staged), (1, 0));
        assert_eq!(m.out, [0]);
    }

    #[test]
    fn ghosts_are_recent_for_about_as_many_evictions_as_main_holds() {
        // Quota 160: M's share 144, 9 S evictions per generation, 16 generations.
        let mut p = Placement::new(4, 160);
        let mut m = Toy::new(4);
        arrive(&mut p, &mut m, 0);
        p.small_target = 0;
        assert_eq!(p.evict(&mut m, 1).from_small, 1);
        p.small_evictions += 142;
        assert_eq!(arrive(&mut p, &mut m, 0), Queue::Main);
        // Out of M, a page keeps no ghost.
        p.forget(0);
        assert_eq!(arrive(&mut p, &mut m, 0), Queue::Small);
        p.evict(&mut m, 1);
        p.small_evictions += 144;
        assert_eq!(arrive(&mut p, &mut m, 0), Queue::Small);
    }

    /// Takes page `i`, alone in S, out of DRAM through S (whatever S's share), leaving S's
    /// share as it was.
    fn out_of_small(p: &mut Placement, m: &mut Toy, i: usize) {
        let target = p.small_target;
        p.small_target = 0;
        assert_eq!(p.evict(m, 1).from_small, 1);
        assert_eq!(m.out.last(), Some(&i));
        p.small_target = target;
    }

    /// Puts page `i` in M, staged and unused, and takes it out of DRAM through M.
    fn out_of_main(p: &mut Placement, m: &mut Toy, i: usize) {
        p.flags[i] = IN_MAIN | STAGED;
        p.push_main(i);
        m.res[i] = Residence::Staged;
        assert_eq!(p.evict(m, 1).from_main, 1);
        assert_eq!(m.out.last(), Some(&i));
    }

    #[test]
    fn returning_ghosts_move_small_queues_share() {
        // Quota 1000: S's share starts at 100; 57 evictions per generation.
        let mut p = Placement::new(8, 1000);
        let mut m = Toy::new(8);
        assert_eq!((p.small_target(), p.generation_len), (100, 57));
        // Page 0 leaves S unused and comes back within ADAPT_GENERATIONS: S grows by a page,
        // and the page joins M.
        arrive(&mut p, &mut m, 0);
        out_of_small(&mut p, &mut m, 0);
        p.small_evictions += 57 * (ADAPT_GENERATIONS as u64 - 1);
        assert_eq!(arrive(&mut p, &mut m, 0), Queue::Main);
        assert_eq!(p.small_target(), 101);
        // It leaves M (staged, unused) and comes back as soon: S shrinks by a page, and the
        // page starts again in S.
        assert_eq!(p.evict(&mut m, 1).from_main, 1);
        assert_eq!(arrive(&mut p, &mut m, 0), Queue::Small);
        assert_eq!(p.small_target(), 100);
        // A ghost older than ADAPT_GENERATIONS still joins M from S, but moves nothing.
        out_of_small(&mut p, &mut m, 0);
        p.small_evictions += 57 * ADAPT_GENERATIONS as u64;
        assert_eq!(arrive(&mut p, &mut m, 0), Queue::Main);
        assert_eq!(p.small_target(), 100);
        // From M, an old ghost starts again in S and moves nothing either.
        assert_eq!(p.evict(&mut m, 1).from_main, 1);
        p.main_evictions += 57 * ADAPT_GENERATIONS as u64;
        assert_eq!(arrive(&mut p, &mut m, 0), Queue::Small);
        assert_eq!(p.small_target(), 100);
    }

    #[test]
    fn small_queues_share_stays_between_its_bounds_and_follows_the_quota() {
        let mut p = Placement::new(8, 1000);
        let mut m = Toy::new(8);
        // A page that keeps coming back soon after leaving M shrinks S a page each time, to
        // 0.1% of the quota and no further.
        // Once S's share is 1% of the quota (10 pages) or less, such a page joins M at once.
        for k in 1..=200 {
            out_of_main(&mut p, &mut m, 0);
            let target = 100u64.saturating_sub(k).max(1);
            let queue = if target <= 10 {
                Queue::Main
            } else {
                Queue::Small
            };
            assert_eq!(arrive(&mut p, &mut m, 0), queue);
            assert_eq!(p.small_target(), target);
            p.forget(0);
        }
        // One that keeps coming back soon after leaving S grows it, to half the quota.
        p.small_target = 498;
        for k in 1..=4 {
            arrive(&mut p, &mut m, 0);
            out_of_small(&mut p, &mut m, 0);
            assert_eq!(arrive(&mut p, &mut m, 0), Queue::Main);
            assert_eq!(p.small_target(), (498 + k).min(500));
            p.forget(0);
        }
        // A new quota keeps the adapted fraction: 50% of 1000 pages, then of 400.
        p.set_quota(400);
        assert_eq!(p.small_target(), 200);
        p.set_quota(100_000);
        assert_eq!(p.small_target(), 50_000);
        // ...within the bounds of the new quota.
        p.small_target = 1;
        p.set_quota(10_000);
        assert_eq!(p.small_target(), 10);
    }

    #[test]
    fn a_page_used_in_main_comes_back_from_small_to_main() {
        // Quota 1000: S's share 100, well above 1% of the quota.
        let mut p = Placement::new(8, 1000);
        let mut m = Toy::new(8);
        // Page 0 in M is used after the hand staged it, then left unused for a pass: it leaves.
        // (One staging per call, so that each call is one visit of the hand.)
        p.flags[0] = IN_MAIN;
        p.push_main(0);
        m.res[0] = Residence::Mapped;
        p.set_stage_limit(1);
        assert_eq!(p.evict(&mut m, 1).staged, 1);
        m.touch(0);
        // Seen used: it spends its pass of credit, and is staged on the next visit.
        let e = p.evict(&mut m, 1);
        assert_eq!((e.staged, e.total()), (1, 0));
        assert_eq!(p.evict(&mut m, 1).from_main, 1);
        assert_eq!(m.out, [0]);
        // Back soon, it starts in S; not used there, it goes back to M, not out of DRAM.
        assert_eq!(arrive(&mut p, &mut m, 0), Queue::Small);
        assert_eq!(m.res[0], Residence::Staged);
        // (Page 2, staged and unused in M, is there for the hand to take instead.)
        p.flags[2] = IN_MAIN | STAGED;
        p.push_main(2);
        m.res[2] = Residence::Staged;
        p.small_target = 0;
        let e = p.evict(&mut m, 1);
        assert_eq!((e.promoted, e.from_small, e.from_main), (1, 0, 1));
        assert_eq!(m.out, [0, 2]);
        assert!(p.holds(0));
        assert_eq!((p.small_len(), p.main_len()), (0, 1));
        // A page M never saw used (page 1) goes out of DRAM from S as before.
        p.forget(0);
        p.small_target = 100;
        out_of_main(&mut p, &mut m, 1);
        assert_eq!(arrive(&mut p, &mut m, 1), Queue::Small);
        out_of_small(&mut p, &mut m, 1);
        assert!(!p.holds(1));
    }

    #[test]
    fn a_forgotten_page_leaves_its_queue() {
        let mut p = Placement::new(8, 10);
        let mut m = Toy::new(8);
        for i in 0..3 {
            arrive(&mut p, &mut m, i);
        }
        p.forget(1);
        m.res[1] = Residence::Busy;
        assert_eq!(p.small_len(), 2);
        p.small_target = 0;
        assert_eq!(p.evict(&mut m, 5).total(), 2);
        assert_eq!(m.out, [0, 2]);
    }
}
