//! How large the compressed pool should be, when it sizes itself (`--compressed-sizing
//! adaptive`): its bounds as shares of the DRAM quota, and the judgement made once a period from
//! what the run showed. The engine feeds [`Sizer`] its own counts and measured latencies; the
//! simulator feeds it the counts of a replay priced by its latency model, so both move the pool
//! by the same rules (the simulator, which does not keep its policies' inactive lists apart,
//! passes all of a policy's DRAM as the pages in use). Entry point: [`Sizer`].
//!
//! A step more pool takes a step of DRAM from the pages in use. What it would have saved is
//! read from *ghost* hits (file faults on pages the pool wrote back within the last step's worth
//! of write-backs: a larger pool would still hold them), each worth a file fault less a pool
//! fault; what it would cost from *young* hits (pool faults on pages stored within the last
//! step's worth of stores: with a step less DRAM they would have been faults anyway, but a
//! step more DRAM would have kept them mapped) and from the hint faults a smaller active list
//! adds. A step up after which more of the deactivated pages come back squeezed the hot set:
//! it is undone, and the next step up waits, longer each time.

/// How often the pool's size is judged.
pub const SIZING_PERIOD_NS: u64 = 2_000_000_000;
/// A period with fewer faults from below DRAM than this says too little to move on.
pub const SIZING_MIN_FAULTS: u64 = 256;
/// A step up must be expected to save this many times what it costs (the estimate of its cost
/// is the lower bound of the two sides: see [`Judgement::more_hints`]); a step down is taken as
/// soon as the cost outweighs the saving.
pub const SIZING_MARGIN: f64 = 2.0;
/// A hint fault's own work (a staged page mapped back), without its delivery.
pub const HINT_NS: f64 = 5_000.0;
/// The first wait after a step up that did not pay.
const SIZING_BACKOFF_NS: u64 = 8_000_000_000;
/// A step up after which the share of deactivated pages that come back rose by more than this
/// (relative) squeezed the pages in use: it is undone. On the hot/cold workload the share rises
/// about 5% a step while the pool gains, 12% once it squeezes the hot set, 30% past that.
const SQUEEZE_RISE: f64 = 0.10;
/// What a pool or file fault is taken to cost in a period that had none of them.
const POOL_NS_UNSEEN: f64 = 15_000.0;
const FILE_NS_UNSEEN: f64 = 80_000.0;

/// The pool's share of the quota at the start: a sixteenth.
pub fn default_pages(quota_pages: u64) -> u64 {
    quota_pages / 16
}

/// The most of the quota the pool may take even when asked for more (the rest holds the
/// pages in use).
pub fn most_pages(quota_pages: u64) -> u64 {
    quota_pages * 3 / 4
}

/// The most of the quota a pool that sizes itself grows to unless asked otherwise: half, as
/// zram and zswap are commonly given.
pub fn adaptive_most_pages(quota_pages: u64) -> u64 {
    quota_pages / 2
}

/// The step a pool that sizes itself moves by, and its smallest size: a thirty-second of the
/// quota.
pub fn step_pages(quota_pages: u64) -> u64 {
    (quota_pages / 32).max(1)
}

/// Counts at one moment, each a running total: faults served from the pool and from the file
/// and the time they took (without their delivery), young and ghost hits, hint faults and
/// deactivations.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Sample {
    pub at_ns: u64,
    pub pool_faults: u64,
    pub pool_ns: f64,
    pub file_faults: u64,
    pub file_ns: f64,
    pub young: u64,
    pub ghost: u64,
    pub inactive_hits: u64,
    pub deactivations: u64,
}

/// What the judgement adds to the measured fault times: a fault's delivery (the wake-ups of
/// a handler thread and of the faulting thread, or a signal's delivery and return) and a hint
/// fault's own work.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Prices {
    pub wake_ns: f64,
    pub hint_ns: f64,
}

/// A period's reading: what a step more pool would save, and what the step of DRAM it takes
/// from the pages in use would cost, in nanoseconds of the program's time per second.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Judgement {
    pub saves_ns: f64,
    pub costs_ns: f64,
}

impl Judgement {
    /// From one period's rates (per second): `ghost` file faults a step more pool would have
    /// served (each saving a file fault's cost less a pool fault's), against `young` pool
    /// faults on pages that left DRAM within the last step (a step less DRAM for the pages
    /// in use turns about as many hits into pool faults, each with its delivery) and
    /// `more_hints`, the hint faults a step less of them adds (each a hint fault's work and
    /// its delivery).
    pub fn of(
        ghost: f64,
        young: f64,
        more_hints: f64,
        pool_ns: f64,
        file_ns: f64,
        prices: Prices,
    ) -> Judgement {
        Judgement {
            saves_ns: ghost * (file_ns - pool_ns).max(0.0),
            costs_ns: young * (pool_ns + prices.wake_ns)
                + more_hints * (prices.hint_ns + prices.wake_ns),
        }
    }

    /// The hint faults a step less of `active_pages` adds, if they rise in proportion: the
    /// estimate before a step is taken (a step taken measures it instead).
    pub fn more_hints(hints: f64, step: u64, active_pages: u64) -> f64 {
        hints * step as f64 / active_pages.max(step) as f64
    }

    /// +1 grow, -1 shrink, 0 hold.
    pub fn verdict(&self) -> i32 {
        if self.saves_ns > SIZING_MARGIN * self.costs_ns {
            1
        } else if self.costs_ns > self.saves_ns {
            -1
        } else {
            0
        }
    }
}

/// The pool's sizer: what it saw at its last judgement, and its last move.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Sizer {
    last: Option<Sample>,
    /// The last move (+1 up, -1 down, 0 none yet) and the share of deactivated pages that
    /// came back (hint faults over deactivations) in the period before it: after a step up,
    /// a rise of that share says the step squeezed pages in use.
    last_move: i32,
    back_before: f64,
    /// After a step up cost more than it saved, no step up before this time; the wait doubles
    /// each time (from [`SIZING_BACKOFF_NS`] to 64 times that) and is reset by a step up that
    /// paid.
    hold_until_ns: u64,
    backoff_ns: u64,
}

impl Sizer {
    /// Whether a period has passed since the last sample (the first is always due).
    pub fn due(&self, now_ns: u64) -> bool {
        self.last
            .is_none_or(|l| now_ns.saturating_sub(l.at_ns) >= SIZING_PERIOD_NS)
    }

    /// Ends a period at `now`: the verdict (+1 a step up, -1 down, 0 hold), or none when
    /// there is no period yet or it saw too few faults to say. `step` is the step in pages,
    /// `active_pages` the pages in use that are not on the inactive list.
    pub fn judge(
        &mut self,
        now: Sample,
        step: u64,
        active_pages: u64,
        prices: Prices,
    ) -> Option<i32> {
        let last = self.last.replace(now)?;
        let d = |a: u64, b: u64| a.saturating_sub(b);
        let (dp, df) = (
            d(now.pool_faults, last.pool_faults),
            d(now.file_faults, last.file_faults),
        );
        if dp + df < SIZING_MIN_FAULTS || now.at_ns <= last.at_ns {
            return None;
        }
        let secs = (now.at_ns - last.at_ns) as f64 / 1e9;
        let rate = |a: u64, b: u64| d(a, b) as f64 / secs;
        let mean = |ns: f64, n: u64, unseen: f64| if n > 0 { ns / n as f64 } else { unseen };
        let pool_ns = mean(now.pool_ns - last.pool_ns, dp, POOL_NS_UNSEEN);
        let file_ns = mean(now.file_ns - last.file_ns, df, FILE_NS_UNSEEN);
        let hints = rate(now.inactive_hits, last.inactive_hits);
        let back = d(now.inactive_hits, last.inactive_hits) as f64
            / d(now.deactivations, last.deactivations).max(1) as f64;
        let squeezed = self.last_move > 0
            && self.back_before > 0.0
            && back > self.back_before * (1.0 + SQUEEZE_RISE);
        let j = Judgement::of(
            rate(now.ghost, last.ghost),
            rate(now.young, last.young),
            Judgement::more_hints(hints, step, active_pages),
            pool_ns,
            file_ns,
            prices,
        );
        let verdict = if squeezed { -1 } else { j.verdict() };
        if self.last_move > 0 && verdict > 0 {
            // The last step up paid.
            self.backoff_ns = 0;
        }
        if squeezed {
            // What the last step up cost showed only once taken: wait before the next.
            self.backoff_ns =
                (self.backoff_ns * 2).clamp(SIZING_BACKOFF_NS, 64 * SIZING_BACKOFF_NS);
            self.hold_until_ns = now.at_ns + self.backoff_ns;
        }
        // A squeeze and a step that paid are judged in the period right after the step only.
        self.last_move = 0;
        self.back_before = back;
        Some(verdict)
    }

    /// The capacity after `verdict`, for a pool of `cap` pages bounded by `min` and `max`
    /// moving by `step`; none when it stays. Only a pool that uses its room (`used`) moves: one
    /// that does not writes nothing back (no saving to see) and takes no DRAM it does not use.
    /// Down moves two steps (a pool grown through a scan gives the pages in use back soon once
    /// they are used again); up waits out a hold after a squeeze.
    #[allow(clippy::too_many_arguments)]
    pub fn apply(
        &mut self,
        verdict: i32,
        cap: u64,
        min: u64,
        max: u64,
        step: u64,
        used: bool,
        now_ns: u64,
    ) -> Option<u64> {
        match verdict {
            1 if used && cap < max && now_ns >= self.hold_until_ns => {
                self.last_move = 1;
                Some((cap + step).min(max))
            }
            -1 if used && cap > min => {
                self.last_move = -1;
                Some(cap.saturating_sub(2 * step).max(min))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PRICES: Prices = Prices {
        wake_ns: 10_000.0,
        hint_ns: HINT_NS,
    };

    /// A period of `secs` seconds after `s` with these many more faults and hits.
    fn after(s: Sample, secs: u64, pool: u64, file: u64, young: u64, ghost: u64) -> Sample {
        Sample {
            at_ns: s.at_ns + secs * 1_000_000_000,
            pool_faults: s.pool_faults + pool,
            pool_ns: s.pool_ns + pool as f64 * 10_000.0,
            file_faults: s.file_faults + file,
            file_ns: s.file_ns + file as f64 * 80_000.0,
            young: s.young + young,
            ghost: s.ghost + ghost,
            inactive_hits: s.inactive_hits + 100,
            deactivations: s.deactivations + 1000,
        }
    }

    #[test]
    fn the_pool_grows_when_its_saving_outweighs_what_it_takes() {
        let p = |wake_ns| Prices {
            wake_ns,
            hint_ns: HINT_NS,
        };
        // 1000 file faults a second on pages the pool wrote back lately, each 60 µs against
        // 15 µs from the pool: 45 ms saved. 100 young pool faults (15 + 10 µs each) and 100
        // more hint faults (5 + 10 µs each): 4 ms.
        let j = Judgement::of(1000.0, 100.0, 100.0, 15e3, 60e3, p(10e3));
        assert_eq!(j.saves_ns, 45e6);
        assert_eq!(j.costs_ns, 4e6);
        assert_eq!(j.verdict(), 1);
        // Hot pages squeezed out: hint faults and young pool faults swamp the saving.
        assert_eq!(
            Judgement::of(1000.0, 1000.0, 3000.0, 15e3, 60e3, p(10e3)).verdict(),
            -1
        );
        // Close: hold.
        assert_eq!(
            Judgement::of(100.0, 150.0, 0.0, 15e3, 45e3, p(0.0)).verdict(),
            0
        );
        assert_eq!(
            Judgement::of(100.0, 120.0, 0.0, 15e3, 45e3, p(0.0)).verdict(),
            0
        );
        // No saving at all (nothing written back is read again): shrink.
        assert_eq!(
            Judgement::of(0.0, 10.0, 0.0, 15e3, 60e3, p(10e3)).verdict(),
            -1
        );
        // Hint faults estimated in proportion to the step.
        assert_eq!(Judgement::more_hints(1000.0, 1024, 8192), 125.0);
        assert_eq!(Judgement::more_hints(1000.0, 1024, 0), 1000.0);
    }

    #[test]
    fn a_period_is_judged_once_it_has_passed_and_seen_enough_faults() {
        let mut s = Sizer::default();
        let first = Sample::default();
        assert!(s.due(0));
        assert_eq!(s.judge(first, 32, 1000, PRICES), None, "no period yet");
        assert!(!s.due(SIZING_PERIOD_NS - 1));
        assert!(s.due(SIZING_PERIOD_NS));
        let quiet = after(first, 2, 10, 10, 0, 10);
        assert_eq!(s.judge(quiet, 32, 1000, PRICES), None, "too few faults");
        let busy = after(quiet, 2, 1000, 1000, 10, 900);
        assert_eq!(s.judge(busy, 32, 1000, PRICES), Some(1));
    }

    #[test]
    fn a_step_up_that_squeezed_the_pages_in_use_is_undone_and_the_next_waits() {
        let mut s = Sizer::default();
        let mut now = Sample::default();
        s.judge(now, 32, 1000, PRICES);
        now = after(now, 2, 1000, 1000, 10, 900);
        assert_eq!(s.judge(now, 32, 1000, PRICES), Some(1));
        assert_eq!(s.apply(1, 64, 32, 512, 32, true, now.at_ns), Some(96));
        // The period after the step: as many ghost hits, but twice the share of deactivated
        // pages came back.
        let mut next = after(now, 2, 1000, 1000, 10, 900);
        next.inactive_hits += 100;
        assert_eq!(s.judge(next, 32, 1000, PRICES), Some(-1), "squeezed");
        assert_eq!(s.apply(-1, 96, 32, 512, 32, true, next.at_ns), Some(32));
        // Saving again at once: no step up before the hold ends.
        let again = after(next, 2, 1000, 1000, 10, 900);
        assert_eq!(s.judge(again, 32, 1000, PRICES), Some(1));
        assert_eq!(s.apply(1, 32, 32, 512, 32, true, again.at_ns), None);
        let later = after(again, 8, 1000, 1000, 10, 900);
        assert_eq!(s.judge(later, 32, 1000, PRICES), Some(1));
        assert_eq!(s.apply(1, 32, 32, 512, 32, true, later.at_ns), Some(64));
    }

    #[test]
    fn the_hold_after_a_squeeze_doubles_up_to_its_cap_and_a_step_that_paid_resets_it() {
        let mut s = Sizer::default();
        let mut now = Sample::default();
        s.judge(now, 32, 1000, PRICES);
        let mut holds = Vec::new();
        for _ in 0..9 {
            // A step up, then a period in which twice the share of deactivated pages came back.
            now = after(now, 2, 1000, 1000, 10, 900);
            s.judge(now, 32, 1000, PRICES);
            s.last_move = 1;
            now = after(now, 2, 1000, 1000, 10, 900);
            now.inactive_hits += 100;
            assert_eq!(s.judge(now, 32, 1000, PRICES), Some(-1));
            holds.push(s.hold_until_ns - now.at_ns);
            // Back to the usual share, so that the next squeeze is measured from it.
            now = after(now, 2, 1000, 1000, 10, 900);
            s.judge(now, 32, 1000, PRICES);
        }
        let first = SIZING_BACKOFF_NS;
        assert_eq!(
            holds,
            [1, 2, 4, 8, 16, 32, 64, 64, 64].map(|k| k * first).to_vec()
        );
        // A step up that paid (the next period still saves) resets the wait.
        s.last_move = 1;
        now = after(now, 2, 1000, 1000, 10, 900);
        assert_eq!(s.judge(now, 32, 1000, PRICES), Some(1));
        assert_eq!(s.backoff_ns, 0);
        s.last_move = 1;
        now = after(now, 2, 1000, 1000, 10, 900);
        now.inactive_hits += 100;
        assert_eq!(s.judge(now, 32, 1000, PRICES), Some(-1));
        assert_eq!(s.hold_until_ns - now.at_ns, first);
        // A sample no later than the last says nothing.
        assert_eq!(s.judge(now, 32, 1000, PRICES), None);
    }

    #[test]
    fn a_pool_that_does_not_use_its_room_stays_and_bounds_hold() {
        let mut s = Sizer::default();
        assert_eq!(s.apply(1, 64, 32, 512, 32, false, 0), None);
        assert_eq!(s.apply(-1, 64, 32, 512, 32, false, 0), None);
        assert_eq!(s.apply(1, 500, 32, 512, 32, true, 0), Some(512));
        assert_eq!(s.apply(1, 512, 32, 512, 32, true, 0), None);
        assert_eq!(s.apply(-1, 40, 32, 512, 32, true, 0), Some(32));
        assert_eq!(s.apply(-1, 32, 32, 512, 32, true, 0), None);
    }
}
