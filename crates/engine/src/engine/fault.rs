//! The fault path: a touch of a managed page that is not mapped, resolved in the faulting
//! thread (from the SIGBUS handler) or before a system call uses the page. A first touch maps
//! zeros, a touch of an inactive page moves it back from staging (a hint fault: it is hot), a
//! touch of an evicted page reads it from tier 1. Entry point: [`Engine::handle_fault`].
//!
//! Signal-handler context: no locks, no allocation. It waits only on page words and on the
//! quota, each with a timeout.

use std::cell::Cell;
use std::io;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use memtide_policy::{Activeness, PAGE_SIZE};

use super::fatal::{fatal, fatal_with, presence_code};
use super::{Engine, Fault, ZERO_CHUNK};
use crate::pages::{State, Word, NONE};
use crate::stats::Counters;
use crate::sys::{self, Mapping};

/// Most pages read ahead on a sequential run of tier faults.
pub(super) const READAHEAD: usize = 16;
/// Faults in a row on one page the engine holds mapped before it looks whether the page is
/// really there (see `check_mapped`).
const MAPPED_MISSING_LIMIT: u32 = 1000;
/// Bounce buffers for tier reads, each `READAHEAD` pages.
const BOUNCE_BUFFERS: usize = 64;

/// Pages a tier read brings in on the `run`-th fault of a sequential run: 1, 1, 2, 4, 8,
/// then `READAHEAD`.
fn readahead_window(run: usize) -> usize {
    if run < 3 {
        1
    } else {
        (1usize << (run - 2).min(8)).min(READAHEAD)
    }
}

/// Page-sized, aligned buffers for tier reads, taken without locks.
pub(super) struct BouncePool {
    mem: Mapping,
    used: AtomicU64,
}

impl BouncePool {
    pub(super) fn new() -> io::Result<BouncePool> {
        Ok(BouncePool {
            mem: Mapping::anon(BOUNCE_BUFFERS * READAHEAD * PAGE_SIZE)?,
            used: AtomicU64::new(0),
        })
    }

    fn take(&self) -> usize {
        loop {
            let bits = self.used.load(Ordering::Acquire);
            if bits == u64::MAX {
                std::thread::yield_now();
                continue;
            }
            let i = (!bits).trailing_zeros() as usize;
            if self
                .used
                .compare_exchange(bits, bits | 1 << i, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return self.mem.addr() + i * READAHEAD * PAGE_SIZE;
            }
        }
    }

    fn give(&self, buf: usize) {
        let i = (buf - self.mem.addr()) / (READAHEAD * PAGE_SIZE);
        self.used.fetch_and(!(1 << i), Ordering::Release);
    }
}

/// Where the last tier read ended, and how many reads in a row each started right after the
/// one before: read-ahead grows with that run.
pub(super) struct SequentialRun {
    last: AtomicUsize,
    run: AtomicUsize,
}

impl SequentialRun {
    pub(super) fn new() -> SequentialRun {
        SequentialRun {
            last: AtomicUsize::new(usize::MAX - 1),
            run: AtomicUsize::new(0),
        }
    }

    /// A tier fault at page `p`: how many pages to read (one page gap allowed in a run).
    fn window(&self, p: usize) -> usize {
        let last = self.last.load(Ordering::Relaxed);
        let run = if p == last.wrapping_add(1) || p == last.wrapping_add(2) {
            self.run.load(Ordering::Relaxed).saturating_add(1)
        } else {
            1
        };
        self.run.store(run, Ordering::Relaxed);
        readahead_window(run)
    }

    /// The read that just ended brought in pages up to `last`.
    fn ended_at(&self, last: usize) {
        self.last.store(last, Ordering::Relaxed);
    }
}

impl Engine {
    /// Resolves a fault at `addr`. Called from the SIGBUS handler of the faulting thread, or
    /// directly to bring a page in before a system call uses it.
    pub fn handle_fault(&self, addr: usize) -> Fault {
        if !self.contains(addr) {
            return Fault::NotManaged;
        }
        let p = self.page_of(addr);
        loop {
            let w = self.pt.load(p);
            match w.state() {
                State::Free => return Fault::NotManaged,
                State::Mapped => {
                    self.check_mapped(p, addr, w);
                    return Fault::Handled;
                }
                State::Busy | State::Writing => {
                    Counters::bump(&self.counters.faults_wait);
                    self.pt.wait(p, w);
                }
                State::Unpopulated => {
                    if self.fill_zero(p) {
                        return Fault::Handled;
                    }
                }
                State::Staged => {
                    if self.reactivate(p) {
                        return Fault::Handled;
                    }
                }
                State::Evicted => {
                    if self.fetch(p) {
                        return Fault::Handled;
                    }
                }
            }
        }
    }

    /// A fault on a page the engine has mapped: normally a race (another thread mapped it
    /// between the fault and this look). If the page is in fact missing, the retried access
    /// faults again at once; a long unbroken run of such faults on one page means the books
    /// are wrong, and the engine stops loudly rather than spin forever.
    fn check_mapped(&self, p: usize, addr: usize, w: Word) {
        thread_local! {
            static STREAK: Cell<(usize, u32)> = const { Cell::new((usize::MAX, 0)) };
        }
        let n = STREAK.with(|c| {
            let (last, n) = c.get();
            let n = if last == p { n + 1 } else { 1 };
            c.set((p, n));
            n
        });
        if n < MAPPED_MISSING_LIMIT {
            return;
        }
        if sys::presence_of(addr) == Some(sys::Presence::Absent) && self.pt.load(p).0 == w.0 {
            // Where might its bytes be? A ring slot still naming the page, and whether that
            // staging slot holds a page.
            let named = self.ring.naming(p);
            let named_presence =
                presence_code(named.and_then(|s| sys::presence_of(self.ring.addr(s as u32))));
            fatal_with(
                "a page the engine had mapped is missing from the program's page tables",
                &[
                    ("page", p as u64),
                    ("word", w.0 as u64),
                    ("tier slot", self.pt.slot(p).map_or(u64::MAX, |s| s)),
                    ("faults on it in a row", n as u64),
                    ("ring slot naming it", named.unwrap_or(u64::MAX)),
                    (
                        "that slot (0 present, 1 swapped, 2 absent, 3 none or unknown)",
                        named_presence,
                    ),
                    (
                        "moves underreported",
                        self.counters.moves_underreported.load(Ordering::Relaxed),
                    ),
                ],
                &io::Error::from_raw_os_error(libc::EFAULT),
            );
        }
        STREAK.with(|c| c.set((p, 0)));
    }

    /// Reserves DRAM for `n` pages, waiting for the evictor if the quota is used up.
    fn reserve(&self, n: u64) {
        self.quota.reserve(n, &self.bell, &self.counters);
    }

    /// First touch: maps zeros at `p` and, when the touches look sequential (the page before
    /// is mapped, or `p` starts an allocation), at the untouched pages after it, up to 64 KiB
    /// in one call; likewise backwards. Random first touches fill one page, so they do not
    /// spend the quota on neighbours nobody asked for.
    fn fill_zero(&self, p: usize) -> bool {
        let pages = self.pt.pages();
        let forward =
            p == 0 || self.pt.load(p - 1).state() == State::Mapped || self.pt.block(p).0 != 0;
        let backward = p + 1 < pages && self.pt.load(p + 1).state() == State::Mapped;
        let want = if forward || backward { ZERO_CHUNK } else { 1 };
        self.reserve(want as u64);
        if self.pt.claim(p, State::Unpopulated, false).is_none() {
            self.quota.unreserve(want as u64);
            return false;
        }
        let mut hi = p + 1;
        let mut lo = p;
        // Neighbours are filled only within p's allocation (an allocation's first page names
        // its length), so that a new allocation beside this one stays untouched.
        if forward {
            let end = (p + ZERO_CHUNK).min(pages);
            while hi < end
                && self.pt.block(hi).0 == 0
                && self.pt.claim(hi, State::Unpopulated, false).is_some()
            {
                hi += 1;
            }
        } else if backward {
            let start = p.saturating_sub(ZERO_CHUNK - 1);
            while lo > start
                && self.pt.block(lo).0 == 0
                && self.pt.claim(lo - 1, State::Unpopulated, false).is_some()
            {
                lo -= 1;
            }
        }
        let n = hi - lo;
        self.quota.unreserve((want - n) as u64);
        // SAFETY: the zero buffer is readable; pages lo..hi are ours (Busy) and missing.
        let res = unsafe {
            self.uffd
                .copy(self.addr_of(lo), self.zero.addr(), n * PAGE_SIZE)
        };
        if let Err(e) = res {
            // EEXIST means a page is already mapped (the program discarded it behind our
            // back and touched it again through a path we did not see); anything else is an
            // engine bug. Either way the bytes there are what the program sees.
            if e.error.raw_os_error() != Some(libc::EEXIST) {
                fatal("UFFDIO_COPY of zeros failed", &e.error);
            }
            self.fill_zero_pagewise(lo + e.done / PAGE_SIZE, hi);
        }
        for i in lo..hi {
            self.pt.publish(i, State::Mapped, Some(Activeness::TOUCHED));
        }
        Counters::add(&self.counters.faults_zero, n as u64);
        true
    }

    fn fill_zero_pagewise(&self, from: usize, to: usize) {
        for i in from..to {
            // SAFETY: as in fill_zero, one page at a time.
            if let Err(e) = unsafe { self.uffd.copy(self.addr_of(i), self.zero.addr(), PAGE_SIZE) }
            {
                if e.error.raw_os_error() != Some(libc::EEXIST) {
                    fatal("UFFDIO_COPY of zeros failed", &e.error);
                }
            }
        }
    }

    /// A touch of an inactive page: move it back from its staging slot. It is hot.
    fn reactivate(&self, p: usize) -> bool {
        let Some(old) = self.pt.claim(p, State::Staged, false) else {
            return false;
        };
        let s = self.pt.stage(p);
        // SAFETY: page p is ours (Busy); its bytes are mapped at staging slot s and its arena
        // address is missing. Both ranges are registered.
        let res = unsafe {
            self.uffd
                .move_pages(self.addr_of(p), self.ring.addr(s), PAGE_SIZE)
        };
        if let Err(e) = res {
            let presence = sys::presence_of(self.ring.addr(s));
            let moved_anyway = presence == Some(sys::Presence::Absent)
                && sys::presence_of(self.addr_of(p)).is_some_and(|a| a != sys::Presence::Absent);
            if moved_anyway {
                // The kernel reported a failure but moved the page (see `which_moved`).
                Counters::bump(&self.counters.moves_underreported);
            } else {
                if presence == Some(sys::Presence::Swapped) {
                    // Linux swapped the inactive page out (reclaim or DAMON, with swap on): a read
                    // swaps it back in (the page table holds a swap entry: no missing-page fault).
                    // SAFETY: the staging page is ours (p is Busy) and readable once swapped in.
                    unsafe { std::ptr::read_volatile(self.ring.addr(s) as *const u8) };
                }
                // Fall back to a copy; the staging page stays until the evictor zaps its slot.
                // SAFETY: the staging page is mapped and readable; the arena page is ours.
                if let Err(e2) = unsafe {
                    self.uffd
                        .copy(self.addr_of(p), self.ring.addr(s), PAGE_SIZE)
                } {
                    fatal_with(
                        "moving an inactive page back failed",
                        &[
                            ("move errno", e.error.raw_os_error().unwrap_or(0) as u64),
                            ("page", p as u64),
                            ("slot", s as u64),
                            ("ring slots", self.ring.slots()),
                            (
                                "entry",
                                self.ring.entry(s as u64).load(Ordering::Relaxed) as u64,
                            ),
                            ("tail", self.ring.tail()),
                            ("head", self.ring.head()),
                            ("word", old.0 as u64),
                            (
                                "staging page (0 present, 1 swapped, 2 absent, 3 unknown)",
                                presence_code(presence),
                            ),
                        ],
                        &e2.error,
                    );
                }
            }
        }
        self.pt.set_stage(p, NONE);
        self.ring.staged.fetch_sub(1, Ordering::AcqRel);
        self.pt
            .publish(p, State::Mapped, Some(old.history().touch()));
        Counters::bump(&self.counters.faults_inactive);
        Counters::bump(&self.counters.promotions);
        true
    }

    /// A touch of an evicted page: read it (and, on a sequential run, its neighbours) from
    /// tier 1 and map it.
    fn fetch(&self, p: usize) -> bool {
        let t0 = sys::now_ns();
        // Read-ahead grows with the run of faults that each start where the last read ended
        // (one page gap allowed): none for the first two (an object spanning two pages is
        // not a stream), then 2, 4, 8, 16 pages.
        let window = self.sequential.window(p);
        self.reserve(1);
        let Some(old) = self.pt.claim(p, State::Evicted, false) else {
            self.quota.unreserve(1);
            return false;
        };
        let slot = self.pt.slot(p).expect("an evicted page has a tier slot");
        // Read-ahead: the following evicted pages whose slots follow on.
        let mut n = 1;
        if window > 1 {
            while n < window && p + n < self.pt.pages() {
                let q = p + n;
                if self.pt.slot(q) != Some(slot + n as u64)
                    || self.pt.load(q).state() != State::Evicted
                {
                    break;
                }
                self.reserve(1);
                if self.pt.claim(q, State::Evicted, false).is_none() {
                    self.quota.unreserve(1);
                    break;
                }
                n += 1;
            }
        }
        let buf = self.bounce.take();
        let mut tries = 0;
        loop {
            let r0 = sys::now_ns();
            // SAFETY: `buf` is a bounce buffer of READAHEAD pages owned by this call.
            match unsafe { self.tier.read(slot, n, buf as *mut u8) } {
                Ok(()) => {
                    self.counters.tier_read_latency.record(sys::now_ns() - r0);
                    break;
                }
                Err(e) => {
                    Counters::bump(&self.counters.tier_errors);
                    tries += 1;
                    if tries >= 5 {
                        // The only copy of the program's data is unreadable: stop loudly
                        // rather than hand it wrong bytes.
                        fatal("reading an evicted page from tier 1 failed", &e);
                    }
                }
            }
        }
        // SAFETY: buf holds n pages just read; pages p..p+n are ours (Busy) and missing.
        if let Err(e) = unsafe { self.uffd.copy(self.addr_of(p), buf, n * PAGE_SIZE) } {
            fatal("mapping a fetched page failed", &e.error);
        }
        self.bounce.give(buf);
        for i in 0..n {
            let h = if i == 0 {
                old.history().touch()
            } else {
                self.pt.load(p + i).history()
            };
            self.pt.publish(p + i, State::Mapped, Some(h));
        }
        self.sequential.ended_at(p + n - 1);
        Counters::bump(&self.counters.faults_tier);
        Counters::add(&self.counters.promotions, n as u64);
        Counters::add(&self.counters.readahead_pages, n as u64 - 1);
        Counters::add(&self.counters.tier_read_bytes, (n * PAGE_SIZE) as u64);
        self.counters.fault_tier_latency.record(sys::now_ns() - t0);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readahead_grows_with_the_sequential_run() {
        // Two faults in a row are an object spanning two pages, not a stream.
        assert_eq!(readahead_window(1), 1);
        assert_eq!(readahead_window(2), 1);
        let w: Vec<usize> = (3..=8).map(readahead_window).collect();
        assert_eq!(w, [2, 4, 8, 16, 16, 16]);
        assert_eq!(readahead_window(usize::MAX), READAHEAD);
    }
}
