//! The compressed level: pages leaving DRAM are compressed into a pool in DRAM ([`Pool`]:
//! LZ4, packed by size class) before any goes to the file. A fault on a page in the pool is a
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
//! The pool may take a sixteenth of the quota (`--compressed-max` sets another share, up to
//! three quarters), and keeps that share when the quota changes; a pool over its size after
//! a change writes its oldest back. A pool that adapts its size to what it saves is the goal;
//! the two ways tried (weighing faults near the pool's two boundaries, as ghost lists do, and
//! a hill climb on the time faults cost) both grew the pool past its best size on a
//! single-threaded program bound by faults, whose DRAM the pool then squeezed, and lost to a
//! small fixed pool (the notebook's nineteenth run).
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
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use memtide_policy::PAGE_SIZE;

use super::fatal::{fatal, fatal_with};
use super::{Engine, Event};
use crate::pages::{State, TierCopy, Word};
use crate::stats::Counters;
use crate::sys::{self, Mapping};
use crate::tier::{Handle, Pool, Stored};

/// Pages written back from the pool to the file in one batch: when the pool is full, a batch
/// makes room for about as many new pages (the batch the evictor retires); when the pool must
/// shrink, [`SPILL_BATCH`] a round.
pub(super) const SPILL_ROOM: usize = 64;
pub(super) const SPILL_BATCH: usize = 256;

/// How pages are compressed on their way out of DRAM.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Compress {
    /// LZ4 (the default): about 1 µs to decompress a page here.
    #[default]
    Lz4,
    /// No compressed level: pages go to the file.
    Off,
}

impl Compress {
    /// The names `--compress` takes.
    pub const NAMES: [&'static str; 2] = ["lz4", "off"];

    pub fn from_name(name: &str) -> Option<Compress> {
        match name {
            "lz4" => Some(Compress::Lz4),
            "off" | "none" => Some(Compress::Off),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Compress::Lz4 => "lz4",
            Compress::Off => "off",
        }
    }
}

/// The pool's share of the quota unless `--compressed-max` says otherwise: a sixteenth.
pub(super) fn default_capacity(quota_pages: u64) -> u64 {
    quota_pages / 16
}

/// The most of the quota the pool may take even when asked for more (the rest holds the
/// pages in use).
pub(super) fn capacity_cap(quota_pages: u64) -> u64 {
    quota_pages * 3 / 4
}

/// The compressed level of one engine.
pub(super) struct Compressed {
    pub(super) pool: Pool,
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
}

impl Compressed {
    /// A level for a quota of `quota_pages` that may grow to `max_quota_pages`, whose pool
    /// takes `asked_pages` (`--compressed-max`) or a sixteenth of the quota.
    pub(super) fn new(
        quota_pages: u64,
        max_quota_pages: u64,
        asked_pages: Option<u64>,
    ) -> io::Result<Compressed> {
        let max = Self::max_for(asked_pages, max_quota_pages)
            .max(Self::max_for(asked_pages, quota_pages));
        let c = Compressed {
            pool: Pool::new(PAGE_SIZE, max as usize * PAGE_SIZE)?,
            asked_pages,
            order: Mutex::new(VecDeque::new()),
            spill_buf: Mutex::new(Mapping::anon(SPILL_BATCH * PAGE_SIZE)?),
            share_ppm: AtomicU64::new(0),
            futile: Default::default(),
        };
        let size = asked_pages.unwrap_or_else(|| default_capacity(quota_pages));
        c.set_capacity(size, quota_pages);
        Ok(c)
    }

    /// The most the pool may take under a quota of `quota_pages`.
    fn max_for(asked: Option<u64>, quota_pages: u64) -> u64 {
        asked
            .unwrap_or(u64::MAX)
            .min(capacity_cap(quota_pages))
            .max(1)
    }

    /// Sets the pool's capacity to `pages` (at most its bound) under a quota of `quota_pages`.
    /// Returns the capacity in force.
    fn set_capacity(&self, pages: u64, quota_pages: u64) -> u64 {
        let max = Self::max_for(self.asked_pages, quota_pages);
        let c = self.pool.set_capacity(pages.clamp(1, max));
        self.share_ppm
            .store(c * 1_000_000 / quota_pages.max(1), Ordering::Relaxed);
        c
    }

    /// The quota became `quota_pages`: the pool keeps its share of it.
    pub(super) fn quota_changed(&self, quota_pages: u64) {
        let share = self.share_ppm.load(Ordering::Relaxed);
        self.set_capacity(quota_pages * share / 1_000_000, quota_pages);
    }

    fn order(&self) -> std::sync::MutexGuard<'_, VecDeque<(u32, u32)>> {
        self.order.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the pool has room for more objects and took some of the last batch that
    /// the file could not.
    pub(super) fn has_room(&self) -> bool {
        self.pool.pages() + 4 <= self.pool.capacity_pages() && !self.futile.load(Ordering::Relaxed)
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
                self.spill(SPILL_ROOM);
                stored = c.pool.store(page);
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
                    Counters::bump(&self.counters.compressed_stores);
                    out.stored += 1;
                }
                Stored::TooBig => {
                    Counters::bump(&self.counters.compressed_rejected);
                    to_file.push((p, s, h));
                }
                Stored::Full => to_file.push((p, s, h)),
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
            }
            self.pt.publish(p, State::Evicted, None);
        }
        Counters::add(&self.counters.compressed_spills, written as u64);
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
            TierCopy::Pool(h) => self.load_checked(p, h, out),
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
        let c = Compressed::new(1024, 4096, None).unwrap();
        assert_eq!(c.pool.capacity_pages(), 64);
        assert_eq!(c.set_capacity(10_000, 1024), 768);
        // A quota four times larger keeps the share.
        c.set_capacity(256, 1024);
        c.quota_changed(4096);
        assert_eq!(c.pool.capacity_pages(), 1024);
        let asked = Compressed::new(1024, 1024, Some(100)).unwrap();
        assert_eq!(asked.pool.capacity_pages(), 100);
        assert_eq!(asked.set_capacity(500, 1024), 100);
        let too_much = Compressed::new(1024, 1024, Some(1000)).unwrap();
        assert_eq!(too_much.pool.capacity_pages(), 768);
    }
}
