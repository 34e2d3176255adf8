//! Tier-1 backends: where evicted pages live. One trait, one file per backend (the file backend
//! with O_DIRECT is the first). Slots are page-sized and numbered from 0; the engine's
//! [`SlotMap`] decides which slots are free. Entry points: [`Backend`], [`FileTier`].

mod file;
mod slots;

pub use file::{FileTier, TierOpenError};
pub use slots::SlotMap;

use std::io;

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
    unsafe fn read(&self, slot: u64, count: usize, buf: *mut u8) -> io::Result<()>;

    /// Writes pages (each a page-aligned pointer) to consecutive slots starting at `slot`.
    ///
    /// # Safety
    ///
    /// Every pointer must be a readable, page-aligned page.
    unsafe fn write(&self, slot: u64, pages: &[usize]) -> io::Result<()>;

    /// Makes room for `slots` slots in total (grows the backing store).
    fn grow(&self, slots: u64) -> io::Result<()>;

    /// Whether the backend bypasses the page cache (O_DIRECT).
    fn direct(&self) -> bool;

    /// Human-readable description for the summary.
    fn describe(&self) -> String;
}
