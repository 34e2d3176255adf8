//! The compressed level: pages leaving DRAM are compressed into a pool in DRAM ([`Pool`]:
//! LZ4 or zstd, packed by size class) before any goes to the file. A fault on a page in the pool is a
//! decompression and a copy, no I/O. The pool's DRAM counts against the quota; when it is full,
//! its oldest objects are written back to the file, decompressed, in batches. Entry points:
//! [`Compressed`], [`Engine::compress_out`], [`Engine::fetch_compressed`].
//!
//! # How a page moves through it
//!
//! ```text
//!  Writing --evictor: compressed (or one repeated word)--> Evicted, copy in the pool
//!  Evicted (pool) --program touches it: decompress, check, UFFDIO_COPY--> Mapped (copy kept)
//!  Mapped with a pool copy --evictor, each epoch or when the pool is full--> copy dropped
//!  Evicted (pool) --evictor, pool full: decompress, write to the file--> Evicted (file)
//! ```
//!
//! A page that compresses worse than [`crate::tier::MAX_OBJECT`] goes straight to the file.
//! A page whose words are all one value is kept as that word (no pool space); it leaves that
//! copy when it is brought in.
//!
//! # Size
//!
//! The pool takes a sixteenth of the quota (`--compressed-max` sets another share, up to
//! three quarters), and keeps that share when the quota changes; a pool over its size after
//! a change writes its oldest back. With `--compressed-sizing adaptive` it sizes itself
//! ([`Engine::size_pool`]): every 2 s it weighs the file faults on pages written back within
//! the last step of pool against the pool faults on pages stored within the last step and the
//! hint faults a smaller active list adds, each at its measured price ([`Judgement`]), and
//! undoes a step after which more of the deactivated pages come back (the hot set was
//! squeezed). Measured, it does not beat the fixed sixteenth yet (notebook, run 24), so it is
//! not the default; two earlier ways were dropped (run 19).
//!
//! # Compaction
//!
//! Objects freed in place (copies dropped, pages brought in, freed or written back) leave holes
//! in the pool's chunks. When they take more than [`crate::tier::COMPACT_WASTE`] of its DRAM,
//! the evictor compacts it ([`Engine::compact_pool`]): at each epoch, and before it writes the
//! pool's oldest objects to the file to make room, so that room a move of a few objects gives
//! costs no write. Each object of the chunks set apart is moved with its page claimed, as a
//! write-back does; a page in flight keeps its object where it is.
//!
//! # Why write-back is decompressed
//!
//! The file keeps whole pages in page-sized slots: a fault on it reads one page (or a run, with
//! read-ahead) straight into a bounce buffer, encryption seals a page per slot, and a lowered
//! tier limit moves slots one at a time. Packed compressed blocks would save device space and
//! write bandwidth, but a fault would read a block to find one object in it, and every one of
//! those paths would learn a second format. The file is not where space is short.

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;

use memtide_policy::PAGE_SIZE;

use super::fatal::{fatal, fatal_with};
use super::{Engine, Event};
use crate::pages::{State, TierCopy, Word};
use crate::stats::Counters;
use crate::sys::{self, Mapping};
use crate::tier::{Codec, Handle, Pool, Stored};
use std::collections::HashMap;

/// Pages written back from the pool to the file in one batch: when the pool is full, a batch
/// makes room for about as many new pages (the batch the evictor retires); when the pool must
/// shrink, [`SPILL_BATCH`] a round.
pub(super) const SPILL_ROOM: usize = 64;
pub(super) const SPILL_BATCH: usize = 256;
/// The most objects one compaction moves: about a millisecond of the evictor's time, for which
/// it holds the order of stores (an mremap of pool pages waits meanwhile).
const COMPACT_BATCH: usize = 1024;

/// How pages are compressed on their way out of DRAM.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Compress {
    /// LZ4 (the default): about 1 µs to decompress a page here.
    #[default]
    Lz4,
    /// zstd (level 1): much smaller objects of text-like data, the same of pages whose only
    /// redundancy is zero runs; about twice LZ4's time to compress, up to 3.5x to decompress.
    Zstd,
    /// No compressed level: pages go to the file.
    Off,
}

impl Compress {
    /// The names `--compress` takes.
    pub const NAMES: [&'static str; 3] = ["lz4", "zstd", "off"];

    pub fn from_name(name: &str) -> Option<Compress> {
        match name {
            "lz4" => Some(Compress::Lz4),
            "zstd" => Some(Compress::Zstd),
            "off" | "none" => Some(Compress::Off),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Compress::Lz4 => "lz4",
            Compress::Zstd => "zstd",
            Compress::Off => "off",
        }
    }

    /// The pool's codec; `None` for no pool.
    pub(super) fn codec(self) -> Option<Codec> {
        match self {
            Compress::Lz4 => Some(Codec::Lz4),
            Compress::Zstd => Some(Codec::Zstd),
            Compress::Off => None,
        }
    }
}

/// The pool's share of the quota at the start: a sixteenth (or `--compressed-max`, if less).
pub(super) fn default_capacity(quota_pages: u64) -> u64 {
    quota_pages / 16
}

/// The most of the quota the pool may take even when asked for more (the rest holds the
/// pages in use).
pub(super) fn capacity_cap(quota_pages: u64) -> u64 {
    quota_pages * 3 / 4
}

/// The most of the quota a pool that sizes itself grows to unless `--compressed-max` says
/// otherwise: half, as zram and zswap are commonly given.
fn adaptive_cap(quota_pages: u64) -> u64 {
    quota_pages / 2
}

/// The step a pool that sizes itself moves by, and its smallest size: a thirty-second of the
/// quota.
fn sizing_step(quota_pages: u64) -> u64 {
    (quota_pages / 32).max(1)
}

/// How often the pool's size is judged.
const SIZING_PERIOD_NS: u64 = 2_000_000_000;
/// A period with fewer faults from below DRAM than this says too little to move on.
const SIZING_MIN_FAULTS: u64 = 256;
/// A step up must be expected to save this many times what it costs (the estimate of its cost
/// is the lower bound of the two sides: see [`Judgement::more_hints`]); a step down is taken as
/// soon as the cost outweighs the saving.
const SIZING_MARGIN: f64 = 2.0;
/// What a fault costs the program beyond the time the engine measures inside it: the wake-up of
/// a handler thread and of the faulting thread (`--faults threads`), or the signal's delivery
/// and return (`--faults signal`). Roughly what these machines show (docs/notebook, runs 16
/// and 23).
const WAKE_THREADS_NS: f64 = 10_000.0;
const WAKE_SIGNAL_NS: f64 = 2_000.0;
/// A hint fault's own work (a staged page mapped back), as the simulator prices it.
const HINT_NS: f64 = 5_000.0;

/// The compressed level of one engine.
pub(super) struct Compressed {
    pub(super) pool: Pool,
    /// How the pool compresses.
    pub(super) codec: Codec,
    /// The capacity asked for (`--compressed-max`), or none for the default share.
    asked_pages: Option<u64>,
    /// Objects in the order they were stored, as (page, handle): the oldest go to the file
    /// first. An entry whose page no longer names that handle is stale and skipped.
    order: Mutex<VecDeque<(u32, u32)>>,
    /// Pages decompressed on their way to the file (the evictor's alone).
    spill_buf: Mutex<Mapping>,
    /// The pool's size as a share of the quota, in millionths (kept across quota changes).
    share_ppm: AtomicU64,
    /// Set when a batch found the file unusable and the pool took none of it (the pages do
    /// not compress): eviction waits for the file, or the next epoch, instead of compressing
    /// the same pages again. Cleared each epoch.
    pub(super) futile: std::sync::atomic::AtomicBool,
    /// Whether the pool sizes itself ([`Engine::size_pool`], `--compressed-sizing adaptive`).
    adaptive: bool,
    /// Per page of the arena: its number in the order of stores while its copy is in the pool,
    /// or in the order of write-backs once the pool wrote it to the file; 0 otherwise.
    seq_of: Mapping,
    stores: AtomicU32,
    spills: AtomicU32,
    /// A fault on one of the last `young_window` objects stored is one a step more DRAM for
    /// pages would have spared (it left DRAM that recently); a file fault on one of the last
    /// `ghost_window` pages written back is one a step more pool would have served.
    young_window: AtomicU32,
    ghost_window: AtomicU32,
    pub(super) young_hits: AtomicU64,
    pub(super) ghost_hits: AtomicU64,
    pub(super) grows: AtomicU64,
    pub(super) shrinks: AtomicU64,
    sizer: Mutex<Sizer>,
    /// Held while the capacity is set (by the sizer or a quota change); never on a fault path.
    resize: Mutex<()>,
}

/// What the sizer saw at its last judgement.
#[derive(Clone, Copy, Default)]
struct Sample {
    at_ns: u64,
    pool_faults: u64,
    pool_ns: f64,
    file_faults: u64,
    file_ns: f64,
    young: u64,
    ghost: u64,
    inactive_hits: u64,
    deactivations: u64,
}

/// The sizer's state between judgements.
#[derive(Default)]
struct Sizer {
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

/// The first wait after a step up that did not pay.
const SIZING_BACKOFF_NS: u64 = 8_000_000_000;
/// A step up after which the share of deactivated pages that come back rose by more than this
/// (relative) squeezed the pages in use: it is undone. On the hot/cold workload the share rises
/// about 5% a step while the pool gains, 12% once it squeezes the hot set, 30% past that.
const SQUEEZE_RISE: f64 = 0.10;

/// The sizer's reading of one period: what a step more pool would save, and what the step of
/// DRAM it takes from the pages in use would cost, in nanoseconds of the program's time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Judgement {
    pub(super) saves_ns: f64,
    pub(super) costs_ns: f64,
}

impl Judgement {
    /// From one period's rates (per second): `ghost` file faults a step more pool would have
    /// served (each saving a file fault's cost less a pool fault's), against `young` pool
    /// faults on pages that left DRAM within the last step (a step less DRAM for the pages
    /// in use turns about as many hits into pool faults, each with its wake-up) and
    /// `more_hints`, the hint faults a step less of them adds (each a hint fault's work and
    /// its wake-up).
    pub(super) fn of(
        ghost: f64,
        young: f64,
        more_hints: f64,
        pool_ns: f64,
        file_ns: f64,
        wake_ns: f64,
    ) -> Judgement {
        Judgement {
            saves_ns: ghost * (file_ns - pool_ns).max(0.0),
            costs_ns: young * (pool_ns + wake_ns) + more_hints * (HINT_NS + wake_ns),
        }
    }

    /// The hint faults a step less of `active_pages` adds, if they rise in proportion: the
    /// estimate before a step is taken (a step taken measures it instead).
    pub(super) fn more_hints(hints: f64, step: u64, active_pages: u64) -> f64 {
        hints * step as f64 / active_pages.max(step) as f64
    }

    /// +1 grow, -1 shrink, 0 hold.
    pub(super) fn verdict(&self) -> i32 {
        if self.saves_ns > SIZING_MARGIN * self.costs_ns {
            1
        } else if self.costs_ns > self.saves_ns {
            -1
        } else {
            0
        }
    }
}

impl Compressed {
    /// A level for a quota of `quota_pages` that may grow to `max_quota_pages`, over an arena
    /// of `arena_pages`. With `adaptive`, the pool starts at a sixteenth of the quota and sizes
    /// itself, up to `asked_pages` (`--compressed-max`) or half the quota; without, it takes
    /// `asked_pages` (`--compressed-max`) or a sixteenth, fixed.
    pub(super) fn new(
        codec: Codec,
        quota_pages: u64,
        max_quota_pages: u64,
        arena_pages: usize,
        asked_pages: Option<u64>,
        adaptive: bool,
    ) -> io::Result<Compressed> {
        let bound = |q| Self::bound(asked_pages, adaptive, q);
        let max = bound(max_quota_pages).max(bound(quota_pages));
        // Fault paths that may decompress at once: the handler threads, or (faults in the
        // program's threads) about as many as there are CPUs to run them.
        let readers = std::thread::available_parallelism().map_or(4, |n| n.get() * 2);
        let c = Compressed {
            pool: Pool::new(
                PAGE_SIZE,
                max as usize * PAGE_SIZE,
                codec,
                readers.clamp(4, 64),
            )?,
            codec,
            asked_pages,
            order: Mutex::new(VecDeque::new()),
            spill_buf: Mutex::new(Mapping::anon(SPILL_BATCH * PAGE_SIZE)?),
            share_ppm: AtomicU64::new(0),
            futile: Default::default(),
            adaptive,
            // Only a pool that sizes itself dates its pages.
            seq_of: Mapping::anon(if adaptive { arena_pages * 4 } else { 4 })?,
            stores: AtomicU32::new(0),
            spills: AtomicU32::new(0),
            young_window: AtomicU32::new(0),
            ghost_window: AtomicU32::new(0),
            young_hits: AtomicU64::new(0),
            ghost_hits: AtomicU64::new(0),
            grows: AtomicU64::new(0),
            shrinks: AtomicU64::new(0),
            sizer: Mutex::new(Sizer::default()),
            resize: Mutex::new(()),
        };
        let size = match (adaptive, asked_pages) {
            (false, Some(a)) => a,
            _ => default_capacity(quota_pages),
        };
        c.set_capacity(size, quota_pages);
        Ok(c)
    }

    /// The most the pool may take under a quota of `quota_pages`.
    fn max_for(&self, quota_pages: u64) -> u64 {
        Self::bound(self.asked_pages, self.adaptive, quota_pages)
    }

    fn bound(asked: Option<u64>, adaptive: bool, quota_pages: u64) -> u64 {
        let default = if adaptive {
            adaptive_cap(quota_pages)
        } else {
            u64::MAX
        };
        asked
            .unwrap_or(default)
            .min(capacity_cap(quota_pages))
            .max(1)
    }

    /// The least a pool that sizes itself shrinks to.
    fn min_for(&self, quota_pages: u64) -> u64 {
        sizing_step(quota_pages).min(self.max_for(quota_pages))
    }

    /// Sets the pool's capacity to `pages` (at most its bound) under a quota of `quota_pages`.
    /// Returns the capacity in force.
    fn set_capacity(&self, pages: u64, quota_pages: u64) -> u64 {
        let max = self.max_for(quota_pages);
        let c = self.pool.set_capacity(pages.clamp(1, max));
        self.share_ppm
            .store(c * 1_000_000 / quota_pages.max(1), Ordering::Relaxed);
        c
    }

    /// The quota became `quota_pages`: the pool keeps its share of it.
    pub(super) fn quota_changed(&self, quota_pages: u64) {
        let _serial = self.resize.lock().unwrap_or_else(|e| e.into_inner());
        let share = self.share_ppm.load(Ordering::Relaxed);
        self.set_capacity(quota_pages * share / 1_000_000, quota_pages);
    }

    /// In a forked child: its own sizing starts afresh (the counters it weighs start at zero).
    pub(super) fn forked(&self) {
        for c in [
            &self.young_hits,
            &self.ghost_hits,
            &self.grows,
            &self.shrinks,
        ] {
            c.store(0, Ordering::Relaxed);
        }
        *self.sizer.lock().unwrap_or_else(|e| e.into_inner()) = Sizer::default();
    }

    fn order(&self) -> std::sync::MutexGuard<'_, VecDeque<(u32, u32)>> {
        self.order.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the pool has room for more objects and took some of the last batch that
    /// the file could not.
    pub(super) fn has_room(&self) -> bool {
        self.pool.pages() + 4 <= self.pool.capacity_pages() && !self.futile.load(Ordering::Relaxed)
    }

    /// Whether the pool sizes itself.
    pub(super) fn adaptive(&self) -> bool {
        self.adaptive
    }

    fn seq(&self, p: usize) -> &AtomicU32 {
        &self.seq_of.as_slice::<AtomicU32>()[p]
    }

    /// The next number of `counter` (never 0, which means none).
    fn next(counter: &AtomicU32) -> u32 {
        let n = counter.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
        if n == 0 {
            counter.fetch_add(1, Ordering::Relaxed).wrapping_add(1)
        } else {
            n
        }
    }

    /// Page `p` was stored in the pool.
    fn stored(&self, p: usize) {
        if !self.adaptive {
            return;
        }
        self.seq(p)
            .store(Self::next(&self.stores), Ordering::Relaxed);
    }

    /// Page `p` was written back from the pool to the file.
    fn spilled(&self, p: usize) {
        if !self.adaptive {
            return;
        }
        self.seq(p)
            .store(Self::next(&self.spills), Ordering::Relaxed);
    }

    /// Page `p` went to the file straight from DRAM.
    pub(super) fn forget_seq(&self, p: usize) {
        if !self.adaptive {
            return;
        }
        self.seq(p).store(0, Ordering::Relaxed);
    }

    /// A fault on page `p`, served from the pool: counts it if the page left DRAM recently.
    fn pool_fault(&self, p: usize) {
        if !self.adaptive {
            return;
        }
        let s = self.seq(p).load(Ordering::Relaxed);
        let age = self.stores.load(Ordering::Relaxed).wrapping_sub(s);
        if s != 0 && age < self.young_window.load(Ordering::Relaxed) {
            self.young_hits.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A fault on page `p`, served from the file: counts it if the pool wrote it there
    /// recently.
    pub(super) fn file_fault(&self, p: usize) {
        if !self.adaptive {
            return;
        }
        let s = self.seq(p).load(Ordering::Relaxed);
        let age = self.spills.load(Ordering::Relaxed).wrapping_sub(s);
        if s != 0 && age < self.ghost_window.load(Ordering::Relaxed) {
            self.ghost_hits.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// What [`Engine::compress_out`] did with a batch.
#[derive(Default)]
pub(super) struct CompressedOut {
    /// Pages now in the pool (as objects or repeated words).
    pub(super) stored: u64,
}

impl Engine {
    /// Stores the dirty pages `dirty` (each `Writing`, ours: page, staging slot, hash) in the
    /// compressed pool, making room by writing the pool's oldest objects to the file when it
    /// is full. Pages it would not take (too little compression, no room) are pushed to
    /// `to_file`.
    pub(super) fn compress_out(
        &self,
        dirty: &[(usize, u32, u64)],
        to_file: &mut Vec<(usize, u32, u64)>,
    ) -> CompressedOut {
        let mut out = CompressedOut::default();
        let Some(c) = &self.compressed else {
            to_file.extend_from_slice(dirty);
            return out;
        };
        let mut spilled = false;
        for &(p, s, h) in dirty {
            // SAFETY: the staging page is mapped (Writing is ours) and readable.
            let page = unsafe { &*(self.ring.addr(s) as *const [u8; PAGE_SIZE]) };
            let mut stored = c.pool.store(page);
            if stored == Stored::Full && !spilled {
                spilled = true;
                // Room from the pool's holes first: moving objects writes nothing to the file.
                if self.compact_pool() > 0 {
                    stored = c.pool.store(page);
                }
                if stored == Stored::Full {
                    // Not enough for this page's class: the oldest go to the file.
                    self.spill(SPILL_ROOM);
                    stored = c.pool.store(page);
                }
            }
            match stored {
                Stored::Same(word) => {
                    self.forget_copy(p);
                    self.pt.set_hash(p, word);
                    self.pt.set_copy(p, Some(TierCopy::Same));
                    Counters::bump(&self.counters.compressed_same);
                    out.stored += 1;
                }
                Stored::Object(handle) => {
                    self.forget_copy(p);
                    self.pt.set_hash(p, h);
                    self.pt.set_copy(p, Some(TierCopy::Pool(handle)));
                    self.pool_order_push(p, handle);
                    c.stored(p);
                    Counters::bump(&self.counters.compressed_stores);
                    out.stored += 1;
                }
                Stored::TooBig => {
                    Counters::bump(&self.counters.compressed_rejected);
                    c.forget_seq(p);
                    to_file.push((p, s, h));
                }
                Stored::Full => {
                    c.forget_seq(p);
                    to_file.push((p, s, h));
                }
            }
        }
        out
    }

    /// Notes that page `p` was given pool object `h` (a new store, or a page moved by mremap),
    /// as the newest in the order of write-back.
    pub(super) fn pool_order_push(&self, p: usize, h: Handle) {
        let Some(c) = &self.compressed else {
            return;
        };
        let mut o = c.order();
        o.push_back((p as u32, h.raw()));
        // Stale entries (pages brought in, freed, moved) are dropped once they outnumber the
        // live objects.
        if o.len() > 1024 && o.len() as u64 > 2 * c.pool.stats().objects {
            o.retain(|&(p, h)| {
                self.pt.copy(p as usize) == Some(TierCopy::Pool(Handle::from_raw(h)))
            });
        }
    }

    /// Frees pool objects whose pages have let go of them (the program freed the pages).
    pub(super) fn free_pool_objects(&self, objects: &[Handle]) {
        let Some(c) = &self.compressed else {
            return;
        };
        if objects.is_empty() {
            return;
        }
        for &h in objects {
            c.pool.free(h);
        }
    }

    /// Frees page `p`'s copy below DRAM, whatever level it is in (the page is ours).
    pub(super) fn forget_copy(&self, p: usize) {
        match self.pt.copy(p) {
            None => return,
            Some(TierCopy::File(s)) => self.file.slots().free(s),
            Some(TierCopy::Pool(h)) => {
                if let Some(c) = &self.compressed {
                    c.pool.free(h);
                }
            }
            Some(TierCopy::Same) => {}
        }
        self.pt.set_copy(p, None);
    }

    /// Writes up to `want` of the pool's oldest objects to the file (decompressed, checked)
    /// and frees them; copies of pages that are in DRAM again are dropped on the way. Pages
    /// the file would not take keep their objects. Returns the pool pages given back.
    pub(super) fn spill(&self, want: usize) -> u64 {
        let Some(c) = &self.compressed else {
            return 0;
        };
        let before = c.pool.pages();
        let buf = c.spill_buf.lock().unwrap_or_else(|e| e.into_inner());
        let mut batch: Vec<(usize, usize, u64)> = Vec::with_capacity(want.min(SPILL_BATCH));
        let mut dropped = 0u64;
        let file_ok = self.file.usable();
        {
            let mut order = c.order();
            if order.is_empty() && c.pool.pages() > 0 {
                // Objects no entry names (a page moved while its entry was dropped as
                // stale): find them in the page table.
                let hw = self.high_water.load(std::sync::atomic::Ordering::Acquire);
                for i in 0..hw {
                    if let Some(TierCopy::Pool(h)) = self.pt.copy(i) {
                        order.push_back((i as u32, h.raw()));
                    }
                }
            }
            let mut skipped: Vec<(u32, u32)> = Vec::new();
            while batch.len() < want.min(SPILL_BATCH) {
                let Some((p32, raw)) = order.pop_front() else {
                    break;
                };
                let (p, h) = (p32 as usize, Handle::from_raw(raw));
                if p >= self.pt.pages() || self.pt.copy(p) != Some(TierCopy::Pool(h)) {
                    continue;
                }
                let st = self.pt.load(p).state();
                let evicted = st == State::Evicted;
                if !evicted && !matches!(st, State::Mapped | State::Staged) {
                    // On its way in or out: its fault or its eviction decides.
                    skipped.push((p32, raw));
                    continue;
                }
                if evicted && !file_ok {
                    skipped.push((p32, raw));
                    continue;
                }
                if self.pt.claim(p, st, false).is_none() {
                    skipped.push((p32, raw));
                    continue;
                }
                if self.pt.copy(p) != Some(TierCopy::Pool(h)) {
                    self.pt.publish(p, st, None);
                    continue;
                }
                if !evicted {
                    // In DRAM again: the copy only saves a compression if it leaves again.
                    c.pool.free(h);
                    self.pt.set_copy(p, None);
                    self.pt.publish(p, st, None);
                    dropped += 1;
                    continue;
                }
                let to = buf.addr() + batch.len() * PAGE_SIZE;
                // SAFETY: `to` is a page of the spill buffer, which this thread holds.
                let out = unsafe { &mut *(to as *mut [u8; PAGE_SIZE]) };
                self.load_checked(p, h, out);
                batch.push((p, to, self.pt.hash(p)));
            }
            // Entries passed over go back in front, in their order.
            for e in skipped.into_iter().rev() {
                order.push_front(e);
            }
        }
        let written = if batch.is_empty() {
            0
        } else {
            self.write_to_file(&batch)
        };
        for (k, &(p, _, _)) in batch.iter().enumerate() {
            if k >= written {
                // Still in the pool: back in front for the next try.
                if let Some(TierCopy::Pool(h)) = self.pt.copy(p) {
                    c.order().push_front((p as u32, h.raw()));
                }
            } else {
                c.spilled(p);
            }
            self.pt.publish(p, State::Evicted, None);
        }
        Counters::add(&self.counters.compressed_spills, written as u64);
        Counters::add(&self.counters.compressed_drops, dropped);
        before.saturating_sub(c.pool.pages())
    }

    /// Compacts the pool if its holes take more than [`crate::tier::COMPACT_WASTE`] of its
    /// DRAM (the evictor's): the objects of its sparsest chunks move into the holes of the
    /// others, each with its page claimed; copies of pages in DRAM again are dropped on the
    /// way. Returns the pool pages given back.
    pub(super) fn compact_pool(&self) -> u64 {
        let Some(c) = &self.compressed else {
            return 0;
        };
        if !c.pool.stats().fragmented() {
            return 0;
        }
        let before = c.pool.pages();
        let draining = c.pool.begin_compaction(COMPACT_BATCH);
        if draining.is_empty() {
            c.pool.end_compaction();
            return 0;
        }
        // The pages whose objects are to move, from the order of stores, which names every
        // object (and some stale entries, which the page table tells apart). The order stays
        // locked until the moved objects' entries name their new handles, so that no one
        // (an mremap dropping stale entries) takes a moved object's entry for a stale one.
        let mut order = c.order();
        let held: Vec<(usize, Handle)> = order
            .iter()
            .map(|&(p, h)| (p as usize, Handle::from_raw(h)))
            .filter(|&(p, h)| {
                draining.holds(h)
                    && p < self.pt.pages()
                    && self.pt.copy(p) == Some(TierCopy::Pool(h))
            })
            .collect();
        let (mut moved, mut dropped) = (HashMap::new(), 0u64);
        for (p, h) in held {
            let st = self.pt.load(p).state();
            if !matches!(st, State::Evicted | State::Mapped | State::Staged)
                || self.pt.claim(p, st, false).is_none()
            {
                // On its way in or out: its object stays where it is.
                continue;
            }
            if self.pt.copy(p) == Some(TierCopy::Pool(h)) {
                if st != State::Evicted {
                    // In DRAM again: the copy only saves a compression if it leaves again.
                    c.pool.free(h);
                    self.pt.set_copy(p, None);
                    dropped += 1;
                } else if let Some(n) = c.pool.relocate(h) {
                    self.pt.set_copy(p, Some(TierCopy::Pool(n)));
                    moved.insert((p as u32, h.raw()), n.raw());
                }
            }
            self.pt.publish(p, st, None);
        }
        c.pool.end_compaction();
        if !moved.is_empty() {
            // Moved objects keep their place in the order of write-back.
            for e in order.iter_mut() {
                if let Some(&n) = moved.get(&*e) {
                    e.1 = n;
                }
            }
        }
        drop(order);
        Counters::bump(&self.counters.compressed_compactions);
        Counters::add(&self.counters.compressed_moves, moved.len() as u64);
        Counters::add(&self.counters.compressed_drops, dropped);
        before.saturating_sub(c.pool.pages())
    }

    /// Drops the pool copies of pages that are in DRAM again (the evictor, once an epoch).
    pub(super) fn drop_mapped_copies(&self, hw: usize) {
        let Some(c) = &self.compressed else {
            return;
        };
        let mut dropped = 0u64;
        for i in 0..hw {
            let Some(TierCopy::Pool(h)) = self.pt.copy(i) else {
                continue;
            };
            if self.pt.load(i).state() != State::Mapped
                || self.pt.claim(i, State::Mapped, false).is_none()
            {
                continue;
            }
            if self.pt.copy(i) == Some(TierCopy::Pool(h)) {
                c.pool.free(h);
                self.pt.set_copy(i, None);
                dropped += 1;
            }
            self.pt.publish(i, State::Mapped, None);
        }
        if dropped > 0 {
            Counters::add(&self.counters.compressed_drops, dropped);
        }
    }

    /// Once a period (the evictor, at an epoch's start): moves a pool that sizes itself a
    /// step up when what a step more pool would have saved in the last period outweighs what
    /// the step of DRAM it takes from the pages in use would have cost, a step down when the
    /// cost outweighs the saving. Both sides are read from the engine's own counts and
    /// latencies: [`Judgement::of`].
    pub(super) fn size_pool(&self, now_ns: u64) {
        let Some(c) = self.compressed.as_ref().filter(|c| c.adaptive) else {
            return;
        };
        let mut sizer = c.sizer.lock().unwrap_or_else(|e| e.into_inner());
        let sizer = &mut *sizer;
        if sizer
            .last
            .is_some_and(|l| now_ns.saturating_sub(l.at_ns) < SIZING_PERIOD_NS)
        {
            return;
        }
        let k = &self.counters;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let now = Sample {
            at_ns: now_ns,
            pool_faults: k.fault_compressed_latency.count(),
            pool_ns: k.fault_compressed_latency.sum_us() * 1e3,
            file_faults: k.fault_tier_latency.count(),
            file_ns: k.fault_tier_latency.sum_us() * 1e3,
            young: r(&c.young_hits),
            ghost: r(&c.ghost_hits),
            inactive_hits: r(&k.faults_inactive),
            deactivations: r(&k.deactivations),
        };
        let quota = self.quota.wm().quota;
        let step = sizing_step(quota);
        // Windows for the next period: a step of DRAM holds `step` pages; a step of pool
        // holds `step` times what a pool page holds now.
        let st = c.pool.stats();
        let per_page = if st.pool_bytes > 0 {
            (st.objects as f64 * PAGE_SIZE as f64 / st.pool_bytes as f64).max(1.0)
        } else {
            1.0
        };
        let window = |n: f64| n.min(u32::MAX as f64) as u32;
        c.young_window.store(window(step as f64), Ordering::Relaxed);
        c.ghost_window
            .store(window(step as f64 * per_page), Ordering::Relaxed);
        let Some(last) = sizer.last.replace(now) else {
            return;
        };
        let d = |a: u64, b: u64| a.saturating_sub(b);
        let (dp, df) = (
            d(now.pool_faults, last.pool_faults),
            d(now.file_faults, last.file_faults),
        );
        if dp + df < SIZING_MIN_FAULTS {
            return;
        }
        let secs = (now_ns - last.at_ns) as f64 / 1e9;
        let rate = |a: u64, b: u64| d(a, b) as f64 / secs;
        let mean = |ns: f64, n: u64, fallback: f64| if n > 0 { ns / n as f64 } else { fallback };
        let pool_ns = mean(now.pool_ns - last.pool_ns, dp, 15_000.0);
        let file_ns = mean(now.file_ns - last.file_ns, df, 80_000.0);
        let wake_ns = if self.uffd.delivery() == crate::Delivery::Signal {
            WAKE_SIGNAL_NS
        } else {
            WAKE_THREADS_NS
        };
        let hints = rate(now.inactive_hits, last.inactive_hits);
        // The pages in use that are not on the inactive list.
        let active = quota
            .saturating_sub(self.ring.staged.load(Ordering::Relaxed))
            .saturating_sub(c.pool.pages());
        let back = d(now.inactive_hits, last.inactive_hits) as f64
            / d(now.deactivations, last.deactivations).max(1) as f64;
        let squeezed = sizer.last_move > 0
            && sizer.back_before > 0.0
            && back > sizer.back_before * (1.0 + SQUEEZE_RISE);
        let j = Judgement::of(
            rate(now.ghost, last.ghost),
            rate(now.young, last.young),
            Judgement::more_hints(hints, step, active),
            pool_ns,
            file_ns,
            wake_ns,
        );
        let verdict = if squeezed { -1 } else { j.verdict() };
        if sizer.last_move > 0 && verdict > 0 {
            // The last step up paid.
            sizer.backoff_ns = 0;
        }
        if squeezed {
            // What the last step up cost showed only once taken: wait before the next.
            sizer.backoff_ns =
                (sizer.backoff_ns * 2).clamp(SIZING_BACKOFF_NS, 64 * SIZING_BACKOFF_NS);
            sizer.hold_until_ns = now_ns + sizer.backoff_ns;
        }
        // A squeeze and a step that paid are judged in the period right after the step only.
        sizer.last_move = 0;
        sizer.back_before = back;
        // Capacity changes are serialised with the quota's (`quota_changed` takes this lock),
        // so that a quota changed since `quota` was read is not overwritten.
        let _serial = c.resize.lock().unwrap_or_else(|e| e.into_inner());
        let quota = self.quota.wm().quota;
        let cap = c.pool.capacity_pages();
        // Only a pool that uses its room is worth moving: one that does not spills nothing
        // (no saving to see) and takes no DRAM it does not use.
        let used = c.pool.pages() + step / 2 >= cap;
        match verdict {
            1 if used && cap < c.max_for(quota) && now_ns >= sizer.hold_until_ns => {
                c.set_capacity(cap + step, quota);
                Counters::bump(&c.grows);
                sizer.last_move = 1;
            }
            -1 if used && cap > c.min_for(quota) => {
                // Down faster than up: a pool grown through a scan gives the pages in use
                // back soon once they are used again.
                c.set_capacity(cap.saturating_sub(2 * step).max(c.min_for(quota)), quota);
                Counters::bump(&c.shrinks);
                sizer.last_move = -1;
            }
            _ => {}
        }
    }

    /// Decompresses page `p`'s pool object `h` into `out` and checks it against the checksum
    /// taken when it left DRAM. The page's only copy is wrong otherwise: the program stops.
    fn load_checked(&self, p: usize, h: Handle, out: &mut [u8; PAGE_SIZE]) {
        let Some(c) = &self.compressed else {
            fatal_with(
                "a page is in a compressed pool that does not exist",
                &[("page", p as u64)],
                &io::Error::from_raw_os_error(libc::EFAULT),
            );
        };
        let ok =
            c.pool.load(h, out).is_ok() && xxhash_rust::xxh3::xxh3_64(&out[..]) == self.pt.hash(p);
        if !ok {
            fatal_with(
                "a page in the compressed pool does not decompress to what left DRAM; memtide stops the program rather than serve it",
                &[("page", p as u64), ("object", h.raw() as u64)],
                &io::Error::from_raw_os_error(libc::EIO),
            );
        }
    }

    /// A touch of an evicted page whose copy is in the pool (`copy`; the page is ours, its
    /// DRAM reserved, `old` its word before): decompress it into a bounce buffer, check it,
    /// map it. The pool copy stays until the evictor drops it; a repeated word's does not.
    pub(super) fn fetch_compressed(&self, p: usize, old: Word, copy: TierCopy, t0: u64) {
        let buf = self.file.bounce.take();
        // SAFETY: `buf` is a bounce buffer (at least a page) this call holds.
        let out = unsafe { &mut *(buf as *mut [u8; PAGE_SIZE]) };
        match copy {
            TierCopy::Pool(h) => {
                self.load_checked(p, h, out);
                if let Some(c) = &self.compressed {
                    c.pool_fault(p);
                }
            }
            TierCopy::Same => {
                let word = self.pt.hash(p).to_ne_bytes();
                for w in out.chunks_exact_mut(8) {
                    w.copy_from_slice(&word);
                }
            }
            TierCopy::File(_) => fatal("a file copy reached the compressed fault path", &{
                io::Error::from_raw_os_error(libc::EFAULT)
            }),
        }
        // Counted before the page is mapped, which wakes the faulting thread (as in
        // `Engine::fetch`), and recorded with them.
        self.note(p, Event::PoolFault);
        Counters::bump(&self.counters.faults_tier);
        Counters::bump(&self.counters.faults_compressed);
        Counters::bump(&self.counters.promotions);
        // SAFETY: buf holds the page; page p is ours (Busy) and missing.
        unsafe { self.fill(p, buf, 1, false, "mapping a decompressed page failed") };
        self.file.bounce.give(buf);
        if copy == TierCopy::Same {
            self.pt.set_copy(p, None);
        }
        self.pt
            .publish(p, State::Mapped, Some(old.history().touch()));
        self.arrived(p);
        self.counters
            .fault_compressed_latency
            .record(sys::now_ns() - t0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compressor_names_round_trip() {
        for n in Compress::NAMES {
            assert_eq!(Compress::from_name(n).unwrap().name(), n);
        }
        assert_eq!(Compress::from_name("zstd9"), None);
    }

    #[test]
    fn the_pool_takes_its_share_and_keeps_it_within_its_bounds() {
        // Sizing itself: from a sixteenth, up to half, down to a thirty-second.
        let c = Compressed::new(Codec::Lz4, 1024, 4096, 1 << 16, None, true).unwrap();
        assert_eq!(c.pool.capacity_pages(), 64);
        assert_eq!(c.set_capacity(10_000, 1024), 512);
        assert_eq!(c.min_for(1024), 32);
        // A quota four times larger keeps the share.
        c.set_capacity(256, 1024);
        c.quota_changed(4096);
        assert_eq!(c.pool.capacity_pages(), 1024);
        // --compressed-max caps it, and it starts at the smaller of that and a sixteenth.
        let capped = Compressed::new(Codec::Lz4, 1024, 1024, 1 << 16, Some(40), true).unwrap();
        assert_eq!(capped.pool.capacity_pages(), 40);
        assert_eq!(capped.set_capacity(500, 1024), 40);
        assert_eq!(capped.min_for(1024), 32);
        // Fixed (the default): --compressed-max, at most three quarters.
        let fixed = Compressed::new(Codec::Lz4, 1024, 1024, 1 << 16, Some(100), false).unwrap();
        assert_eq!(fixed.pool.capacity_pages(), 100);
        assert_eq!(fixed.set_capacity(500, 1024), 100);
        let too_much = Compressed::new(Codec::Lz4, 1024, 1024, 1 << 16, Some(1000), false).unwrap();
        assert_eq!(too_much.pool.capacity_pages(), 768);
    }

    #[test]
    fn the_pool_grows_when_its_saving_outweighs_what_it_takes() {
        // 1000 file faults a second on pages the pool wrote back lately, each 60 µs against
        // 15 µs from the pool: 45 ms saved. 100 young pool faults (15 + 10 µs each) and 100
        // more hint faults (5 + 10 µs each): 4 ms.
        let j = Judgement::of(1000.0, 100.0, 100.0, 15e3, 60e3, 10e3);
        assert_eq!(j.saves_ns, 45e6);
        assert_eq!(j.costs_ns, 4e6);
        assert_eq!(j.verdict(), 1);
        // Hot pages squeezed out: hint faults and young pool faults swamp the saving.
        assert_eq!(
            Judgement::of(1000.0, 1000.0, 3000.0, 15e3, 60e3, 10e3).verdict(),
            -1
        );
        // Close: hold.
        assert_eq!(
            Judgement::of(100.0, 150.0, 0.0, 15e3, 45e3, 0.0).verdict(),
            0
        );
        assert_eq!(
            Judgement::of(100.0, 120.0, 0.0, 15e3, 45e3, 0.0).verdict(),
            0
        );
        // No saving at all (nothing written back is read again): shrink.
        assert_eq!(
            Judgement::of(0.0, 10.0, 0.0, 15e3, 60e3, 10e3).verdict(),
            -1
        );
        // Hint faults estimated in proportion to the step.
        assert_eq!(Judgement::more_hints(1000.0, 1024, 8192), 125.0);
        assert_eq!(Judgement::more_hints(1000.0, 1024, 0), 1000.0);
    }
}
