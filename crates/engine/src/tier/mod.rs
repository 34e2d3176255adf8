//! Tier-1 backends: where evicted pages live. One trait, one file per backend (the file with
//! O_DIRECT through plain system calls, and the same file through io_uring), and layers in
//! front of one (encryption; injected faults for tests). Slots are page-sized and numbered
//! from 0; the engine's [`SlotMap`] decides which slots are free. Beside them, the compressed
//! pool ([`Pool`]), the level to come between DRAM and the file. Entry points: [`Backend`],
//! [`FileTier`], [`Pool`].

mod encrypted;
mod faulty;
mod file;
mod pool;
mod slots;
mod uring;

pub use encrypted::Encrypted;
pub use faulty::{Faulty, TierFaults};
pub use file::{FileTier, TierOpenError};
pub use pool::{
    same_word, Codec, Corrupt, Draining, Handle, Pool, PoolStats, Stored, COMPACT_WASTE,
    MAX_OBJECT, ZSTD_LEVEL,
};
pub use slots::{SlotMap, MEMBERS};
pub use uring::{best, UringTier};

use std::io;

/// Why a tier read failed.
#[derive(Debug)]
pub struct ReadError {
    pub error: io::Error,
    /// The read may still land in the buffer later (the backend lost track of a request it
    /// had submitted): the buffer must never be used again.
    pub buffer_lost: bool,
}

impl From<io::Error> for ReadError {
    fn from(error: io::Error) -> ReadError {
        ReadError {
            error,
            buffer_lost: false,
        }
    }
}

/// A tier-1 store of page-sized slots.
///
/// `read` is called from the faulting thread inside a signal handler, so implementations must be
/// async-signal-safe there: no allocation, no locks.
pub trait Backend: Send + Sync {
    /// Reads `count` consecutive slots starting at `slot` into `buf` (`count` pages, aligned).
    ///
    /// # Safety
    ///
    /// `buf` must be a writable, page-aligned buffer of `count` pages.
    unsafe fn read(&self, slot: u64, count: usize, buf: *mut u8) -> Result<(), ReadError>;

    /// Writes pages (each a page-aligned pointer) to consecutive slots starting at `slot`.
    ///
    /// # Safety
    ///
    /// Every pointer must be a readable, page-aligned page.
    unsafe fn write(&self, slot: u64, pages: &[usize]) -> io::Result<()>;

    /// Writes several runs (each: first slot, pages) — at once where the backend can overlap
    /// them. Returns the first error; on error, which runs landed is unknown.
    ///
    /// # Safety
    ///
    /// As [`write`](Self::write), for every page.
    unsafe fn write_runs(&self, runs: &[(u64, &[usize])]) -> io::Result<()> {
        for (slot, pages) in runs {
            // SAFETY: forwarded contract.
            unsafe { self.write(*slot, pages)? };
        }
        Ok(())
    }

    /// Makes room for `slots` slots in total (grows the backing store).
    fn grow(&self, slots: u64) -> io::Result<()>;

    /// Cuts the backing store to `slots` slots (none above is in use), giving the space back.
    fn shrink(&self, slots: u64) -> io::Result<()>;

    /// Whether the backend bypasses the page cache (O_DIRECT).
    fn direct(&self) -> bool;

    /// Human-readable description for the summary.
    fn describe(&self) -> String;

    /// Reads whose completion the waiting thread saw by polling, and reads it slept for, so
    /// far (a backend that never polls: all zero).
    fn reads_polled(&self) -> (u64, u64) {
        (0, 0)
    }

    /// In a forked child, before any I/O: whatever the backend holds that cannot be shared
    /// with the parent (io_uring rings) is made afresh. The file itself is shared: both
    /// processes read and write it at the slots they hold.
    fn forked(&self) {}
}
