//! Active memory, estimated by sampling: the engine sees an access only when it faults, so
//! a page that stays mapped looks idle however hot it is, and counting the pages seen touched
//! undercounts active memory badly. Instead, as hypervisors do without hardware help, every
//! window the evictor takes a uniform random sample of the program's populated pages (mapped,
//! inactive or in tier 1), unmaps the mapped ones into the inactive list, and at the end of the
//! window counts how many of the sample were touched: every touch of an unmapped page faults,
//! and every fault is recorded in the page's history. Active memory is that fraction of the
//! populated pages, averaged over the last few windows. Entry points: [`ActiveSampler`],
//! `Engine::sample_active`.
//!
//! # Cost
//!
//! At most [`SAMPLE`] pages per window ([`WINDOW_EPOCHS`] epochs, 1 s by default): one page
//! move each for the mapped ones (about 5–15 µs of evictor time), and one hint fault for each
//! sampled page the program touches (the active share of the sample). Untouched sampled
//! pages wait in the inactive list like pages the sweep unmapped: under pressure they are the
//! first written out; without pressure they are put back once the staging ring needs room.
//!
//! # Accuracy
//!
//! With a sample of 1024 and an active share `f`, one window's standard error is
//! `sqrt(f (1 - f) / 1024)`: 1.25 percentage points at `f` = 20%; the average of four
//! windows halves it. Pages brought in by read-ahead beside a faulting neighbour are mapped
//! without a fault of their own, so a sampled tier-1 page read ahead and then touched is missed.
//!
//! # Under SIGBUS delivery
//!
//! There, a kernel access to an unmapped page (a futex on a condition variable, a system call
//! memtide does not wrap) fails with EFAULT instead of waiting, so a program well within its
//! quota must find all its pages mapped: the sampler unmaps nothing until the program is near
//! its quota (where eviction unmaps pages anyway), and until then reports every populated page
//! as active, an upper bound that takes no DRAM from the program on a guess.

use std::sync::atomic::Ordering;

use super::ring::{RING_DEAD, RING_EMPTY};
use super::Engine;
use crate::pages::{State, NONE};
use crate::stats::Counters;
use crate::sys;

/// Most pages in one window's sample.
pub(super) const SAMPLE: u64 = 1024;
/// Epochs one sample watches (at most 8: a page's history holds eight epochs).
pub(super) const WINDOW_EPOCHS: u32 = 5;
/// Windows averaged into the estimate reported.
const AVERAGED: usize = 4;

/// The sample being watched and the latest estimates.
pub(super) struct ActiveSampler {
    sample: Vec<usize>,
    /// Epochs ended since the sample was taken.
    epochs: u32,
    rng: u64,
    /// The latest windows' estimates, in pages (a ring of `AVERAGED`).
    recent: [u64; AVERAGED],
    windows: usize,
    /// Nothing is sampled (SIGBUS delivery, well within the quota): every populated page
    /// counts as active.
    held_back: bool,
}

impl ActiveSampler {
    pub(super) fn new(seed: u64) -> ActiveSampler {
        ActiveSampler {
            sample: Vec::with_capacity(SAMPLE as usize),
            epochs: 0,
            rng: seed | 1,
            recent: [0; AVERAGED],
            windows: 0,
            held_back: false,
        }
    }

    /// xorshift64*: a uniform draw below `n` (n > 0), good enough for sampling.
    fn below(&mut self, n: usize) -> usize {
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        let r = self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D);
        (((r >> 32) * n as u64) >> 32) as usize
    }

    /// The estimate in pages: the mean of the latest windows, `None` before the first ends.
    pub(super) fn estimate(&self) -> Option<u64> {
        let n = self.windows.min(AVERAGED);
        (n > 0).then(|| self.recent[..n].iter().sum::<u64>() / n as u64)
    }

    fn record(&mut self, pages: u64) {
        self.recent[self.windows % AVERAGED] = pages;
        self.windows += 1;
    }
}

impl Engine {
    /// Called by the evictor at the end of every epoch, before histories are aged, with the
    /// number of populated pages (`populated`, as the last aging counted them): ends the
    /// current window if it is over, and returns the estimate of active pages.
    pub(super) fn active_window_ends(&self, s: &mut ActiveSampler, populated: u64) -> Option<u64> {
        if s.held_back {
            return Some(populated);
        }
        if s.sample.is_empty() {
            return s.estimate();
        }
        s.epochs += 1;
        if s.epochs < WINDOW_EPOCHS {
            return s.estimate();
        }
        // The window's epochs are the top WINDOW_EPOCHS bits of each history: the sample was
        // taken just after an aging, when every page's current-epoch bit was clear.
        let shift = 8 - WINDOW_EPOCHS;
        let (mut alive, mut touched) = (0u64, 0u64);
        for &p in &s.sample {
            let w = self.pt.load(p);
            if matches!(w.state(), State::Free | State::Unpopulated | State::Lent) {
                // Freed (or discarded) since: no longer part of what is measured.
                continue;
            }
            alive += 1;
            if w.history().0 >> shift != 0 {
                touched += 1;
            }
        }
        s.sample.clear();
        if let Some(pages) = (touched * populated + alive / 2).checked_div(alive) {
            s.record(pages);
        }
        s.estimate()
    }

    /// Called by the evictor just after an aging: takes a new sample unless one is being
    /// watched. Mapped pages of the sample are unmapped into the inactive list (making room in
    /// it first if there is no pressure); the sample is cut short, never skewed, when the list
    /// has no room for more.
    pub(super) fn sample_active(&self, s: &mut ActiveSampler, victims: &mut Vec<usize>) {
        if !s.sample.is_empty() {
            return;
        }
        s.epochs = 0;
        s.held_back =
            self.kernel_access_needs_pins() && !self.quota.wm().near_quota(self.quota.held());
        if s.held_back {
            // Windows measured before do not describe the program once sampling resumes.
            s.windows = 0;
            return;
        }
        let extent = self.high_water.load(Ordering::Acquire);
        if extent == 0 {
            return;
        }
        if self.ring.room() < SAMPLE && !self.quota.wm().over_high(self.quota.held()) {
            self.retire_staged(SAMPLE);
        }
        // The head moves only under this lock: the room stays ours until the pages move.
        let mut staging = self.staging();
        let room = self.ring.room().min(victims.capacity() as u64) as usize;
        victims.clear();
        for _ in 0..8 * SAMPLE {
            if s.sample.len() + victims.len() >= SAMPLE as usize {
                break;
            }
            let p = s.below(extent);
            let w = self.pt.load(p);
            match w.state() {
                State::Staged | State::Writing | State::Evicted => s.sample.push(p),
                State::Mapped if w.pins() == 0 && !w.protected() => {
                    if victims.len() >= room {
                        // No room to unmap it: stop here rather than sample only the
                        // pages already unmapped (the colder ones).
                        break;
                    }
                    if self.pt.claim(p, State::Mapped, true).is_some() {
                        victims.push(p);
                    }
                }
                _ => {}
            }
        }
        victims.sort_unstable();
        self.stage(staging.moved(), victims);
        drop(staging);
        s.sample.extend_from_slice(victims);
        s.sample.sort_unstable();
        s.sample.dedup();
    }

    /// Makes room in the staging ring without pressure: pages staged long ago and never
    /// written (a sample's untouched pages, or the inactive list of a program now within its
    /// quota) go back to their addresses, oldest first, until `want` slots are free. Stops at a
    /// page someone else is moving.
    pub(super) fn retire_staged(&self, want: u64) {
        self.retire_slots(want, true);
    }

    /// Moves the tail past the slots at its end that hold nothing any more (emptied, or
    /// naming a page that has since left them), stopping at the first staged page: placement
    /// empties slots out of order, and chunks the tail passes give back their page tables
    /// (see `ring.rs`).
    pub(super) fn skip_spent_slots(&self) {
        self.retire_slots(u64::MAX, false);
    }

    /// Moves the tail until `want` slots are free or it meets a page someone else is moving;
    /// a staged page met on the way goes back to its address when `put_back`, else the tail
    /// stops there.
    fn retire_slots(&self, want: u64, put_back: bool) {
        let tail0 = self.ring.tail();
        let head = self.ring.head();
        let mut pos = tail0;
        let mut dead = 0u64;
        while pos < head && self.ring.room() + (pos - tail0) < want {
            let entry = self.ring.entry(pos);
            let e = entry.load(Ordering::Acquire);
            if e == RING_EMPTY {
                pos += 1;
                continue;
            }
            if e == RING_DEAD {
                dead += 1;
                pos += 1;
                continue;
            }
            let p = (e - 1) as usize;
            let s = (pos % self.ring.slots()) as u32;
            let w = self.pt.load(p);
            if self.pt.stage(p) == s && matches!(w.state(), State::Busy | State::Writing) {
                break;
            }
            if w.state() == State::Staged && self.pt.stage(p) == s {
                if !put_back {
                    break;
                }
                let Some(old) = self.pt.claim(p, State::Staged, false) else {
                    break;
                };
                self.unstage(p, s, old, "putting back an inactive page failed");
                self.pt.set_stage(p, NONE);
                self.ring.staged.fetch_sub(1, Ordering::AcqRel);
                // Unmapped and untouched until now: not in use, whatever it was before.
                self.pt.unprove(p);
                self.pt.publish(p, State::Mapped, None);
                Counters::bump(&self.counters.reactivations);
                pos += 1;
                continue;
            }
            if entry.load(Ordering::Acquire) != e {
                // The slot changed hands while we looked.
                continue;
            }
            pos += 1;
        }
        // Every slot passed is empty now, or holds a dead page's DRAM: release them at once.
        self.pass_tail(tail0, pos);
        if dead > 0 {
            self.ring.staged.fetch_sub(dead, Ordering::AcqRel);
            self.quota.unreserve(dead);
            self.quota.wake_waiters();
        }
    }
}

/// A seed for the sampler that differs between processes and runs.
pub(super) fn seed() -> u64 {
    sys::now_ns() ^ ((std::process::id() as u64) << 32)
}
