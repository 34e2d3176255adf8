//! The engine: one arena of managed memory registered with userfaultfd, its page table, the
//! fault path (run in the faulting thread, from the SIGBUS handler) and the evictor thread.
//! Entry points: [`Engine::start`], [`Engine::alloc`], [`Engine::handle_fault`].
//!
//! # How a page moves
//!
//! ```text
//!  Unpopulated --first touch (zero-fill, 16-page chunks)--> Mapped
//!  Mapped --evictor: UFFDIO_MOVE to a staging slot--> Staged      (the inactive list)
//!  Staged --program touches it: UFFDIO_MOVE back--> Mapped        (a hint fault: it is hot)
//!  Staged --evictor: write to tier 1 (or drop if clean/zero)--> Evicted (or Unpopulated)
//!  Evicted --program touches it: read tier 1, UFFDIO_COPY--> Mapped (tier copy kept: clean)
//! ```
//!
//! # Invariants
//!
//! - No write is lost: a page leaves the program's view only by `UFFDIO_MOVE`, which unmaps
//!   and moves it atomically; its DRAM is released (staging zapped) only after its bytes are in
//!   tier 1 (the write returned) or are known to equal the tier copy or to be all zero.
//! - The fault path takes no locks and allocates nothing (it runs in a signal handler); it
//!   waits only on page words and on the quota, each with a timeout, and the evictor, which
//!   it waits for, never waits for a quota.
//! - `resident` counts pages holding DRAM (mapped, staged, writing, or in flight); a faulting
//!   thread reserves quota before it claims a page.

use std::cell::Cell;
use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use memtide_policy::{Activeness, EpochClock, Sweep, Watermarks, PAGE_SIZE};

use crate::arena::RangeAlloc;
use crate::pages::{PageTable, State, Word, NONE};
use crate::stats::{Counters, Snapshot};
use crate::sys::{self, Mapping};
use crate::tier::{self, Backend, FileTier, SlotMap, TierOpenError};
use crate::uffd::{OpenError, Uffd};

/// Pages zero-filled together on a first touch (64 KiB).
const ZERO_CHUNK: usize = 16;
/// Most pages read ahead on a sequential run of tier faults.
const READAHEAD: usize = 16;
/// Faults in a row on one page the engine holds mapped before it looks whether the page is
/// really there (see `check_mapped`).
const MAPPED_MISSING_LIMIT: u32 = 1000;
/// Pages a tier read brings in on the `run`-th fault of a sequential run: 1, 1, 2, 4, 8,
/// then `READAHEAD`.
fn readahead_window(run: usize) -> usize {
    if run < 3 {
        1
    } else {
        (1usize << (run - 2).min(8)).min(READAHEAD)
    }
}

/// Bounce buffers for tier reads, each `READAHEAD` pages.
const BOUNCE_BUFFERS: usize = 64;
/// Ring entry values besides `page + 1`.
const RING_EMPTY: u32 = 0;
const RING_DEAD: u32 = u32::MAX;

/// What the engine is asked to do.
#[derive(Clone, Debug)]
pub struct Config {
    /// DRAM quota for managed memory, in bytes.
    pub dram_bytes: u64,
    /// Directory to create the tier file in, or the file to create.
    pub tier_path: PathBuf,
    /// Most bytes tier 1 may hold (default: the arena's size).
    pub tier_bytes: Option<u64>,
    /// Virtual size of the arena: the most managed memory the program can have at once.
    pub arena_bytes: u64,
    /// Length of an activeness epoch.
    pub epoch_ms: u64,
}

impl Config {
    /// The defaults for a quota and a tier path.
    pub fn new(dram_bytes: u64, tier_path: impl Into<PathBuf>) -> Config {
        Config {
            dram_bytes,
            tier_path: tier_path.into(),
            tier_bytes: None,
            arena_bytes: 1 << 40,
            epoch_ms: 200,
        }
    }
}

/// Why the engine could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Uffd(#[from] OpenError),
    #[error(transparent)]
    Tier(#[from] TierOpenError),
    #[error("the DRAM quota must be at least 64 KiB")]
    QuotaTooSmall,
    #[error("cannot {what}: {source}")]
    Io {
        what: &'static str,
        source: io::Error,
    },
}

fn io_err(what: &'static str) -> impl FnOnce(io::Error) -> StartError {
    move |source| StartError::Io { what, source }
}

/// What the fault path did with an address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Resolved: return and retry the access.
    Handled,
    /// Not managed memory (or memory the program freed): the program's own fault.
    NotManaged,
}

/// Why a managed-memory call failed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MemError {
    #[error("the arena has no room for the request")]
    NoRoom,
    #[error("the range is not managed memory")]
    NotManaged,
    #[error("this form of the call is not supported on managed memory")]
    Unsupported,
}

/// Page-sized, aligned buffers for tier reads, taken without locks.
struct BouncePool {
    mem: Mapping,
    used: AtomicU64,
}

impl BouncePool {
    fn new() -> io::Result<BouncePool> {
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

/// The engine for one process's managed memory.
pub struct Engine {
    // Field order is drop order: the uffd goes after the mappings registered with it, which
    // is harmless either way; the engine is never dropped while the program runs.
    arena: Mapping,
    staging: Mapping,
    /// Ring of staging slots: which page each holds (page + 1), or `RING_EMPTY`/`RING_DEAD`.
    ring: Mapping,
    ring_slots: u64,
    ring_head: AtomicU64,
    ring_tail: AtomicU64,
    pt: PageTable,
    uffd: Uffd,
    tier: Box<dyn Backend>,
    slots: Mutex<SlotMap>,
    ranges: Mutex<RangeAlloc>,
    high_water: AtomicUsize,
    zero: Mapping,
    bounce: BouncePool,
    wm: Watermarks,
    epoch_ns: u64,
    resident: AtomicU64,
    staged: AtomicU64,
    /// Bumped and woken when the evictor frees DRAM.
    freed: AtomicU32,
    quota_waiters: AtomicU32,
    /// Bumped and woken to wake the evictor early.
    kick: AtomicU32,
    evictor_sleeping: AtomicBool,
    /// Set when eviction cannot make room (tier full or failing, nothing evictable): faulting
    /// threads are then admitted above the quota instead of waiting.
    overcommit: AtomicBool,
    tier_failed: AtomicBool,
    /// Set after `fork` fallback: memory is all in DRAM and no longer registered.
    detached: AtomicBool,
    /// Whether the arena and staging area are locked in DRAM (see `start`).
    locked: bool,
    /// Asks the evictor to stop (for `fork` and for audits).
    pause: AtomicBool,
    /// Set by the evictor once it has seen `pause` and stopped.
    parked: AtomicBool,
    /// The last page the latest tier read brought in, and how many tier reads in a row each
    /// started right after the one before (read-ahead grows with it).
    last_tier_fault: AtomicUsize,
    tier_fault_run: AtomicUsize,
    pub counters: Counters,
    warnings: Mutex<Vec<String>>,
    start_ns: u64,
    pid: u32,
}

impl Engine {
    /// Creates the arena, the tier file and the evictor thread, and installs the fault handler.
    /// The engine lives as long as the process.
    pub fn start(cfg: &Config) -> Result<&'static Engine, StartError> {
        if cfg.dram_bytes < (ZERO_CHUNK * PAGE_SIZE) as u64 {
            return Err(StartError::QuotaTooSmall);
        }
        let uffd = Uffd::open()?;
        let (tier, tier_note) = tier::best(FileTier::create(&cfg.tier_path)?);
        let arena_pages = (cfg.arena_bytes as usize / PAGE_SIZE).max(ZERO_CHUNK);
        let arena = Mapping::anon(arena_pages * PAGE_SIZE).map_err(io_err("reserve the arena"))?;
        let wm = Watermarks::for_quota(cfg.dram_bytes / PAGE_SIZE as u64);
        let ring_slots = wm.inactive_target + 4 * wm.batch;
        let staging = Mapping::anon(ring_slots as usize * PAGE_SIZE)
            .map_err(io_err("reserve the staging area"))?;
        for m in [&arena, &staging] {
            // SAFETY: advice on our own fresh mappings; NOHUGEPAGE keeps every page 4 KiB so
            // that moves never split huge pages.
            unsafe { sys::madvise(m.addr(), m.len(), libc::MADV_NOHUGEPAGE) }
                .map_err(io_err("configure the arena"))?;
            uffd.register(m.addr(), m.len())
                .map_err(io_err("register the arena with userfaultfd"))?;
        }
        // Managed DRAM is locked as it is faulted in: memtide decides what leaves DRAM, and
        // Linux must not swap managed pages out behind it (a page moved with UFFDIO_MOVE while
        // swapped out can come back as zeros on this kernel). Without the privilege to lock
        // (RLIMIT_MEMLOCK), the evictor skips swapped-out pages instead.
        let locked = [&arena, &staging]
            .iter()
            .all(|m| sys::lock_on_fault(m.addr(), m.len()).is_ok());
        let tier_limit = cfg.tier_bytes.unwrap_or(cfg.arena_bytes) / PAGE_SIZE as u64;
        let engine = Box::leak(Box::new(Engine {
            ring: Mapping::anon(ring_slots as usize * 4).map_err(io_err("map the ring"))?,
            ring_slots,
            ring_head: AtomicU64::new(0),
            ring_tail: AtomicU64::new(0),
            pt: PageTable::new(arena_pages).map_err(io_err("map the page table"))?,
            tier,
            slots: Mutex::new(SlotMap::new(tier_limit.min(u32::MAX as u64 - 2))),
            ranges: Mutex::new(RangeAlloc::new(arena_pages)),
            high_water: AtomicUsize::new(0),
            zero: Mapping::anon(ZERO_CHUNK * PAGE_SIZE).map_err(io_err("map zeros"))?,
            bounce: BouncePool::new().map_err(io_err("map bounce buffers"))?,
            wm,
            epoch_ns: cfg.epoch_ms.max(1) * 1_000_000,
            resident: AtomicU64::new(0),
            staged: AtomicU64::new(0),
            freed: AtomicU32::new(0),
            quota_waiters: AtomicU32::new(0),
            kick: AtomicU32::new(0),
            evictor_sleeping: AtomicBool::new(false),
            overcommit: AtomicBool::new(false),
            tier_failed: AtomicBool::new(false),
            detached: AtomicBool::new(false),
            locked,
            pause: AtomicBool::new(false),
            parked: AtomicBool::new(false),
            last_tier_fault: AtomicUsize::new(usize::MAX - 1),
            tier_fault_run: AtomicUsize::new(0),
            counters: Counters::default(),
            warnings: Mutex::new(Vec::new()),
            start_ns: sys::now_ns(),
            pid: std::process::id(),
            arena,
            staging,
            uffd,
        }));
        if let Some(note) = tier_note {
            engine.warn(note);
        }
        let swap_on = std::fs::read_to_string("/proc/swaps").is_ok_and(|s| s.lines().count() > 1);
        if !engine.locked && swap_on {
            engine.warn("cannot lock managed memory in DRAM (needs CAP_IPC_LOCK or a larger RLIMIT_MEMLOCK) and swap is on: Linux may swap managed pages out; memtide leaves those alone until they are touched".into());
        }
        if !engine.tier.direct() {
            engine.warn(format!(
                "tier {} does not support O_DIRECT; using buffered I/O (tier reads may be served from the page cache)",
                cfg.tier_path.display()
            ));
        }
        crate::signal::install().map_err(io_err("install the SIGBUS handler"))?;
        crate::signal::register(engine);
        let e: &'static Engine = engine;
        std::thread::Builder::new()
            .name("memtide-evict".into())
            .spawn(move || {
                // A dead evictor would leave faulting threads waiting for room forever: a
                // panic here ends the process loudly instead.
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| e.evictor_main()))
                    .is_err()
                {
                    eprintln!("memtide: fatal: the evictor thread panicked");
                    std::process::abort();
                }
            })
            .map_err(io_err("start the evictor thread"))?;
        Ok(e)
    }

    // ----- addresses -----

    pub fn contains(&self, addr: usize) -> bool {
        addr.wrapping_sub(self.arena.addr()) < self.arena.len()
    }

    fn page_of(&self, addr: usize) -> usize {
        (addr - self.arena.addr()) / PAGE_SIZE
    }

    fn addr_of(&self, page: usize) -> usize {
        self.arena.addr() + page * PAGE_SIZE
    }

    /// The tier slot map. A panic while it was held cannot leave it inconsistent (every update
    /// is one bitmap change and its counter), so a poisoned lock is taken as is.
    fn slots(&self) -> std::sync::MutexGuard<'_, SlotMap> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn ring_entry(&self, pos: u64) -> &AtomicU32 {
        &self.ring.as_slice::<AtomicU32>()[(pos % self.ring_slots) as usize]
    }

    fn stage_addr(&self, s: u32) -> usize {
        self.staging.addr() + s as usize * PAGE_SIZE
    }

    /// The DRAM quota in bytes.
    pub fn quota_bytes(&self) -> u64 {
        self.wm.quota * PAGE_SIZE as u64
    }

    /// Pages of managed memory the program currently has allocated.
    pub fn managed_pages(&self) -> u64 {
        self.counters.managed_pages.load(Ordering::Relaxed)
    }

    /// Pages currently holding DRAM.
    pub fn resident_pages(&self) -> u64 {
        self.resident.load(Ordering::Relaxed)
    }

    fn warn(&self, msg: String) {
        if let Ok(mut w) = self.warnings.lock() {
            if !w.contains(&msg) {
                eprintln!("memtide: warning: {msg}");
                w.push(msg);
            }
        }
    }

    // ----- the fault path (signal handler context: no locks, no allocation) -----

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
            let named = (0..self.ring_slots)
                .find(|&s| self.ring_entry(s).load(Ordering::Relaxed) == p as u32 + 1);
            let named_presence =
                presence_code(named.and_then(|s| sys::presence_of(self.stage_addr(s as u32))));
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
        let limit = self.wm.hard_limit();
        loop {
            let r = self.resident.fetch_add(n, Ordering::AcqRel) + n;
            if self.wm.over_high(r) {
                self.kick_evictor();
            }
            if r <= limit
                || self.overcommit.load(Ordering::Acquire)
                || self.detached.load(Ordering::Relaxed)
            {
                Counters::peak(&self.counters.peak_resident_pages, r);
                if r > limit {
                    Counters::add(&self.counters.quota_overruns, n);
                }
                return;
            }
            self.resident.fetch_sub(n, Ordering::AcqRel);
            let seen = self.freed.load(Ordering::Acquire);
            Counters::bump(&self.counters.quota_waits);
            self.quota_waiters.fetch_add(1, Ordering::AcqRel);
            if self.resident.load(Ordering::Acquire) + n > limit
                && !self.overcommit.load(Ordering::Acquire)
            {
                self.kick_evictor();
                sys::futex_wait(&self.freed, seen, 10_000_000);
            }
            self.quota_waiters.fetch_sub(1, Ordering::AcqRel);
        }
    }

    fn unreserve(&self, n: u64) {
        if n > 0 {
            self.resident.fetch_sub(n, Ordering::AcqRel);
        }
    }

    fn kick_evictor(&self) {
        if self.evictor_sleeping.load(Ordering::Acquire) {
            self.kick.fetch_add(1, Ordering::AcqRel);
            sys::futex_wake(&self.kick);
        }
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
            self.unreserve(want as u64);
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
        self.unreserve((want - n) as u64);
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
                .move_pages(self.addr_of(p), self.stage_addr(s), PAGE_SIZE)
        };
        if let Err(e) = res {
            let presence = sys::presence_of(self.stage_addr(s));
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
                    unsafe { std::ptr::read_volatile(self.stage_addr(s) as *const u8) };
                }
                // Fall back to a copy; the staging page stays until the evictor zaps its slot.
                // SAFETY: the staging page is mapped and readable; the arena page is ours.
                if let Err(e2) = unsafe {
                    self.uffd
                        .copy(self.addr_of(p), self.stage_addr(s), PAGE_SIZE)
                } {
                    fatal_with(
                        "moving an inactive page back failed",
                        &[
                            ("move errno", e.error.raw_os_error().unwrap_or(0) as u64),
                            ("page", p as u64),
                            ("slot", s as u64),
                            ("ring slots", self.ring_slots),
                            (
                                "entry",
                                self.ring_entry(s as u64).load(Ordering::Relaxed) as u64,
                            ),
                            ("tail", self.ring_tail.load(Ordering::Relaxed)),
                            ("head", self.ring_head.load(Ordering::Relaxed)),
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
        self.staged.fetch_sub(1, Ordering::AcqRel);
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
        let window = {
            let last = self.last_tier_fault.load(Ordering::Relaxed);
            let run = if p == last.wrapping_add(1) || p == last.wrapping_add(2) {
                self.tier_fault_run
                    .load(Ordering::Relaxed)
                    .saturating_add(1)
            } else {
                1
            };
            self.tier_fault_run.store(run, Ordering::Relaxed);
            readahead_window(run)
        };
        self.reserve(1);
        let Some(old) = self.pt.claim(p, State::Evicted, false) else {
            self.unreserve(1);
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
                    self.unreserve(1);
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
        self.last_tier_fault.store(p + n - 1, Ordering::Relaxed);
        Counters::bump(&self.counters.faults_tier);
        Counters::add(&self.counters.promotions, n as u64);
        Counters::add(&self.counters.readahead_pages, n as u64 - 1);
        Counters::add(&self.counters.tier_read_bytes, (n * PAGE_SIZE) as u64);
        self.counters.fault_tier_latency.record(sys::now_ns() - t0);
        true
    }

    // ----- the program's memory calls (normal context) -----

    /// Allocates `len` bytes of managed memory aligned to `align` (a power of two, at least a
    /// page), as for an anonymous `mmap`. The memory reads as zeros.
    pub fn alloc(&self, len: usize, align: usize) -> Result<usize, MemError> {
        self.alloc_kind(len, align, false)
    }

    /// Allocates a malloc-family block: like [`alloc`](Self::alloc), but remembered as such,
    /// so that [`malloc_len`](Self::malloc_len) knows it. (Other allocators may place their
    /// own blocks in managed mappings; those are not ours to free.)
    pub fn alloc_malloc(&self, len: usize, align: usize) -> Result<usize, MemError> {
        self.alloc_kind(len, align, true)
    }

    fn alloc_kind(&self, len: usize, align: usize, malloc: bool) -> Result<usize, MemError> {
        if self.in_child() {
            return Err(MemError::NoRoom);
        }
        let pages = len.div_ceil(PAGE_SIZE).max(1);
        let align_pages = (align / PAGE_SIZE).max(1);
        let start = {
            let mut r = self.ranges.lock().unwrap_or_else(|e| e.into_inner());
            let s = r.alloc(pages, align_pages).ok_or(MemError::NoRoom)?;
            self.high_water.store(r.high_water(), Ordering::Release);
            s
        };
        for i in start..start + pages {
            self.pt.allocate(i);
        }
        self.pt.set_block(start, pages, malloc);
        let m = self
            .counters
            .managed_pages
            .fetch_add(pages as u64, Ordering::Relaxed)
            + pages as u64;
        Counters::peak(&self.counters.peak_managed_pages, m);
        Ok(self.addr_of(start))
    }

    fn page_range(&self, addr: usize, len: usize) -> Result<(usize, usize), MemError> {
        if !self.contains(addr) || !addr.is_multiple_of(PAGE_SIZE) {
            return Err(MemError::NotManaged);
        }
        let first = self.page_of(addr);
        let pages = len.div_ceil(PAGE_SIZE).min(self.pt.pages() - first);
        Ok((first, pages))
    }

    /// Takes every page of `[first, first+pages)` out of wherever it is, leaving each `Busy`
    /// and its DRAM and tier slot released, or `Free` pages untouched. Returns the pages it
    /// claimed. `keep_slots` leaves tier slots attached (for moves).
    fn take_pages(&self, first: usize, pages: usize, out: &mut Vec<(usize, State)>) {
        for i in first..first + pages {
            if let Some(old) = self.pt.claim_any(i) {
                out.push((i, old.state()));
            }
        }
    }

    /// Drops the contents of pages claimed by [`take_pages`](Self::take_pages): zaps mapped
    /// pages, frees tier slots, marks staged pages dead for the evictor.
    fn drop_contents(&self, first: usize, pages: usize, taken: &[(usize, State)]) {
        let mut mapped = 0u64;
        {
            let mut slots = self.slots();
            for &(i, st) in taken {
                match st {
                    State::Mapped => mapped += 1,
                    State::Staged => {
                        // The staging slot keeps holding DRAM until the evictor's tail passes
                        // it; it counts that page then.
                        self.ring_entry(self.pt.stage(i) as u64)
                            .store(RING_DEAD, Ordering::Release);
                        self.pt.set_stage(i, NONE);
                    }
                    _ => {}
                }
                if let Some(s) = self.pt.slot(i) {
                    slots.free(s);
                    self.pt.set_slot(i, None);
                }
            }
        }
        if mapped > 0 || self.is_detached() {
            // SAFETY: every mapped page in the range is ours (Busy) and the program asked
            // for its contents to go; Free pages in the range are already empty.
            unsafe {
                let _ = sys::discard(self.addr_of(first), pages * PAGE_SIZE);
            }
            self.unreserve(mapped);
        }
    }

    /// `munmap` of managed memory: the range goes back to the arena.
    pub fn release(&self, addr: usize, len: usize) -> Result<(), MemError> {
        let (first, pages) = self.page_range(addr, len)?;
        if self.in_child() {
            return self.child_zap(first, pages);
        }
        let mask = sys::block_signals();
        let mut taken = Vec::with_capacity(pages.min(1 << 16));
        self.take_pages(first, pages, &mut taken);
        self.drop_contents(first, pages, &taken);
        for &(i, _) in &taken {
            self.pt.set_block(i, 0, false);
            self.pt.publish(i, State::Free, Some(Activeness(0)));
        }
        {
            let mut r = self.ranges.lock().unwrap_or_else(|e| e.into_inner());
            let mut run: Option<(usize, usize)> = None;
            for &(i, _) in &taken {
                run = match run {
                    Some((s, n)) if s + n == i => Some((s, n + 1)),
                    Some((s, n)) => {
                        r.free(s, n);
                        Some((i, 1))
                    }
                    None => Some((i, 1)),
                };
            }
            if let Some((s, n)) = run {
                r.free(s, n);
            }
        }
        self.counters
            .managed_pages
            .fetch_sub(taken.len() as u64, Ordering::Relaxed);
        sys::restore_signals(&mask);
        Ok(())
    }

    /// `madvise(MADV_DONTNEED/MADV_FREE)` of managed memory: the range stays allocated and
    /// reads as zeros.
    pub fn discard(&self, addr: usize, len: usize) -> Result<(), MemError> {
        let (first, pages) = self.page_range(addr, len)?;
        if self.in_child() {
            return self.child_zap(first, pages);
        }
        let mask = sys::block_signals();
        let mut taken = Vec::with_capacity(pages.min(1 << 16));
        self.take_pages(first, pages, &mut taken);
        self.drop_contents(first, pages, &taken);
        for &(i, _) in &taken {
            self.pt.publish(i, State::Unpopulated, Some(Activeness(0)));
        }
        sys::restore_signals(&mask);
        Ok(())
    }

    /// In a forked child: discards the range's contents and leaves the address space alone.
    fn child_zap(&self, first: usize, pages: usize) -> Result<(), MemError> {
        // SAFETY: the program released or discarded this range; in the child it is plain
        // anonymous memory.
        unsafe {
            let _ = sys::discard(self.addr_of(first), pages * PAGE_SIZE);
        }
        Ok(())
    }

    /// Length in bytes of the malloc-family block that starts at `addr` (made by
    /// [`alloc_malloc`](Self::alloc_malloc), maybe resized by [`remap`](Self::remap)), if one
    /// does. Lock-free.
    pub fn malloc_len(&self, addr: usize) -> Option<usize> {
        if !self.contains(addr) || !addr.is_multiple_of(PAGE_SIZE) {
            return None;
        }
        match self.pt.block(self.page_of(addr)) {
            (n, true) if n > 0 => Some(n * PAGE_SIZE),
            _ => None,
        }
    }

    /// `mremap` of managed memory: shrinks in place, grows in place when the arena has room
    /// after the range, or else (with `may_move`) moves every page's contents to a new range.
    pub fn remap(
        &self,
        addr: usize,
        old_len: usize,
        new_len: usize,
        may_move: bool,
    ) -> Result<usize, MemError> {
        let (first, old_pages) = self.page_range(addr, old_len)?;
        let new_pages = new_len.div_ceil(PAGE_SIZE).max(1);
        if (self.in_child() || self.is_detached()) && new_pages > old_pages {
            // Plain memory now: the caller copies.
            return Err(MemError::NoRoom);
        }
        if new_pages <= old_pages {
            if new_pages < old_pages {
                self.release(
                    self.addr_of(first + new_pages),
                    (old_pages - new_pages) * PAGE_SIZE,
                )?;
                if !self.in_child() {
                    let malloc = self.pt.block(first).1;
                    self.pt.set_block(first, new_pages, malloc);
                }
            }
            return Ok(addr);
        }
        let grown_in_place = {
            let mut r = self.ranges.lock().unwrap_or_else(|e| e.into_inner());
            let ok = r.alloc_at(first + old_pages, new_pages - old_pages);
            self.high_water.store(r.high_water(), Ordering::Release);
            ok
        };
        if grown_in_place {
            for i in first + old_pages..first + new_pages {
                self.pt.allocate(i);
            }
            let malloc = self.pt.block(first).1;
            self.pt.set_block(first, new_pages, malloc);
            let m = self
                .counters
                .managed_pages
                .fetch_add((new_pages - old_pages) as u64, Ordering::Relaxed);
            Counters::peak(&self.counters.peak_managed_pages, m);
            return Ok(addr);
        }
        if !may_move {
            return Err(MemError::NoRoom);
        }
        let to = self.alloc_kind(new_len, PAGE_SIZE, self.pt.block(first).1)?;
        self.move_contents(first, self.page_of(to), old_pages);
        self.release(addr, old_pages * PAGE_SIZE)?;
        Ok(to)
    }

    /// Moves the contents of `pages` pages from `from` to `to` (fresh, unpopulated pages),
    /// whatever tier each page is in, leaving the source pages unpopulated.
    fn move_contents(&self, from: usize, to: usize, pages: usize) {
        let mask = sys::block_signals();
        let mut taken = Vec::with_capacity(pages.min(1 << 16));
        self.take_pages(from, pages, &mut taken);
        for &(i, _) in &taken {
            // The destination is a fresh allocation, but a page of it may already have been
            // zero-filled (a program thread touching it through a stray pointer): take it
            // whatever its state, and empty it, so that what lands there is the source page.
            let j = to + (i - from);
            if let Some(old) = self.pt.claim_any(j) {
                if old.state() != State::Unpopulated {
                    self.drop_contents(j, 1, &[(j, old.state())]);
                }
            }
        }
        // Mapped pages move in runs with UFFDIO_MOVE (no copy, no DRAM change).
        let mut k = 0;
        while k < taken.len() {
            if taken[k].1 != State::Mapped {
                k += 1;
                continue;
            }
            let start = k;
            while k < taken.len()
                && taken[k].1 == State::Mapped
                && taken[k].0 == taken[start].0 + (k - start)
            {
                k += 1;
            }
            let i = taken[start].0;
            let n = k - start;
            // SAFETY: source pages are ours (Busy) and mapped; destination pages are ours
            // (Busy), fresh and missing. Both lie in the registered arena.
            if let Err(e) = unsafe {
                self.uffd.move_pages(
                    self.addr_of(to + (i - from)),
                    self.addr_of(i),
                    n * PAGE_SIZE,
                )
            } {
                // A page that cannot be moved (shared after fork) is copied instead.
                let done = e.done / PAGE_SIZE;
                for q in i + done..i + n {
                    // SAFETY: the source page is mapped and ours; the destination is ours.
                    if let Err(e2) = unsafe {
                        self.uffd
                            .copy(self.addr_of(to + (q - from)), self.addr_of(q), PAGE_SIZE)
                    } {
                        fatal("moving memory for mremap failed", &e2.error);
                    }
                    // SAFETY: the source page is ours; its contents now live at the destination.
                    unsafe {
                        let _ = sys::discard(self.addr_of(q), PAGE_SIZE);
                    }
                }
            }
        }
        for &(i, st) in &taken {
            let j = to + (i - from);
            let h = self.pt.load(i).history();
            if let Some(s) = self.pt.slot(i) {
                self.pt.set_slot(j, Some(s));
                self.pt.set_hash(j, self.pt.hash(i));
                self.pt.set_slot(i, None);
            }
            if st == State::Staged {
                // Order matters to the evictor reading the ring concurrently: the new page
                // names its slot before the ring names the new page, and the old page forgets
                // its slot only after that (see write_back).
                let s = self.pt.stage(i);
                self.pt.set_stage(j, s);
                self.ring_entry(s as u64)
                    .store(j as u32 + 1, Ordering::Release);
                self.pt.set_stage(i, NONE);
            }
            self.pt.publish(j, st, Some(h));
            self.pt.publish(i, State::Unpopulated, Some(Activeness(0)));
        }
        sys::restore_signals(&mask);
    }

    /// Brings every page of `[addr, addr+len)` into DRAM and pins it there until the guard is
    /// dropped: for system calls that read or write managed memory from the kernel, where a
    /// missing page would fail the call with EFAULT instead of faulting.
    pub fn pin(&self, addr: usize, len: usize) -> Pinned<'_> {
        let mut pinned = Pinned {
            engine: self,
            first: 0,
            pages: 0,
        };
        if len == 0 || self.detached.load(Ordering::Relaxed) || self.in_child() {
            return pinned;
        }
        let lo = addr.max(self.arena.addr());
        let hi = (addr.saturating_add(len)).min(self.arena.addr() + self.arena.len());
        if lo >= hi {
            return pinned;
        }
        let first = self.page_of(lo);
        let last = self.page_of(hi - 1);
        pinned.first = first;
        let mask = sys::block_signals();
        for i in first..=last {
            loop {
                if self.pt.pin(i) {
                    break;
                }
                let w = self.pt.load(i);
                match w.state() {
                    State::Free => {
                        sys::restore_signals(&mask);
                        return pinned;
                    }
                    State::Mapped => std::thread::yield_now(),
                    _ => {
                        self.handle_fault(self.addr_of(i));
                    }
                }
            }
            pinned.pages += 1;
        }
        sys::restore_signals(&mask);
        pinned
    }

    // ----- fork fallback -----

    /// Before `fork`: brings every page back into DRAM and stops tiering, so that the child
    /// gets an ordinary copy-on-write copy of all memory. (Tiering in both processes after
    /// fork needs userfaultfd's fork events and is not done yet.)
    pub fn detach_for_fork(&self) {
        if self.detached.swap(true, Ordering::AcqRel) {
            return;
        }
        // Stop the evictor first: nothing may leave DRAM once we start bringing pages back.
        self.pause_evictor();
        let mask = sys::block_signals();
        let hw = self.high_water.load(Ordering::Acquire);
        for i in 0..hw {
            while !matches!(
                self.pt.load(i).state(),
                State::Free | State::Mapped | State::Unpopulated
            ) {
                self.handle_fault(self.addr_of(i));
            }
        }
        if let Err(e) = self.uffd.unregister(self.arena.addr(), self.arena.len()) {
            fatal("unregistering the arena before fork failed", &e);
        }
        // Plain memory from now on: Linux manages it as any other.
        let _ = sys::unlock(self.arena.addr(), self.arena.len());
        self.warn("the program forked: its managed memory was brought back into DRAM and is no longer tiered (tiering across fork is not supported yet)".into());
        sys::restore_signals(&mask);
    }

    /// Stops the evictor and waits until it is idle.
    pub fn pause_evictor(&self) {
        self.pause.store(true, Ordering::Release);
        while !self.parked.load(Ordering::Acquire) {
            self.kick.fetch_add(1, Ordering::AcqRel);
            sys::futex_wake(&self.kick);
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }

    /// Lets a paused evictor run again (not after a fork fallback).
    pub fn resume_evictor(&self) {
        if !self.is_detached() {
            self.pause.store(false, Ordering::Release);
            self.kick.fetch_add(1, Ordering::AcqRel);
            sys::futex_wake(&self.kick);
        }
    }

    pub fn is_detached(&self) -> bool {
        self.detached.load(Ordering::Relaxed)
    }

    /// Whether this is a forked child of the process that started the engine. A child has no
    /// evictor and no userfaultfd registration (the parent detached before the fork), and the
    /// engine's locks may have been held by parent threads at the fork: in a child, managed
    /// memory is plain memory and the engine touches no shared state.
    pub fn in_child(&self) -> bool {
        // SAFETY: getpid has no preconditions.
        self.pid != unsafe { libc::getpid() } as u32
    }

    // ----- the evictor -----

    fn evictor_main(&self) {
        let mut sweep = Sweep::default();
        let mut clock = EpochClock::new(self.epoch_ns);
        let mut hand = 0usize;
        let mut victims: Vec<usize> = Vec::with_capacity(Watermarks::MAX_BATCH as usize * 4);
        let mut writing: Vec<(usize, u32)> = Vec::with_capacity(Watermarks::MAX_BATCH as usize);
        loop {
            if self.pause.load(Ordering::Acquire) {
                self.parked.store(true, Ordering::Release);
                let k = self.kick.load(Ordering::Acquire);
                sys::futex_wait(&self.kick, k, 1_000_000);
                continue;
            }
            self.parked.store(false, Ordering::Release);
            let cpu0 = sys::thread_cpu_ns();
            let now = sys::now_ns();
            if clock.tick(now) {
                self.age_all();
                Counters::bump(&self.counters.epochs);
            }
            let ecpu0 = sys::thread_cpu_ns();
            if !self.detached.load(Ordering::Acquire) && !self.tier_failed.load(Ordering::Acquire) {
                self.relieve_pressure(&mut sweep, &mut hand, &mut victims, &mut writing);
            }
            let cpu1 = sys::thread_cpu_ns();
            Counters::add(&self.counters.scan_cpu_ns, ecpu0 - cpu0);
            Counters::add(&self.counters.evict_cpu_ns, cpu1 - ecpu0);

            let k = self.kick.load(Ordering::Acquire);
            self.evictor_sleeping.store(true, Ordering::Release);
            if !self.wm.over_high(self.resident.load(Ordering::Acquire))
                || self.tier_failed.load(Ordering::Acquire)
                || self.detached.load(Ordering::Acquire)
            {
                let wait = clock
                    .remaining_ns(sys::now_ns())
                    .clamp(1_000_000, 50_000_000);
                sys::futex_wait(&self.kick, k, wait);
            }
            self.evictor_sleeping.store(false, Ordering::Release);
        }
    }

    /// Writes back until resident memory is under the low watermark, refilling the inactive
    /// list as it goes; or, near the quota, keeps the inactive list filled so that hot pages
    /// show themselves by faulting back.
    fn relieve_pressure(
        &self,
        sweep: &mut Sweep,
        hand: &mut usize,
        victims: &mut Vec<usize>,
        writing: &mut Vec<(usize, u32)>,
    ) {
        let resident = self.resident.load(Ordering::Acquire);
        if !self.wm.over_high(resident) {
            if resident + self.wm.low_headroom + self.wm.inactive_target >= self.wm.quota {
                let staged = self.staged.load(Ordering::Acquire);
                if staged < self.wm.inactive_target {
                    self.deactivate(self.wm.inactive_target - staged, sweep, hand, victims);
                }
            }
            self.overcommit.store(false, Ordering::Release);
            return;
        }
        while !self.wm.under_low(self.resident.load(Ordering::Acquire)) {
            let staged = self.staged.load(Ordering::Acquire);
            let mut progress = 0;
            if staged < self.wm.inactive_target {
                progress += self.deactivate(self.wm.inactive_target - staged, sweep, hand, victims);
            }
            progress += self.write_back(self.wm.batch, writing);
            if self.tier_failed.load(Ordering::Acquire) || self.pause.load(Ordering::Acquire) {
                break;
            }
            if progress == 0 {
                // Nothing evictable right now (everything pinned, in flight, or tiny): let
                // faulting threads through rather than have them wait on us.
                self.overcommit.store(true, Ordering::Release);
                self.wake_quota_waiters();
                return;
            }
            self.overcommit.store(false, Ordering::Release);
            self.wake_quota_waiters();
        }
    }

    fn wake_quota_waiters(&self) {
        self.freed.fetch_add(1, Ordering::AcqRel);
        if self.quota_waiters.load(Ordering::Acquire) > 0 {
            sys::futex_wake(&self.freed);
        }
    }

    /// Ends an epoch: shifts every page's history and counts active memory.
    fn age_all(&self) {
        let hw = self.high_water.load(Ordering::Acquire);
        let mut active = 0u64;
        for i in 0..hw {
            let w = self.pt.load(i);
            if matches!(w.state(), State::Free | State::Unpopulated) {
                continue;
            }
            if self.pt.age(i).is_active() {
                active += 1;
            }
        }
        self.counters.active_pages.store(active, Ordering::Relaxed);
    }

    /// Moves up to `want` of the coldest mapped pages into the inactive list (staging). Returns
    /// how many it moved.
    fn deactivate(
        &self,
        want: u64,
        sweep: &mut Sweep,
        hand: &mut usize,
        victims: &mut Vec<usize>,
    ) -> u64 {
        let room = self.ring_slots
            - (self.ring_head.load(Ordering::Acquire) - self.ring_tail.load(Ordering::Acquire));
        let want = want.min(room).min(victims.capacity() as u64) as usize;
        let hw = self.high_water.load(Ordering::Acquire);
        if want == 0 || hw == 0 {
            return 0;
        }
        victims.clear();
        sweep.want(want as u64);
        // Up to MAX_IDLE + 1 passes: each pass that comes up short lowers the bar.
        let mut scanned = 0usize;
        while victims.len() < want && scanned < hw * (Sweep::MAX_IDLE as usize + 1) {
            if *hand >= hw {
                *hand = 0;
                sweep.end_pass((want - victims.len()) as u64);
            }
            let i = *hand;
            *hand += 1;
            scanned += 1;
            let w = self.pt.load(i);
            if w.state() == State::Mapped
                && w.pins() == 0
                && sweep.take(w.history())
                && self.pt.claim(i, State::Mapped, true).is_some()
            {
                victims.push(i);
            }
        }
        if !self.locked {
            // Unlocked memory may have been swapped out by Linux: only pages in DRAM move.
            victims.retain(|&p| {
                let present = sys::presence_of(self.addr_of(p)) == Some(sys::Presence::Present);
                if !present {
                    self.handle_unmovable(p);
                }
                present
            });
        }
        // Victims are in address order: move runs of neighbours in one call each.
        let mut moved_total = 0u64;
        let mut k = 0;
        while k < victims.len() {
            let head = self.ring_head.load(Ordering::Acquire);
            let s0 = (head % self.ring_slots) as u32;
            let start = k;
            while k < victims.len()
                && victims[k] == victims[start] + (k - start)
                && (s0 as u64 + (k - start) as u64) < self.ring_slots
            {
                k += 1;
            }
            let n = k - start;
            let first = victims[start];
            // SAFETY: pages first..first+n are ours (Busy) and mapped; staging slots
            // s0..s0+n are free (between tail and head nothing else lives there) and missing.
            let res = unsafe {
                self.uffd
                    .move_pages(self.stage_addr(s0), self.addr_of(first), n * PAGE_SIZE)
            };
            // After a failure, which pages moved is read from the page tables: the count
            // the kernel reports is not trusted with the program's data.
            let moved = match res {
                Ok(()) => None,
                Err(e) => Some(self.which_moved(first, s0, n, e.done / PAGE_SIZE)),
            };
            for j in 0..n {
                let p = first + j;
                let s = s0 + j as u32;
                if moved.as_ref().is_none_or(|m| m[j]) {
                    self.pt.set_stage(p, s);
                    self.ring_entry(s as u64)
                        .store(p as u32 + 1, Ordering::Release);
                    self.pt.publish(p, State::Staged, None);
                    moved_total += 1;
                } else {
                    self.ring_entry(s as u64)
                        .store(RING_EMPTY, Ordering::Release);
                    // Why did it stay? (Each page is asked: one that is not there at all
                    // must not be taken for mapped.)
                    self.handle_unmovable(p);
                }
            }
            self.ring_head.store(head + n as u64, Ordering::Release);
        }
        self.staged.fetch_add(moved_total, Ordering::AcqRel);
        Counters::add(&self.counters.deactivations, moved_total);
        moved_total
    }

    /// After a move of pages `first..first+n` to staging slots `s0..` failed with `done` pages
    /// reported moved: which pages did move, read from the page tables (a page moved when its
    /// arena address is empty and its staging slot holds a page). Pages the kernel reported
    /// are taken as moved. If it moved more than it reported, the engine says so once: those
    /// pages would otherwise be taken for mapped while their bytes sat in a staging slot about
    /// to be discarded.
    fn which_moved(&self, first: usize, s0: u32, n: usize, done: usize) -> Vec<bool> {
        let mut moved = vec![false; n];
        moved[..done.min(n)].fill(true);
        if done >= n {
            return moved;
        }
        let mut arena = vec![sys::Presence::Absent; n - done];
        let mut staging = vec![sys::Presence::Absent; n - done];
        let read = sys::presence(self.addr_of(first + done), &mut arena)
            .and_then(|()| sys::presence(self.stage_addr(s0 + done as u32), &mut staging));
        if read.is_err() {
            return moved;
        }
        let mut extra = 0u64;
        for j in done..n {
            if arena[j - done] == sys::Presence::Absent
                && staging[j - done] != sys::Presence::Absent
            {
                moved[j] = true;
                extra += 1;
            }
        }
        if extra > 0 {
            Counters::add(&self.counters.moves_underreported, extra);
            if self.counters.moves_underreported.load(Ordering::Relaxed) == extra {
                self.warn(format!(
                    "the kernel reported a page move as failed although {extra} page(s) moved; \
                     memtide follows the page tables (counted as moves_underreported)"
                ));
            }
        }
        moved
    }

    /// A mapped page that UFFDIO_MOVE refused. Nothing there: the program zapped it without
    /// telling us (it reads as zeros now); anything else (swapped out by Linux, shared after
    /// fork, pinned by the kernel for I/O, or pagemap unreadable): it stays mapped.
    fn handle_unmovable(&self, p: usize) {
        if sys::presence_of(self.addr_of(p)) == Some(sys::Presence::Absent) {
            if let Some(s) = self.pt.slot(p) {
                self.slots().free(s);
                self.pt.set_slot(p, None);
            }
            self.unreserve(1);
            self.pt.publish(p, State::Unpopulated, None);
        } else {
            self.pt.publish(p, State::Mapped, None);
        }
    }

    /// Writes up to `batch` of the oldest inactive pages to tier 1 and releases their DRAM.
    /// Returns how many pages left DRAM.
    fn write_back(&self, batch: u64, writing: &mut Vec<(usize, u32)>) -> u64 {
        let tail0 = self.ring_tail.load(Ordering::Acquire);
        let head = self.ring_head.load(Ordering::Acquire);
        let end = head.min(tail0 + batch);
        if end == tail0 {
            return 0;
        }
        writing.clear();
        let mut dead = 0u64;
        for pos in tail0..end {
            let entry = self.ring_entry(pos);
            let s = (pos % self.ring_slots) as u32;
            loop {
                let e = entry.load(Ordering::Acquire);
                if e == RING_EMPTY {
                    break;
                }
                if e == RING_DEAD {
                    dead += 1;
                    break;
                }
                let p = (e - 1) as usize;
                let w = self.pt.load(p);
                if w.state() == State::Staged && self.pt.stage(p) == s {
                    if self.pt.claim(p, State::Staged, false).is_some() {
                        // Claimed as Busy; mark Writing so faulting threads wait for us.
                        self.pt.publish(p, State::Writing, None);
                        writing.push((p, s));
                        break;
                    }
                    continue;
                }
                if w.state() == State::Busy && self.pt.stage(p) == s {
                    // Someone is taking it out of this slot (a fault, a free, a move): wait
                    // for them, then look again at what the slot holds.
                    self.pt.wait(p, w);
                    continue;
                }
                if entry.load(Ordering::Acquire) != e {
                    // The slot changed hands (a move renamed its page) while we looked.
                    continue;
                }
                break;
            }
        }
        // Classify: zero pages and clean pages need no write.
        let mut dirty: Vec<(usize, u32, u64)> = Vec::with_capacity(writing.len());
        let mut zero = 0u64;
        let mut clean = 0u64;
        let mut gone: Vec<usize> = Vec::new();
        for &(p, s) in writing.iter() {
            let a = self.stage_addr(s);
            // SAFETY: the staging page is mapped (Writing is ours) and readable.
            if unsafe { sys::page_is_zero(a) } {
                zero += 1;
                gone.push(p);
                continue;
            }
            // SAFETY: as above.
            let bytes = unsafe { std::slice::from_raw_parts(a as *const u8, PAGE_SIZE) };
            let h = xxhash_rust::xxh3::xxh3_64(bytes);
            if self.pt.slot(p).is_some() && self.pt.hash(p) == h {
                clean += 1;
            } else {
                dirty.push((p, s, h));
            }
        }
        let mut failed: Vec<(usize, u32)> = Vec::new();
        if !dirty.is_empty() {
            self.write_dirty(&dirty, &mut failed);
        }
        // Publish: written and clean pages are evicted; zero pages drop their tier copy.
        {
            let mut slots = self.slots();
            for &p in &gone {
                if let Some(s) = self.pt.slot(p) {
                    slots.free(s);
                    self.pt.set_slot(p, None);
                }
            }
        }
        let mut left = 0u64;
        for &(p, s) in writing.iter() {
            if failed.iter().any(|&(q, _)| q == p) {
                // Tier 1 would not take it: put it back where the program can reach it.
                // SAFETY: the page is ours (Writing), its bytes at staging slot s, its arena
                // address missing.
                if let Err(e) = unsafe {
                    self.uffd
                        .move_pages(self.addr_of(p), self.stage_addr(s), PAGE_SIZE)
                } {
                    fatal("putting back a page tier 1 refused failed", &e.error);
                }
                self.pt.set_stage(p, NONE);
                self.pt.publish(p, State::Mapped, None);
                continue;
            }
            self.pt.set_stage(p, NONE);
            let to = if gone.contains(&p) {
                State::Unpopulated
            } else {
                State::Evicted
            };
            self.pt.publish(p, to, None);
            left += 1;
        }
        // Release the DRAM of every processed slot at once (one TLB shootdown per batch).
        self.zap_ring(tail0, end);
        self.ring_tail.store(end, Ordering::Release);
        let released = left + dead;
        self.staged
            .fetch_sub(released + failed.len() as u64, Ordering::AcqRel);
        self.unreserve(released);
        Counters::add(&self.counters.demotions, left);
        Counters::add(&self.counters.demotions_clean, clean);
        Counters::add(&self.counters.demotions_zero, zero);
        // Pages that went back count as progress only if something else did.
        released
    }

    /// Writes dirty pages to runs of consecutive tier slots, all runs at once. Pages that could
    /// not be written are pushed to `failed`, and tier 1 is marked failed (eviction stops, data
    /// stays in DRAM).
    fn write_dirty(&self, dirty: &[(usize, u32, u64)], failed: &mut Vec<(usize, u32)>) {
        // Slots first: as many runs as it takes.
        let mut runs: Vec<(u64, usize, usize)> = Vec::new();
        let mut k = 0;
        let mut full = false;
        {
            let mut slots = self.slots();
            while k < dirty.len() {
                match slots.alloc_run((dirty.len() - k) as u64, |n| self.tier.grow(n).is_ok()) {
                    Some((first, n)) => {
                        runs.push((first, k, n as usize));
                        k += n as usize;
                    }
                    None => {
                        full = true;
                        break;
                    }
                }
            }
        }
        let written = k;
        let addrs: Vec<usize> = dirty[..written]
            .iter()
            .map(|&(_, s, _)| self.stage_addr(s))
            .collect();
        let io: Vec<(u64, &[usize])> = runs
            .iter()
            .map(|&(first, start, n)| (first, &addrs[start..start + n]))
            .collect();
        let res = if io.is_empty() {
            Ok(())
        } else {
            // SAFETY: every address is a mapped staging page owned by us (Writing).
            unsafe { self.tier.write_runs(&io) }
        };
        let mut slots = self.slots();
        match res {
            Ok(()) => {
                Counters::add(
                    &self.counters.tier_write_bytes,
                    (written * PAGE_SIZE) as u64,
                );
                Counters::add(&self.counters.tier_write_ops, runs.len() as u64);
                for &(first, start, n) in &runs {
                    for (j, &(p, _, h)) in dirty[start..start + n].iter().enumerate() {
                        if let Some(old) = self.pt.slot(p) {
                            slots.free(old);
                        }
                        self.pt.set_slot(p, Some(first + j as u64));
                        self.pt.set_hash(p, h);
                    }
                }
            }
            Err(e) => {
                Counters::bump(&self.counters.tier_errors);
                for &(first, _, n) in &runs {
                    for j in 0..n as u64 {
                        slots.free(first + j);
                    }
                }
                drop(slots);
                self.warn(format!(
                    "writing to tier 1 failed ({e}); keeping further pages in DRAM"
                ));
                self.fail_tier(dirty, failed);
                return;
            }
        }
        drop(slots);
        if full {
            self.warn(format!(
                "tier 1 is full or cannot grow ({}); keeping further pages in DRAM",
                self.tier.describe()
            ));
            self.fail_tier(&dirty[written..], failed);
        }
    }

    fn fail_tier(&self, rest: &[(usize, u32, u64)], failed: &mut Vec<(usize, u32)>) {
        self.tier_failed.store(true, Ordering::Release);
        self.overcommit.store(true, Ordering::Release);
        failed.extend(rest.iter().map(|&(p, s, _)| (p, s)));
        self.wake_quota_waiters();
    }

    /// Zaps the staging slots of ring positions `[from, to)` and empties their entries.
    fn zap_ring(&self, from: u64, to: u64) {
        if from == to {
            return;
        }
        for pos in from..to {
            self.ring_entry(pos).store(RING_EMPTY, Ordering::Release);
        }
        let a = from % self.ring_slots;
        let b = a + (to - from);
        let zap = |s: u64, e: u64| {
            // SAFETY: staging slots between the old and new tail hold nothing anyone needs:
            // their pages are evicted, dead, or were moved out.
            unsafe {
                let _ = sys::discard(
                    self.staging.addr() + s as usize * PAGE_SIZE,
                    (e - s) as usize * PAGE_SIZE,
                );
            }
        };
        if b <= self.ring_slots {
            zap(a, b);
        } else {
            zap(a, self.ring_slots);
            zap(0, b - self.ring_slots);
        }
    }

    // ----- reporting -----

    /// The counters now.
    pub fn snapshot(&self) -> Snapshot {
        let c = &self.counters;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let page = PAGE_SIZE as u64;
        let (tier_pages, tier_file_pages) = {
            let s = self.slots();
            (s.in_use(), s.len())
        };
        Snapshot {
            pid: self.pid,
            elapsed_seconds: (sys::now_ns() - self.start_ns) as f64 / 1e9,
            quota_bytes: self.wm.quota * page,
            dram_bytes: r(&self.resident) * page,
            peak_dram_bytes: r(&c.peak_resident_pages) * page,
            inactive_bytes: r(&self.staged) * page,
            tier_bytes: tier_pages * page,
            tier_file_bytes: tier_file_pages * page,
            managed_bytes: r(&c.managed_pages) * page,
            peak_managed_bytes: r(&c.peak_managed_pages) * page,
            active_bytes: r(&c.active_pages) * page,
            process_rss_bytes: process_rss_bytes(),
            faults_zero: r(&c.faults_zero),
            faults_tier: r(&c.faults_tier),
            faults_inactive: r(&c.faults_inactive),
            faults_wait: r(&c.faults_wait),
            moves_underreported: r(&c.moves_underreported),
            readahead_pages: r(&c.readahead_pages),
            promotions: r(&c.promotions),
            demotions: r(&c.demotions),
            demotions_clean: r(&c.demotions_clean),
            demotions_zero: r(&c.demotions_zero),
            deactivations: r(&c.deactivations),
            tier_read_bytes: r(&c.tier_read_bytes),
            tier_write_bytes: r(&c.tier_write_bytes),
            tier_write_ops: r(&c.tier_write_ops),
            tier_errors: r(&c.tier_errors),
            tier_read_latency_p50_us: c.tier_read_latency.quantile_us(0.5),
            tier_read_latency_p99_us: c.tier_read_latency.quantile_us(0.99),
            fault_tier_latency_p50_us: c.fault_tier_latency.quantile_us(0.5),
            fault_tier_latency_p99_us: c.fault_tier_latency.quantile_us(0.99),
            quota_waits: r(&c.quota_waits),
            quota_overruns: r(&c.quota_overruns),
            epochs: r(&c.epochs),
            scan_cpu_seconds: r(&c.scan_cpu_ns) as f64 / 1e9,
            evict_cpu_seconds: r(&c.evict_cpu_ns) as f64 / 1e9,
            tier: self.tier.describe(),
            warnings: self.warnings.lock().map(|w| w.clone()).unwrap_or_default(),
        }
    }

    /// What the engine knows of the page at `addr`, for a test's failure message.
    #[doc(hidden)]
    pub fn describe_page(&self, addr: usize) -> String {
        if !self.contains(addr) {
            return "not managed".into();
        }
        let p = self.page_of(addr);
        let w = self.pt.load(p);
        format!(
            "page {p}: {:?}, tier slot {:?}, stage {}, arena {:?}",
            w.state(),
            self.pt.slot(p),
            self.pt.stage(p) as i64,
            sys::presence_of(addr)
        )
    }

    /// Checks the page table's books (for tests, with the program's threads quiet): resident
    /// pages equal mapped and staged pages plus dead ring entries, every evicted page has a
    /// slot, every staged page is named by its ring slot. Pauses the evictor while it looks.
    pub fn audit(&self) -> Result<(), String> {
        self.pause_evictor();
        let r = self.audit_paused();
        self.resume_evictor();
        r
    }

    fn audit_paused(&self) -> Result<(), String> {
        let hw = self.high_water.load(Ordering::Acquire);
        let mut mapped = 0u64;
        let mut staged = 0u64;
        let mut present = vec![sys::Presence::Absent; hw];
        if hw > 0 {
            sys::presence(self.arena.addr(), &mut present).map_err(|e| format!("pagemap: {e}"))?;
        }
        let mut staging = vec![sys::Presence::Absent; self.ring_slots as usize];
        sys::presence(self.staging.addr(), &mut staging).map_err(|e| format!("pagemap: {e}"))?;
        for (i, &there) in present.iter().enumerate() {
            let w = self.pt.load(i);
            // The page table must agree with the hardware one: exactly the Mapped pages are
            // there in the arena, in DRAM or swapped out by Linux (others live in staging,
            // tier 1, or nowhere).
            let is_present = there != sys::Presence::Absent;
            if is_present != (w.state() == State::Mapped) {
                return Err(format!(
                    "page {i} is {:?} but {} in the arena",
                    w.state(),
                    if is_present { "present" } else { "missing" }
                ));
            }
            match w.state() {
                State::Mapped => mapped += 1,
                State::Staged | State::Writing => {
                    staged += 1;
                    let s = self.pt.stage(i);
                    if self.ring_entry(s as u64).load(Ordering::Acquire) != i as u32 + 1 {
                        return Err(format!(
                            "page {i} is staged at slot {s}, which does not name it"
                        ));
                    }
                    if staging[s as usize] == sys::Presence::Absent {
                        return Err(format!("page {i} is staged at slot {s}, which is empty"));
                    }
                }
                State::Evicted if self.pt.slot(i).is_none() => {
                    return Err(format!("page {i} is evicted without a tier slot"))
                }
                State::Busy => return Err(format!("page {i} is busy while the engine is idle")),
                _ => {}
            }
        }
        let dead = (self.ring_tail.load(Ordering::Acquire)..self.ring_head.load(Ordering::Acquire))
            .filter(|&pos| self.ring_entry(pos).load(Ordering::Acquire) == RING_DEAD)
            .count() as u64;
        let counted = self.staged.load(Ordering::Acquire);
        if counted != staged + dead {
            return Err(format!(
                "staged counter {counted} != staged {staged} + dead {dead}"
            ));
        }
        let resident = self.resident.load(Ordering::Acquire);
        if resident != mapped + staged + dead {
            return Err(format!(
                "resident {resident} != mapped {mapped} + staged {staged} + dead {dead}"
            ));
        }
        Ok(())
    }
}

/// Resident set size of this process, from /proc/self/statm.
pub fn process_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |p| p * PAGE_SIZE as u64)
}

/// Guard returned by [`Engine::pin`].
pub struct Pinned<'a> {
    engine: &'a Engine,
    first: usize,
    pages: usize,
}

impl Drop for Pinned<'_> {
    fn drop(&mut self) {
        for i in self.first..self.first + self.pages {
            self.engine.pt.unpin(i);
        }
    }
}

/// The engine cannot keep the program's data correct: say why and abort, rather than let the
/// program run on with wrong bytes. Async-signal-safe (no allocation).
fn fatal(what: &str, e: &io::Error) -> ! {
    fatal_with(what, &[], e)
}

/// [`fatal`], naming some numbers that tell what state the engine was in.
fn fatal_with(what: &str, facts: &[(&str, u64)], e: &io::Error) -> ! {
    struct Buf {
        b: [u8; 512],
        n: usize,
    }
    impl Buf {
        fn put(&mut self, s: &[u8]) {
            let take = s.len().min(self.b.len() - self.n);
            self.b[self.n..self.n + take].copy_from_slice(&s[..take]);
            self.n += take;
        }
        fn num(&mut self, mut v: u64) {
            let mut digits = [0u8; 20];
            let mut d = 0;
            loop {
                digits[d] = b'0' + (v % 10) as u8;
                d += 1;
                v /= 10;
                if v == 0 {
                    break;
                }
            }
            while d > 0 {
                d -= 1;
                self.put(&digits[d..d + 1]);
            }
        }
    }
    let mut buf = Buf { b: [0; 512], n: 0 };
    buf.put(b"memtide: fatal: ");
    buf.put(what.as_bytes());
    buf.put(b" (errno ");
    buf.num(e.raw_os_error().unwrap_or(0).unsigned_abs() as u64);
    for (name, v) in facts {
        buf.put(b", ");
        buf.put(name.as_bytes());
        buf.put(b" ");
        buf.num(*v);
    }
    buf.put(b")\n");
    // SAFETY: writing our own buffer to stderr; abort never returns.
    unsafe {
        libc::syscall(libc::SYS_write, 2, buf.b.as_ptr(), buf.n);
        libc::abort();
    }
}

/// A page's presence as a fatal line prints it: 0 present, 1 swapped, 2 absent, 3 unknown.
fn presence_code(p: Option<sys::Presence>) -> u64 {
    match p {
        Some(sys::Presence::Present) => 0,
        Some(sys::Presence::Swapped) => 1,
        Some(sys::Presence::Absent) => 2,
        None => 3,
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
