//! The placement queues in the engine (`--policy placement`): the evictor runs
//! [`memtide_policy::Placement`], the code the simulator replays as `placement`, over the page
//! table. New pages join a small FIFO queue on probation and are staged soon after they come
//! in; a page the program uses again shows itself by a hint fault and moves to the SIEVE main
//! queue; pressure takes pages out of DRAM from the small queue while it is over its share,
//! else where the main queue's hand finds a page still staged. Entry points:
//! [`Engine::place_relieve`] (the evictor's round), [`Arrivals`] (how the fault path tells it
//! what came in).
//!
//! # How it sits on the engine
//!
//! - Staged pages live in the staging ring as with the CLOCK sweep, but leave it out of order:
//!   placement names the staged page to evict, and its slot is zapped and emptied on its own.
//!   The ring's tail passes the empty slots at its end before each batch, so that the area
//!   behind it gives back its page tables; a page staged so long that the head comes round to
//!   it is put back (`retire_staged`), which placement then takes for a use.
//! - A freed staged page gives its slot back at once (not when the tail passes, which may be
//!   long in coming): see `region.rs`.
//! - The fault path appends the pages it brings in to [`Arrivals`] (no lock, no allocation);
//!   the evictor drains it into placement before each decision. A page that came in without
//!   being heard of (the queue was full, or `mremap` moved it) is adopted by the scan at each
//!   epoch.
//! - Placement's choices are claims (`Busy`) made while it decides; the moves, writes and
//!   zaps follow in one batch, so a decision never waits for a page.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use memtide_policy::{Pages, Placement, Relief, Residence, Watermarks, PAGE_SIZE};

use super::policy::Evictor;
use super::ring::U32S_PER_PAGE;
use super::Engine;
use crate::pages::State;
use crate::stats::Counters;
use crate::sys::{self, Mapping};

/// Arrivals the queue holds before the evictor must have drained it.
const ARRIVALS: u64 = 1 << 20;

/// Pages brought into DRAM, in the order they came, for the evictor to place. Producers are
/// the fault paths (one compare-and-swap and a store: async-signal-safe); the evictor is the
/// only consumer.
///
/// The queue is a ring the producers go round, so every page of it would stay resident once
/// they had (4 MiB). The consumer gives each page back once it has drained it, before it lets
/// the producers know: `tail`, which bounds where they may write, moves a whole page at a
/// time and only past pages given back, so no producer can be writing into a page as it goes.
pub(super) struct Arrivals {
    /// `page + 1` per entry; 0 while empty (or claimed and not yet written).
    entries: Mapping,
    head: AtomicU64,
    /// Where the producers may write up to (`tail + ARRIVALS`): the start of the page the
    /// consumer is draining.
    tail: AtomicU64,
    /// Where the consumer has drained to (the consumer only).
    drained: AtomicU64,
    /// Set when an arrival did not fit: the evictor's next scan adopts what it missed.
    overflowed: AtomicBool,
}

impl Arrivals {
    pub(super) fn new() -> io::Result<Arrivals> {
        Ok(Arrivals {
            entries: Mapping::anon(ARRIVALS as usize * 4)?,
            head: AtomicU64::new(0),
            tail: AtomicU64::new(0),
            drained: AtomicU64::new(0),
            overflowed: AtomicBool::new(false),
        })
    }

    fn entry(&self, i: u64) -> &AtomicU32 {
        &self.entries.as_slice::<AtomicU32>()[(i % ARRIVALS) as usize]
    }

    /// Page `page` came into DRAM.
    pub(super) fn push(&self, page: usize) {
        let mut h = self.head.load(Ordering::Relaxed);
        loop {
            if h - self.tail.load(Ordering::Acquire) >= ARRIVALS {
                self.overflowed.store(true, Ordering::Release);
                return;
            }
            match self
                .head
                .compare_exchange_weak(h, h + 1, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => break,
                Err(now) => h = now,
            }
        }
        self.entry(h).store(page as u32 + 1, Ordering::Release);
    }

    /// Hands every arrival written so far to `f`, oldest first (the evictor only).
    fn drain(&self, mut f: impl FnMut(usize)) {
        let mut t = self.drained.load(Ordering::Relaxed);
        loop {
            let e = self.entry(t).swap(0, Ordering::AcqRel);
            if e == 0 {
                // Empty, or a producer is between its claim and its store: later.
                break;
            }
            f((e - 1) as usize);
            t += 1;
        }
        self.drained.store(t, Ordering::Relaxed);
        // Pages drained whole go back, then the producers may come round to them.
        let from = self.tail.load(Ordering::Relaxed);
        let to = t - t % U32S_PER_PAGE;
        for page in (from..to).step_by(U32S_PER_PAGE as usize) {
            // SAFETY: every entry of this page was written and drained (it reads as zero), and
            // no producer may write into it again before `tail` passes it, below.
            unsafe {
                let _ = sys::discard(self.entry(page) as *const AtomicU32 as usize, PAGE_SIZE);
            }
        }
        if to > from {
            self.tail.store(to, Ordering::Release);
        }
    }

    /// Whether arrivals were lost since the last call.
    fn take_overflow(&self) -> bool {
        self.overflowed.swap(false, Ordering::AcqRel)
    }
}

/// The evictor's placement state.
pub(super) struct Placer {
    placement: Placement,
    quota: u64,
    to_stage: Vec<usize>,
    to_evict: Vec<(usize, u32)>,
    to_unmap: Vec<usize>,
    failed: Vec<usize>,
}

impl Placer {
    pub(super) fn new(pages: usize, quota: u64) -> Placer {
        Placer {
            placement: Placement::new(pages, quota),
            quota,
            to_stage: Vec::with_capacity(Watermarks::MAX_BATCH as usize * 4),
            to_evict: Vec::with_capacity(Watermarks::MAX_BATCH as usize),
            to_unmap: Vec::with_capacity(Watermarks::MAX_BATCH as usize),
            failed: Vec::new(),
        }
    }

    /// Page `i` is in DRAM: placement takes it if it does not hold it yet (the epoch's scan).
    pub(super) fn adopt(&mut self, i: usize) {
        if !self.placement.holds(i) {
            self.placement.arrived(i);
        }
    }
}

impl Evictor for Placer {
    fn relieve(
        &mut self,
        engine: &Engine,
        writing: &mut Vec<(usize, u32)>,
        new_epoch: bool,
    ) -> Relief {
        engine.place_relieve(self, writing, new_epoch)
    }
}

/// The most pages one decision stages (each is a page move).
const STAGE_PER_ROUND: usize = Watermarks::MAX_BATCH as usize * 4;

impl Engine {
    /// Page `p` came into DRAM: tells placement, when it runs (async-signal-safe).
    pub(super) fn arrived(&self, p: usize) {
        if let Some(a) = &self.arrivals {
            a.push(p);
        }
    }

    /// One round of the evictor under placement, as the simulator's `placement` runs it: over
    /// the high watermark, takes pages out of DRAM (a batch at a time, waking waiting threads
    /// after each) until resident memory is under the low one; near the quota, stages the
    /// pages that came in, so that those used again show themselves.
    fn place_relieve(
        &self,
        pl: &mut Placer,
        writing: &mut Vec<(usize, u32)>,
        scan: bool,
    ) -> Relief {
        self.take_arrivals(pl, scan);
        let wm = self.quota.wm();
        if wm.quota != pl.quota {
            pl.placement.set_quota(wm.quota);
            pl.quota = wm.quota;
        }
        let mut relief = Relief::Calm;
        if wm.over_high(self.quota.held()) {
            relief = Relief::Relieved;
            loop {
                let resident = self.quota.held();
                if wm.under_low(resident) {
                    break;
                }
                let want = (resident + wm.low_headroom - wm.quota).min(wm.batch);
                let room = self.stage_room();
                pl.placement.set_stage_limit(room as u64);
                let mut pages = EnginePages {
                    engine: self,
                    to_stage: &mut pl.to_stage,
                    to_evict: &mut pl.to_evict,
                    to_unmap: &mut pl.to_unmap,
                    room,
                };
                pl.placement.evict(&mut pages, want);
                let staged = self.stage_chosen(&mut pl.to_stage);
                self.unmap_chosen(pl);
                let left = self.evict_chosen(&mut pl.to_evict, writing, &mut pl.failed);
                for &p in &pl.failed {
                    pl.placement.arrived(p);
                }
                if !self.tier_usable() || self.pause.load(Ordering::Acquire) {
                    return Relief::Stopped;
                }
                if staged + left == 0 {
                    return Relief::Stuck;
                }
                if left > 0 {
                    self.quota.set_overcommit(false);
                    self.quota.wake_waiters();
                }
                self.take_arrivals(pl, false);
            }
        }
        let resident = self.quota.held();
        if wm.near_quota(resident) {
            loop {
                let room = self.stage_room();
                let mut pages = EnginePages {
                    engine: self,
                    to_stage: &mut pl.to_stage,
                    to_evict: &mut pl.to_evict,
                    to_unmap: &mut pl.to_unmap,
                    room,
                };
                if pl.placement.probe(&mut pages, room as u64) == 0 {
                    break;
                }
                self.stage_chosen(&mut pl.to_stage);
                if self.pause.load(Ordering::Acquire) {
                    break;
                }
            }
        }
        relief
    }

    /// Hands what came in to placement; with `scan` (once an epoch, or after arrivals were
    /// lost) adopts every page in DRAM placement does not hold.
    fn take_arrivals(&self, pl: &mut Placer, scan: bool) {
        let Some(a) = &self.arrivals else {
            return;
        };
        let lost = a.take_overflow();
        a.drain(|p| {
            pl.placement.arrived(p);
        });
        if scan || lost {
            let hw = self.high_water.load(Ordering::Acquire);
            for i in 0..hw {
                if matches!(self.pt.load(i).state(), State::Mapped | State::Staged) {
                    pl.adopt(i);
                }
            }
        }
    }

    /// Slots the ring can take now for pages placement stages (making room at its tail first
    /// when it is short).
    fn stage_room(&self) -> usize {
        self.skip_spent_slots();
        if self.ring.room() < STAGE_PER_ROUND as u64 {
            self.retire_staged(4 * STAGE_PER_ROUND as u64);
        }
        self.ring.room().min(STAGE_PER_ROUND as u64) as usize
    }

    /// Moves the pages placement chose to stage (claimed `Busy`) into the ring. Returns how
    /// many moved.
    fn stage_chosen(&self, chosen: &mut Vec<usize>) -> u64 {
        if chosen.is_empty() {
            return 0;
        }
        chosen.sort_unstable();
        let n = self.stage(self.staging().moved(), chosen);
        chosen.clear();
        n
    }

    /// Stages the mapped pages placement chose to evict (claimed `Busy`) and adds those that
    /// moved to the pages to evict. One the program touched in between is back in use: it is
    /// placed again, as are pages that would not move.
    fn unmap_chosen(&self, pl: &mut Placer) {
        if pl.to_unmap.is_empty() {
            return;
        }
        let chosen = pl.to_unmap.clone();
        pl.to_unmap.sort_unstable();
        self.stage(self.staging().moved(), &mut pl.to_unmap);
        for &p in &chosen {
            if pl.to_unmap.binary_search(&p).is_err() {
                pl.placement.arrived(p);
            }
        }
        for &p in &pl.to_unmap {
            if self.pt.claim(p, State::Staged, false).is_some() {
                pl.to_evict.push((p, self.pt.stage(p)));
            } else {
                pl.placement.arrived(p);
            }
        }
        pl.to_unmap.clear();
    }

    /// Takes the staged pages placement chose (claimed `Busy`, with their slots) out of DRAM:
    /// writes those that need it to tier 1, then zaps their slots. Pages tier 1 would not take
    /// are mapped again and pushed to `failed`. Returns how many left DRAM.
    fn evict_chosen(
        &self,
        chosen: &mut Vec<(usize, u32)>,
        writing: &mut Vec<(usize, u32)>,
        failed: &mut Vec<usize>,
    ) -> u64 {
        failed.clear();
        if chosen.is_empty() {
            return 0;
        }
        writing.clear();
        // In page order: neighbours evicted together get neighbouring tier slots, which
        // read-ahead brings back in one read.
        chosen.sort_unstable();
        for &(p, s) in chosen.iter() {
            // Faulting threads wait for a Writing page.
            self.pt.publish(p, State::Writing, None);
            writing.push((p, s));
        }
        chosen.clear();
        let out = self.retire(writing);
        failed.extend(out.failed.iter().map(|&(p, _)| p));
        // Release the slots, in runs of neighbours: a zap each.
        let mut slots: Vec<u32> = writing.iter().map(|&(_, s)| s).collect();
        slots.sort_unstable();
        for &s in &slots {
            self.ring
                .entry(s as u64)
                .store(super::ring::RING_EMPTY, Ordering::Release);
        }
        let mut k = 0;
        while k < slots.len() {
            let start = k;
            while k < slots.len() && slots[k] == slots[start] + (k - start) as u32 {
                k += 1;
            }
            // SAFETY: these slots held pages now evicted, dropped, or moved back: nothing in
            // them is needed, and only the evictor stages into slots (faults never stage
            // under placement).
            unsafe {
                let _ = sys::discard(self.ring.addr(slots[start]), (k - start) * PAGE);
            }
        }
        self.ring
            .staged
            .fetch_sub(writing.len() as u64, Ordering::AcqRel);
        self.quota.unreserve(out.left);
        Counters::add(&self.counters.demotions, out.left);
        Counters::add(&self.counters.demotions_clean, out.clean);
        Counters::add(&self.counters.demotions_zero, out.zero);
        out.left
    }
}

const PAGE: usize = memtide_policy::PAGE_SIZE;

/// The page table as placement sees it; its choices are claimed and collected, to be carried
/// out after the decision.
struct EnginePages<'a> {
    engine: &'a Engine,
    to_stage: &'a mut Vec<usize>,
    to_evict: &'a mut Vec<(usize, u32)>,
    /// Mapped pages to evict: staged first, then evicted with `to_evict`.
    to_unmap: &'a mut Vec<usize>,
    /// Ring slots free for this decision's stagings.
    room: usize,
}

impl Pages for EnginePages<'_> {
    fn residence(&mut self, i: usize) -> Residence {
        let w = self.engine.pt.load(i);
        match w.state() {
            State::Mapped if w.pins() == 0 && !w.protected() => Residence::Mapped,
            State::Mapped | State::Busy | State::Writing => Residence::Busy,
            State::Staged => Residence::Staged,
            _ => Residence::Gone,
        }
    }

    fn stage(&mut self, i: usize) -> bool {
        if self.to_stage.len() + self.to_unmap.len() >= self.room {
            return false;
        }
        let e = self.engine;
        let w = e.pt.load(i);
        if w.state() != State::Mapped || w.protected() {
            return false;
        }
        if e.pt.claim(i, State::Mapped, true).is_none() {
            return false;
        }
        self.to_stage.push(i);
        true
    }

    fn evict(&mut self, i: usize) -> bool {
        let e = self.engine;
        if e.pt.claim(i, State::Staged, false).is_some() {
            self.to_evict.push((i, e.pt.stage(i)));
            return true;
        }
        // A mapped page placement never staged (on probation, it had no chance to show a
        // use): it goes through staging on its way out.
        if self.to_stage.len() + self.to_unmap.len() >= self.room {
            return false;
        }
        let w = e.pt.load(i);
        if w.state() != State::Mapped || w.protected() {
            return false;
        }
        if e.pt.claim(i, State::Mapped, true).is_none() {
            return false;
        }
        self.to_unmap.push(i);
        true
    }
}
