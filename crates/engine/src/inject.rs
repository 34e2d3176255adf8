//! Fault injection for memtide's own tests: gates that hold a thread at a chosen point of the
//! engine until the test lets it go, so that a narrow race can be played out step by step.
//! Device faults are injected by the tier layer (`tier::faulty`), kernel misreports by the
//! userfaultfd bindings (`Uffd::inject_underreport`, `Uffd::inject_copy_eexist`). Nothing is
//! armed unless a test arms it; an unarmed gate costs one relaxed load where it sits. Entry
//! point: [`Engine::inject`](crate::Engine::inject).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::sys;

/// The points a test can hold a thread at.
#[derive(Default)]
pub struct Inject {
    /// A tier fault between looking at a read-ahead neighbour (its state and tier slot) and
    /// claiming it. Info: the neighbour page, the slot it was seen with.
    pub readahead: Gate,
    /// Write-back about to claim a staged page at a lower address than one it already holds
    /// in the same batch (where the sweep wrapped). Info: the page it holds, the page next.
    pub writeback_wrap: Gate,
    /// `release` or `discard` after claiming the pages of its range, before dropping their
    /// contents. Info: the range's first page and length in pages.
    pub taken: Gate,
}

/// A point where one thread is held, once, after the gate is armed.
#[derive(Default)]
pub struct Gate {
    armed: AtomicBool,
    held: AtomicBool,
    /// Bumped (and woken) to let the held thread go.
    opened: AtomicU32,
    info: [AtomicU64; 2],
}

impl Gate {
    /// The next thread to reach the gate stops there.
    pub fn arm(&self) {
        self.armed.store(true, Ordering::Release);
    }

    /// Waits up to `timeout` for a thread to be held at the gate, and returns what it said.
    pub fn wait_held(&self, timeout: Duration) -> Option<[u64; 2]> {
        let t0 = Instant::now();
        while !self.held.load(Ordering::Acquire) {
            if t0.elapsed() > timeout {
                return None;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Some([
            self.info[0].load(Ordering::Acquire),
            self.info[1].load(Ordering::Acquire),
        ])
    }

    /// Lets the held thread go on (and disarms the gate).
    pub fn open(&self) {
        self.armed.store(false, Ordering::Release);
        self.opened.fetch_add(1, Ordering::AcqRel);
        sys::futex_wake(&self.opened);
    }

    /// Whether a thread reaching the gate would stop (for conditions worth checking only
    /// then).
    pub(crate) fn armed(&self) -> bool {
        self.armed.load(Ordering::Relaxed)
    }

    /// Engine side: if the gate is armed, the first thread here stops until the test opens
    /// it. Async-signal-safe.
    pub(crate) fn pass(&self, info: [u64; 2]) {
        if !self.armed() || !self.armed.swap(false, Ordering::AcqRel) {
            return;
        }
        self.info[0].store(info[0], Ordering::Release);
        self.info[1].store(info[1], Ordering::Release);
        let seen = self.opened.load(Ordering::Acquire);
        self.held.store(true, Ordering::Release);
        while self.opened.load(Ordering::Acquire) == seen {
            sys::futex_wait(&self.opened, seen, 10_000_000);
        }
        self.held.store(false, Ordering::Release);
    }
}
