//! The compressed pool: pages kept in DRAM compressed (LZ4 or zstd, [`Codec`]), packed by size
//! class into chunks of contiguous memory (as zsmalloc packs zspages), for the compressed level
//! that sits between DRAM and the file. A page whose eight-byte words are all the same is kept
//! as that word alone ([`Stored::Same`]); one that compresses worse than [`MAX_OBJECT`] is
//! refused ([`Stored::TooBig`]) and belongs in the file.
//!
//! The engine's compressed level (`engine/compressed.rs`) keeps one pool; this file is the
//! pool's own contract, tested on its own. Entry point: [`Pool`].
//!
//! # Layout
//!
//! One anonymous mapping, reserved whole at the start (address space only), cut into chunk
//! slots of [`MAX_CHUNK_PAGES`] pages. A size class holds objects of up to `size` bytes (a
//! multiple of 64, the first two bytes of each object its compressed length); its chunks use
//! the first 1–8 pages of their slot, whichever wastes least (the rest of the slot is address
//! space only), and objects may straddle the pages of a chunk. A chunk whose last object is freed gives its
//! DRAM back at once and its slot goes to the free list.
//!
//! # Compaction
//!
//! Frees leave holes in chunks that stay in use. When the holes take more than
//! [`COMPACT_WASTE`] of the pool's DRAM, the engine compacts it, as zsmalloc does: in each
//! class, the sparsest partly used chunks are set apart ([`Pool::begin_compaction`]), so that
//! nothing new is stored in them, and only as many as the other chunks of the class have room
//! for; the holder of each of their objects moves it ([`Pool::relocate`]: its compressed bytes
//! copied into a hole elsewhere, no decompression) and takes the new handle. A chunk emptied
//! so gives its DRAM back; one whose objects did not all move goes back to use
//! ([`Pool::end_compaction`]).
//!
//! # Concurrency
//!
//! `store` and `free` take the pool's lock (and `store` allocates LZ4's hash table, or takes
//! the zstd compression context's lock): they are for the evictor, never for a fault path.
//! `load` takes no lock and allocates nothing, so that a fault path (a signal handler among
//! them) may call it: where a chunk is follows from its number, and its class is an atomic set
//! before any object of it is handed out; zstd decompresses with one of a set of contexts made
//! with the pool, taken with an atomic flag ([`Zstd::decompress`]). The
//! caller must hold the object (the engine's page is claimed while it loads), so no `free` of
//! it runs meanwhile, and must have received its handle with Release/Acquire ordering from the
//! thread that stored it (the class atomic does not publish the object's bytes). A freed
//! object's length is cleared, so a load of it fails until its place is reused; past that,
//! the engine checks a loaded page against its checksum, as it does pages read from the file.

use std::cell::UnsafeCell;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::sys::{self, Mapping};

const PAGE: usize = 4096;
/// Object sizes are multiples of this.
const ALIGN: usize = 64;
/// The largest object kept: a page that compresses to more (with its length) goes to the file.
pub const MAX_OBJECT: usize = 3 * PAGE / 4;
const CLASSES: usize = MAX_OBJECT / ALIGN;
/// Room for LZ4's output of a page, however incompressible.
const COMPRESSED_MAX: usize = lz4_flex::block::get_maximum_output_size(PAGE);
/// The most pages a chunk spans: the size of a chunk slot. Eight (as zsmalloc's default chain
/// of eight pages) packs objects of 2,112 bytes (a page that compresses 2:1, with its length)
/// with 3.3% of the chunk left over at its end, where four left 9.8%.
const MAX_CHUNK_PAGES: usize = 8;
const SLOT: usize = MAX_CHUNK_PAGES * PAGE;
/// A chunk slot's class while no chunk is in it.
const NO_CLASS: u16 = u16::MAX;
/// The share of the pool's DRAM that holes (free objects in chunks in use) may take before
/// compaction is due: an eighth. Below it, new stores fill the holes soon enough; above it,
/// the pool holds noticeably fewer pages than its DRAM could.
pub const COMPACT_WASTE: f64 = 0.125;
/// The most chunks a pool has: a handle's number stays below 2^31 - 1, so that the page
/// table can mark it with the top bit of a word and keep one value besides.
const MAX_CHUNKS: usize = (1 << 23) - 1;

/// How a pool compresses its pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Codec {
    /// LZ4 (lz4_flex): about 1 µs to decompress a page here, and fast to compress.
    #[default]
    Lz4,
    /// zstd at [`ZSTD_LEVEL`]: smaller objects of most data, slower both ways.
    Zstd,
}

/// zstd's compression level for pool objects: its fastest positive level. Higher levels
/// shrink 4 KiB pages little more and cost the evictor several times the CPU.
pub const ZSTD_LEVEL: i32 = 1;

/// zstd's state for a pool: one compression context (for the evictor, under a lock) and a
/// set of decompression contexts, made with the pool, that fault paths take without a lock
/// or an allocation.
struct Zstd {
    compress: Mutex<zstd_safe::CCtx<'static>>,
    contexts: Box<[DContext]>,
    /// Where the next taker starts looking (spreads takers over the contexts).
    next: AtomicUsize,
}

struct DContext {
    busy: AtomicBool,
    ctx: UnsafeCell<zstd_safe::DCtx<'static>>,
}

// SAFETY: a context is used only by the thread that set its `busy` flag (Acquire) until it
// clears it (Release).
unsafe impl Sync for DContext {}

impl Zstd {
    /// State with `n` decompression contexts (about 100 KiB of memory each; at least two, so
    /// that a load nested in a signal handler on a thread that holds one finds another): as
    /// many fault paths as that decompress at once without waiting for each other. Made as the
    /// engine's: zstd allocates them with the public `malloc`, which in a program under the
    /// preload library would otherwise be the program's allocator.
    fn new(n: usize) -> io::Result<Zstd> {
        crate::threads::as_engine(|| Self::make(n))
    }

    fn make(n: usize) -> io::Result<Zstd> {
        let ctx = || {
            zstd_safe::DCtx::try_create()
                .ok_or_else(|| io::Error::other("zstd could not make a decompression context"))
        };
        Ok(Zstd {
            compress: Mutex::new(
                zstd_safe::CCtx::try_create()
                    .ok_or_else(|| io::Error::other("zstd could not make a compression context"))?,
            ),
            contexts: (0..n.max(2))
                .map(|_| {
                    Ok(DContext {
                        busy: AtomicBool::new(false),
                        ctx: UnsafeCell::new(ctx()?),
                    })
                })
                .collect::<io::Result<_>>()?,
            next: AtomicUsize::new(0),
        })
    }

    /// Compresses `page` into `out`; `None` if it does not fit.
    fn compress(&self, page: &[u8; PAGE], out: &mut [u8]) -> Option<usize> {
        let mut c = self.compress.lock().unwrap_or_else(|e| e.into_inner());
        c.compress(out, page, ZSTD_LEVEL).ok()
    }

    /// Decompresses `object` into `out` with a free context (no lock, no allocation, safe in a
    /// signal handler): whether it made a page. With every context taken (more fault paths
    /// decompressing at once than there are contexts, or a signal handler that interrupted
    /// one), it tries again, yielding the CPU between rounds.
    fn decompress(&self, object: &[u8], out: &mut [u8; PAGE]) -> bool {
        let n = self.contexts.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let mut i = 0;
        loop {
            let c = &self.contexts[(start + i) % n];
            if !c.busy.load(Ordering::Relaxed)
                && c.busy
                    .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                // SAFETY: the flag just taken gives this thread the context alone.
                let r = unsafe { (*c.ctx.get()).decompress(&mut out[..], object) };
                c.busy.store(false, Ordering::Release);
                return r == Ok(PAGE);
            }
            i += 1;
            if i % n == 0 {
                sys::yield_cpu();
            }
        }
    }
}

/// The pool's compressor.
enum Coder {
    Lz4,
    Zstd(Box<Zstd>),
}

/// Object size of class `class`.
fn class_size(class: usize) -> usize {
    (class + 1) * ALIGN
}

/// The chunk of 1 to [`MAX_CHUNK_PAGES`] pages that wastes the fewest bytes per page, for
/// objects of `size`, and how many objects it holds (at most 256: a handle's object number
/// is a byte).
fn chunk_shape(size: usize) -> (usize, usize) {
    let per = |p: usize| (p * PAGE / size).min(256);
    let pages = (1..=MAX_CHUNK_PAGES)
        .min_by_key(|&p| (p * PAGE - per(p) * size) * MAX_CHUNK_PAGES / p)
        .expect("at least one choice");
    (pages, per(pages))
}

/// Where a stored page is: the chunk and the object in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Handle(u32);

impl Handle {
    fn new(chunk: usize, object: usize) -> Handle {
        Handle((chunk as u32) << 8 | object as u32)
    }
    fn chunk(self) -> usize {
        (self.0 >> 8) as usize
    }
    fn object(self) -> usize {
        (self.0 & 0xFF) as usize
    }
    /// The handle as a number (for a side table).
    pub fn raw(self) -> u32 {
        self.0
    }
    pub fn from_raw(raw: u32) -> Handle {
        Handle(raw)
    }
}

/// What [`Pool::store`] did with a page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stored {
    /// Every word of the page is this one: nothing stored, the caller keeps the word.
    Same(u64),
    /// Compressed and stored.
    Object(Handle),
    /// It compresses too little to be worth DRAM ([`MAX_OBJECT`]): for the file.
    TooBig,
    /// The pool has no room (its capacity is used up).
    Full,
}

/// The word `page` repeats throughout, if it is one word repeated (a zero page, a page of one
/// fill value): such a page is kept as that word, no pool space.
pub fn same_word(page: &[u8; PAGE]) -> Option<u64> {
    let first = u64::from_ne_bytes(page[..8].try_into().expect("8 bytes"));
    page.chunks_exact(8)
        .all(|w| u64::from_ne_bytes(w.try_into().expect("8 bytes")) == first)
        .then_some(first)
}

/// Why a load failed: the object does not decompress to a page (the pool's memory was
/// overwritten, or the handle is not one of the pool's).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("compressed object {0:?} does not decompress to a page")]
pub struct Corrupt(pub Handle);

/// A size class (its object size is [`class_size`]): its chunk size, and the chunks that have
/// free objects.
struct Class {
    chunk_pages: usize,
    per_chunk: usize,
    /// Chunks of this class with a free object.
    partial: Vec<usize>,
}

/// A chunk in use: which objects are taken (at most 256), and whether it is set apart for
/// compaction.
#[derive(Clone, Copy, Default)]
struct Chunk {
    used: u16,
    draining: bool,
    taken: [u64; 4],
}

struct Inner {
    classes: Vec<Class>,
    chunks: Vec<Chunk>,
    /// Chunk slots free for reuse.
    free_chunks: Vec<usize>,
    /// Chunks set apart for compaction (each marked `Chunk::draining`): in no class's partial
    /// list, so nothing is stored in them; their objects move out ([`Pool::relocate`]). A
    /// chunk emptied meanwhile loses its mark and stays listed until the compaction ends.
    draining: Vec<usize>,
    /// Compressed bytes of the objects stored, and how many there are.
    compressed: u64,
    objects: u64,
    /// Pages of chunks in use, and the bytes of their free objects (the holes).
    pages: u64,
    holes: u64,
}

/// A compressed pool of up to `capacity` bytes of DRAM.
pub struct Pool {
    memory: Mapping,
    coder: Coder,
    /// The most pages its chunks may take now ([`set_capacity`](Self::set_capacity)).
    capacity_pages: AtomicU64,
    /// Pages its chunks take now (as `Inner::pages`, readable without the lock; shared with
    /// whoever counts the pool's DRAM, see [`pages_counter`](Self::pages_counter)).
    pages_now: Arc<AtomicU64>,
    /// Each chunk slot's class, or [`NO_CLASS`]: read by `load` without the lock.
    class_of: Box<[AtomicU16]>,
    inner: Mutex<Inner>,
}

/// The pool's figures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Pages stored as objects.
    pub objects: u64,
    /// Their compressed bytes (with each object's two-byte length).
    pub compressed_bytes: u64,
    /// DRAM the pool's chunks take (whole chunks in use).
    pub pool_bytes: u64,
    /// Of that, the bytes of free objects in chunks in use: what compaction could give back.
    pub hole_bytes: u64,
}

impl PoolStats {
    /// Whether the holes take more than [`COMPACT_WASTE`] of the pool's DRAM.
    pub fn fragmented(&self) -> bool {
        self.hole_bytes as f64 > COMPACT_WASTE * self.pool_bytes as f64
    }
}

/// The chunks set apart by [`Pool::begin_compaction`]: their objects are to move.
#[derive(Debug, Default)]
pub struct Draining {
    /// Sorted chunk numbers.
    chunks: Vec<usize>,
}

impl Draining {
    /// Whether object `h` is in one of the chunks set apart.
    pub fn holds(&self, h: Handle) -> bool {
        self.chunks.binary_search(&h.chunk()).is_ok()
    }

    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }
}

impl Pool {
    /// A pool that may use up to `capacity` bytes (rounded down to pages): address space now,
    /// DRAM as pages are stored. Its capacity may be raised later up to `max` bytes. With
    /// zstd, `readers` decompression contexts are made now: as many fault paths as may load
    /// at once without waiting (see [`Zstd::decompress`]).
    pub fn new(capacity: usize, max: usize, codec: Codec, readers: usize) -> io::Result<Pool> {
        // A chunk slot per page of the largest capacity: chunks of one page take a slot of
        // eight, the rest of which stays address space.
        let capacity_pages = (capacity / PAGE).max(1);
        let slots = (max / PAGE).max(capacity_pages).min(MAX_CHUNKS);
        let classes = (0..CLASSES)
            .map(|k| {
                let (chunk_pages, per_chunk) = chunk_shape(class_size(k));
                Class {
                    chunk_pages,
                    per_chunk,
                    partial: Vec::new(),
                }
            })
            .collect();
        Ok(Pool {
            memory: Mapping::anon(slots * SLOT)?,
            coder: match codec {
                Codec::Lz4 => Coder::Lz4,
                Codec::Zstd => Coder::Zstd(Box::new(Zstd::new(readers)?)),
            },
            capacity_pages: AtomicU64::new(capacity_pages as u64),
            pages_now: Arc::new(AtomicU64::new(0)),
            class_of: (0..slots).map(|_| AtomicU16::new(NO_CLASS)).collect(),
            inner: Mutex::new(Inner {
                classes,
                chunks: Vec::new(),
                free_chunks: Vec::new(),
                draining: Vec::new(),
                compressed: 0,
                objects: 0,
                pages: 0,
                holes: 0,
            }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stores `page` compressed (or as its one word, or not at all): see [`Stored`].
    pub fn store(&self, page: &[u8; PAGE]) -> Stored {
        if let Some(word) = same_word(page) {
            return Stored::Same(word);
        }
        // Compressed before the lock is taken: other stores and frees need not wait for it.
        let mut compressed = [0u8; COMPRESSED_MAX];
        let n = match &self.coder {
            Coder::Lz4 => lz4_flex::block::compress_into(page, &mut compressed).ok(),
            // zstd stops at a full buffer: one an object's size is enough.
            Coder::Zstd(z) => z.compress(page, &mut compressed[..MAX_OBJECT - 2]),
        };
        let n = match n {
            Some(n) if n + 2 <= MAX_OBJECT => n,
            _ => return Stored::TooBig,
        };
        let mut g = self.lock();
        let inner = &mut *g;
        let class = (n + 2).div_ceil(ALIGN) - 1;
        let Some((chunk, object)) = self.take_object(inner, class, true) else {
            return Stored::Full;
        };
        let at = chunk * SLOT + object * class_size(class);
        // SAFETY: the object lies inside a chunk of the pool's mapping that this call just
        // took for it; no one else writes it (the lock is held, and loads read only objects
        // they hold).
        unsafe {
            let dst = (self.memory.addr() + at) as *mut u8;
            std::ptr::copy_nonoverlapping((n as u16).to_le_bytes().as_ptr(), dst, 2);
            std::ptr::copy_nonoverlapping(compressed.as_ptr(), dst.add(2), n);
        }
        inner.compressed += n as u64 + 2;
        inner.objects += 1;
        Stored::Object(Handle::new(chunk, object))
    }

    /// A free object of `class`: from a partial chunk, else (with `grow`) a new or freed chunk.
    fn take_object(&self, inner: &mut Inner, class: usize, grow: bool) -> Option<(usize, usize)> {
        let chunk = match inner.classes[class].partial.last() {
            Some(&c) => c,
            None if !grow => return None,
            None => {
                let pages = inner.classes[class].chunk_pages;
                if inner.pages + pages as u64 > self.capacity_pages.load(Ordering::Relaxed) {
                    return None;
                }
                let c = match inner.free_chunks.pop() {
                    Some(c) => c,
                    None => {
                        if inner.chunks.len() >= self.class_of.len() {
                            return None;
                        }
                        inner.chunks.push(Chunk::default());
                        inner.chunks.len() - 1
                    }
                };
                inner.chunks[c] = Chunk::default();
                // Before any object of it is handed out, so that `load` finds it.
                self.class_of[c].store(class as u16, Ordering::Release);
                inner.pages += pages as u64;
                inner.holes += (inner.classes[class].per_chunk * class_size(class)) as u64;
                self.pages_now.store(inner.pages, Ordering::Release);
                inner.classes[class].partial.push(c);
                c
            }
        };
        let per_chunk = inner.classes[class].per_chunk;
        let ch = &mut inner.chunks[chunk];
        let object = (0..per_chunk)
            .find(|&o| ch.taken[o / 64] & (1 << (o % 64)) == 0)
            .expect("a partial chunk has a free object");
        ch.taken[object / 64] |= 1 << (object % 64);
        ch.used += 1;
        inner.holes -= class_size(class) as u64;
        if ch.used as usize == per_chunk {
            // The chunk taken from is the last partial one.
            inner.classes[class].partial.pop();
        }
        Some((chunk, object))
    }

    /// Decompresses the object `h` into `out` (no lock, no allocation). The caller holds `h`:
    /// no [`free`](Self::free) of it runs meanwhile.
    pub fn load(&self, h: Handle, out: &mut [u8; PAGE]) -> Result<(), Corrupt> {
        let class = self
            .class_of
            .get(h.chunk())
            .map(|c| c.load(Ordering::Acquire) as usize)
            .filter(|&c| c < CLASSES)
            .ok_or(Corrupt(h))?;
        let size = class_size(class);
        if h.object() >= chunk_shape(size).1 {
            return Err(Corrupt(h));
        }
        let at = h.chunk() * SLOT + h.object() * size;
        // SAFETY: `at..at + size` lies inside chunk slot `h.chunk()` of the pool's mapping
        // (the object number is within its class's chunk), which holds object `h`; the
        // caller holds it, so nothing writes it while it is read.
        let object =
            unsafe { std::slice::from_raw_parts((self.memory.addr() + at) as *const u8, size) };
        let n = u16::from_le_bytes([object[0], object[1]]) as usize;
        if n + 2 > size {
            return Err(Corrupt(h));
        }
        let whole = match &self.coder {
            Coder::Lz4 => matches!(
                lz4_flex::block::decompress_into(&object[2..2 + n], out),
                Ok(PAGE)
            ),
            Coder::Zstd(z) => z.decompress(&object[2..2 + n], out),
        };
        if whole {
            Ok(())
        } else {
            Err(Corrupt(h))
        }
    }

    /// Frees object `h`; a chunk left empty gives its DRAM back.
    pub fn free(&self, h: Handle) {
        let mut g = self.lock();
        self.free_locked(&mut g, h);
    }

    /// Frees object `h` under the lock: its compressed length (0 if `h` was not held).
    fn free_locked(&self, inner: &mut Inner, h: Handle) -> u64 {
        let Some(ch) = inner.chunks.get_mut(h.chunk()) else {
            return 0;
        };
        let o = h.object();
        let class = self.class_of[h.chunk()].load(Ordering::Relaxed) as usize;
        if class >= CLASSES || ch.taken[o / 64] & (1 << (o % 64)) == 0 {
            return 0;
        }
        let at = h.chunk() * SLOT + o * class_size(class);
        let mut len = [0u8; 2];
        // SAFETY: inside the pool's mapping, the start of an object this pool handed out.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (self.memory.addr() + at) as *const u8,
                len.as_mut_ptr(),
                2,
            )
        };
        let n = u16::from_le_bytes(len) as u64;
        // SAFETY: as above; the object is no longer anyone's, so its length goes (a load of
        // it then fails).
        unsafe { std::ptr::write_bytes((self.memory.addr() + at) as *mut u8, 0, 2) };
        ch.taken[o / 64] &= !(1 << (o % 64));
        let was_full = ch.used as usize == inner.classes[class].per_chunk;
        ch.used -= 1;
        let empty = ch.used == 0;
        inner.compressed = inner.compressed.saturating_sub(n + 2);
        inner.objects -= 1;
        inner.holes += class_size(class) as u64;
        let draining = ch.draining;
        if empty {
            ch.draining = false;
            if !draining {
                inner.classes[class].partial.retain(|&c| c != h.chunk());
            }
            inner.holes -= (inner.classes[class].per_chunk * class_size(class)) as u64;
            let pages = inner.classes[class].chunk_pages;
            // SAFETY: every object of this chunk is freed; nothing in it is needed.
            unsafe {
                let _ = sys::discard(self.memory.addr() + h.chunk() * SLOT, pages * PAGE);
            }
            self.class_of[h.chunk()].store(NO_CLASS, Ordering::Release);
            inner.free_chunks.push(h.chunk());
            inner.pages -= pages as u64;
            self.pages_now.store(inner.pages, Ordering::Release);
        } else if was_full && !draining {
            inner.classes[class].partial.push(h.chunk());
        }
        n
    }

    /// Sets apart, in each class, its sparsest partly used chunks whose objects (at most
    /// `max_objects` in all) the class's other partly used chunks have room for: nothing is
    /// stored in them until [`end_compaction`](Self::end_compaction). Their objects' holders
    /// then move them with [`relocate`](Self::relocate); every chunk whose objects all move
    /// gives its DRAM back. One compaction at a time (the caller's).
    pub fn begin_compaction(&self, max_objects: usize) -> Draining {
        let mut g = self.lock();
        let inner = &mut *g;
        let mut d = Draining::default();
        let mut objects = 0;
        for class in 0..CLASSES {
            let per = inner.classes[class].per_chunk;
            let mut partial = inner.classes[class].partial.clone();
            if partial.len() < 2 {
                continue;
            }
            let used = |c: usize| inner.chunks[c].used as usize;
            partial.sort_by_key(|&c| used(c));
            // Room left in the chunks that stay, as sources are taken from the sparse end.
            let mut room: usize = partial.iter().map(|&c| per - used(c)).sum();
            let mut moving = 0;
            let mut taken = Vec::new();
            for &c in &partial {
                let (u, f) = (used(c), per - used(c));
                if objects + u > max_objects || moving + u > room - f {
                    break;
                }
                moving += u;
                room -= f;
                objects += u;
                taken.push(c);
            }
            for &c in &taken {
                inner.chunks[c].draining = true;
            }
            let chunks = &inner.chunks;
            inner.classes[class]
                .partial
                .retain(|&c| !chunks[c].draining);
            d.chunks.extend_from_slice(&taken);
        }
        inner.draining.extend_from_slice(&d.chunks);
        d.chunks.sort_unstable();
        d
    }

    /// Moves object `h`, which is in a chunk set apart by
    /// [`begin_compaction`](Self::begin_compaction), into a hole of a chunk in use of its
    /// class (its compressed bytes as they are) and frees it: the object's new handle, or
    /// `None` (it stays) when `h` is not such an object or the class has no hole left. The
    /// caller holds `h` as for a load and gives the new handle to its holder.
    pub fn relocate(&self, h: Handle) -> Option<Handle> {
        let mut g = self.lock();
        let inner = &mut *g;
        let class = self.class_of[h.chunk()].load(Ordering::Relaxed) as usize;
        let o = h.object();
        let ch = inner.chunks.get(h.chunk())?;
        if !ch.draining || class >= CLASSES || ch.taken[o / 64] & (1 << (o % 64)) == 0 {
            return None;
        }
        let (chunk, object) = self.take_object(inner, class, false)?;
        let size = class_size(class);
        // SAFETY: both lie inside chunks of the pool's mapping and are distinct objects of one
        // class (a chunk set apart is in no partial list, so `take_object` did not pick it):
        // the source is `h`, which the caller holds, the destination was free until now; the
        // lock keeps every other store and free away.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (self.memory.addr() + h.chunk() * SLOT + o * size) as *const u8,
                (self.memory.addr() + chunk * SLOT + object * size) as *mut u8,
                size,
            );
        }
        // The object stays counted: `free_locked` takes back what `store` added.
        let n = self.free_locked(inner, h);
        inner.compressed += n + 2;
        inner.objects += 1;
        Some(Handle::new(chunk, object))
    }

    /// Ends a compaction: chunks set apart whose objects did not all move are used again.
    pub fn end_compaction(&self) {
        let mut g = self.lock();
        let inner = &mut *g;
        for c in std::mem::take(&mut inner.draining) {
            // A chunk emptied during the compaction lost its mark (its slot may be in use
            // again, as another chunk).
            if !inner.chunks[c].draining {
                continue;
            }
            inner.chunks[c].draining = false;
            let class = self.class_of[c].load(Ordering::Relaxed) as usize;
            inner.classes[class].partial.push(c);
        }
    }

    /// Pages of DRAM the pool's chunks take now (no lock).
    pub fn pages(&self) -> u64 {
        self.pages_now.load(Ordering::Acquire)
    }

    /// The count of pages the pool's chunks take, kept up to date under the pool's lock: a
    /// quota that holds it reads the pool's DRAM as it is, never a stale copy.
    pub fn pages_counter(&self) -> Arc<AtomicU64> {
        self.pages_now.clone()
    }

    /// The most pages the pool may take.
    pub fn capacity_pages(&self) -> u64 {
        self.capacity_pages.load(Ordering::Acquire)
    }

    /// Sets the most pages the pool may take (at most what its address space holds). A pool
    /// above its new capacity takes nothing more until objects are freed. Returns the
    /// capacity in force.
    pub fn set_capacity(&self, pages: u64) -> u64 {
        let c = pages.clamp(1, self.class_of.len() as u64);
        self.capacity_pages.store(c, Ordering::Release);
        c
    }

    pub fn stats(&self) -> PoolStats {
        let g = self.lock();
        PoolStats {
            objects: g.objects,
            compressed_bytes: g.compressed,
            pool_bytes: g.pages * PAGE as u64,
            hole_bytes: g.holes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A page of `random` random words (the rest zero), from `seed`: compresses about
    /// 512 / `random` to 1.
    fn page(seed: u64, random: usize) -> Box<[u8; PAGE]> {
        let mut p = Box::new([0u8; PAGE]);
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        for w in p.chunks_exact_mut(8).take(random) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            w.copy_from_slice(&x.to_ne_bytes());
        }
        p
    }

    #[test]
    fn a_page_comes_back_as_it_went_in_or_is_refused() {
        for codec in [Codec::Lz4, Codec::Zstd] {
            comes_back_or_is_refused(codec);
        }
    }

    fn comes_back_or_is_refused(codec: Codec) {
        let pool = Pool::new(1 << 20, 1 << 20, codec, 1).unwrap();
        assert_eq!(pool.store(&[0; PAGE]), Stored::Same(0));
        assert_eq!(
            pool.store(&[0xAB; PAGE]),
            Stored::Same(0xABAB_ABAB_ABAB_ABAB)
        );
        assert_eq!(pool.store(&page(1, 512)), Stored::TooBig, "random bytes");
        for random in [1, 64, 256, 300] {
            let p = page(random as u64, random);
            let Stored::Object(h) = pool.store(&p) else {
                panic!("{random} random words of 512 should compress");
            };
            let mut out = [0u8; PAGE];
            pool.load(h, &mut out).unwrap();
            assert!(out == *p, "{random} random words came back different");
        }
        let s = pool.stats();
        assert_eq!(s.objects, 4);
        assert!(s.compressed_bytes < 4 * 3072, "{s:?}");
        assert!(s.pool_bytes >= s.compressed_bytes, "{s:?}");
    }

    /// A page of words from a small vocabulary, from `seed`: text, which lz4 makes about
    /// 1.6:1 of and zstd's entropy coding much more.
    fn text(seed: u64) -> Box<[u8; PAGE]> {
        const WORDS: [&str; 8] = ["the", "memory", "of", "page", "and", "cold", "tier", "hot"];
        let mut p = Box::new([b' '; PAGE]);
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut at = 0;
        while at < PAGE {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            for &b in WORDS[(x >> 61) as usize].as_bytes() {
                if at < PAGE {
                    p[at] = b;
                    at += 1;
                }
            }
            at += 1;
        }
        p
    }

    #[test]
    fn zstd_packs_text_tighter_than_lz4_and_both_bring_it_back() {
        let bytes = |codec| {
            let pool = Pool::new(1 << 20, 1 << 20, codec, 1).unwrap();
            let mut out = [0u8; PAGE];
            for seed in 0..64 {
                let Stored::Object(h) = pool.store(&text(seed)) else {
                    panic!("{codec:?}: text should compress");
                };
                pool.load(h, &mut out).unwrap();
                assert!(out == *text(seed), "{codec:?}: text came back different");
            }
            pool.stats().compressed_bytes
        };
        let (lz4, zstd) = (bytes(Codec::Lz4), bytes(Codec::Zstd));
        assert!(
            (zstd as f64) < 0.8 * lz4 as f64,
            "64 pages of text: zstd {zstd} bytes, lz4 {lz4}"
        );
    }

    #[test]
    fn zstd_loads_from_more_threads_than_it_has_contexts() {
        // Two contexts, four threads loading at once: each waits its turn, none reads another's.
        let pool = Pool::new(1 << 20, 1 << 20, Codec::Zstd, 2).unwrap();
        let held: Vec<(Handle, u64)> = (0..32u64)
            .map(|seed| match pool.store(&page(seed, 100)) {
                Stored::Object(h) => (h, seed),
                other => panic!("{other:?}"),
            })
            .collect();
        std::thread::scope(|s| {
            for t in 0..4 {
                let (pool, held) = (&pool, &held);
                s.spawn(move || {
                    let mut out = [0u8; PAGE];
                    for i in 0..2000 {
                        let (h, seed) = held[(i * 7 + t) % held.len()];
                        pool.load(h, &mut out).unwrap();
                        assert!(out == *page(seed, 100), "page {seed} came back different");
                    }
                });
            }
        });
    }

    #[test]
    fn a_full_pool_says_so_and_freeing_makes_room() {
        // One chunk slot: a few objects of one class fit, then the pool is full.
        let pool = Pool::new(SLOT, SLOT, Codec::Lz4, 1).unwrap();
        let p = page(7, 256);
        let mut held = Vec::new();
        loop {
            match pool.store(&p) {
                Stored::Object(h) => held.push(h),
                Stored::Full => break,
                other => panic!("{other:?}"),
            }
            assert!(
                held.len() < 64,
                "a 32 KiB pool cannot hold {} half pages",
                held.len()
            );
        }
        assert!(!held.is_empty());
        pool.free(held.pop().unwrap());
        assert!(matches!(pool.store(&p), Stored::Object(_)));
    }

    #[test]
    fn the_pool_fills_its_capacity_of_dram_whatever_the_class() {
        // One random word a page: tiny objects, whose chunks are one page each.
        for (random, capacity_pages) in [(1, 8), (100, 8), (300, 9)] {
            let pool =
                Pool::new(capacity_pages * PAGE, capacity_pages * PAGE, Codec::Lz4, 1).unwrap();
            let mut n = 0u64;
            while let Stored::Object(_) = pool.store(&page(n, random)) {
                n += 1;
                assert!(n < 100_000);
            }
            let s = pool.stats();
            // Full once another chunk would not fit: within one chunk of it.
            assert!(
                s.pool_bytes <= (capacity_pages * PAGE) as u64
                    && s.pool_bytes + (MAX_CHUNK_PAGES * PAGE) as u64
                        > (capacity_pages * PAGE) as u64,
                "{random} random words: {s:?} of {capacity_pages} pages"
            );
        }
    }

    #[test]
    fn a_freed_object_does_not_load_while_its_chunk_lives_on() {
        let pool = Pool::new(1 << 20, 1 << 20, Codec::Lz4, 1).unwrap();
        let hs: Vec<Handle> = (0..3)
            .map(|i| match pool.store(&page(i, 40)) {
                Stored::Object(h) => h,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(hs[0].chunk(), hs[2].chunk(), "small objects share a chunk");
        pool.free(hs[1]);
        let mut out = [0u8; PAGE];
        assert!(pool.load(hs[1], &mut out).is_err());
        pool.load(hs[2], &mut out).unwrap();
        assert!(out == *page(2, 40));
    }

    #[test]
    fn a_handle_that_is_not_held_does_not_load() {
        let pool = Pool::new(1 << 20, 1 << 20, Codec::Lz4, 1).unwrap();
        let mut out = [0u8; PAGE];
        assert!(pool.load(Handle::new(3, 0), &mut out).is_err(), "no chunk");
        let Stored::Object(h) = pool.store(&page(2, 100)) else {
            panic!()
        };
        assert!(
            pool.load(Handle::new(h.chunk(), 255), &mut out).is_err(),
            "past the chunk"
        );
        pool.free(h);
        assert!(pool.load(h, &mut out).is_err(), "its chunk was emptied");
        assert_eq!(pool.stats(), PoolStats::default());
    }

    /// Checks that every object of `held` loads the page it was stored from.
    fn every_page_loads(pool: &Pool, held: &[(Handle, u64, usize)], when: &str) {
        let mut out = [0u8; PAGE];
        for &(h, seed, random) in held {
            pool.load(h, &mut out).unwrap();
            assert!(
                out == *page(seed, random),
                "{when}: page {seed} came back different"
            );
        }
    }

    /// Moves every object of the chunks set apart that `held` names (as a holder would),
    /// skipping those `skip` picks; returns how many moved.
    fn compact(
        pool: &Pool,
        held: &mut [(Handle, u64, usize)],
        skip: impl Fn(usize) -> bool,
    ) -> usize {
        let d = pool.begin_compaction(usize::MAX);
        let mut moved = 0;
        for (k, (h, _, _)) in held.iter_mut().enumerate() {
            if d.holds(*h) && !skip(k) {
                *h = pool
                    .relocate(*h)
                    .expect("the class has room for what was set apart");
                moved += 1;
            }
        }
        pool.end_compaction();
        moved
    }

    #[test]
    fn compaction_gives_chunks_back_and_every_page_still_loads() {
        let pool = Pool::new(8 << 20, 8 << 20, Codec::Lz4, 1).unwrap();
        // Four sizes of object, then two in three freed: holes everywhere.
        let mut held: Vec<(Handle, u64, usize)> = (0..2000u64)
            .map(|seed| {
                let random = [20, 90, 180, 300][seed as usize % 4];
                match pool.store(&page(seed, random)) {
                    Stored::Object(h) => (h, seed, random),
                    other => panic!("{other:?}"),
                }
            })
            .collect();
        let mut k = 0;
        held.retain(|&(h, _, _)| {
            k += 1;
            if k % 3 != 0 {
                pool.free(h);
            }
            k % 3 == 0
        });
        let before = pool.stats();
        assert!(before.fragmented(), "{before:?}");
        let moved = compact(&pool, &mut held, |_| false);
        let after = pool.stats();
        assert!(moved > 0);
        assert_eq!(after.objects, before.objects);
        assert_eq!(after.compressed_bytes, before.compressed_bytes);
        assert!(
            after.pool_bytes * 2 < before.pool_bytes,
            "a third of the objects left: {before:?} -> {after:?}"
        );
        assert!(!after.fragmented(), "{after:?}");
        every_page_loads(&pool, &held, "after the compaction");
        // New stores fill the chunks again once the compaction is over.
        assert!(matches!(pool.store(&page(9999, 180)), Stored::Object(_)));
    }

    #[test]
    fn frees_and_stores_during_a_compaction_keep_every_page_and_the_books() {
        for seed in 0..20u64 {
            let pool = Pool::new(8 << 20, 8 << 20, Codec::Lz4, 1).unwrap();
            let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            let mut rnd = |n: u64| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x % n
            };
            let mut held: Vec<(Handle, u64, usize)> = Vec::new();
            for s in 0..600u64 {
                let random = [40, 120, 250][rnd(3) as usize];
                if let Stored::Object(h) = pool.store(&page(s, random)) {
                    held.push((h, s, random));
                }
            }
            // Three in five freed, anywhere: holes in most chunks.
            held.retain(|&(h, _, _)| {
                let keep = rnd(5) < 2;
                if !keep {
                    pool.free(h);
                }
                keep
            });
            let d = pool.begin_compaction(usize::MAX);
            let mut next = 10_000;
            let mut k = 0;
            while k < held.len() {
                match rnd(4) {
                    // The holder frees its page meanwhile (the chunk may empty and be reused).
                    0 => {
                        pool.free(held.swap_remove(k).0);
                        continue;
                    }
                    // A store meanwhile never lands in a chunk set apart (one emptied by
                    // frees may be in use again as a new chunk).
                    1 => {
                        let random = [40, 120, 250][rnd(3) as usize];
                        if let Stored::Object(h) = pool.store(&page(next, random)) {
                            assert!(
                                !pool.lock().chunks[h.chunk()].draining,
                                "seed {seed}: stored into a chunk set apart"
                            );
                            held.push((h, next, random));
                        }
                        next += 1;
                    }
                    _ => {}
                }
                let h = held[k].0;
                if d.holds(h) {
                    if let Some(n) = pool.relocate(h) {
                        held[k].0 = n;
                    }
                }
                k += 1;
            }
            pool.end_compaction();
            every_page_loads(&pool, &held, &format!("seed {seed}"));
            let st = pool.stats();
            assert_eq!(st.objects, held.len() as u64, "seed {seed}");
            assert!(st.hole_bytes < st.pool_bytes, "seed {seed}: {st:?}");
            // Every chunk is in use again: stores fill the holes before new chunks are made.
            let before = st.pool_bytes;
            if let Stored::Object(h) = pool.store(&page(99_999, 40)) {
                held.push((h, 99_999, 40));
            }
            assert!(pool.stats().pool_bytes <= before + (MAX_CHUNK_PAGES * PAGE) as u64);
            for (h, _, _) in held {
                pool.free(h);
            }
            assert_eq!(pool.stats(), PoolStats::default(), "seed {seed}");
        }
    }

    #[test]
    fn nothing_is_stored_in_a_chunk_set_apart_and_an_unmoved_object_stays() {
        let pool = Pool::new(1 << 20, 1 << 20, Codec::Lz4, 1).unwrap();
        // Chunks of one class, then every other object freed: each chunk half empty.
        let mut held: Vec<(Handle, u64, usize)> = (0..60u64)
            .map(|seed| match pool.store(&page(seed, 100)) {
                Stored::Object(h) => (h, seed, 100),
                other => panic!("{other:?}"),
            })
            .collect();
        let chunks: std::collections::BTreeSet<usize> = held.iter().map(|h| h.0.chunk()).collect();
        assert!(chunks.len() >= 2, "{chunks:?}");
        let mut k = 0;
        held.retain(|&(h, _, _)| {
            k += 1;
            if k % 2 == 0 {
                pool.free(h);
            }
            k % 2 == 1
        });
        let d = pool.begin_compaction(usize::MAX);
        assert!(!d.is_empty());
        // A store meanwhile goes into a chunk that stays.
        let Stored::Object(fresh) = pool.store(&page(5000, 100)) else {
            panic!()
        };
        assert!(!d.holds(fresh), "stored into a chunk set apart");
        // An object its holder does not move stays where it is and loads.
        let stays = held.iter().position(|h| d.holds(h.0)).unwrap();
        for (k, (h, _, _)) in held.iter_mut().enumerate() {
            if d.holds(*h) && k != stays {
                *h = pool.relocate(*h).unwrap();
            }
        }
        pool.end_compaction();
        assert_eq!(pool.relocate(held[stays].0), None, "compaction is over");
        let mut out = [0u8; PAGE];
        for &(h, seed, random) in &held {
            pool.load(h, &mut out).unwrap();
            assert!(out == *page(seed, random));
        }
        pool.load(fresh, &mut out).unwrap();
        assert!(out == *page(5000, 100));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Stores and frees in any order: every held object loads its page, the counts add
        /// up, and a pool emptied of objects holds no DRAM.
        #[test]
        fn stores_frees_and_compactions_keep_every_page(
            ops in proptest::collection::vec((0u8..8, 0u64..1000, 1usize..400), 1..300),
            zstd in any::<bool>(),
        ) {
            let codec = if zstd { Codec::Zstd } else { Codec::Lz4 };
            let pool = Pool::new(4 << 20, 4 << 20, codec, 1).unwrap();
            let mut held: Vec<(Handle, u64, usize)> = Vec::new();
            for (op, seed, random) in ops {
                if op == 0 {
                    // A compaction whose holder cannot move some objects (pages in flight).
                    let before = pool.stats();
                    compact(&pool, &mut held, |k| (k as u64 + seed).is_multiple_of(5));
                    let after = pool.stats();
                    prop_assert_eq!(after.objects, before.objects);
                    prop_assert_eq!(after.compressed_bytes, before.compressed_bytes);
                    prop_assert!(after.pool_bytes <= before.pool_bytes);
                } else if op < 5 || held.is_empty() {
                    if let Stored::Object(h) = pool.store(&page(seed, random)) {
                        held.push((h, seed, random));
                    }
                } else {
                    let (h, _, _) = held.swap_remove(seed as usize % held.len());
                    pool.free(h);
                }
                prop_assert_eq!(pool.stats().objects, held.len() as u64);
            }
            let mut out = [0u8; PAGE];
            for &(h, seed, random) in &held {
                pool.load(h, &mut out).unwrap();
                prop_assert!(out == *page(seed, random));
            }
            for (h, _, _) in held {
                pool.free(h);
            }
            prop_assert_eq!(pool.stats(), PoolStats::default());
        }
    }
}
