//! Eviction: the evictor thread ages every page's history once per epoch, unmaps the idlest
//! mapped pages into the staging ring (the inactive list) with `UFFDIO_MOVE`, and writes the
//! oldest inactive pages to tier 1 in batches of consecutive slots, releasing their DRAM only
//! once their bytes are safe. Entry point: the thread started by [`Engine::start`]
//! (`evictor_main`).

use std::sync::atomic::Ordering;

use memtide_policy::{
    Activeness, EpochClock, Relief, Relieve, Sweep, SweepPages, Watermarks, PAGE_SIZE,
};

use super::active::{self, ActiveSampler};
use super::compressed;
use super::fatal::fatal;
use super::policy::Evictor;
use super::ring::{RING_DEAD, RING_EMPTY};
use super::Engine;
use crate::pages::{State, TierCopy, NONE};
use crate::stats::Counters;
use crate::sys;

impl Engine {
    pub(super) fn evictor_main(&self) {
        self.evictor_tid
            .store(crate::threads::gettid(), Ordering::Relaxed);
        // This process is a member of its tree for as long as this thread lives (see fork.rs).
        self.hold_member();
        let mut evictor = self.policy.evictor(self);
        let mut clock = EpochClock::new(self.epoch_ns);
        let mut sampled: Vec<usize> = Vec::with_capacity(active::SAMPLE as usize);
        let mut sampler = ActiveSampler::new(active::seed());
        let mut populated = 0u64;
        let mut writing: Vec<(usize, u32)> = Vec::with_capacity(Watermarks::MAX_BATCH as usize);
        let mut warned_underreport = false;
        loop {
            if self.pause.load(Ordering::Acquire) {
                self.parked.store(true, Ordering::Release);
                let k = self.bell.seen();
                self.bell.wait(k, 1_000_000);
                continue;
            }
            self.parked.store(false, Ordering::Release);
            self.adopt_orphans();
            self.fault_staging_idle.store(false, Ordering::Release);
            self.share_quota();
            let cpu0 = sys::thread_cpu_ns();
            let now = sys::now_ns();
            let new_epoch = clock.tick(now);
            if new_epoch {
                let estimate = self.active_window_ends(&mut sampler, populated);
                let (seen_active, now_populated) = self.age_all();
                populated = now_populated;
                self.counters
                    .active_pages
                    .store(estimate.unwrap_or(seen_active), Ordering::Relaxed);
                if !self.detached.load(Ordering::Acquire) {
                    self.sample_active(&mut sampler, &mut sampled);
                }
                Counters::bump(&self.counters.epochs);
                self.reap_members();
                self.size_pool(now);
                self.compact_pool();
            }
            let ecpu0 = sys::thread_cpu_ns();
            if self.file.reclaim.swap(false, Ordering::AcqRel)
                || (new_epoch && self.file.slots().needs_reclaim())
            {
                self.reclaim_tier(Watermarks::MAX_BATCH * 4);
            }
            if let Some(c) = &self.compressed {
                if c.pool.pages() > c.pool.capacity_pages() {
                    // The quota was lowered: the pool gives back what it no longer may hold.
                    self.spill(compressed::SPILL_BATCH);
                }
            }
            if let Some(c) = self.compressed.as_ref().filter(|_| new_epoch) {
                c.futile.store(false, Ordering::Relaxed);
            }
            if self.file.full.load(Ordering::Acquire) && (new_epoch || self.tier_has_room()) {
                // Try again: the program freed slots, or the filesystem may have room now.
                self.file.full.store(false, Ordering::Release);
            }
            if !self.detached.load(Ordering::Acquire) && !self.tier_usable() {
                // Nothing can leave DRAM now (the file failed or is full, and the pool is full
                // or took nothing of the last batch): let faulting threads through rather than
                // have them wait for eviction that cannot come.
                self.quota.set_overcommit(true);
                self.quota.wake_waiters();
            }
            if !self.detached.load(Ordering::Acquire) && self.tier_usable() {
                match evictor.relieve(self, &mut writing, new_epoch) {
                    Relief::Calm => self.quota.set_overcommit(false),
                    Relief::Stuck => {
                        // Nothing evictable right now (everything pinned, in flight, or tiny):
                        // let faulting threads through rather than have them wait on us.
                        self.quota.set_overcommit(true);
                        self.quota.wake_waiters();
                    }
                    Relief::Relieved | Relief::Stopped => {}
                }
            }
            let cpu1 = sys::thread_cpu_ns();
            let underreported = self.counters.moves_underreported.load(Ordering::Relaxed);
            if underreported > 0 && !warned_underreport {
                warned_underreport = true;
                let errno = self.underreport_errno.load(Ordering::Relaxed);
                self.warn(format!(
                    "the kernel reported a page move as failed (errno {errno}) although \
                     {underreported} page(s) moved; memtide follows the page tables (counted as \
                     moves_underreported)"
                ));
            }
            Counters::add(&self.counters.scan_cpu_ns, ecpu0 - cpu0);
            Counters::add(&self.counters.evict_cpu_ns, cpu1 - ecpu0);

            let k = self.bell.seen();
            self.bell.set_sleeping(true);
            if !self.quota.wm().over_high(self.quota.held())
                || !self.tier_usable()
                || self.detached.load(Ordering::Acquire)
            {
                let wait = clock
                    .remaining_ns(sys::now_ns())
                    .clamp(1_000_000, 50_000_000);
                self.bell.wait(k, wait);
            }
            self.bell.set_sleeping(false);
        }
    }

    /// Whether eviction can take pages out of DRAM now: the file takes them, or the
    /// compressed pool has room.
    pub(super) fn tier_usable(&self) -> bool {
        self.file.usable() || self.compressed.as_ref().is_some_and(|c| c.has_room())
    }

    /// Whether tier 1 has free slots within its limit (after it was found full).
    fn tier_has_room(&self) -> bool {
        self.file.slots().has_room()
    }

    /// Brings tier 1 within its limit (and, when it was found full, makes `room` free slots
    /// where it can): drops the tier copies of pages that are in DRAM as well (a promoted page
    /// keeps its copy so that its next eviction needs no write; it is written again then) —
    /// every copy in a slot above the limit, and others until few enough slots are in use —
    /// moves the copies of pages that live only in tier 1 from above the limit to free slots
    /// below it (at most `room` a call), then cuts the store's free tail above the limit.
    /// Returns the slots freed.
    fn reclaim_tier(&self, room: u64) -> u64 {
        let (limit, len, mut in_use, target) = {
            let s = self.file.slots();
            let short = if self.file.full.load(Ordering::Acquire) {
                room.saturating_sub(s.limit().min(s.len()).saturating_sub(s.in_use()))
            } else {
                0
            };
            (
                s.limit(),
                s.len(),
                s.in_use(),
                s.limit().saturating_sub(short),
            )
        };
        let mut freed: Vec<u64> = Vec::new();
        let mut movers: Vec<usize> = Vec::new();
        // A tier that failed is read only by faults, never rewritten.
        let may_move = !self.file.failed.load(Ordering::Acquire);
        let hw = self.high_water.load(Ordering::Acquire);
        for i in 0..hw {
            if in_use <= target && len <= limit {
                break;
            }
            let above = match self.pt.slot(i) {
                Some(s) if s >= limit || in_use > target => s >= limit,
                _ => continue,
            };
            let st = self.pt.load(i).state();
            if st == State::Evicted && above && may_move && (movers.len() as u64) < room {
                movers.push(i);
                continue;
            }
            if !matches!(st, State::Mapped | State::Staged) {
                continue;
            }
            // Claimed, the page cannot be freed, evicted or brought in while its copy goes.
            if self.pt.claim(i, st, false).is_none() {
                continue;
            }
            if let Some(s) = self.pt.slot(i) {
                self.pt.set_copy(i, None);
                freed.push(s);
                in_use -= 1;
            }
            self.pt.publish(i, st, None);
        }
        {
            let mut slots = self.file.slots();
            for &s in &freed {
                slots.free(s);
            }
        }
        if !movers.is_empty() {
            self.relocate(&movers);
        }
        let mut slots = self.file.slots();
        if let Some(to) = slots.shrink_to() {
            // The map stays locked: no slot is allocated above `to` meanwhile.
            if self.file.backend.shrink(to).is_ok() {
                slots.shrunk(to);
            }
        }
        Counters::add(&self.counters.tier_copies_dropped, freed.len() as u64);
        freed.len() as u64
    }

    /// Moves the tier copies of `pages` (pages that live only in tier 1, in slots above the
    /// limit) to free slots below it, while there are any. Each copy is read, checked against
    /// the checksum taken when it was written and written to its new slot before the page
    /// points there; a page that changed state meanwhile is left alone, and on a failure the
    /// page keeps its old slot (nothing is lost; the next epoch tries again). An encrypted
    /// tier seals the copy again for its new slot. Returns the pages moved.
    fn relocate(&self, pages: &[usize]) -> u64 {
        let mut buf = self.file.bounce.take();
        let mut moved = 0;
        for &i in pages {
            // Below the limit, even when as many slots are in use as it allows: the old slot
            // goes back once the copy has moved.
            let Some(new) = self.file.slots().take_below_limit() else {
                break;
            };
            // Claimed, the page cannot be faulted in or freed while its copy moves (a fault
            // waits for it).
            if self.pt.claim(i, State::Evicted, false).is_none() {
                self.file.slots().free(new);
                continue;
            }
            let Some(old) = self.pt.slot(i) else {
                self.file.slots().free(new);
                self.pt.publish(i, State::Evicted, None);
                continue;
            };
            // SAFETY: `buf` is a bounce buffer of READAHEAD pages that this thread holds.
            let ok = match unsafe { self.file.backend.read(old, 1, buf as *mut u8) } {
                Ok(()) if self.matches_tier_copy(i, buf) => {
                    // SAFETY: `buf` holds one page just read.
                    unsafe { self.file.backend.write(new, &[buf]) }.is_ok()
                }
                Ok(()) => {
                    Counters::bump(&self.counters.tier_read_mismatches);
                    false
                }
                Err(e) => {
                    self.read_failed(&mut buf, &e);
                    false
                }
            };
            {
                let mut s = self.file.slots();
                if ok {
                    self.pt.set_copy(i, Some(TierCopy::File(new)));
                    s.free(old);
                    moved += 1;
                    Counters::add(&self.counters.tier_read_bytes, PAGE_SIZE as u64);
                    Counters::add(&self.counters.tier_write_bytes, PAGE_SIZE as u64);
                } else {
                    s.free(new);
                }
            }
            self.pt.publish(i, State::Evicted, None);
        }
        self.file.bounce.give(buf);
        Counters::add(&self.counters.tier_copies_moved, moved);
        moved
    }

    /// Ends an epoch: shifts every page's history. Returns the pages seen touched in this
    /// epoch or the one before, and the populated pages (neither free nor never touched).
    fn age_all(&self) -> (u64, u64) {
        let hw = self.high_water.load(Ordering::Acquire);
        self.drop_mapped_copies(hw);
        let (mut active, mut populated) = (0u64, 0u64);
        for i in 0..hw {
            let w = self.pt.load(i);
            if matches!(w.state(), State::Free | State::Unpopulated | State::Lent) {
                continue;
            }
            populated += 1;
            if self.pt.age(i).is_active() {
                active += 1;
            }
        }
        (active, populated)
    }

    /// Moves up to `want` of the coldest mapped pages, as the policy's CLOCK sweep picks them,
    /// into the inactive list (staging). Returns how many it moved.
    fn deactivate(&self, want: u64, staging: &mut Staging) -> u64 {
        self.deactivate_in(want, staging, usize::MAX, false)
    }

    /// [`deactivate`](Self::deactivate), with the sweep looking at no more than `max_scan`
    /// pages, from a fault when `in_fault`.
    fn deactivate_in(
        &self,
        want: u64,
        staging: &mut Staging,
        max_scan: usize,
        in_fault: bool,
    ) -> u64 {
        let Staging { moved, hand } = staging;
        let Some(Hand {
            sweep,
            victims,
            scanned,
        }) = hand
        else {
            return 0;
        };
        let want = want.min(self.ring.room()).min(victims.capacity() as u64) as usize;
        victims.clear();
        let mut candidates = Candidates {
            engine: self,
            extent: self.high_water.load(Ordering::Acquire),
            victims,
            scanned,
        };
        if sweep.deactivate_within(&mut candidates, want, max_scan) == 0 {
            return 0;
        }
        self.stage_from(moved, victims, in_fault)
    }

    /// The staging lock ([`Staging`]), taken by the evictor and by `pause_evictor`.
    pub(super) fn staging(&self) -> std::sync::MutexGuard<'_, Staging> {
        self.staging.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fills the inactive list from a fault resolved in the faulting thread (see
    /// `Config::stage_in_faults`), before the thread goes on: the thread unmaps pages of its
    /// own process on its own CPU, so the kernel flushes the TLB there only (and on CPUs
    /// running other threads of the process), where each page the evictor unmaps from
    /// another CPU interrupts the program with a flush. Near the quota, when the inactive list
    /// is short and nobody else is staging: up to [`FAULT_STAGE_MAX`] pages.
    /// Async-signal-safe (no allocation; the lock is only tried).
    pub(super) fn stage_for_fault(&self) {
        if !self.stage_in_faults
            || self.pause.load(Ordering::Acquire)
            || self.detached.load(Ordering::Acquire)
            || self.fault_staging_idle.load(Ordering::Acquire)
        {
            return;
        }
        let wm = self.quota.wm();
        let inactive = self.ring.staged.load(Ordering::Acquire);
        if inactive >= wm.inactive_target || !wm.near_quota(self.quota.held()) {
            return;
        }
        let mut staging = match self.staging.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return,
        };
        // Under the lock: a fork or an audit that paused eviction waits for it (see
        // `pause_evictor`).
        if self.pause.load(Ordering::Acquire) || !self.tier_usable() {
            return;
        }
        // A page that will not move and is gone is left to the evictor (see `stage_from`):
        // room for each page this may take.
        let want = (wm.inactive_target - inactive)
            .min(FAULT_STAGE_MAX)
            .min(self.orphans.room() as u64);
        if want == 0 {
            return;
        }
        let n = self.deactivate_in(want, &mut staging, FAULT_SCAN_MAX, true);
        if n == 0 {
            // Nothing within reach: faults leave the search to the evictor until its next
            // round rather than each scanning again.
            self.fault_staging_idle.store(true, Ordering::Release);
        }
        Counters::add(&self.counters.deactivations_in_faults, n);
    }

    /// Finishes with the pages faults could not stage and found gone (see [`Orphans`]):
    /// each is the evictor's now.
    pub(super) fn adopt_orphans(&self) {
        while let Some(p) = self.orphans.take() {
            self.unmovable(p, self.presence(self.addr_of(p)), false);
        }
    }

    /// Moves the mapped pages `victims` (claimed `Busy` by this thread, in address order) into
    /// staging slots at the ring's head. The caller holds [`Engine::staging`] (of which
    /// `moved` is part): the head moves only under it. Pages beyond the ring's room, and those
    /// that would not move, are put back (or found gone); `victims` keeps those that moved.
    /// Returns how many moved. Allocates nothing while `victims` is no longer than `moved`'s
    /// capacity.
    pub(super) fn stage(&self, moved: &mut Vec<bool>, victims: &mut Vec<usize>) -> u64 {
        self.stage_from(moved, victims, false)
    }

    /// [`stage`](Self::stage); from a fault when `in_fault`, where a page that would not move
    /// and is gone (zapped behind memtide's back) stays `Busy` for the evictor, which frees
    /// its copy below DRAM (that takes locks a signal handler must not wait on): the caller
    /// made room in [`Orphans`] for every victim.
    fn stage_from(&self, moved: &mut Vec<bool>, victims: &mut Vec<usize>, in_fault: bool) -> u64 {
        let room = self.ring.room() as usize;
        if victims.len() > room {
            for &p in &victims[room..] {
                self.pt.publish(p, State::Mapped, None);
            }
            victims.truncate(room);
        }
        if !self.locked.load(Ordering::Acquire) {
            // Unlocked memory may have been swapped out by Linux: only pages in DRAM move.
            victims.retain(|&p| {
                let presence = self.presence(self.addr_of(p));
                if presence != sys::Presence::Present {
                    self.unmovable(p, presence, in_fault);
                }
                presence == sys::Presence::Present
            });
        }
        // Victims are in address order: move runs of neighbours in one call each.
        let mut moved_total = 0u64;
        moved.clear();
        moved.resize(victims.len(), false);
        let mut k = 0;
        while k < victims.len() {
            let head = self.ring.head();
            let s0 = (head % self.ring.slots()) as u32;
            let start = k;
            while k < victims.len()
                && victims[k] == victims[start] + (k - start)
                && (s0 as u64 + (k - start) as u64) < self.ring.slots()
            {
                k += 1;
            }
            let n = k - start;
            let first = victims[start];
            let moved = &mut moved[start..k];
            // SAFETY: pages first..first+n are ours (Busy) and mapped; staging slots
            // s0..s0+n are free (between tail and head nothing else lives there) and missing.
            let report = unsafe {
                self.uffd.move_verified(
                    &self.pagemap,
                    self.ring.addr(s0),
                    self.addr_of(first),
                    moved,
                )
            };
            let report =
                report.unwrap_or_else(|e| fatal("reading the page tables after a move failed", &e));
            self.count_underreported(&report);
            for (j, &m) in moved.iter().enumerate() {
                let p = first + j;
                let s = s0 + j as u32;
                if m {
                    self.pt.set_stage(p, s);
                    self.ring
                        .entry(s as u64)
                        .store(p as u32 + 1, Ordering::Release);
                    // Counted before it is published: a touch may take it back at once.
                    self.ring.staged.fetch_add(1, Ordering::AcqRel);
                    self.pt.publish(p, State::Staged, None);
                    moved_total += 1;
                } else {
                    self.ring
                        .entry(s as u64)
                        .store(RING_EMPTY, Ordering::Release);
                    // Why did it stay? (Each page is asked: one that is not there at all
                    // must not be taken for mapped.)
                    self.unmovable(p, self.presence(self.addr_of(p)), in_fault);
                }
            }
            self.ring.set_head(head + n as u64);
        }
        let mut i = 0;
        victims.retain(|_| {
            i += 1;
            moved[i - 1]
        });
        Counters::add(&self.counters.deactivations, moved_total);
        moved_total
    }

    /// A mapped page that UFFDIO_MOVE refused, found `presence` (read once by the caller: a
    /// page found there and published mapped takes no lock, whatever a zap racing with this
    /// does). Nothing there: the program zapped it without telling us (it reads as zeros
    /// now), and from a fault (`in_fault`) it is left to the evictor ([`Orphans`]: freeing
    /// its copy takes locks); anything else (swapped out by Linux, shared after fork, pinned
    /// by the kernel for I/O): it stays mapped.
    fn unmovable(&self, p: usize, presence: sys::Presence, in_fault: bool) {
        match presence {
            sys::Presence::Absent if in_fault => {
                self.orphans.leave(p);
                Counters::bump(&self.counters.fault_stage_orphans);
                self.bell.ring();
            }
            sys::Presence::Absent => {
                self.forget_copy(p);
                self.quota.unreserve(1);
                self.pt.publish(p, State::Unpopulated, None);
            }
            _ => self.pt.publish(p, State::Mapped, None),
        }
    }

    /// Writes up to `batch` of the oldest inactive pages to tier 1 and releases their DRAM.
    /// Returns how many pages left DRAM.
    fn write_back(&self, batch: u64, writing: &mut Vec<(usize, u32)>) -> u64 {
        let tail0 = self.ring.tail();
        let head = self.ring.head();
        let end = head.min(tail0 + batch);
        if end == tail0 {
            return 0;
        }
        writing.clear();
        let mut dead = 0u64;
        let mut end = end;
        'positions: for pos in tail0..end {
            let entry = self.ring.entry(pos);
            let s = (pos % self.ring.slots()) as u32;
            loop {
                let e = entry.load(Ordering::Acquire);
                if e == RING_EMPTY {
                    break;
                }
                if e == RING_DEAD {
                    dead += 1;
                    break;
                }
                let p = (e - 1) as usize;
                let w = self.pt.load(p);
                if w.state() == State::Staged && self.pt.stage(p) == s {
                    if self.inject.writeback_wrap.armed() {
                        if let Some(&(q, _)) = writing.last().filter(|&&(q, _)| q > p) {
                            self.inject.writeback_wrap.pass([q as u64, p as u64]);
                        }
                    }
                    if self.pt.claim(p, State::Staged, false).is_some() {
                        // Claimed as Busy; mark Writing so faulting threads wait for us.
                        self.pt.publish(p, State::Writing, None);
                        writing.push((p, s));
                        break;
                    }
                    continue;
                }
                if w.state() == State::Busy && self.pt.stage(p) == s {
                    // Someone is taking it out of this slot (a fault, a free, a move). While
                    // we hold none of the batch, wait for them and look again. Holding some,
                    // we must not wait: a free or mremap claims its range in address order
                    // and may be waiting for a page we hold Writing (where the sweep wrapped,
                    // ring order is the reverse of address order). The batch ends here; the
                    // next one starts with this slot.
                    if writing.is_empty() {
                        // The one taking it may itself wait on a page a fault left to us
                        // (a free claims its range in address order): finish with those
                        // first.
                        self.adopt_orphans();
                        self.pt.wait(p, w);
                        continue;
                    }
                    end = pos;
                    break 'positions;
                }
                if entry.load(Ordering::Acquire) != e {
                    // The slot changed hands (a move renamed its page) while we looked.
                    continue;
                }
                break;
            }
        }
        let out = self.retire(writing);
        // Release the DRAM of every processed slot at once (one TLB shootdown per batch).
        self.pass_tail(tail0, end);
        let released = out.left + dead;
        self.ring
            .staged
            .fetch_sub(released + out.failed.len() as u64, Ordering::AcqRel);
        self.quota.unreserve(released);
        Counters::add(&self.counters.demotions, out.left);
        Counters::add(&self.counters.demotions_clean, out.clean);
        Counters::add(&self.counters.demotions_zero, out.zero);
        // Pages that went back count as progress only if something else did.
        released
    }

    /// Moves the ring's tail from `from` to `to`, releasing the positions it passes (see
    /// [`StagingRing::zap`]) and giving back the page tables of the chunks it has passed.
    /// Under the staging lock: a fault staging meanwhile could move the head into a chunk
    /// being mapped afresh (the old tail still leaves it room there).
    pub(super) fn pass_tail(&self, from: u64, to: u64) {
        let _staging = self.staging();
        self.ring.zap(from, to, |addr, len| {
            // SAFETY: a chunk behind the tail that the head has not reached again: its slots
            // hold nothing (see `StagingRing::zap`), and nobody stages while we hold the lock.
            unsafe { self.renew(addr, len, "renewing the staging area failed") }
        });
        self.ring.set_tail(to);
    }

    /// Takes the pages `writing` (each `Writing`, ours, at its staging slot) out of DRAM: zero
    /// pages are dropped, clean ones (equal to their tier copy) released, dirty ones written
    /// to tier 1 first; each is published `Evicted` (zero pages `Unpopulated`). Pages tier 1
    /// would not take go back to the program, `Mapped`. The caller releases the slots.
    pub(super) fn retire(&self, writing: &[(usize, u32)]) -> Retired {
        // Classify: zero pages and clean pages need no write.
        let mut dirty: Vec<(usize, u32, u64)> = Vec::with_capacity(writing.len());
        let mut zero = 0u64;
        let mut clean = 0u64;
        let mut gone: Vec<usize> = Vec::new();
        let pool_has_room = self.compressed.as_ref().is_some_and(|c| c.has_room());
        for &(p, s) in writing.iter() {
            let a = self.ring.addr(s);
            // SAFETY: the staging page is mapped (Writing is ours) and readable.
            if unsafe { sys::page_is_zero(a) } {
                zero += 1;
                gone.push(p);
                continue;
            }
            // SAFETY: as above.
            let bytes = unsafe { std::slice::from_raw_parts(a as *const u8, PAGE_SIZE) };
            let h = xxhash_rust::xxh3::xxh3_64(bytes);
            // A page unchanged since its copy was taken leaves without a write, unless its
            // copy is in the file and the pool has room: a fault on it then costs a
            // decompression instead of a read (the file slot goes when it is stored).
            let kept = match self.pt.copy(p) {
                Some(TierCopy::Pool(_)) => true,
                Some(TierCopy::File(_)) => !pool_has_room,
                _ => false,
            };
            if kept && self.pt.hash(p) == h {
                clean += 1;
            } else {
                dirty.push((p, s, h));
            }
        }
        let mut failed: Vec<(usize, u32)> = Vec::new();
        let mut to_file: Vec<(usize, u32, u64)> = Vec::new();
        let mut pooled = 0;
        if !dirty.is_empty() {
            pooled = self.compress_out(&dirty, &mut to_file).stored;
        }
        // Pages the pool would not take whose copy in the file is still theirs leave without
        // a write after all.
        to_file.retain(|&(p, _, h)| {
            let kept = matches!(self.pt.copy(p), Some(TierCopy::File(_))) && self.pt.hash(p) == h;
            clean += kept as u64;
            !kept
        });
        if !to_file.is_empty() {
            let addrs: Vec<(usize, usize, u64)> = to_file
                .iter()
                .map(|&(p, s, h)| (p, self.ring.addr(s), h))
                .collect();
            let written = if self.file.usable() {
                self.write_to_file(&addrs)
            } else {
                0
            };
            if written < to_file.len() {
                self.keep_in_dram(&to_file[written..], &mut failed);
                if pooled == 0 {
                    if let Some(c) = &self.compressed {
                        c.futile.store(true, Ordering::Relaxed);
                    }
                }
            }
        }
        // Publish: written and clean pages are evicted; zero pages drop their tier copy.
        for &p in &gone {
            self.forget_copy(p);
        }
        let mut left = 0u64;
        for &(p, s) in writing.iter() {
            if failed.iter().any(|&(q, _)| q == p) {
                // Tier 1 would not take it: put it back where the program can reach it.
                self.unstage(
                    p,
                    s,
                    self.pt.load(p),
                    "putting back a page tier 1 refused failed",
                );
                self.pt.set_stage(p, NONE);
                self.pt.unprove(p);
                self.pt.publish(p, State::Mapped, None);
                continue;
            }
            self.pt.set_stage(p, NONE);
            let to = if gone.contains(&p) {
                State::Unpopulated
            } else {
                State::Evicted
            };
            self.pt.publish(p, to, None);
            left += 1;
        }
        Retired {
            left,
            clean,
            zero,
            failed,
        }
    }

    /// Writes pages (each ours: page, address of its bytes, hash) to runs of consecutive
    /// slots of the file, all runs at once; each page written has its copy there (an older
    /// copy, in the file or the pool, is freed). Returns how many pages from the first on were
    /// written: on a write error none (the file is marked failed: eviction to it stops), when
    /// the file is full those that found slots (it is marked full until it has room).
    pub(super) fn write_to_file(&self, pages: &[(usize, usize, u64)]) -> usize {
        // Slots first: as many runs as it takes.
        let mut runs: Vec<(u64, usize, usize)> = Vec::new();
        let mut k = 0;
        let mut full = false;
        {
            let mut slots = self.file.slots();
            while k < pages.len() {
                match slots.alloc_run((pages.len() - k) as u64, |n| {
                    self.file.backend.grow(n).is_ok()
                }) {
                    Some((first, n)) => {
                        runs.push((first, k, n as usize));
                        k += n as usize;
                    }
                    None => {
                        full = true;
                        break;
                    }
                }
            }
        }
        let written = k;
        let addrs: Vec<usize> = pages[..written].iter().map(|&(_, a, _)| a).collect();
        let io: Vec<(u64, &[usize])> = runs
            .iter()
            .map(|&(first, start, n)| (first, &addrs[start..start + n]))
            .collect();
        let res = if io.is_empty() {
            Ok(())
        } else {
            // SAFETY: every address is a mapped page whose page is ours (Writing or Busy).
            unsafe { self.file.backend.write_runs(&io) }
        };
        if let Err(e) = res {
            Counters::bump(&self.counters.tier_errors);
            {
                let mut slots = self.file.slots();
                for &(first, _, n) in &runs {
                    for j in 0..n as u64 {
                        slots.free(first + j);
                    }
                }
            }
            self.warn(format!(
                "writing to tier 1 failed ({e}); keeping further pages in DRAM"
            ));
            self.file.failed.store(true, Ordering::Release);
            return 0;
        }
        Counters::add(
            &self.counters.tier_write_bytes,
            (written * PAGE_SIZE) as u64,
        );
        Counters::add(&self.counters.tier_write_ops, runs.len() as u64);
        for &(first, start, n) in &runs {
            for (j, &(p, _, h)) in pages[start..start + n].iter().enumerate() {
                self.forget_copy(p);
                self.pt.set_copy(p, Some(TierCopy::File(first + j as u64)));
                self.pt.set_hash(p, h);
            }
        }
        if full {
            self.warn(format!(
                "tier 1 is full or cannot grow ({}); keeping further pages in DRAM until it has room",
                self.file.backend.describe()
            ));
            self.file.full.store(true, Ordering::Release);
            // Tier copies of pages also in DRAM can make room for more evictions.
            self.file.reclaim.store(true, Ordering::Release);
        }
        written
    }

    /// Tier 1 cannot take `rest`: they go back to the program, and faulting threads are let
    /// through above the quota instead of waiting for eviction.
    fn keep_in_dram(&self, rest: &[(usize, u32, u64)], failed: &mut Vec<(usize, u32)>) {
        self.quota.set_overcommit(true);
        failed.extend(rest.iter().map(|&(p, s, _)| (p, s)));
        self.quota.wake_waiters();
    }
}

/// What [`Engine::retire`] did with a batch.
pub(super) struct Retired {
    /// Pages that left DRAM.
    pub(super) left: u64,
    /// Of those, pages equal to their tier copy (no write) and all-zero pages (dropped).
    pub(super) clean: u64,
    pub(super) zero: u64,
    /// Pages tier 1 would not take, mapped again, with their slots.
    pub(super) failed: Vec<(usize, u32)>,
}

/// The page table as the policy's sweep sees it: mapped, unpinned pages the program has not
/// protected are candidates; taking one claims it (`Busy`) for the move to staging.
struct Candidates<'a> {
    engine: &'a Engine,
    extent: usize,
    victims: &'a mut Vec<usize>,
    /// The pages whose writes were last read, ahead of the hand.
    scanned: &'a mut Written,
}

impl SweepPages for Candidates<'_> {
    fn extent(&self) -> usize {
        self.extent
    }

    fn candidate(&mut self, i: usize) -> Option<Activeness> {
        if !self.scanned.pages.contains(&i) || i < self.scanned.last {
            self.scanned.read(self.engine, i, self.extent);
        }
        self.scanned.last = i;
        if self.scanned.was_written(i) {
            // Found in use without a test: it keeps its place on this pass.
            return None;
        }
        let w = self.engine.pt.load(i);
        (w.state() == State::Mapped && w.pins() == 0 && !w.protected()).then(|| w.history())
    }

    fn proven(&self, i: usize) -> u8 {
        self.engine.pt.load(i).proven()
    }

    fn take(&mut self, i: usize) -> bool {
        let claimed = self.engine.pt.claim(i, State::Mapped, true).is_some();
        if claimed {
            self.victims.push(i);
        }
        claimed
    }
}

/// Pages whose writes the sweep reads at a time, just ahead of its hand (2 MiB).
const WRITE_SCAN_PAGES: usize = 512;
/// Times a pass of the hand reads each page's writes: at the hand and evenly ahead of it.
const WRITE_LOOKS: usize = 4;

/// Pages a fault stages at most for the evictor ([`Engine::stage_for_fault`]): one page in
/// per fault is the steady state; more lets faults catch up after a write-back batch without
/// making any one fault wait long.
const FAULT_STAGE_MAX: u64 = 8;

/// Pages a fault's sweep looks at most: two windows of written pages.
const FAULT_SCAN_MAX: usize = 2 * WRITE_SCAN_PAGES;

/// Pages a fault staging for the evictor found gone (zapped behind memtide's back, so that
/// they cannot be unmapped): each stays `Busy` here until the evictor, which may take the
/// locks that freeing its copy below DRAM needs, finishes with it
/// ([`Engine::adopt_orphans`]). Only a fault holding the staging lock leaves pages here;
/// the evictor (or `pause_evictor`) takes them, which only makes room, so the room a fault
/// counts under the lock is there when it leaves one.
pub(super) struct Orphans {
    /// Each `page + 1`, or 0.
    pages: [std::sync::atomic::AtomicU32; FAULT_STAGE_MAX as usize],
}

impl Orphans {
    pub(super) fn new() -> Orphans {
        Orphans {
            pages: std::array::from_fn(|_| std::sync::atomic::AtomicU32::new(0)),
        }
    }

    /// Free places.
    fn room(&self) -> usize {
        self.pages
            .iter()
            .filter(|e| e.load(Ordering::Acquire) == 0)
            .count()
    }

    /// Leaves page `p` (claimed `Busy`) for the evictor; the caller counted the room.
    fn leave(&self, p: usize) {
        let left = self.pages.iter().any(|e| {
            e.compare_exchange(0, p as u32 + 1, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        });
        assert!(left, "no room for a page a fault could not stage");
    }

    /// A page left here, if any.
    fn take(&self) -> Option<usize> {
        self.pages
            .iter()
            .find_map(|e| match e.swap(0, Ordering::AcqRel) {
                0 => None,
                v => Some(v as usize - 1),
            })
    }
}

/// How far short of its target the inactive list runs before the evictor fills it itself,
/// where faults stage pages for it: the faults of a program that keeps faulting fill it,
/// without a TLB flush on another CPU.
const FAULT_STAGE_SLACK_BATCHES: u64 = 2;

/// Whoever moves pages into the staging ring holds this ([`Engine::staging`]): the ring's
/// head moves only under it. The evictor takes it for each round of staging; a fault only
/// tries it.
pub(super) struct Staging {
    /// Which pages of a batch moved (scratch for [`Engine::stage`]).
    moved: Vec<bool>,
    /// The CLOCK sweep's state (`None` under placement), shared by the evictor and the faults
    /// that stage for it.
    hand: Option<Hand>,
}

impl Staging {
    /// Scratch for batches of up to [`STAGE_CAPACITY`] pages without allocating, and the
    /// sweep's hand when the policy is the CLOCK sweep.
    pub(super) fn new(sweep: bool) -> Staging {
        Staging {
            moved: Vec::with_capacity(STAGE_CAPACITY),
            hand: sweep.then(Hand::new),
        }
    }

    /// The scratch [`Engine::stage`] needs, for callers that picked their own victims.
    pub(super) fn moved(&mut self) -> &mut Vec<bool> {
        &mut self.moved
    }
}

/// The largest batch a sweep stages in one call.
const STAGE_CAPACITY: usize = {
    let a = (Watermarks::MAX_BATCH * 4) as usize;
    let b = active::SAMPLE as usize;
    if a > b {
        a
    } else {
        b
    }
};

/// The CLOCK sweep's state: the hand, and the pages it picks.
pub(super) struct Hand {
    sweep: Sweep,
    victims: Vec<usize>,
    /// The pages whose writes were last read, just ahead of the hand.
    scanned: Written,
}

impl Hand {
    fn new() -> Hand {
        Hand {
            sweep: Sweep::default(),
            victims: Vec::with_capacity(STAGE_CAPACITY),
            scanned: Written::new(),
        }
    }
}

/// The CLOCK sweep as the evictor drives it; its state is in [`Engine::staging`].
pub(super) struct Sweeping;

/// Which pages at the sweep's hand the program wrote lately (where the kernel tracks writes,
/// [`Uffd::tracks_writes`]). A written page was in use: it keeps its place in DRAM without
/// being unmapped to prove it, and counts as found in use, as a hint fault would.
///
/// Reading a page's writes also write-protects it again, so a read tells of the writes since
/// the one before. The hand reads the pages it is about to pass, and half a pass ahead of
/// itself it reads them once more: a page written then and again before the hand arrives is
/// in use. Writes count only from a read that found the page mapped: the access that brought
/// a page in may have been a write and its only one (a program filling memory), so a page
/// that came in since is tested as before.
struct Written {
    pages: std::ops::Range<usize>,
    bits: [u64; WRITE_SCAN_PAGES / 64],
    /// The page the hand asked about last: one before it means the hand went round, and the
    /// window is read again (it may be all there is).
    last: usize,
}

impl Written {
    fn new() -> Written {
        Written {
            pages: 0..0,
            bits: [0; WRITE_SCAN_PAGES / 64],
            last: 0,
        }
    }

    /// Reads the writes of the pages from `at` on (at most [`WRITE_SCAN_PAGES`]), which the
    /// hand passes next, and of those a quarter, a half and three quarters of `extent` ahead.
    fn read(&mut self, engine: &Engine, at: usize, extent: usize) {
        let pages = at..(at + WRITE_SCAN_PAGES).min(extent);
        self.pages = pages.clone();
        self.bits = [0; WRITE_SCAN_PAGES / 64];
        if !engine.uffd.tracks_writes() || pages.is_empty() {
            return;
        }
        let bits = &mut self.bits;
        let mut seen = 0u64;
        Self::look(engine, pages.clone(), |p, written| {
            let w = engine.pt.load(p);
            let in_use = (written && w.swept()) || w.wrote();
            if engine.pt.sweep_read(p, false, in_use) && in_use {
                let k = p - pages.start;
                bits[k / 64] |= 1 << (k % 64);
                seen += 1;
            }
        });
        for j in 1..WRITE_LOOKS {
            let ahead = (at + extent / WRITE_LOOKS * j) % extent;
            Self::look(
                engine,
                ahead..(ahead + WRITE_SCAN_PAGES).min(extent),
                |p, written| {
                    let w = engine.pt.load(p);
                    engine
                        .pt
                        .sweep_read(p, w.wrote() || (written && w.swept()), false);
                },
            );
        }
        Counters::add(&engine.counters.pages_seen_written, seen);
    }

    /// Reads (and resets) the writes of `pages`: calls `f(page, written)` for each mapped one.
    fn look(engine: &Engine, pages: std::ops::Range<usize>, mut f: impl FnMut(usize, bool)) {
        let mut written = [0u64; WRITE_SCAN_PAGES / 64];
        let base = engine.addr_of(pages.start);
        let scan = engine
            .pagemap
            .written(base, engine.addr_of(pages.end), |a, b| {
                for k in (a - base) / PAGE_SIZE..(b - base) / PAGE_SIZE {
                    written[k / 64] |= 1 << (k % 64);
                }
            });
        if scan.is_err() {
            // Nothing is known of these pages' writes: the sweep tests them as before.
            return;
        }
        for (k, p) in pages.enumerate() {
            if engine.pt.load(p).state() == State::Mapped {
                f(p, written[k / 64] >> (k % 64) & 1 == 1);
            }
        }
    }

    fn was_written(&self, p: usize) -> bool {
        let k = p.wrapping_sub(self.pages.start);
        self.pages.contains(&p) && self.bits[k / 64] >> (k % 64) & 1 == 1
    }
}

impl Evictor for Sweeping {
    /// The policy crate's pressure relief ([`Watermarks::relieve`]) over the page table: the
    /// sweep fills the inactive list, the list's oldest pages are written back.
    fn relieve(
        &mut self,
        engine: &Engine,
        writing: &mut Vec<(usize, u32)>,
        _new_epoch: bool,
    ) -> Relief {
        engine.quota.wm().relieve(&mut Pressure {
            engine,
            writing,
            left_to_faults: 0,
        })
    }
}

/// The engine as the policy's pressure relief drives it.
struct Pressure<'a> {
    engine: &'a Engine,
    writing: &'a mut Vec<(usize, u32)>,
    /// Pages this round left to the faults to stage.
    left_to_faults: u64,
}

impl Relieve for Pressure<'_> {
    fn resident(&self) -> u64 {
        self.engine.quota.held()
    }

    fn inactive(&self) -> u64 {
        self.engine.ring.staged.load(Ordering::Acquire)
    }

    fn deactivate(&mut self, want: u64) -> u64 {
        let e = self.engine;
        // Where faults stage for the evictor, they keep the list filled while the program
        // faults; the evictor fills it only when they fall well behind (or do not fault).
        let wm = e.quota.wm();
        if e.stage_in_faults
            && want <= FAULT_STAGE_SLACK_BATCHES * wm.batch
            && self.inactive() >= wm.batch
        {
            self.left_to_faults = want;
            return 0;
        }
        self.left_to_faults = 0;
        e.deactivate(want, &mut e.staging())
    }

    fn write_back(&mut self, batch: u64) -> u64 {
        let e = self.engine;
        // Pages faults left to the evictor are finished with each round: a fault or a free
        // may be waiting on one.
        e.adopt_orphans();
        let out = e.write_back(batch, self.writing);
        let left = std::mem::take(&mut self.left_to_faults);
        if out == 0 && left > 0 {
            // Nothing at the tail could be written (pages taken back, or in flight): stage
            // after all, rather than report no progress and let faults past the quota.
            return e.deactivate(left, &mut e.staging());
        }
        out
    }

    fn stopped(&self) -> bool {
        !self.engine.tier_usable() || self.engine.pause.load(Ordering::Acquire)
    }

    fn made_room(&mut self) {
        self.engine.quota.set_overcommit(false);
        self.engine.quota.wake_waiters();
    }
}
