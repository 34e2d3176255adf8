//! The staging ring: where inactive pages wait in DRAM, unmapped from the program, until the
//! evictor writes them to tier 1 or a touch moves them back. A registered staging area of
//! page-sized slots, and one entry per slot naming the page it holds. The evictor (or a fault
//! staging for it) fills slots at the head; the evictor retires them at the tail, oldest
//! first. Entry point: [`StagingRing`].
//!
//! # Invariants
//!
//! - Slots between tail and head are in use; an entry there is `page + 1` (a staged or
//!   writing page whose stage is that slot), [`RING_DEAD`] (the program freed the page; the
//!   slot still holds DRAM until the tail passes it) or [`RING_EMPTY`] (the page went back).
//! - `staged` counts the pages in slots between tail and head: staged and writing pages plus
//!   dead entries. Each of them holds DRAM.
//! - The head moves only under the staging lock (`Engine::staging`: the evictor, or a fault
//!   staging for it); the tail only in the evictor, under that lock too (`Engine::pass_tail`:
//!   the chunks it maps afresh must not be the head's meanwhile).
//! - Slots behind the tail hold nothing: each whole chunk of them (see [`CHUNK_SLOTS`]) is
//!   mapped afresh as the tail passes it, unless the head has come round to it already.

use std::io;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use memtide_policy::PAGE_SIZE;

use crate::sys::{self, Mapping};

/// 32-bit entries in one page: the staging ring's entries and placement's arrivals queue give
/// their pages back a page of entries at a time.
pub(super) const U32S_PER_PAGE: u64 = (PAGE_SIZE / std::mem::size_of::<u32>()) as u64;

/// An entry naming nothing.
pub(super) const RING_EMPTY: u32 = 0;
/// An entry whose page the program freed while it was staged.
pub(super) const RING_DEAD: u32 = u32::MAX;

/// Slots in one chunk of the staging area: 2 MiB, what one page-table page maps. The head
/// goes round the whole area (up to gigabytes of address space), and a slot it has used
/// keeps its page-table page after the slot is emptied: left alone, the area would hold 2
/// KiB of page tables per MiB of it, for good. So each chunk the tail passes is mapped
/// afresh, and holds page tables again only when the head comes back to it.
pub(super) const CHUNK_SLOTS: u64 = 512;

pub(super) struct StagingRing {
    /// The staging area: one page per slot, registered with userfaultfd like the arena (pages
    /// move between the two with `UFFDIO_MOVE`).
    area: Mapping,
    /// One `AtomicU32` per slot.
    entries: Mapping,
    slots: u64,
    head: AtomicU64,
    tail: AtomicU64,
    /// Pages holding DRAM in slots between tail and head.
    pub(super) staged: AtomicU64,
}

impl StagingRing {
    pub(super) fn new(slots: u64) -> io::Result<StagingRing> {
        Ok(StagingRing {
            area: Mapping::anon(slots as usize * PAGE_SIZE)?,
            entries: Mapping::anon(slots as usize * 4)?,
            slots,
            head: AtomicU64::new(0),
            tail: AtomicU64::new(0),
            staged: AtomicU64::new(0),
        })
    }

    /// The staging area's mapping (for registration, locking and page-table reads).
    pub(super) fn area(&self) -> &Mapping {
        &self.area
    }

    pub(super) fn slots(&self) -> u64 {
        self.slots
    }

    /// The entry of ring position `pos` (positions count up forever; slots wrap).
    pub(super) fn entry(&self, pos: u64) -> &AtomicU32 {
        &self.entries.as_slice::<AtomicU32>()[(pos % self.slots) as usize]
    }

    /// Address of staging slot `s`.
    pub(super) fn addr(&self, s: u32) -> usize {
        self.area.addr() + s as usize * PAGE_SIZE
    }

    pub(super) fn head(&self) -> u64 {
        self.head.load(Ordering::Acquire)
    }

    pub(super) fn tail(&self) -> u64 {
        self.tail.load(Ordering::Acquire)
    }

    pub(super) fn set_head(&self, pos: u64) {
        self.head.store(pos, Ordering::Release);
    }

    pub(super) fn set_tail(&self, pos: u64) {
        self.tail.store(pos, Ordering::Release);
    }

    /// Free slots ahead of the head.
    pub(super) fn room(&self) -> u64 {
        self.slots - (self.head() - self.tail())
    }

    /// The slot whose entry names `page`, if any (for a fatal line: where its bytes might be).
    pub(super) fn naming(&self, page: usize) -> Option<u64> {
        (0..self.slots).find(|&s| self.entry(s).load(Ordering::Relaxed) == page as u32 + 1)
    }

    /// Dead entries between tail and head.
    pub(super) fn dead(&self) -> u64 {
        (self.tail()..self.head())
            .filter(|&pos| self.entry(pos).load(Ordering::Acquire) == RING_DEAD)
            .count() as u64
    }

    /// Zaps the staging slots of ring positions `[from, to)` (the tail is moving from `from`
    /// to `to`) and empties their entries. Every whole chunk of the area the tail has now
    /// passed, and the head will not reach again before the tail passes it next time, is
    /// handed to `renew` (address and length), which must map it afresh: unmapping is the only
    /// way to give back its page tables (see [`CHUNK_SLOTS`]).
    pub(super) fn zap(&self, from: u64, to: u64, renew: impl Fn(usize, usize)) {
        if from == to {
            return;
        }
        for pos in from..to {
            self.entry(pos).store(RING_EMPTY, Ordering::Release);
        }
        let a = from % self.slots;
        let b = a + (to - from);
        let zap = |s: u64, e: u64| {
            // SAFETY: staging slots between the old and new tail hold nothing anyone needs:
            // their pages are evicted, dead, or were moved out.
            unsafe {
                let _ = sys::discard(
                    self.area.addr() + s as usize * PAGE_SIZE,
                    (e - s) as usize * PAGE_SIZE,
                );
            }
        };
        if b <= self.slots {
            zap(a, b);
        } else {
            zap(a, self.slots);
            zap(0, b - self.slots);
        }
        let chunk_base = self.first_chunk_slot();
        self.spent_runs(from, to, chunk_base, CHUNK_SLOTS, |first| {
            renew(self.addr(first as u32), CHUNK_SLOTS as usize * PAGE_SIZE);
        });
        // The entries of those slots are all empty (zero): their pages go back too, a page
        // of entries at a time.
        self.spent_runs(from, to, 0, U32S_PER_PAGE, |first| {
            // SAFETY: entries of slots behind the tail that the head has not reached again:
            // nobody writes them, and they read as empty (zero) before and after.
            unsafe {
                let _ = sys::discard(self.entry(first) as *const AtomicU32 as usize, PAGE_SIZE);
            }
        });
    }

    /// Calls `f` with the first slot of every run of `len` slots (runs start at `base` and
    /// every `len` slots after it; a run past the last slot does not count) whose last slot
    /// the tail passes in moving from `from` to `to`, unless the head has already come round
    /// to the run's first slot again.
    fn spent_runs(&self, from: u64, to: u64, base: u64, len: u64, mut f: impl FnMut(u64)) {
        let head = self.head();
        let mut pos = from;
        while pos < to {
            let slot = pos % self.slots;
            let first = slot
                .checked_sub(base)
                .map(|d| base + d / len * len)
                .filter(|&first| first + len <= self.slots);
            let Some(first) = first else {
                // Before the first run or after the last: on to the next run's start or the
                // next lap.
                pos += if slot < base {
                    base - slot
                } else {
                    self.slots - slot
                };
                continue;
            };
            // Ring positions of this run's slots in this lap: [start, end).
            let end = pos - (slot - first) + len;
            let start = end - len;
            if end <= to && head <= start + self.slots {
                f(first);
            }
            pos = end;
        }
    }

    /// The first slot of a whole chunk (one 2 MiB-aligned run of [`CHUNK_SLOTS`] slots).
    fn first_chunk_slot(&self) -> u64 {
        let addr = self.area.addr();
        ((sys::round_up(addr, CHUNK_SLOTS as usize * PAGE_SIZE) - addr) / PAGE_SIZE) as u64
    }
}
