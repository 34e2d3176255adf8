//! The program's own memory calls on managed memory: allocation, `munmap` (release),
//! `madvise(DONTNEED)` (discard), `mremap` (remap, moving pages' contents wherever they live),
//! pins for system calls, and the fork fallback. Normal context, never the fault path. Entry
//! points: [`Engine::alloc`], [`Engine::release`], [`Engine::discard`], [`Engine::remap`],
//! [`Engine::pin`], [`Engine::detach_for_fork`].
//!
//! A call takes every page of its range out of wherever it is by claiming it (`Busy`), in
//! address order, before it changes anything; faulting threads wait for it.

use std::sync::atomic::Ordering;

use memtide_policy::{Activeness, PAGE_SIZE};

use super::fatal::fatal;
use super::ring::{RING_DEAD, RING_EMPTY};
use super::{prepare, Engine, MemError};
use crate::pages::{State, TierCopy, NONE};
use crate::stats::Counters;
use crate::sys;

impl Engine {
    /// Allocates `len` bytes of managed memory aligned to `align` (a power of two, at least a
    /// page), as for an anonymous `mmap`. The memory reads as zeros.
    pub fn alloc(&self, len: usize, align: usize) -> Result<usize, MemError> {
        // Not while a fork has the engine quiet (see fork.rs).
        let _inside = self.gate.enter();
        self.alloc_kind(len, align, false)
    }

    /// Allocates a malloc-family block: like [`alloc`](Self::alloc), but remembered as such,
    /// so that [`malloc_len`](Self::malloc_len) knows it. (Other allocators may place their
    /// own blocks in managed mappings; those are not ours to free.)
    pub fn alloc_malloc(&self, len: usize, align: usize) -> Result<usize, MemError> {
        let _inside = self.gate.enter();
        self.alloc_kind(len, align, true)
    }

    fn alloc_kind(&self, len: usize, align: usize, malloc: bool) -> Result<usize, MemError> {
        if self.in_child() {
            return Err(MemError::NoRoom);
        }
        let pages = len.div_ceil(PAGE_SIZE).max(1);
        let align_pages = (align / PAGE_SIZE).max(1);
        let start = {
            let mut r = self.ranges.lock().unwrap_or_else(|e| e.into_inner());
            let s = r.alloc(pages, align_pages).ok_or(MemError::NoRoom)?;
            self.high_water.store(r.high_water(), Ordering::Release);
            s
        };
        for i in start..start + pages {
            self.pt.allocate(i);
        }
        self.pt.set_block(start, pages, malloc);
        let m = self
            .counters
            .managed_pages
            .fetch_add(pages as u64, Ordering::Relaxed)
            + pages as u64;
        Counters::peak(&self.counters.peak_managed_pages, m);
        Ok(self.addr_of(start))
    }

    fn page_range(&self, addr: usize, len: usize) -> Result<(usize, usize), MemError> {
        if !self.contains(addr) || !addr.is_multiple_of(PAGE_SIZE) {
            return Err(MemError::NotManaged);
        }
        let first = self.page_of(addr);
        let pages = len.div_ceil(PAGE_SIZE).min(self.pt.pages() - first);
        Ok((first, pages))
    }

    /// Claims every page of `[first, first+pages)` (each `Busy`, whatever it was; `Free` pages
    /// are left alone) and pushes each with the state it had to `out`, in address order.
    fn take_pages(&self, first: usize, pages: usize, out: &mut Vec<(usize, State)>) {
        for i in first..first + pages {
            if let Some(old) = self.pt.claim_any(i) {
                out.push((i, old.state()));
            }
        }
    }

    /// Drops the contents of pages claimed by [`take_pages`](Self::take_pages): zaps mapped
    /// pages, frees tier slots, marks staged pages dead for the evictor.
    fn drop_contents(&self, taken: &[(usize, State)]) {
        let mut mapped = 0u64;
        let mut pool_freed = Vec::new();
        {
            let mut slots = self.file.slots();
            for &(i, st) in taken {
                match st {
                    State::Mapped => mapped += 1,
                    State::Staged if self.staged_out_of_order => {
                        // The policy keeps pages staged long and takes them out of order: the
                        // ring's tail may not pass this slot for a long time, so its DRAM is
                        // given back now. The slot is emptied after it is zapped: only then
                        // may the evictor stage into it again.
                        let s = self.pt.stage(i);
                        // SAFETY: the page is ours (claimed) and the program asked for its
                        // contents to go; the slot holds nothing else.
                        unsafe {
                            let _ = sys::discard(self.ring.addr(s), PAGE_SIZE);
                        }
                        self.ring
                            .entry(s as u64)
                            .store(RING_EMPTY, Ordering::Release);
                        self.pt.set_stage(i, NONE);
                        self.ring.staged.fetch_sub(1, Ordering::AcqRel);
                        mapped += 1;
                    }
                    State::Staged => {
                        // The staging slot keeps holding DRAM until the evictor's tail passes
                        // it; it counts that page then.
                        self.ring
                            .entry(self.pt.stage(i) as u64)
                            .store(RING_DEAD, Ordering::Release);
                        self.pt.set_stage(i, NONE);
                    }
                    _ => {}
                }
                match self.pt.copy(i) {
                    Some(TierCopy::File(s)) => slots.free(s),
                    Some(TierCopy::Pool(h)) => pool_freed.push(h),
                    _ => {}
                }
                self.pt.set_copy(i, None);
            }
        }
        self.free_pool_objects(&pool_freed);
        // Zap exactly the pages we claimed that hold memory in the arena, in runs: a Free
        // page of the range is not ours, and another thread may be allocating and touching it
        // right now. (After a fork fallback the arena is plain memory, where any claimed page
        // may hold bytes the kernel mapped without asking us.)
        let detached = self.is_detached();
        for run in runs(taken, |_, st| st == State::Mapped || detached) {
            // SAFETY: these pages are ours (Busy) and the program asked for their contents to
            // go.
            unsafe {
                let _ = sys::discard(self.addr_of(taken[run.start].0), run.len() * PAGE_SIZE);
            }
        }
        self.quota.unreserve(mapped);
    }

    /// Claims the pages of a range and drops their contents: the first half of `munmap` and
    /// `madvise(DONTNEED)`. Returns the pages claimed, each still `Busy`.
    fn take_and_drop(&self, first: usize, pages: usize) -> Vec<(usize, State)> {
        let mut taken = Vec::with_capacity(pages.min(1 << 16));
        self.take_pages(first, pages, &mut taken);
        self.inject.taken.pass([first as u64, pages as u64]);
        self.drop_contents(&taken);
        taken
    }

    /// `munmap` of managed memory: the range goes back to the arena.
    pub fn release(&self, addr: usize, len: usize) -> Result<(), MemError> {
        let _inside = self.gate.enter();
        let (first, pages) = self.page_range(addr, len)?;
        if self.in_child() {
            return self.child_zap(first, pages);
        }
        let mask = sys::block_signals();
        let taken = self.take_and_drop(first, pages);
        self.unprotect(&taken);
        let lent = self.take_back(&taken);
        for &(i, _) in &taken {
            self.pt.set_block(i, 0, false);
            self.pt.publish(i, State::Free, Some(Activeness(0)));
        }
        {
            let mut r = self.ranges.lock().unwrap_or_else(|e| e.into_inner());
            for run in runs(&taken, |_, _| true) {
                r.free(taken[run.start].0, run.len());
            }
        }
        self.counters
            .managed_pages
            .fetch_sub((taken.len() - lent) as u64, Ordering::Relaxed);
        sys::restore_signals(&mask);
        Ok(())
    }

    /// Maps fresh memory over `len` bytes at `addr` (in the arena or the staging area),
    /// registered with userfaultfd and locked as the rest is. Whatever was there is gone, and
    /// so are the page tables of the whole 2 MiB runs in it.
    ///
    /// # Safety
    ///
    /// The range must be the engine's, and nothing in it may be needed or in use.
    pub(super) unsafe fn renew(&self, addr: usize, len: usize, what: &str) {
        // SAFETY: the caller's contract; the mapping replaces only the engine's own range.
        let mapped = unsafe {
            sys::mmap(
                addr,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if let Err(e) = mapped.and_then(|_| prepare(&self.uffd, addr, len)) {
            fatal(what, &e);
        }
        if self.locked.load(Ordering::Acquire) && sys::lock_on_fault(addr, len).is_err() {
            // Only a program locking memory of its own between the unmap and this lock can
            // take the room: from now on the evictor moves only pages it sees in DRAM, as
            // it does when nothing could be locked.
            self.locked.store(false, Ordering::Release);
            self.warn("could not lock managed memory in DRAM any more (RLIMIT_MEMLOCK reached): memtide now leaves pages Linux swapped out alone until they are touched".into());
        }
    }

    /// Maps fresh arena memory, registered and configured as the arena is, over the runs of
    /// claimed pages that were lent to a mapping of the program's own (see
    /// [`lend`](Self::lend)). Returns how many pages came back.
    fn take_back(&self, taken: &[(usize, State)]) -> usize {
        let mut back = 0;
        for run in runs(taken, |_, st| st == State::Lent) {
            let (addr, len) = (self.addr_of(taken[run.start].0), run.len() * PAGE_SIZE);
            // SAFETY: the range is the arena's and ours (Busy); what the program had there it
            // gave up by unmapping it or mapping anonymous memory over it.
            unsafe {
                self.renew(
                    addr,
                    len,
                    "taking back arena memory the program had mapped over failed",
                )
            };
            back += run.len();
        }
        back
    }

    /// Makes the free pages of `[first, first+pages)` the program's (`Unpopulated`): a
    /// `MAP_FIXED` mapping takes whatever address space it lands on, so one into arena space
    /// the program gave back (or never had) allocates it, as natively it would replace
    /// whatever was mapped there.
    fn adopt_free(&self, first: usize, pages: usize) {
        let mut adopted = 0u64;
        {
            let mut r = self.ranges.lock().unwrap_or_else(|e| e.into_inner());
            let mut i = first;
            while i < first + pages {
                if self.pt.load(i).state() != State::Free {
                    i += 1;
                    continue;
                }
                let start = i;
                while i < first + pages && self.pt.load(i).state() == State::Free {
                    i += 1;
                }
                // Free in the page table but not in the range map: another call is between
                // the two right now (the program allocating or unmapping there concurrently);
                // that call's outcome stands.
                if r.alloc_at(start, i - start) {
                    for j in start..i {
                        self.pt.allocate(j);
                    }
                    self.pt.set_block(start, i - start, false);
                    adopted += (i - start) as u64;
                }
            }
            self.high_water.store(r.high_water(), Ordering::Release);
        }
        if adopted > 0 {
            let m = self
                .counters
                .managed_pages
                .fetch_add(adopted, Ordering::Relaxed)
                + adopted;
            Counters::peak(&self.counters.peak_managed_pages, m);
        }
    }

    /// A mapping of the program's own placed with `MAP_FIXED` in managed address space — a
    /// file, shared memory, a stack (`map` makes it; it must replace the whole range): the
    /// pages' contents go, as they would natively, and the range leaves management until the
    /// program unmaps it or maps anonymous memory over it again (then the arena takes it
    /// back). The JVM maps its class-data archive this way into a range it reserved.
    pub fn lend(
        &self,
        addr: usize,
        len: usize,
        map: impl FnOnce() -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        let _inside = self.gate.enter();
        let einval = || std::io::Error::from_raw_os_error(libc::EINVAL);
        let (first, pages) = self.page_range(addr, len).map_err(|_| einval())?;
        if self.in_child() || self.is_detached() {
            return map();
        }
        // Past the arena's end is not the arena's to give.
        if pages < len.div_ceil(PAGE_SIZE) {
            return Err(einval());
        }
        self.adopt_free(first, pages);
        let mask = sys::block_signals();
        let taken = self.take_and_drop(first, pages);
        let res = map();
        let mut lent = 0u64;
        for &(i, st) in &taken {
            // Natively a failed MAP_FIXED may have unmapped the old contents too; here they
            // read as zeros.
            let to = if res.is_ok() || st == State::Lent {
                State::Lent
            } else {
                State::Unpopulated
            };
            if to == State::Lent {
                self.pt.set_protected(i, false);
                lent += u64::from(st != State::Lent);
            }
            self.pt.publish(i, to, Some(Activeness(0)));
        }
        self.counters
            .managed_pages
            .fetch_sub(lent, Ordering::Relaxed);
        sys::restore_signals(&mask);
        res
    }

    /// A private anonymous `MAP_FIXED` mapping with protection `prot` in managed address
    /// space: how runtimes commit memory they reserved (QEMU's guest RAM, the JVM's
    /// heap) and give it back (`PROT_NONE`). The range reads as zeros, stays managed, and has
    /// the protection asked for.
    pub fn commit(&self, addr: usize, len: usize, prot: i32) -> std::io::Result<()> {
        let _inside = self.gate.enter();
        let einval = || std::io::Error::from_raw_os_error(libc::EINVAL);
        let (first, pages) = self.page_range(addr, len).map_err(|_| einval())?;
        if pages < len.div_ceil(PAGE_SIZE) {
            return Err(einval());
        }
        if self.in_child() || self.is_detached() {
            // Plain memory now: the program's own mapping, passed through.
            // SAFETY: the program's own MAP_FIXED request over its own memory.
            return unsafe {
                sys::mmap(
                    addr,
                    len,
                    prot,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                    -1,
                    0,
                )
            }
            .map(drop);
        }
        self.adopt_free(first, pages);
        let mask = sys::block_signals();
        let taken = self.take_and_drop(first, pages);
        let back = self.take_back(&taken);
        for &(i, _) in &taken {
            self.pt.publish(i, State::Unpopulated, Some(Activeness(0)));
        }
        self.counters
            .managed_pages
            .fetch_add(back as u64, Ordering::Relaxed);
        sys::restore_signals(&mask);
        self.protect(addr, len, prot)
    }

    /// Gives pages the program had protected their read-write protection back before they
    /// return to the arena (a later allocation there must be read-write).
    fn unprotect(&self, taken: &[(usize, State)]) {
        for run in runs(taken, |i, _| self.pt.load(i).protected()) {
            let first = taken[run.start].0;
            // SAFETY: our own arena pages, going back to the arena.
            let _ = unsafe {
                sys::mprotect(
                    self.addr_of(first),
                    run.len() * PAGE_SIZE,
                    libc::PROT_READ | libc::PROT_WRITE,
                )
            };
            for i in first..first + run.len() {
                self.pt.set_protected(i, false);
            }
        }
    }

    /// `madvise(MADV_DONTNEED/MADV_FREE)` of managed memory: the range stays allocated and
    /// reads as zeros.
    pub fn discard(&self, addr: usize, len: usize) -> Result<(), MemError> {
        let _inside = self.gate.enter();
        let (first, pages) = self.page_range(addr, len)?;
        if self.in_child() {
            return self.child_zap(first, pages);
        }
        let mask = sys::block_signals();
        let taken = self.take_and_drop(first, pages);
        let held = taken
            .iter()
            .filter(|(_, st)| matches!(st, State::Mapped | State::Staged | State::Evicted))
            .count();
        self.counters
            .discarded_pages
            .fetch_add(held as u64, Ordering::Relaxed);
        // A lent range is the program's own mapping: the advice applies to it natively.
        for run in runs(&taken, |_, st| st == State::Lent) {
            // SAFETY: the program's own mapping, which it asked to discard.
            let _ = unsafe {
                sys::madvise(
                    self.addr_of(taken[run.start].0),
                    run.len() * PAGE_SIZE,
                    libc::MADV_DONTNEED,
                )
            };
        }
        for (i, st) in taken {
            let to = if st == State::Lent {
                State::Lent
            } else {
                State::Unpopulated
            };
            self.pt.publish(i, to, Some(Activeness(0)));
        }
        sys::restore_signals(&mask);
        Ok(())
    }

    /// `mprotect` of managed memory: the protection applies as it would natively (the program
    /// gets SIGSEGV where it would), on the pages the program has now and on those it brings
    /// back in later. Pages with a protection other than read-write live in VMAs that
    /// `UFFDIO_MOVE` to and from staging refuses, so the evictor leaves them in DRAM until the
    /// program makes them read-write again; nothing else changes for them.
    pub fn protect(&self, addr: usize, len: usize, prot: i32) -> std::io::Result<()> {
        let _inside = self.gate.enter();
        let Ok((first, pages)) = self.page_range(addr, len) else {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        };
        let rw = prot == libc::PROT_READ | libc::PROT_WRITE;
        if self.in_child() || self.is_detached() {
            // SAFETY: the program's own mprotect, passed through.
            return unsafe { sys::mprotect(addr, len, prot) };
        }
        // Marked before the protection changes, and unmarked after it is undone: the evictor
        // never picks a page whose VMA is about to refuse its move (one it picked just before
        // finds the move refused and keeps it mapped).
        if !rw {
            for i in first..first + pages {
                if self.pt.load(i).state() != State::Lent {
                    self.pt.set_protected(i, true);
                }
            }
        }
        // SAFETY: the program's own mprotect, passed through.
        let res = unsafe { sys::mprotect(addr, len, prot) };
        if rw && res.is_ok() {
            for i in first..first + pages {
                self.pt.set_protected(i, false);
            }
        }
        res
    }

    /// In a forked child: discards the range's contents and leaves the address space alone.
    fn child_zap(&self, first: usize, pages: usize) -> Result<(), MemError> {
        // SAFETY: the program released or discarded this range; in the child it is plain
        // anonymous memory.
        unsafe {
            let _ = sys::discard(self.addr_of(first), pages * PAGE_SIZE);
        }
        Ok(())
    }

    /// Length in bytes of the malloc-family block that starts at `addr` (made by
    /// [`alloc_malloc`](Self::alloc_malloc), maybe resized by [`remap`](Self::remap)), if one
    /// does. Lock-free.
    pub fn malloc_len(&self, addr: usize) -> Option<usize> {
        if !self.contains(addr) || !addr.is_multiple_of(PAGE_SIZE) {
            return None;
        }
        match self.pt.block(self.page_of(addr)) {
            (n, true) if n > 0 => Some(n * PAGE_SIZE),
            _ => None,
        }
    }

    /// `mremap` of managed memory: shrinks in place, grows in place when the arena has room
    /// after the range, or else (with `may_move`) moves every page's contents to a new range.
    pub fn remap(
        &self,
        addr: usize,
        old_len: usize,
        new_len: usize,
        may_move: bool,
    ) -> Result<usize, MemError> {
        let _inside = self.gate.enter();
        let (first, old_pages) = self.page_range(addr, old_len)?;
        let new_pages = new_len.div_ceil(PAGE_SIZE).max(1);
        if (first..first + old_pages).any(|i| {
            let w = self.pt.load(i);
            w.protected() || w.state() == State::Lent
        }) {
            // Its pages would move into read-write memory, or are not managed: the caller
            // copies instead, or refuses.
            return Err(MemError::Unsupported);
        }
        if (self.in_child() || self.is_detached()) && new_pages > old_pages {
            // Plain memory now: the caller copies.
            return Err(MemError::NoRoom);
        }
        if new_pages <= old_pages {
            if new_pages < old_pages {
                self.release(
                    self.addr_of(first + new_pages),
                    (old_pages - new_pages) * PAGE_SIZE,
                )?;
                if !self.in_child() {
                    let malloc = self.pt.block(first).1;
                    self.pt.set_block(first, new_pages, malloc);
                }
            }
            return Ok(addr);
        }
        let grown_in_place = {
            let mut r = self.ranges.lock().unwrap_or_else(|e| e.into_inner());
            let ok = r.alloc_at(first + old_pages, new_pages - old_pages);
            self.high_water.store(r.high_water(), Ordering::Release);
            ok
        };
        if grown_in_place {
            for i in first + old_pages..first + new_pages {
                self.pt.allocate(i);
            }
            let malloc = self.pt.block(first).1;
            self.pt.set_block(first, new_pages, malloc);
            let m = self
                .counters
                .managed_pages
                .fetch_add((new_pages - old_pages) as u64, Ordering::Relaxed);
            Counters::peak(&self.counters.peak_managed_pages, m);
            return Ok(addr);
        }
        if !may_move {
            return Err(MemError::NoRoom);
        }
        let to = self.alloc_kind(new_len, PAGE_SIZE, self.pt.block(first).1)?;
        self.move_contents(first, self.page_of(to), old_pages);
        self.release(addr, old_pages * PAGE_SIZE)?;
        Ok(to)
    }

    /// Moves the contents of `pages` pages from `from` to `to` (fresh, unpopulated pages),
    /// whatever tier each page is in, leaving the source pages unpopulated.
    fn move_contents(&self, from: usize, to: usize, pages: usize) {
        let mask = sys::block_signals();
        let mut taken = Vec::with_capacity(pages.min(1 << 16));
        self.take_pages(from, pages, &mut taken);
        for &(i, _) in &taken {
            // The destination is a fresh allocation, but a page of it may already have been
            // zero-filled (a program thread touching it through a stray pointer): take it
            // whatever its state, and empty it, so that what lands there is the source page.
            let j = to + (i - from);
            if let Some(old) = self.pt.claim_any(j) {
                if old.state() != State::Unpopulated {
                    self.drop_contents(&[(j, old.state())]);
                }
            }
        }
        // Mapped pages move in runs with UFFDIO_MOVE (no copy, no DRAM change).
        let mut moved = Vec::new();
        let mapped: Vec<_> = runs(&taken, |_, st| st == State::Mapped).collect();
        for run in mapped {
            let start = run.start;
            let i = taken[start].0;
            moved.clear();
            moved.resize(run.len(), false);
            // SAFETY: source pages are ours (Busy) and mapped; destination pages are ours
            // (Busy), fresh and missing. Both lie in the registered arena.
            let report = unsafe {
                self.uffd.move_verified(
                    &self.pagemap,
                    self.addr_of(to + (i - from)),
                    self.addr_of(i),
                    &mut moved,
                )
            };
            let report =
                report.unwrap_or_else(|e| fatal("reading the page tables after a move failed", &e));
            self.count_underreported(&report);
            for (d, &m) in moved.iter().enumerate() {
                let q = i + d;
                if m {
                    continue;
                }
                if self.presence(self.addr_of(q)) == sys::Presence::Absent {
                    // Zapped behind our back: it reads as zeros, at its new address too.
                    taken[start + d].1 = State::Unpopulated;
                    self.forget_copy(q);
                    self.quota.unreserve(1);
                    continue;
                }
                // A page that cannot be moved (shared after fork, swapped out by Linux) is
                // copied instead.
                // SAFETY: the source page is mapped and ours; the destination is ours.
                if let Err(e2) = unsafe {
                    self.uffd
                        .copy(self.addr_of(to + (q - from)), self.addr_of(q), PAGE_SIZE)
                } {
                    fatal("moving memory for mremap failed", &e2.error);
                }
                // SAFETY: the source page is ours; its contents now live at the destination.
                unsafe {
                    let _ = sys::discard(self.addr_of(q), PAGE_SIZE);
                }
            }
        }
        for &(i, st) in &taken {
            let j = to + (i - from);
            let h = self.pt.load(i).history();
            if let Some(c) = self.pt.copy(i) {
                self.pt.set_hash(j, self.pt.hash(i));
                self.pt.set_copy(j, Some(c));
                self.pt.set_copy(i, None);
                if let TierCopy::Pool(h) = c {
                    self.pool_order_push(j, h);
                }
            }
            if st == State::Staged {
                // Order matters to the evictor reading the ring concurrently: the new page
                // names its slot before the ring names the new page, and the old page forgets
                // its slot only after that (see write_back).
                let s = self.pt.stage(i);
                self.pt.set_stage(j, s);
                self.ring
                    .entry(s as u64)
                    .store(j as u32 + 1, Ordering::Release);
                self.pt.set_stage(i, NONE);
            }
            self.pt.publish(j, st, Some(h));
            self.pt.publish(i, State::Unpopulated, Some(Activeness(0)));
            if matches!(st, State::Mapped | State::Staged) {
                self.arrived(j);
            }
        }
        sys::restore_signals(&mask);
    }

    /// Brings every page of `[addr, addr+len)` into DRAM and pins it there until the guard is
    /// dropped: for system calls that read or write managed memory from the kernel, where a
    /// missing page would fail the call with EFAULT instead of faulting.
    pub fn pin(&self, addr: usize, len: usize) -> Pinned<'_> {
        let _inside = self.gate.enter();
        let mut pinned = Pinned {
            engine: self,
            first: 0,
            pages: 0,
        };
        if len == 0 || self.detached.load(Ordering::Relaxed) || self.in_child() {
            return pinned;
        }
        let lo = addr.max(self.arena.addr());
        let hi = (addr.saturating_add(len)).min(self.arena.addr() + self.arena.len());
        if lo >= hi {
            return pinned;
        }
        let first = self.page_of(lo);
        let last = self.page_of(hi - 1);
        pinned.first = first;
        let mask = sys::block_signals();
        for i in first..=last {
            loop {
                if self.pt.pin(i) {
                    break;
                }
                let w = self.pt.load(i);
                match w.state() {
                    // Not managed memory: the system call uses it natively.
                    State::Free | State::Lent => {
                        sys::restore_signals(&mask);
                        return pinned;
                    }
                    State::Mapped => std::thread::yield_now(),
                    _ => {
                        self.handle_fault(self.addr_of(i));
                    }
                }
            }
            pinned.pages += 1;
        }
        sys::restore_signals(&mask);
        pinned
    }

    /// Before `fork`, where both processes cannot stay tiered (`why`): brings every page back
    /// into DRAM and stops tiering, so that the child gets an ordinary copy-on-write copy of
    /// all memory (see `fork.rs`).
    pub fn detach_for_fork(&self, why: &str) {
        if self.detached.swap(true, Ordering::AcqRel) {
            return;
        }
        self.quota.lift();
        // Stop the evictor first: nothing may leave DRAM once we start bringing pages back.
        self.pause_evictor();
        let mask = sys::block_signals();
        let hw = self.high_water.load(Ordering::Acquire);
        for i in 0..hw {
            while !matches!(
                self.pt.load(i).state(),
                State::Free | State::Mapped | State::Unpopulated | State::Lent
            ) {
                self.handle_fault(self.addr_of(i));
            }
        }
        // Every page is in DRAM: the compressed pool's copies are of no more use.
        self.drop_mapped_copies(hw);
        // Lent ranges are the program's own mappings, never registered (and UFFDIO_UNREGISTER
        // refuses a range holding a file mapping): unregister around them.
        let lent = |i: usize| i < hw && self.pt.load(i).state() == State::Lent;
        let mut from = 0;
        while from < self.pt.pages() {
            // The registered run from `from` ends at the next lent page (or the arena's end).
            let to = (from..hw).find(|&i| lent(i)).unwrap_or(self.pt.pages());
            if to > from {
                if let Err(e) = self
                    .uffd
                    .unregister(self.addr_of(from), (to - from) * PAGE_SIZE)
                {
                    fatal("unregistering the arena before fork failed", &e);
                }
            }
            from = to + 1;
        }
        // Plain memory from now on: Linux manages it as any other.
        let _ = sys::unlock(self.arena.addr(), self.arena.len());
        self.warn(format!("the program forked: its managed memory was brought back into DRAM and is no longer tiered, because {why}"));
        sys::restore_signals(&mask);
    }

    /// Stops the evictor and waits until it is idle.
    pub fn pause_evictor(&self) {
        self.pause.store(true, Ordering::Release);
        while !self.parked.load(Ordering::Acquire) {
            self.bell.ring_always();
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
        // A fault staging pages for the evictor looks at `pause` under this lock: once we
        // have held it, none is staging, and none will. Pages they left for the evictor are
        // finished with here.
        let _staging = self.staging();
        self.adopt_orphans();
    }

    /// Lets a paused evictor run again (not after a fork fallback).
    pub fn resume_evictor(&self) {
        if !self.is_detached() {
            self.pause.store(false, Ordering::Release);
            self.bell.ring_always();
        }
    }

    pub fn is_detached(&self) -> bool {
        self.detached.load(Ordering::Relaxed)
    }

    /// Whether this is a forked child whose engine does not run: the parent detached before
    /// the fork (or the fork was made without the engine seeing it), so managed memory is
    /// plain memory here and the engine touches no shared state. (A child whose engine came
    /// with the fork runs it, and is not this: see `fork.rs`.)
    pub fn in_child(&self) -> bool {
        // SAFETY: getpid has no preconditions.
        self.pid.load(Ordering::Relaxed) != unsafe { libc::getpid() } as u32
    }
}

/// Guard returned by [`Engine::pin`].
pub struct Pinned<'a> {
    engine: &'a Engine,
    first: usize,
    pages: usize,
}

impl Drop for Pinned<'_> {
    fn drop(&mut self) {
        for i in self.first..self.first + self.pages {
            self.engine.pt.unpin(i);
        }
    }
}

/// The runs of `taken` (pages in address order, with their states) where consecutive entries
/// are consecutive pages that all satisfy `keep`: index ranges into `taken`.
fn runs<'a>(
    taken: &'a [(usize, State)],
    keep: impl Fn(usize, State) -> bool + 'a,
) -> impl Iterator<Item = std::ops::Range<usize>> + 'a {
    let mut k = 0;
    std::iter::from_fn(move || {
        while k < taken.len() && !keep(taken[k].0, taken[k].1) {
            k += 1;
        }
        if k == taken.len() {
            return None;
        }
        let start = k;
        k += 1;
        while k < taken.len() && keep(taken[k].0, taken[k].1) && taken[k].0 == taken[k - 1].0 + 1 {
            k += 1;
        }
        Some(start..k)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_split_at_gaps_and_at_pages_left_out() {
        use State::{Evicted as E, Mapped as M};
        let taken = [(1, M), (2, M), (3, E), (4, M), (7, M), (8, M)];
        let mapped: Vec<_> = runs(&taken, |_, st| st == M).collect();
        assert_eq!(mapped, [0..2, 3..4, 4..6]);
        let all: Vec<_> = runs(&taken, |_, _| true).collect();
        assert_eq!(all, [0..4, 4..6]);
        assert_eq!(runs(&taken, |i, _| i > 8).count(), 0);
    }
}
