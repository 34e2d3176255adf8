//! How much one fault brings in: read-ahead on a sequential run of tier-1 reads, the next
//! page along with a fault when objects span page pairs, and the zero-fill of first touches.
//! Policy (sizes and when), not mechanism. Entry points: [`readahead_window`], [`Pairs`],
//! [`zero_fill`].

/// Most pages read ahead on a sequential run of tier faults.
pub const READAHEAD: usize = 16;

/// Pages zero-filled together on a first touch that looks sequential (64 KiB).
pub const ZERO_CHUNK: usize = 16;

/// Pages a tier read brings in on the `run`-th fault of a sequential run: 1, 1, 2, 4, 8,
/// then [`READAHEAD`]. Two faults in a row are an object spanning two pages, not a stream.
pub fn readahead_window(run: usize) -> usize {
    if run < 3 {
        1
    } else {
        (1usize << (run - 2).min(8)).min(READAHEAD)
    }
}

/// One tier fault in this many that starts a run reads a single page even while pairs are on,
/// so that the share of pairs keeps being measured.
pub const PAIR_SAMPLE: u64 = 8;

/// Measured faults per decision on pairs.
pub const PAIR_DECISION: u32 = 256;

/// Faults after a measured one within which a fault on its next page makes it a pair (faults
/// from other threads come in between).
pub const PAIR_WITHIN: u8 = 4;

/// Whether a tier fault that starts a run reads the next page too.
///
/// An object that spans two pages (a value of a few KiB in a cache, say) faults twice when
/// both pages are out: on its first page, then on the next. Read-ahead does not start on that
/// (two faults in a row are not a stream), so pairs are measured apart: of the faults that
/// start a run and read one page, the share followed within [`PAIR_WITHIN`] faults by one on
/// the next page. While that share is at least a quarter, such a fault reads the next page as
/// well: one read instead of two for a pair, where a page read for nothing costs a page of
/// DRAM until placement lets it go, and no fault. (memcached with 4000-byte values: about a
/// third of its faults that start a run are pairs; redis, whose allocator keeps such values
/// within a page, and random page access: almost none.)
///
/// The engine holds this under a lock it only tries (faults may be served in a signal
/// handler); a fault that finds it taken reads one page and measures nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pairs {
    /// Faults that started a run so far.
    started: u64,
    /// The measured fault waiting for its next page, and how many faults it still waits.
    pending: Option<(usize, u8)>,
    /// In this decision's window: faults measured, and how many were pairs.
    measured: u32,
    followed: u32,
    on: bool,
}

impl Pairs {
    /// A tier fault at page `p`, starting a run of sequential faults or not: the pages it
    /// reads when it starts one (1 or 2; read-ahead sizes the others).
    pub fn fault(&mut self, p: usize, starts_run: bool) -> usize {
        if let Some((m, left)) = self.pending {
            if p == m.wrapping_add(1) {
                self.pending = None;
                self.measured(true);
            } else if left <= 1 {
                self.pending = None;
                self.measured(false);
            } else {
                self.pending = Some((m, left - 1));
            }
        }
        if !starts_run {
            return 1;
        }
        let n = self.started;
        self.started += 1;
        if self.on && !n.is_multiple_of(PAIR_SAMPLE) {
            return 2;
        }
        if self.pending.is_none() {
            self.pending = Some((p, PAIR_WITHIN));
        }
        1
    }

    /// Whether pairs are on: faults that start a run read the next page too.
    pub fn on(&self) -> bool {
        self.on
    }

    fn measured(&mut self, followed: bool) {
        self.measured += 1;
        self.followed += followed as u32;
        if self.measured >= PAIR_DECISION {
            self.on = Self::decide(self.measured, self.followed);
            self.measured = 0;
            self.followed = 0;
        }
    }

    /// Whether `followed` of `measured` faults is a share of pairs worth reading ahead for.
    pub fn decide(measured: u32, followed: u32) -> bool {
        measured > 0 && 4 * followed as u64 >= measured as u64
    }
}

/// Pages a first touch fills: a chunk when the touches look sequential (the page before is
/// mapped, or the page starts an allocation; or the page after is mapped), one otherwise, so
/// that random first touches do not spend DRAM on neighbours nobody asked for.
pub fn zero_fill(sequential: bool) -> usize {
    if sequential {
        ZERO_CHUNK
    } else {
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readahead_grows_with_the_sequential_run() {
        assert_eq!(readahead_window(1), 1);
        assert_eq!(readahead_window(2), 1);
        let w: Vec<usize> = (3..=8).map(readahead_window).collect();
        assert_eq!(w, [2, 4, 8, 16, 16, 16]);
        assert_eq!(readahead_window(usize::MAX), READAHEAD);
    }

    /// Whether object `i` is one of about one in `n` (scattered: no period for the sampling
    /// to fall in step with).
    fn one_in(i: usize, n: u64) -> bool {
        // splitmix64's finaliser.
        let mut z = (i as u64).wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)).is_multiple_of(n)
    }

    /// Faults at objects `first..first + n` (each `stride` pages apart, so none starts where
    /// the last read ended) that start a run; an object `pair(i)` faults again on its next
    /// page unless the first fault read it. Returns the faults taken.
    fn drive(p: &mut Pairs, first: usize, n: usize, pair: impl Fn(usize) -> bool) -> u64 {
        let mut faults = 0;
        for i in first..first + n {
            let page = i * 16;
            faults += 1;
            if p.fault(page, true) == 1 && pair(i) {
                faults += 1;
                p.fault(page + 1, false);
            }
        }
        faults
    }

    #[test]
    fn pairs_turn_on_when_a_quarter_of_faults_are_followed_by_the_next_page() {
        let decision = (PAIR_DECISION as u64 * PAIR_SAMPLE) as usize;
        // No pairs: every fault reads one page.
        let mut p = Pairs::default();
        assert_eq!(drive(&mut p, 0, 10_000, |_| false), 10_000);
        assert!(!p.on());
        // Every object a pair: on after the first decision; then one fault in PAIR_SAMPLE
        // still reads a single page (and faults again on the next), to keep measuring.
        let mut p = Pairs::default();
        drive(&mut p, 0, PAIR_DECISION as usize, |_| true);
        assert!(p.on());
        let faults = drive(&mut p, 1 << 20, 8_000, |_| true);
        assert_eq!(faults, 8_000 + 8_000 / PAIR_SAMPLE);
        // One in three: still on. One in five: below the bar, off by the first decision
        // made on it alone.
        drive(&mut p, 2 << 20, 2 * decision, |i| one_in(i, 3));
        assert!(p.on());
        drive(&mut p, 3 << 20, 2 * decision, |i| one_in(i, 5));
        assert!(!p.on());
        assert!(Pairs::decide(4, 1) && !Pairs::decide(5, 1) && !Pairs::decide(0, 0));
    }

    #[test]
    fn a_pair_counts_when_other_faults_come_between() {
        // Each object's second fault comes after three faults elsewhere (other threads'):
        // still a pair. After PAIR_WITHIN faults, no longer.
        for (between, on) in [
            (PAIR_WITHIN as usize - 1, true),
            (PAIR_WITHIN as usize, false),
        ] {
            let mut p = Pairs::default();
            for i in 0..PAIR_DECISION as usize {
                let page = i * 1000;
                p.fault(page, true);
                for j in 0..between {
                    p.fault(page + 100 + 2 * j, false);
                }
                p.fault(page + 1, false);
            }
            assert_eq!(p.on(), on, "{between} faults between");
        }
    }

    #[test]
    fn random_first_touches_fill_one_page() {
        assert_eq!(zero_fill(false), 1);
        assert_eq!(zero_fill(true), ZERO_CHUNK);
    }
}
