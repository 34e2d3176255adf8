//! A level of memory below DRAM as the engine holds it: its backend, its slot map, whether it
//! is full, failed or asked to give space back, and what its reads use (bounce buffers, the
//! read-ahead tracker): the file on an NVMe/SSD (`Engine::file`). The compressed pool in DRAM,
//! the level above it, is `compressed.rs` (its objects are not slots). Entry point: [`Store`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

use super::fault::{BouncePool, SequentialRun};
use crate::tier::{Backend, SlotMap};

pub(super) struct Store {
    /// Where the level keeps pages (a file, through io_uring or plain calls; encryption and
    /// injected faults in front of it as configured).
    pub(super) backend: Box<dyn Backend>,
    slots: Mutex<SlotMap>,
    /// Set when writing failed: eviction to this level stops for good, data stays in DRAM.
    pub(super) failed: AtomicBool,
    /// Set when the level is full: eviction pauses until slots are freed or an epoch passes.
    pub(super) full: AtomicBool,
    /// Asks the evictor to bring the level within its limit or make room in it (the limit
    /// was lowered, or the level filled up): see `reclaim_tier`.
    pub(super) reclaim: AtomicBool,
    /// Page-sized buffers for reads that do not go straight into the program's page.
    pub(super) bounce: BouncePool,
    /// Where reads ended, for read-ahead.
    pub(super) sequential: SequentialRun,
}

impl Store {
    pub(super) fn new(backend: Box<dyn Backend>, slots: SlotMap, bounce: BouncePool) -> Store {
        Store {
            backend,
            slots: Mutex::new(slots),
            failed: AtomicBool::new(false),
            full: AtomicBool::new(false),
            reclaim: AtomicBool::new(false),
            bounce,
            sequential: SequentialRun::new(),
        }
    }

    /// The slot map, locked. A panic while it was held cannot leave it inconsistent (every
    /// update is one bitmap change and its counter), so a poisoned lock is taken as is.
    pub(super) fn slots(&self) -> MutexGuard<'_, SlotMap> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether eviction can write to this level now.
    pub(super) fn usable(&self) -> bool {
        !self.failed.load(Ordering::Acquire) && !self.full.load(Ordering::Acquire)
    }
}
