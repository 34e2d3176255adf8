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
//! hint faults a smaller active list adds, each at its measured price ([`memtide_policy::pool::Judgement`]), and
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
use crate::tier::{same_word, Codec, Handle, Pool, Stored};
use memtide_policy::pool::{adaptive_most_pages, step_pages, Prices, Sample, Sizer, HINT_NS};
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
pub(super) use memtide_policy::pool::default_pages as default_capacity;
/// The most of the quota the pool may take even when asked for more.
pub(super) use memtide_policy::pool::most_pages as capacity_cap;

/// What a fault costs the program beyond the time the engine measures inside it: the wake-up of
/// a handler thread and of the faulting thread (`--faults threads`), or the signal's delivery
/// and return (`--faults signal`). Roughly what these machines show (docs/notebook, runs 16
/// and 23).
const WAKE_THREADS_NS: f64 = 10_000.0;
const WAKE_SIGNAL_NS: f64 = 2_000.0;

/// Pages the pool refused in a row (each compressed, and found to compress too little) after
/// which the evictor stops compressing every page: it tries one in [`SAMPLE_EVERY`] and sends
/// the others straight to the file (still kept as one word when they are one word repeated).
/// A page the pool stores compressed ends the sampling. Data that does not compress then costs the
/// evictor a sixteenth of the compressions, the CPU the program's threads and the handler
/// threads compete for, while data that compresses again is found within a few batches.
const REFUSED_BEFORE_SAMPLING: u32 = 32;
const SAMPLE_EVERY: u32 = 16;
const _: () = assert!(SAMPLE_EVERY.is_power_of_two() && SAMPLE_EVERY > 1);

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
    /// Pages refused in a row, and the count of pages that sampling decides on (see
    /// [`REFUSED_BEFORE_SAMPLING`]).
    refused_run: AtomicU32,
    sample_tick: AtomicU32,
    /// Held while the capacity is set (by the sizer or a quota change); never on a fault path.
    resize: Mutex<()>,
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
            refused_run: AtomicU32::new(0),
            sample_tick: AtomicU32::new(0),
            resize: Mutex::new(()),
        };
        let size = match (adaptive, asked_pages) {
            (false, Some(a)) => a,
            _ => default_capacity(quota_pages),
        };
        c.set_capacity(size, quota_pages);
        Ok(c)
    }

    /// Whether the evictor should compress the next page leaving DRAM: always, unless the
    /// pool has refused the last [`REFUSED_BEFORE_SAMPLING`] pages it tried; then one page in
    /// [`SAMPLE_EVERY`] on average, chosen by a multiplicative hash of a count rather than
    /// every sixteenth, so that pages leaving in a pattern with that period are not always
    /// the ones skipped.
    fn worth_trying(&self) -> bool {
        if self.refused_run.load(Ordering::Relaxed) < REFUSED_BEFORE_SAMPLING {
            return true;
        }
        let tick = self.sample_tick.fetch_add(1, Ordering::Relaxed);
        tick.wrapping_mul(0x9E37_79B9) >> (32 - SAMPLE_EVERY.trailing_zeros()) == 0
    }

    /// Notes what the pool did with a page it was offered: a refusal lengthens the run of
    /// refusals, a page taken ends it (a same-filled page or a full pool says nothing of how
    /// the data compresses).
    fn tried(&self, stored: Stored) {
        match stored {
            Stored::TooBig => {
                let n = self.refused_run.load(Ordering::Relaxed);
                self.refused_run
                    .store(n.saturating_add(1), Ordering::Relaxed);
            }
            Stored::Object(_) => self.refused_run.store(0, Ordering::Relaxed),
            Stored::Same(_) | Stored::Full => {}
        }
    }

    /// The most the pool may take under a quota of `quota_pages`.
    fn max_for(&self, quota_pages: u64) -> u64 {
        Self::bound(self.asked_pages, self.adaptive, quota_pages)
    }

    fn bound(asked: Option<u64>, adaptive: bool, quota_pages: u64) -> u64 {
        let default = if adaptive {
            adaptive_most_pages(quota_pages)
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
        step_pages(quota_pages).min(self.max_for(quota_pages))
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
            // None: sent to the file untried (the pool keeps refusing what it tries).
            let stored = if c.worth_trying() {
                let mut stored = c.pool.store(page);
                if stored == Stored::Full && !spilled {
                    spilled = true;
                    // Room from the pool's holes first: moving objects writes nothing to the
                    // file.
                    if self.compact_pool() > 0 {
                        stored = c.pool.store(page);
                    }
                    if stored == Stored::Full {
                        // Not enough for this page's class: the oldest go to the file.
                        self.spill(SPILL_ROOM);
                        stored = c.pool.store(page);
                    }
                }
                c.tried(stored);
                Some(stored)
            } else {
                same_word(page).map(Stored::Same)
            };
            match stored {
                Some(Stored::Same(word)) => {
                    self.forget_copy(p);
                    self.pt.set_hash(p, word);
                    self.pt.set_copy(p, Some(TierCopy::Same));
                    Counters::bump(&self.counters.compressed_same);
                    out.stored += 1;
                }
                Some(Stored::Object(handle)) => {
                    self.forget_copy(p);
                    self.pt.set_hash(p, h);
                    self.pt.set_copy(p, Some(TierCopy::Pool(handle)));
                    self.pool_order_push(p, handle);
                    c.stored(p);
                    Counters::bump(&self.counters.compressed_stores);
                    out.stored += 1;
                }
                Some(Stored::TooBig) => {
                    Counters::bump(&self.counters.compressed_rejected);
                    c.forget_seq(p);
                    to_file.push((p, s, h));
                }
                Some(Stored::Full) => {
                    c.forget_seq(p);
                    to_file.push((p, s, h));
                }
                None => {
                    Counters::bump(&self.counters.compressed_skipped);
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
    /// latencies, by the policy crate's [`Sizer`].
    pub(super) fn size_pool(&self, now_ns: u64) {
        let Some(c) = self.compressed.as_ref().filter(|c| c.adaptive) else {
            return;
        };
        let mut sizer = c.sizer.lock().unwrap_or_else(|e| e.into_inner());
        if !sizer.due(now_ns) {
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
        let step = step_pages(quota);
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
        let prices = Prices {
            wake_ns: if self.uffd.delivery() == crate::Delivery::Signal {
                WAKE_SIGNAL_NS
            } else {
                WAKE_THREADS_NS
            },
            hint_ns: HINT_NS,
        };
        // The pages in use that are not on the inactive list.
        let active = quota
            .saturating_sub(self.ring.staged.load(Ordering::Relaxed))
            .saturating_sub(c.pool.pages());
        let Some(verdict) = sizer.judge(now, step, active, prices) else {
            return;
        };
        // Capacity changes are serialised with the quota's (`quota_changed` takes this lock),
        // so that a quota changed since `quota` was read is not overwritten.
        let _serial = c.resize.lock().unwrap_or_else(|e| e.into_inner());
        let quota = self.quota.wm().quota;
        let cap = c.pool.capacity_pages();
        let used = c.pool.pages() + step / 2 >= cap;
        let moved = sizer.apply(
            verdict,
            cap,
            c.min_for(quota),
            c.max_for(quota),
            step,
            used,
            now_ns,
        );
        if let Some(pages) = moved {
            c.set_capacity(pages, quota);
            Counters::bump(if pages > cap { &c.grows } else { &c.shrinks });
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
}
