//! The fault path: a touch of a managed page that is not mapped, resolved by a handler thread
//! (the default delivery), in the faulting thread (from the SIGBUS handler), or before a
//! system call uses the page (`pin`). A first touch maps
//! zeros, a touch of an inactive page moves it back from staging (a hint fault: it is hot), a
//! touch of an evicted page reads it from tier 1. Entry point: [`Engine::handle_fault`].
//!
//! Possibly signal-handler context: no locks, no allocation. It waits only on page words and on
//! the quota, each with a timeout.

use std::cell::Cell;
use std::io;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use memtide_policy::ahead::{readahead_window, zero_fill, Pairs, READAHEAD, ZERO_CHUNK};
use memtide_policy::{Activeness, PAGE_SIZE};

use super::fatal::{fatal, fatal_with, presence_code};
use super::ring::RING_DEAD;
use super::{Engine, Event, Fault};
use crate::pages::{State, TierCopy, Word, NONE};
use crate::stats::Counters;
use crate::sys::{self, Mapping};

/// Faults in a row on one page the engine holds mapped before it looks whether the page is
/// really there (see `check_mapped`).
const MAPPED_MISSING_LIMIT: u32 = 1000;
/// Bounce buffers for tier reads, each `READAHEAD` pages.
const BOUNCE_BUFFERS: usize = 64;
/// Reads of one run of tier slots before the engine gives up on it.
const TIER_READ_TRIES: u32 = 5;

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

    pub(super) fn take(&self) -> usize {
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

    /// A buffer a read may still land in is never handed out again (it stays taken).
    pub(super) fn retire(&self, _buf: usize) {}

    pub(super) fn give(&self, buf: usize) {
        let i = (buf - self.mem.addr()) / (READAHEAD * PAGE_SIZE);
        self.used.fetch_and(!(1 << i), Ordering::Release);
    }
}

/// Where the last tier read ended, and how many reads in a row each started right after the
/// one before: read-ahead grows with that run. A fault that starts a run reads the next page
/// too while objects span page pairs ([`Pairs`]).
pub(super) struct SequentialRun {
    last: AtomicUsize,
    /// The tier slot the last read ended at.
    last_slot: AtomicU64,
    run: AtomicUsize,
    /// Taken with `try_lock` only (faults may be served in a signal handler): a fault that
    /// finds it taken reads one page and counts for nothing.
    pairs: Mutex<Pairs>,
}

impl SequentialRun {
    pub(super) fn new() -> SequentialRun {
        SequentialRun {
            last: AtomicUsize::new(usize::MAX - 1),
            last_slot: AtomicU64::new(u64::MAX - 1),
            run: AtomicUsize::new(0),
            pairs: Mutex::new(Pairs::default()),
        }
    }

    /// A tier fault at page `p`: how many pages to read (one page gap allowed in a run), and
    /// whether the second is the next page of a pair.
    fn window(&self, p: usize) -> (usize, bool) {
        let last = self.last.load(Ordering::Relaxed);
        let run = if p == last.wrapping_add(1) || p == last.wrapping_add(2) {
            self.run.load(Ordering::Relaxed).saturating_add(1)
        } else {
            1
        };
        self.run.store(run, Ordering::Relaxed);
        let pairs = self
            .pairs
            .try_lock()
            .map_or(1, |mut pairs| pairs.fault(p, run == 1));
        let ahead = readahead_window(run);
        (pairs.max(ahead), pairs > ahead)
    }

    /// The read that just ended brought in pages up to `last`, from slots up to `last_slot`.
    fn ended_at(&self, last: usize, last_slot: u64) {
        self.last.store(last, Ordering::Relaxed);
        self.last_slot.store(last_slot, Ordering::Relaxed);
    }

    /// Whether a read of page `p` at `slot` follows the last read in slot order, and whether
    /// it does in slot order only (not in address order).
    fn follows(&self, p: usize, slot: u64) -> (bool, bool) {
        let last_slot = self.last_slot.load(Ordering::Relaxed);
        let by_slot = slot == last_slot.wrapping_add(1) || slot == last_slot.wrapping_add(2);
        let last = self.last.load(Ordering::Relaxed);
        let by_address = p == last.wrapping_add(1) || p == last.wrapping_add(2);
        (by_slot, by_slot && !by_address)
    }
}

impl Engine {
    /// Resolves a fault at `addr`. Called by a handler thread for a queued fault, from the
    /// SIGBUS handler of the faulting thread, or directly to bring a page in before a system
    /// call uses it.
    pub fn handle_fault(&self, addr: usize) -> Fault {
        let _inside = self.gate.enter();
        if !self.contains(addr) {
            return Fault::NotManaged;
        }
        let p = self.page_of(addr);
        // Near the quota, the faulting thread first fills the inactive list for the evictor.
        self.stage_for_fault();
        loop {
            let w = self.pt.load(p);
            match w.state() {
                State::Free => return Fault::NotManaged,
                // Lent to a mapping of the program's own after this fault was raised: the
                // retried access finds that mapping.
                State::Lent => return Fault::Raced,
                State::Mapped => {
                    self.check_mapped(p, addr, w);
                    return Fault::Raced;
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
        if self.pagemap.of(addr).ok() == Some(sys::Presence::Absent) && self.pt.load(p).0 == w.0 {
            // Where might its bytes be? A ring slot still naming the page, and whether that
            // staging slot holds a page.
            let named = self.ring.naming(p);
            let named_presence =
                presence_code(named.and_then(|s| self.pagemap.of(self.ring.addr(s as u32)).ok()));
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
        let want = zero_fill(forward || backward);
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
        // SAFETY: the zero buffer is readable (ZERO_CHUNK pages); pages lo..hi are ours (Busy).
        unsafe { self.fill(lo, self.zero.addr(), n, true, "UFFDIO_COPY of zeros failed") };
        for i in lo..hi {
            self.note(i, Event::FirstTouch);
            self.pt.publish(i, State::Mapped, Some(Activeness::TOUCHED));
            self.arrived(i);
        }
        Counters::add(&self.counters.faults_zero, n as u64);
        true
    }

    /// Maps the `n` pages at `src` at pages `first..first+n` (ours, missing) with one
    /// `UFFDIO_COPY`, or page by page where the range spans VMAs (the program protected part
    /// of it: ENOENT). The kernel answers EEXIST when a page is already there, but also when a
    /// page-table level is missing for a moment: so a page that is in fact missing is copied
    /// again. A page the page tables do show is left as it is if
    /// `keep_present` (zero-fill: the program zapped it behind our back and touched it again
    /// through a path we did not see, so its bytes are the program's); otherwise nothing but
    /// us can have put it there and the engine stops. Stops the program with `what` on any
    /// other error.
    ///
    /// # Safety
    ///
    /// `src..src+n*PAGE_SIZE` must be readable; pages `first..first+n` must be ours.
    pub(super) unsafe fn fill(
        &self,
        first: usize,
        src: usize,
        n: usize,
        keep_present: bool,
        what: &str,
    ) {
        // SAFETY: the caller's contract.
        let Err(e) = (unsafe { self.uffd.copy(self.addr_of(first), src, n * PAGE_SIZE) }) else {
            return;
        };
        let errno = e.error.raw_os_error();
        if errno != Some(libc::EEXIST) && !(errno == Some(libc::ENOENT) && n > 1) {
            fatal(what, &e.error);
        }
        for i in first + e.done / PAGE_SIZE..first + n {
            let from = src + (i - first) * PAGE_SIZE;
            let mut tries = 0u32;
            // SAFETY: as above, one page at a time.
            while let Err(e) = unsafe { self.uffd.copy(self.addr_of(i), from, PAGE_SIZE) } {
                if e.error.raw_os_error() != Some(libc::EEXIST) {
                    fatal(what, &e.error);
                }
                if self.presence(self.addr_of(i)) != sys::Presence::Absent {
                    if keep_present {
                        // Nothing mapped it through us, so nothing woke a thread that
                        // faulted there before it appeared: wake it to retry.
                        if let Err(e) = self.uffd.wake(self.addr_of(i), PAGE_SIZE) {
                            fatal(what, &e);
                        }
                        break;
                    }
                    fatal_with(
                        "a page the engine was bringing in is already mapped",
                        &[("page", i as u64)],
                        &e.error,
                    );
                }
                tries += 1;
                if tries == 1000 {
                    fatal_with(
                        "mapping a page keeps failing with EEXIST although the page is missing",
                        &[("page", i as u64)],
                        &e.error,
                    );
                }
                std::thread::yield_now();
            }
        }
    }

    /// A touch of an inactive page: bring it back from its staging slot. It is hot.
    ///
    /// Copied where the quota has room for a second page (`Config::copy_inactive_hits`): the
    /// slot is left dead, holding its DRAM until the evictor's tail passes it and zaps it with
    /// its neighbours in one flush. Otherwise moved, which flushes the slot's translation on
    /// every other CPU running the program's threads, though none of them has used it.
    fn reactivate(&self, p: usize) -> bool {
        let copy = self.copy_inactive_hits && self.quota.try_reserve(1, &self.bell, &self.counters);
        let Some(old) = self.pt.claim(p, State::Staged, false) else {
            if copy {
                self.quota.unreserve(1);
            }
            return false;
        };
        let s = self.pt.stage(p);
        if copy {
            // SAFETY: a staged page's slot holds its bytes (mapped, or swapped out by Linux,
            // which the kernel's copy reads back in); page p is ours and missing.
            unsafe {
                self.fill(
                    p,
                    self.ring.addr(s),
                    1,
                    false,
                    "copying an inactive page back failed",
                )
            };
            // The slot still holds DRAM (counted in `staged` and the quota) until the tail
            // passes it. Marked before the page is published: the evictor, waiting on the page
            // at the tail, then finds the slot dead.
            self.ring
                .entry(s as u64)
                .store(RING_DEAD, Ordering::Release);
            Counters::bump(&self.counters.faults_inactive_copied);
        } else {
            self.unstage(p, s, old, "moving an inactive page back failed");
            self.ring.staged.fetch_sub(1, Ordering::AcqRel);
        }
        self.pt.set_stage(p, NONE);
        self.note(p, Event::HintFault);
        self.pt.prove(p);
        self.pt
            .publish(p, State::Mapped, Some(old.history().touch()));
        Counters::bump(&self.counters.faults_inactive);
        Counters::bump(&self.counters.promotions);
        true
    }

    /// Brings the bytes of page `p` (ours: `Busy` or `Writing`, word `old` before we took it)
    /// from staging slot `s` back to its arena address. Where the page does not move (Linux
    /// swapped it out, or the kernel refused), it is copied, and the staging page stays until
    /// the evictor zaps its slot. If neither works the program stops with `what`.
    pub(super) fn unstage(&self, p: usize, s: u32, old: Word, what: &str) {
        let mut moved = [false];
        // SAFETY: page p is ours; its bytes are mapped at staging slot s and its arena address
        // is missing. Both ranges are registered.
        let report = unsafe {
            self.uffd.move_verified(
                &self.pagemap,
                self.addr_of(p),
                self.ring.addr(s),
                &mut moved,
            )
        };
        let report =
            report.unwrap_or_else(|e| fatal("reading the page tables after a move failed", &e));
        self.count_underreported(&report);
        if moved[0] {
            return;
        }
        let presence = self.pagemap.of(self.ring.addr(s)).ok();
        if presence == Some(sys::Presence::Absent) {
            // Neither here nor there: copying from the empty slot would fault on the staging
            // area itself (and, on a handler thread, wait for itself).
            fatal_with(
                "an inactive page is neither at its address nor in its staging slot",
                &[
                    ("page", p as u64),
                    ("slot", s as u64),
                    ("word", old.0 as u64),
                ],
                &io::Error::from_raw_os_error(libc::EFAULT),
            );
        }
        if presence == Some(sys::Presence::Swapped) {
            // Linux swapped the inactive page out (reclaim or DAMON, with swap on): a read
            // swaps it back in (the page table holds a swap entry: no missing-page fault).
            // SAFETY: the staging page is ours (p is) and readable once swapped in.
            unsafe { std::ptr::read_volatile(self.ring.addr(s) as *const u8) };
        }
        // SAFETY: the staging page is mapped and readable; the arena page is ours.
        if let Err(e2) = unsafe {
            self.uffd
                .copy(self.addr_of(p), self.ring.addr(s), PAGE_SIZE)
        } {
            let move_errno = report
                .error
                .as_ref()
                .and_then(|e| e.raw_os_error())
                .unwrap_or(0);
            fatal_with(
                what,
                &[
                    ("move errno", move_errno as u64),
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

    /// Reads the `n` pages of pages `p..` from tier slots `slot..` into a bounce buffer and
    /// checks each against the checksum taken when it was written. Returns the buffer and how
    /// many pages from `p` on are right; pages after those are given back (`Evicted`, their
    /// DRAM unreserved) for their own faults to read again. A failed read or a wrong first
    /// page is read again; when that keeps failing the program stops, naming the page and
    /// slot: the only copy of its data cannot be read back as it was written, and wrong bytes
    /// are never served.
    fn read_verified(&self, p: usize, slot: u64, n: usize) -> (usize, usize) {
        let mut buf = self.file.bounce.take();
        let mut tries = 0;
        loop {
            let r0 = sys::now_ns();
            // SAFETY: `buf` is a bounce buffer of READAHEAD pages owned by this call.
            let failure = match unsafe { self.file.backend.read(slot, n, buf as *mut u8) } {
                Ok(()) => {
                    self.counters.tier_read_latency.record(sys::now_ns() - r0);
                    let good = (0..n)
                        .take_while(|&i| self.matches_tier_copy(p + i, buf + i * PAGE_SIZE))
                        .count();
                    if good > 0 {
                        if good < n {
                            Counters::bump(&self.counters.tier_read_mismatches);
                            for q in p + good..p + n {
                                self.pt.publish(q, State::Evicted, None);
                            }
                            self.quota.unreserve((n - good) as u64);
                        }
                        return (buf, good);
                    }
                    Counters::bump(&self.counters.tier_read_mismatches);
                    None
                }
                Err(e) => {
                    self.read_failed(&mut buf, &e);
                    Some(e.error)
                }
            };
            tries += 1;
            if tries < TIER_READ_TRIES {
                continue;
            }
            let facts = [
                ("page", p as u64),
                ("tier slot", slot),
                ("tries", tries as u64),
            ];
            match failure {
                Some(e) if e.raw_os_error() == Some(libc::EBADMSG) => fatal_with(
                    "a page read back from tier 1 failed authentication (it was altered on the device); memtide stops the program rather than serve it",
                    &facts,
                    &e,
                ),
                Some(e) => fatal_with("reading an evicted page from tier 1 failed", &facts, &e),
                None => fatal_with(
                    "a page read back from tier 1 does not match the checksum taken when it was written",
                    &facts,
                    &io::Error::from_raw_os_error(libc::EIO),
                ),
            }
        }
    }

    /// Whether the page read into `buf` for page `q` is the one written to its tier slot.
    /// Counts a tier read that failed; a buffer the read may still land in is retired and
    /// `buf` becomes a fresh one.
    pub(super) fn read_failed(&self, buf: &mut usize, e: &crate::tier::ReadError) {
        Counters::bump(&self.counters.tier_errors);
        if e.buffer_lost {
            self.file.bounce.retire(*buf);
            *buf = self.file.bounce.take();
        }
    }

    pub(super) fn matches_tier_copy(&self, q: usize, buf: usize) -> bool {
        // SAFETY: `buf` is a page of a bounce buffer this thread holds, just read into.
        let bytes = unsafe { std::slice::from_raw_parts(buf as *const u8, PAGE_SIZE) };
        xxhash_rust::xxh3::xxh3_64(bytes) == self.pt.hash(q)
    }

    /// A touch of an evicted page: decompress it from the pool, or read it (and, on a
    /// sequential run, its neighbours) from the file, and map it.
    fn fetch(&self, p: usize) -> bool {
        let t0 = sys::now_ns();
        self.reserve(1);
        let Some(old) = self.pt.claim(p, State::Evicted, false) else {
            self.quota.unreserve(1);
            return false;
        };
        let slot = match self.pt.copy(p) {
            Some(TierCopy::File(slot)) => {
                if let Some(c) = &self.compressed {
                    c.file_fault(p);
                }
                slot
            }
            Some(copy) => {
                self.fetch_compressed(p, old, copy, t0);
                return true;
            }
            None => fatal_with(
                "an evicted page has no copy below DRAM",
                &[("page", p as u64), ("word", old.0 as u64)],
                &io::Error::from_raw_os_error(libc::EFAULT),
            ),
        };
        // Read-ahead grows with the run of faults that each start where the last read ended
        // (one page gap allowed): none for the first two (an object spanning two pages is
        // not a stream), then 2, 4, 8, 16 pages; the first reads the next page too while
        // pairs are common.
        let (window, pair) = self.file.sequential.window(p);
        // Read-ahead: the following evicted pages whose slots follow on.
        let mut n = 1;
        if window > 1 {
            while n < window && p + n < self.pt.pages() {
                let q = p + n;
                let seen = slot + n as u64;
                if self.pt.slot(q) != Some(seen) || self.pt.load(q).state() != State::Evicted {
                    break;
                }
                self.inject.readahead.pass([q as u64, seen]);
                self.reserve(1);
                if self.pt.claim(q, State::Evicted, false).is_none() {
                    self.quota.unreserve(1);
                    break;
                }
                // Decide from the slot only now that the page is ours: before the claim (and
                // the reservation, which can sleep) it may have been fetched, rewritten and
                // evicted to another slot, and its old slot handed to another page.
                if self.pt.slot(q) != Some(seen) {
                    self.pt.publish(q, State::Evicted, None);
                    self.quota.unreserve(1);
                    break;
                }
                n += 1;
            }
        }
        let (by_slot, by_slot_only) = self.file.sequential.follows(p, slot);
        Counters::add(&self.counters.faults_tier_slot_follows, by_slot as u64);
        Counters::add(
            &self.counters.faults_tier_slot_follows_only,
            by_slot_only as u64,
        );
        let (buf, n) = self.read_verified(p, slot, n);
        // Where this read ended, and the counts, before the pages are mapped: mapping wakes
        // the faulting thread, whose next fault (on another handler thread, perhaps) must
        // find this one's end to count as the run's next, and whose reads of the counters
        // must include its own fault.
        self.file
            .sequential
            .ended_at(p + n - 1, slot + n as u64 - 1);
        self.note(p, Event::TierFault);
        Counters::bump(&self.counters.faults_tier);
        Counters::add(&self.counters.promotions, n as u64);
        Counters::add(&self.counters.readahead_pages, n as u64 - 1);
        if pair {
            Counters::add(&self.counters.readahead_pairs, n as u64 - 1);
        }
        Counters::add(&self.counters.tier_read_bytes, (n * PAGE_SIZE) as u64);
        // SAFETY: buf holds n pages just read; pages p..p+n are ours (Busy) and missing.
        unsafe { self.fill(p, buf, n, false, "mapping a fetched page failed") };
        self.file.bounce.give(buf);
        for i in 0..n {
            let h = if i == 0 {
                old.history().touch()
            } else {
                self.pt.load(p + i).history()
            };
            self.pt.publish(p + i, State::Mapped, Some(h));
        }
        for q in p..p + n {
            self.arrived(q);
        }
        self.counters.fault_tier_latency.record(sys::now_ns() - t0);
        true
    }
}
