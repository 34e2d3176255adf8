//! The per-page state table: one atomic word per page of the arena, plus side arrays for the
//! page's copy below DRAM ([`TierCopy`]: a slot of the file, an object of the compressed pool,
//! or one repeated word), the staging slot and the content hash of that copy. Entry points:
//! [`PageTable`], [`State`], [`TierCopy`].
//!
//! # Invariants
//!
//! - Only the thread that moved a page into [`State::Busy`] (by compare-and-swap) changes its
//!   mapping, its side arrays or its state; everyone else waits on the word (a futex).
//! - `Writing` is owned by the evictor in the same way.
//! - A page is `Mapped` only while its bytes are mapped at its address in the arena; `Staged`
//!   and `Writing` only while its bytes are mapped at its staging slot; `Evicted` only while its
//!   bytes are in its copy below DRAM (a file slot, a pool object, a repeated word) and
//!   nowhere else.
//! - Every transition out of `Busy`/`Writing` goes through [`PageTable::publish`], which wakes
//!   waiters.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use memtide_policy::Activeness;

use crate::sys::{self, Mapping};
use crate::tier::Handle;

/// Where a page is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum State {
    /// Not allocated to the program (arena free space).
    Free = 0,
    /// Allocated, never touched (or discarded): reads as zeros.
    Unpopulated = 1,
    /// In DRAM, mapped into the program.
    Mapped = 2,
    /// In DRAM at a staging slot, unmapped from the program: the inactive list.
    Staged = 3,
    /// At a staging slot, being written to tier 1 by the evictor.
    Writing = 4,
    /// Only in tier 1.
    Evicted = 5,
    /// A thread is moving it; wait.
    Busy = 6,
    /// The program mapped something of its own over it with `MAP_FIXED` (a file, shared
    /// memory): not managed, not registered with userfaultfd, until the program unmaps it or
    /// maps anonymous memory there again and the arena takes it back.
    Lent = 7,
}

const STATE_MASK: u32 = 0xF;
const WAITERS: u32 = 1 << 4;
/// The program gave the page a protection other than read-write (`mprotect`): its mapping
/// lives in a VMA of its own, which `UFFDIO_MOVE` to and from staging refuses.
const PROTECTED: u32 = 1 << 5;
/// The page was mapped when the CLOCK sweep last read which pages were written, and has not
/// left DRAM since: a write reported now came after that read (see `Written` in the evictor).
/// Cleared when the page leaves DRAM.
const SWEPT: u32 = 1 << 6;
/// The page was written after the sweep last read its writes, as read half a pass ahead of
/// the hand: the hand finds it in use. Cleared when the page leaves DRAM.
const WROTE: u32 = 1 << 7;
const PIN_SHIFT: u32 = 8;
const PIN_ONE: u32 = 1 << PIN_SHIFT;
const PIN_MASK: u32 = 0xFF << PIN_SHIFT;
const HIST_SHIFT: u32 = 16;
const HIST_MASK: u32 = 0xFF << HIST_SHIFT;
/// How many times in a row the page was touched while inactive, unmapped by the CLOCK sweep
/// or by the active-memory sample ([`memtide_policy::sweep::MAX_PROVEN`]); cleared when the
/// page leaves DRAM or is put back untouched.
const PROVEN_SHIFT: u32 = 24;
const PROVEN_MASK: u32 = 0x3 << PROVEN_SHIFT;
const _: () = assert!(
    memtide_policy::sweep::MAX_PROVEN <= 3,
    "two bits hold the count"
);

/// Flag in a block length: the block was allocated through the malloc family.
const MALLOC_BLOCK: u32 = 1 << 31;

/// No staging slot / no tier slot.
pub const NONE: u32 = u32::MAX;

/// Where a page's copy below DRAM is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TierCopy {
    /// A slot of the file (below [`TierCopy::MAX_FILE_SLOTS`]).
    File(u64),
    /// An object of the compressed pool.
    Pool(Handle),
    /// Every eight-byte word of the page is the one the hash array holds for it (the page
    /// needs no other copy and no checksum).
    Same,
}

impl TierCopy {
    /// File slots a page's copy can name.
    pub const MAX_FILE_SLOTS: u64 = POOL_BIT as u64 - 1;

    /// The side array's word: 0 for none, a file slot + 1, [`POOL_BIT`] with a pool handle,
    /// or [`SAME`].
    fn encode(c: Option<TierCopy>) -> u32 {
        match c {
            None => 0,
            Some(TierCopy::File(s)) => {
                debug_assert!(s < Self::MAX_FILE_SLOTS);
                s as u32 + 1
            }
            Some(TierCopy::Pool(h)) => {
                debug_assert!(h.raw() < POOL_BIT - 1);
                POOL_BIT | h.raw()
            }
            Some(TierCopy::Same) => SAME,
        }
    }

    fn decode(v: u32) -> Option<TierCopy> {
        match v {
            0 => None,
            SAME => Some(TierCopy::Same),
            v if v & POOL_BIT != 0 => Some(TierCopy::Pool(Handle::from_raw(v & !POOL_BIT))),
            v => Some(TierCopy::File(v as u64 - 1)),
        }
    }
}

/// The bit of a copy word that marks a pool object.
const POOL_BIT: u32 = 1 << 31;
/// The copy word of a same-filled page.
const SAME: u32 = u32::MAX;

/// A decoded page word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Word(pub u32);

impl Word {
    pub fn state(self) -> State {
        match self.0 & STATE_MASK {
            0 => State::Free,
            1 => State::Unpopulated,
            2 => State::Mapped,
            3 => State::Staged,
            4 => State::Writing,
            5 => State::Evicted,
            7 => State::Lent,
            _ => State::Busy,
        }
    }

    pub fn protected(self) -> bool {
        self.0 & PROTECTED != 0
    }

    pub fn pins(self) -> u32 {
        (self.0 & PIN_MASK) >> PIN_SHIFT
    }

    pub fn history(self) -> Activeness {
        Activeness(((self.0 & HIST_MASK) >> HIST_SHIFT) as u8)
    }

    /// Whether the page was mapped when the sweep last read its writes, and stayed in DRAM.
    pub fn swept(self) -> bool {
        self.0 & SWEPT != 0
    }

    /// Whether the page was written after the sweep last read its writes, as read ahead of
    /// the hand.
    pub fn wrote(self) -> bool {
        self.0 & WROTE != 0
    }

    /// How many times in a row the sweep's test found the page in use.
    pub fn proven(self) -> u8 {
        ((self.0 & PROVEN_MASK) >> PROVEN_SHIFT) as u8
    }

    /// The word in state `s`; a page that leaves DRAM loses its standing with the sweep.
    fn with_state(self, s: State) -> Word {
        let kept = match s {
            State::Mapped | State::Writing | State::Busy => !0,
            // Moved back, a page is mapped writable again (its protection stays behind):
            // what the sweep reads of it counts only from its next read.
            State::Staged => !(SWEPT | WROTE),
            _ => !(PROVEN_MASK | SWEPT | WROTE),
        };
        Word((self.0 & !(STATE_MASK | WAITERS) & kept) | s as u32)
    }

    fn with_history(self, h: Activeness) -> Word {
        Word((self.0 & !HIST_MASK) | ((h.0 as u32) << HIST_SHIFT))
    }
}

/// State words and side arrays for every page of an arena.
pub struct PageTable {
    words: Mapping,
    /// The page's copy below DRAM, encoded by [`TierCopy::encode`].
    copies: Mapping,
    /// Staging slot while `Staged`/`Writing`, or [`NONE`].
    stages: Mapping,
    /// xxh3 of the page's copy below DRAM (valid while it has one); a same-filled page's word.
    hashes: Mapping,
    /// Length in pages of the allocation starting at this page (0 elsewhere).
    lens: Mapping,
    pages: usize,
}

impl PageTable {
    /// A table for `pages` pages; the arrays are reserved, not committed, so untouched parts of
    /// a large arena cost nothing.
    pub fn new(pages: usize) -> std::io::Result<PageTable> {
        let t = PageTable {
            words: Mapping::anon(pages * 4)?,
            copies: Mapping::anon(pages * 4)?,
            stages: Mapping::anon(pages * 4)?,
            hashes: Mapping::anon(pages * 8)?,
            lens: Mapping::anon(pages * 4)?,
            pages,
        };
        Ok(t)
    }

    pub fn pages(&self) -> usize {
        self.pages
    }

    pub fn word(&self, i: usize) -> &AtomicU32 {
        &self.words.as_slice::<AtomicU32>()[i]
    }

    pub fn load(&self, i: usize) -> Word {
        Word(self.word(i).load(Ordering::Acquire))
    }

    /// Where page `i`'s copy below DRAM is, if it has a valid one.
    pub fn copy(&self, i: usize) -> Option<TierCopy> {
        TierCopy::decode(self.copies.as_slice::<AtomicU32>()[i].load(Ordering::Acquire))
    }

    pub fn set_copy(&self, i: usize, copy: Option<TierCopy>) {
        self.copies.as_slice::<AtomicU32>()[i].store(TierCopy::encode(copy), Ordering::Release);
    }

    /// The file slot of page `i`'s copy, if its copy is in the file.
    pub fn slot(&self, i: usize) -> Option<u64> {
        match self.copy(i) {
            Some(TierCopy::File(s)) => Some(s),
            _ => None,
        }
    }

    pub fn stage(&self, i: usize) -> u32 {
        // Stored +1 as well.
        self.stages.as_slice::<AtomicU32>()[i]
            .load(Ordering::Acquire)
            .wrapping_sub(1)
    }

    pub fn set_stage(&self, i: usize, s: u32) {
        self.stages.as_slice::<AtomicU32>()[i].store(s.wrapping_add(1), Ordering::Release);
    }

    pub fn hash(&self, i: usize) -> u64 {
        self.hashes.as_slice::<AtomicU64>()[i].load(Ordering::Acquire)
    }

    pub fn set_hash(&self, i: usize, h: u64) {
        self.hashes.as_slice::<AtomicU64>()[i].store(h, Ordering::Release);
    }

    /// The allocation starting at page `i`: its length in pages (0 if none starts here) and
    /// whether it is a malloc-family block (as opposed to a mapping).
    pub fn block(&self, i: usize) -> (usize, bool) {
        let v = self.lens.as_slice::<AtomicU32>()[i].load(Ordering::Acquire);
        ((v & !MALLOC_BLOCK) as usize, v & MALLOC_BLOCK != 0)
    }

    pub fn set_block(&self, i: usize, pages: usize, malloc: bool) {
        let v =
            pages.min((MALLOC_BLOCK - 1) as usize) as u32 | if malloc { MALLOC_BLOCK } else { 0 };
        self.lens.as_slice::<AtomicU32>()[i].store(v, Ordering::Release);
    }

    /// Claims page `i` if it is in state `from` (and, when `unpinned`, has no pins): moves it to
    /// `Busy` and returns the word it had.
    pub fn claim(&self, i: usize, from: State, unpinned: bool) -> Option<Word> {
        let w = self.load(i);
        if w.state() != from || (unpinned && w.pins() != 0) {
            return None;
        }
        self.word(i)
            .compare_exchange(
                w.0,
                w.with_state(State::Busy).0 | (w.0 & WAITERS),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .ok()
            .map(Word)
    }

    /// Claims page `i` whatever its state, waiting while it is `Busy` or `Writing`. Returns the
    /// word it had, or `None` if it was `Free`.
    pub fn claim_any(&self, i: usize) -> Option<Word> {
        loop {
            let w = self.load(i);
            match w.state() {
                State::Free => return None,
                State::Busy | State::Writing => self.wait(i, w),
                s => {
                    if let Some(old) = self.claim(i, s, false) {
                        return Some(old);
                    }
                }
            }
        }
    }

    /// Moves a page this thread owns (`Busy` or `Writing`) to `to`, optionally setting its
    /// history, and wakes anyone waiting on it.
    pub fn publish(&self, i: usize, to: State, history: Option<Activeness>) {
        let word = self.word(i);
        let mut cur = word.load(Ordering::Acquire);
        loop {
            let mut next = Word(cur).with_state(to);
            if let Some(h) = history {
                next = next.with_history(h);
            }
            match word.compare_exchange_weak(cur, next.0, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break,
                Err(c) => cur = c,
            }
        }
        if cur & WAITERS != 0 {
            sys::futex_wake(word);
        }
    }

    /// Waits until page `i` leaves the state seen in `seen` (or a short timeout passes: callers
    /// loop and re-check, so a lost wake-up costs a millisecond, never a hang).
    pub fn wait(&self, i: usize, seen: Word) {
        let word = self.word(i);
        let with = seen.0 | WAITERS;
        if seen.0 & WAITERS == 0
            && word
                .compare_exchange(seen.0, with, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
        {
            return;
        }
        sys::futex_wait(word, with, 1_000_000);
    }

    /// In a forked child: page `i` is pinned by no thread (the parent's threads that pinned
    /// it are not in the child).
    pub fn clear_pins(&self, i: usize) {
        self.word(i).fetch_and(!PIN_MASK, Ordering::AcqRel);
    }

    /// Adds a pin to a `Mapped` page (it may not be evicted while pinned). Fails if the page is
    /// not mapped or has the most pins a word can count.
    pub fn pin(&self, i: usize) -> bool {
        let w = self.load(i);
        if w.state() != State::Mapped || w.pins() == 0xFF {
            return false;
        }
        self.word(i)
            .compare_exchange(w.0, w.0 + PIN_ONE, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Counts one more time in a row that page `i`, ours (`Busy`), was found in use while
    /// inactive, up to [`memtide_policy::sweep::MAX_PROVEN`].
    pub fn prove(&self, i: usize) {
        let word = self.word(i);
        let mut cur = word.load(Ordering::Acquire);
        loop {
            let w = Word(cur);
            let k = (w.proven() + 1).min(memtide_policy::sweep::MAX_PROVEN) as u32;
            let next = (cur & !PROVEN_MASK) | (k << PROVEN_SHIFT);
            match word.compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return,
                Err(c) => cur = c,
            }
        }
    }

    /// Page `i`, ours (`Busy`), was tested and not found in use: it starts again at 0.
    pub fn unprove(&self, i: usize) {
        self.word(i).fetch_and(!PROVEN_MASK, Ordering::AcqRel);
    }

    /// Marks page `i` as protected by the program (or no longer), whatever its state.
    pub fn set_protected(&self, i: usize, on: bool) {
        if on {
            self.word(i).fetch_or(PROTECTED, Ordering::AcqRel);
        } else {
            self.word(i).fetch_and(!PROTECTED, Ordering::AcqRel);
        }
    }

    pub fn unpin(&self, i: usize) {
        self.word(i).fetch_sub(PIN_ONE, Ordering::AcqRel);
    }

    /// The sweep read page `i`'s writes: marks it swept ([`Word::swept`]), notes whether it
    /// was written ([`Word::wrote`]) and, if `in_use`, counts it found in use once more (as
    /// [`prove`](Self::prove)). Only while the page is `Mapped`: returns whether it was.
    pub fn sweep_read(&self, i: usize, wrote: bool, in_use: bool) -> bool {
        let word = self.word(i);
        let mut cur = word.load(Ordering::Acquire);
        loop {
            let w = Word(cur);
            if w.state() != State::Mapped {
                return false;
            }
            let mut next = (cur | SWEPT) & !WROTE;
            if wrote {
                next |= WROTE;
            }
            if in_use {
                let k = (w.proven() + 1).min(memtide_policy::sweep::MAX_PROVEN) as u32;
                next = (next & !PROVEN_MASK) | (k << PROVEN_SHIFT);
            }
            match word.compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(c) => cur = c,
            }
        }
    }

    /// Ends an epoch for page `i`: shifts its history. Returns the history before the shift.
    pub fn age(&self, i: usize) -> Activeness {
        let word = self.word(i);
        let mut cur = word.load(Ordering::Relaxed);
        loop {
            let w = Word(cur);
            let next = w.with_history(w.history().age());
            if next == w {
                return w.history();
            }
            match word.compare_exchange_weak(cur, next.0, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return w.history(),
                Err(c) => cur = c,
            }
        }
    }

    /// Marks a `Free` page allocated (`Unpopulated`). Only the arena allocator calls this, on
    /// pages no one else can reach.
    pub fn allocate(&self, i: usize) {
        debug_assert_eq!(self.load(i).state(), State::Free);
        self.word(i)
            .store(State::Unpopulated as u32, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_keeps_its_standing_in_dram_and_loses_it_when_it_leaves() {
        let t = PageTable::new(2).unwrap();
        t.allocate(0);
        t.claim(0, State::Unpopulated, false).unwrap();
        t.publish(0, State::Mapped, Some(Activeness::TOUCHED));
        let max = memtide_policy::sweep::MAX_PROVEN;
        for k in 1..=max as u32 + 2 {
            t.claim(0, State::Mapped, false).unwrap();
            t.publish(0, State::Staged, None);
            t.claim(0, State::Staged, false).unwrap();
            t.prove(0);
            t.publish(0, State::Mapped, None);
            assert_eq!(t.load(0).proven() as u32, k.min(max as u32));
        }
        assert!(t.pin(0));
        t.unpin(0);
        t.age(0);
        assert_eq!(t.load(0).proven(), max, "pins and ageing keep it");
        t.claim(0, State::Mapped, false).unwrap();
        t.publish(0, State::Writing, None);
        assert_eq!(t.load(0).proven(), max);
        t.publish(0, State::Staged, None);
        t.claim(0, State::Staged, false).unwrap();
        t.unprove(0);
        t.publish(0, State::Mapped, None);
        assert_eq!(t.load(0).proven(), 0, "put back untouched: it starts again");
        assert!(t.claim(0, State::Staged, false).is_none());
        t.claim(0, State::Mapped, false).unwrap();
        t.prove(0);
        t.publish(0, State::Writing, None);
        t.publish(0, State::Evicted, None);
        assert_eq!(t.load(0).proven(), 0, "leaving DRAM clears it");
        t.claim(0, State::Evicted, false).unwrap();
        t.publish(0, State::Mapped, Some(Activeness::TOUCHED));
        assert_eq!(t.load(0).proven(), 0);
    }

    #[test]
    fn claim_publish_round_trip_keeps_pins_and_history() {
        let t = PageTable::new(4).unwrap();
        t.allocate(1);
        assert!(t.claim(1, State::Mapped, false).is_none());
        let old = t.claim(1, State::Unpopulated, false).unwrap();
        assert_eq!(old.state(), State::Unpopulated);
        assert_eq!(t.load(1).state(), State::Busy);
        t.publish(1, State::Mapped, Some(Activeness::TOUCHED));
        assert!(t.pin(1));
        assert_eq!(t.load(1).pins(), 1);
        assert!(
            t.claim(1, State::Mapped, true).is_none(),
            "pinned pages are not evictable"
        );
        t.unpin(1);
        assert_eq!(t.age(1), Activeness::TOUCHED);
        assert_eq!(t.load(1).proven(), 0);
        assert_eq!(t.load(1).history(), Activeness(0x40));
        assert!(t.claim(1, State::Mapped, true).is_some());
    }

    #[test]
    fn side_arrays_default_to_none() {
        let t = PageTable::new(2).unwrap();
        assert_eq!(t.copy(0), None);
        assert_eq!(t.stage(0), NONE);
        t.set_stage(0, 7);
        assert_eq!(t.stage(0), 7);
        for c in [
            TierCopy::File(0),
            TierCopy::File(TierCopy::MAX_FILE_SLOTS - 1),
            TierCopy::Pool(Handle::from_raw(0)),
            TierCopy::Pool(Handle::from_raw(POOL_BIT - 2)),
            TierCopy::Same,
        ] {
            t.set_copy(1, Some(c));
            assert_eq!(t.copy(1), Some(c));
            let file_slot = match c {
                TierCopy::File(s) => Some(s),
                _ => None,
            };
            assert_eq!(t.slot(1), file_slot);
        }
        t.set_copy(1, None);
        assert_eq!(t.copy(1), None);
    }
}
