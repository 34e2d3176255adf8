//! The CLOCK sweep that picks pages to deactivate, and the pressure-relief loop that drives
//! deactivation and write-back between the watermarks. Both reach the pages through a small
//! trait ([`SweepPages`], [`Relieve`]) that the engine implements over its page table and the
//! simulator over its page states, so that the simulator replays exactly the engine's policy.
//! Entry points: [`Sweep::deactivate`], [`Watermarks::relieve`].

use crate::{Activeness, Watermarks};

/// The most times in a row a page is counted as found in use when tested (unmapped into the
/// inactive list, by the sweep or the engine's active-memory sample, then touched there; a
/// page put back untouched starts again at 0). A page found in use `k` times in a row is
/// tested again only every `2^k`-th pass of the hand, and spared on the others. Without this,
/// a page the hand has just tested and found used is unmapped again at the next pass, and a
/// hot page costs a hint fault per pass: a guest's hot memory, touched through mappings the
/// engine cannot see, faults at every test. With it, a page hot for good is tested every
/// `2^MAX_PROVEN` passes; one that cools keeps its DRAM for up to that many passes, and loses
/// its standing when it leaves DRAM.
pub const MAX_PROVEN: u8 = 3;

/// The bar the CLOCK sweep applies: decides, page by page, whether a resident active page
/// should be unmapped into the inactive list.
///
/// The sweep demands a minimum number of idle epochs. When a full pass over resident memory
/// finds too few such pages, the demand drops by one epoch (pressure wins over history); when a
/// pass finds plenty, it rises again, up to [`IdleBar::MAX_IDLE`]. A page that was touched in the
/// current epoch is never taken while any other page qualifies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdleBar {
    required_idle: u32,
    found_this_pass: u64,
    wanted_this_pass: u64,
}

impl Default for IdleBar {
    fn default() -> Self {
        IdleBar {
            required_idle: Self::MAX_IDLE,
            found_this_pass: 0,
            wanted_this_pass: 0,
        }
    }
}

impl IdleBar {
    /// The demand a sweep starts with and never exceeds: two idle epochs.
    pub const MAX_IDLE: u32 = 2;

    /// Current demand in idle epochs.
    pub fn required_idle(&self) -> u32 {
        self.required_idle
    }

    /// The engine is about to look for `pages` pages to deactivate. The demand of a whole pass
    /// (all such calls until [`end_pass`](Self::end_pass)) is what the pass's findings are
    /// judged against; judging them against one call's demand would tighten the bar after
    /// every small call and make the next call scan everything again.
    pub fn want(&mut self, pages: u64) {
        self.wanted_this_pass = self.wanted_this_pass.saturating_add(pages);
    }

    /// Withdraws demand a search left unmet by stopping early (not for want of pages): the
    /// next search asks again.
    pub fn unwant(&mut self, pages: u64) {
        self.wanted_this_pass = self.wanted_this_pass.saturating_sub(pages);
    }

    /// Whether a page with this history should be deactivated now.
    pub fn take(&mut self, history: Activeness) -> bool {
        let take = history.idle_epochs() >= self.required_idle;
        if take {
            self.found_this_pass += 1;
        }
        take
    }

    /// Called when the hand has passed over all resident memory once. `still_wanted` is what
    /// the search under way has yet to find: it is demand on the next pass.
    pub fn end_pass(&mut self, still_wanted: u64) {
        let wanted = self.wanted_this_pass;
        if self.found_this_pass < wanted {
            self.required_idle = self.required_idle.saturating_sub(1);
        } else if wanted > 0 && self.found_this_pass >= wanted.saturating_mul(2) {
            self.required_idle = (self.required_idle + 1).min(Self::MAX_IDLE);
        }
        self.found_this_pass = 0;
        self.wanted_this_pass = still_wanted;
    }
}

/// What the sweep sees of the pages it passes over.
pub trait SweepPages {
    /// The sweep covers pages `0..extent()`.
    fn extent(&self) -> usize;
    /// Page `i`'s history, if it may be deactivated now (in DRAM, mapped, not pinned);
    /// `None` otherwise.
    fn candidate(&mut self, i: usize) -> Option<Activeness>;
    /// Takes page `i`, which the sweep chose, into the inactive list; false if it could not
    /// (it changed meanwhile).
    fn take(&mut self, i: usize) -> bool;
    /// How many times in a row page `i` was found in use when tested (at most
    /// [`MAX_PROVEN`]).
    fn proven(&self, _i: usize) -> u8 {
        0
    }
}

/// The CLOCK hand and the bar it applies ([`IdleBar`]).
#[derive(Clone, Debug, Default)]
pub struct Sweep {
    sweep: IdleBar,
    hand: usize,
    /// Passes the hand has completed.
    passes: usize,
}

impl Sweep {
    /// Moves the hand over the pages until `want` of them were taken, or the hand went round
    /// `MAX_IDLE + 1` times (each pass that comes up short lowers the bar), `2^MAX_PROVEN`
    /// more once it has spared a page (a page proven in use is spared on all but one of
    /// `2^proven` passes). Returns how many pages were taken.
    pub fn deactivate(&mut self, pages: &mut impl SweepPages, want: usize) -> usize {
        self.deactivate_within(pages, want, usize::MAX)
    }

    /// [`deactivate`](Self::deactivate), looking at no more than `max_scan` pages: for a
    /// caller that must not wait long (a fault), which leaves a longer search to the next.
    pub fn deactivate_within(
        &mut self,
        pages: &mut impl SweepPages,
        want: usize,
        max_scan: usize,
    ) -> usize {
        let n = pages.extent();
        if want == 0 || n == 0 {
            return 0;
        }
        self.sweep.want(want as u64);
        let mut taken = 0;
        let mut scanned = 0;
        // Passes that come up short lower the bar; passes that spare proven pages may take
        // up to 2^MAX_PROVEN more to reach pages due a test.
        let mut limit = n * (IdleBar::MAX_IDLE as usize + 1);
        let mut spared = false;
        while taken < want && scanned < limit.min(max_scan) {
            if self.hand >= n {
                self.hand = 0;
                self.passes = self.passes.wrapping_add(1);
                self.sweep.end_pass((want - taken) as u64);
            }
            let i = self.hand;
            self.hand += 1;
            scanned += 1;
            if let Some(h) = pages.candidate(i) {
                // A spared page counts as found: the bar measures idleness, not standing.
                if self.sweep.take(h) {
                    if self.spares(pages.proven(i), i) {
                        if !spared {
                            spared = true;
                            limit += n << MAX_PROVEN;
                        }
                    } else if pages.take(i) {
                        taken += 1;
                    }
                }
            }
        }
        if taken < want && scanned >= max_scan && scanned < limit {
            // Stopped by the budget, not by a lack of idle pages: what is still wanted is
            // asked again by the next search, and must not count twice against the bar.
            self.sweep.unwant((want - taken) as u64);
        }
        taken
    }

    /// Whether this pass spares page `i`, found in use `proven` times in a row: it is tested
    /// on one pass in `2^proven`, staggered by its index so that a pass tests an even share.
    fn spares(&self, proven: u8, i: usize) -> bool {
        let every = 1usize << proven.min(MAX_PROVEN);
        !self.passes.wrapping_add(i).is_multiple_of(every)
    }

    /// The bar the sweep applies now, in idle epochs.
    pub fn required_idle(&self) -> u32 {
        self.sweep.required_idle()
    }
}

/// What pressure relief drives: resident and inactive pages, deactivation, write-back.
pub trait Relieve {
    /// Pages holding DRAM.
    fn resident(&self) -> u64;
    /// Pages in the inactive list (unmapped, still in DRAM).
    fn inactive(&self) -> u64;
    /// Moves up to `want` pages the sweep picks into the inactive list; returns how many.
    fn deactivate(&mut self, want: u64) -> u64;
    /// Writes up to `batch` of the oldest inactive pages to tier 1 (or drops them); returns
    /// how many left DRAM.
    fn write_back(&mut self, batch: u64) -> u64;
    /// Whether relief must stop now (tier 1 cannot be written, or eviction is paused).
    fn stopped(&self) -> bool {
        false
    }
    /// A round of relief made progress: threads waiting for DRAM may look again.
    fn made_room(&mut self) {}
}

/// How a round of [`Watermarks::relieve`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Relief {
    /// No pressure: at most the inactive list was topped up.
    Calm,
    /// Resident memory is back under the low watermark.
    Relieved,
    /// [`Relieve::stopped`] said to stop.
    Stopped,
    /// Nothing could be deactivated or written back (all pinned, in flight, or tiny).
    Stuck,
}

impl Watermarks {
    /// One round of pressure relief: over the high watermark, deactivates (keeping the
    /// inactive list at its target) and writes back batches until resident memory is under
    /// the low watermark; near the quota but under the high watermark, keeps the inactive
    /// list filled, so that hot pages show themselves by faulting back before any is written.
    pub fn relieve(&self, m: &mut impl Relieve) -> Relief {
        let resident = m.resident();
        if !self.over_high(resident) {
            if self.near_quota(resident) {
                let inactive = m.inactive();
                if inactive < self.inactive_target {
                    m.deactivate(self.inactive_target - inactive);
                }
            }
            return Relief::Calm;
        }
        while !self.under_low(m.resident()) {
            let inactive = m.inactive();
            let mut progress = 0;
            if inactive < self.inactive_target {
                progress += m.deactivate(self.inactive_target - inactive);
            }
            progress += m.write_back(self.batch);
            if m.stopped() {
                return Relief::Stopped;
            }
            if progress == 0 {
                return Relief::Stuck;
            }
            m.made_room();
        }
        Relief::Relieved
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sweep_relaxes_when_starved_and_tightens_when_rich() {
        let mut s = IdleBar::default();
        assert_eq!(s.required_idle(), 2);
        s.want(10);
        assert!(!s.take(Activeness(0x40)));
        // The search still needs its 10 pages on the next pass.
        s.end_pass(10);
        assert_eq!(s.required_idle(), 1);
        s.end_pass(10);
        assert_eq!(s.required_idle(), 0);
        assert!(s.take(Activeness::TOUCHED));
        for _ in 0..20 {
            s.take(Activeness(0));
        }
        s.end_pass(0);
        assert_eq!(s.required_idle(), 1);
        // A pass nobody wanted anything from changes nothing.
        s.end_pass(0);
        assert_eq!(s.required_idle(), 1);
    }

    #[test]
    fn sweep_judges_a_pass_by_the_demand_of_the_whole_pass() {
        // Many small calls in one pass: 30 found for 40 wanted is short, whatever each call
        // asked for.
        let mut s = IdleBar::default();
        for _ in 0..40 {
            s.want(1);
        }
        for _ in 0..30 {
            assert!(s.take(Activeness(0)));
        }
        s.end_pass(0);
        assert_eq!(s.required_idle(), 1);
    }

    #[test]
    fn a_bounded_search_stops_at_its_budget_and_the_next_goes_on_from_there() {
        // Every page idle enough only from index 100 on: a search of 40 pages finds none and
        // leaves the hand at 40; the next goes on from there.
        let mut hist = vec![Activeness::TOUCHED; 100];
        hist.extend(vec![Activeness(0); 100]);
        let mut pages = Pages {
            hist,
            taken: Vec::new(),
        };
        let mut s = Sweep::default();
        assert_eq!(s.deactivate_within(&mut pages, 4, 40), 0);
        assert_eq!(s.hand, 40);
        assert_eq!(s.deactivate_within(&mut pages, 4, 40), 0);
        assert_eq!(s.deactivate_within(&mut pages, 4, 40), 4);
        assert_eq!(pages.taken, vec![100, 101, 102, 103]);
        // Unbounded, the sweep goes round as far as it takes.
        assert_eq!(s.deactivate(&mut pages, 8), 8);
        assert_eq!(pages.taken.len(), 12);
        // The searches cut short by their budget asked for 4 pages each, once: the pass's
        // demand is what was found (12), so the bar stays where it was at the wrap.
        assert_eq!(s.sweep.wanted_this_pass, 12);
    }

    /// Pages with given histories, all candidates; taking one records it.
    struct Pages {
        hist: Vec<Activeness>,
        taken: Vec<usize>,
    }

    impl SweepPages for Pages {
        fn extent(&self) -> usize {
            self.hist.len()
        }
        fn candidate(&mut self, i: usize) -> Option<Activeness> {
            (!self.taken.contains(&i)).then_some(self.hist[i])
        }
        fn take(&mut self, i: usize) -> bool {
            self.taken.push(i);
            true
        }
    }

    #[test]
    fn the_clock_takes_the_idlest_pages_and_lowers_the_bar_when_short() {
        // Pages 1 and 3 were idle for two epochs or more; the rest were touched lately.
        let hist = [0x80, 0x20, 0xC0, 0x00, 0x40, 0x80];
        let mut pages = Pages {
            hist: hist.iter().map(|&h| Activeness(h)).collect(),
            taken: Vec::new(),
        };
        let mut c = Sweep::default();
        assert_eq!(c.deactivate(&mut pages, 2), 2);
        assert_eq!(pages.taken, [1, 3]);
        // Two more: none is idle for two epochs, so the bar drops to one (page 4), then to
        // none (the next in hand order).
        assert_eq!(c.deactivate(&mut pages, 2), 2);
        assert_eq!(pages.taken[2], 4);
        assert_eq!(c.required_idle(), 0);
    }

    /// Idle pages with a standing each; a taken page is put back at once (it was touched
    /// while inactive), so every pass finds all of them again.
    struct Proven {
        proven: Vec<u8>,
        taken: Vec<usize>,
    }

    impl SweepPages for Proven {
        fn extent(&self) -> usize {
            self.proven.len()
        }
        fn candidate(&mut self, _i: usize) -> Option<Activeness> {
            Some(Activeness(0))
        }
        fn take(&mut self, i: usize) -> bool {
            self.taken.push(i);
            true
        }
        fn proven(&self, i: usize) -> u8 {
            self.proven[i]
        }
    }

    #[test]
    fn a_page_proven_in_use_k_times_is_tested_once_in_2_to_the_k_passes() {
        let n = 64;
        let proven: Vec<u8> = (0..n).map(|i| (i % 5) as u8).collect();
        let mut pages = Proven {
            proven: proven.clone(),
            taken: Vec::new(),
        };
        let mut c = Sweep::default();
        // More than the pages can give: the hand goes round as often as one call allows.
        let got = c.deactivate(&mut pages, usize::MAX);
        let passes = IdleBar::MAX_IDLE as usize + 1 + (1 << MAX_PROVEN);
        let mut tested = vec![0usize; n];
        for &i in &pages.taken {
            tested[i] += 1;
        }
        assert_eq!(got, pages.taken.len());
        for i in 0..n {
            let every = 1usize << proven[i].min(MAX_PROVEN);
            let expected = (0..passes)
                .filter(|p| (p + i).is_multiple_of(every))
                .count();
            assert_eq!(tested[i], expected, "page {i}, proven {} times", proven[i]);
            assert!(tested[i] <= passes.div_ceil(every));
            if proven[i] == 0 {
                assert_eq!(
                    tested[i], passes,
                    "an unproven page is tested at every pass"
                );
            }
        }
    }

    /// A toy memory: `resident` pages, of which the inactive ones are written back first.
    struct Toy {
        resident: u64,
        inactive: u64,
        evictable: u64,
        rounds: u32,
    }

    impl Relieve for Toy {
        fn resident(&self) -> u64 {
            self.resident
        }
        fn inactive(&self) -> u64 {
            self.inactive
        }
        fn deactivate(&mut self, want: u64) -> u64 {
            let n = want.min(self.evictable);
            self.evictable -= n;
            self.inactive += n;
            n
        }
        fn write_back(&mut self, batch: u64) -> u64 {
            let n = batch.min(self.inactive);
            self.inactive -= n;
            self.resident -= n;
            n
        }
        fn made_room(&mut self) {
            self.rounds += 1;
        }
    }

    #[test]
    fn relief_brings_resident_memory_under_the_low_watermark() {
        let wm = Watermarks::for_quota(1024);
        let mut m = Toy {
            resident: 1024,
            inactive: 0,
            evictable: 1024,
            rounds: 0,
        };
        assert_eq!(wm.relieve(&mut m), Relief::Relieved);
        assert!(wm.under_low(m.resident));
        assert!(m.rounds > 0);
        // Under the high mark but near the quota: the inactive list is topped up only.
        let before = m.resident;
        assert_eq!(wm.relieve(&mut m), Relief::Calm);
        assert_eq!(m.resident, before);
        assert!(m.inactive >= wm.inactive_target.min(m.evictable + m.inactive));
        // Nothing evictable: stuck.
        let mut stuck = Toy {
            resident: 1024,
            inactive: 0,
            evictable: 0,
            rounds: 0,
        };
        assert_eq!(wm.relieve(&mut stuck), Relief::Stuck);
    }
}
