//! Fork: the parent and the child both stay tiered. Entry points: [`Engine::fork_prepare`],
//! [`Engine::fork_parent`] and [`Engine::fork_child`] (the preload library's `pthread_atfork`
//! handlers).
//!
//! # What happens at a fork
//!
//! With userfaultfd's fork events (handler threads, and CAP_SYS_PTRACE, which the kernel asks
//! for them), the child keeps the parent's registered memory and gets a userfaultfd of its
//! own, which the kernel hands to whoever reads the parent's: a handler thread, which passes it
//! to the child over a socket. The child's engine is the parent's, copied by the fork: its page
//! table, staging ring, compressed pool and books, as they were at the fork. The child makes
//! what cannot be shared afresh (its handler threads and evictor, io_uring rings, its pagemap
//! reader) and goes on tiering on its own.
//!
//! What is shared, and how it is given back:
//!
//! - **Pages in DRAM** are shared copy-on-write by the kernel, as any memory at a fork. A write
//!   in either process gives it its own copy. A page still shared cannot be moved
//!   (`UFFDIO_MOVE` takes only a page the process holds alone), so eviction and reactivation
//!   first break the sharing ([`crate::uffd`]): the moving process gets its own copy, the
//!   other keeps the original.
//! - **Pages in the compressed pool** are in the engine's private memory: each process has the
//!   pool as it was at the fork, shared copy-on-write by the kernel too.
//! - **Pages in tier 1** are one slot of one file, held by both processes: a slot's holders
//!   are a word of bits in memory shared by the process tree ([`crate::tier::SlotMap`]), the
//!   parent adds the child's bit to every slot it holds before the fork, and a slot is free
//!   again when the last holder lets it go (it faults the page in and changes it, frees it,
//!   or exits).
//!
//! # Members, and a member that dies
//!
//! Each process is a member of its run's group (`group.rs`), by a number that is also its bit
//! in the slots' holder words. A member that exits, is killed or calls `exec` is found dead by
//! the others, and one of its family lets go of every slot it held.
//!
//! # Quiet at the fork
//!
//! The child must find the engine's books consistent: no page half-way through a fault, a
//! move or a write-back. Before the fork, the gate ([`Gate`]) is closed, so no thread enters
//! the engine (program threads wait; handler threads keep their faults for later, and keep
//! reading the userfaultfd, where the fork's event arrives); the threads inside finish; then the
//! evictor parks. After the fork, both processes open the gate again.
//!
//! Where fork events are not available (faults delivered as SIGBUS, no CAP_SYS_PTRACE, every
//! member number taken), the fallback stays: the parent brings its pages back into DRAM and
//! stops tiering ([`Engine::detach_for_fork`]), and says why.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};

use super::fatal::fatal;
use super::Engine;
use crate::pages::State;
use crate::sys;

thread_local! {
    /// How deep this thread is inside the engine (a nested entry never waits at the gate).
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// The engine's door: threads inside are counted, and a fork closes it and waits for the
/// count to reach zero.
pub(super) struct Gate {
    closed: AtomicBool,
    inside: AtomicUsize,
}

/// A thread inside the engine (see [`Gate::enter`]).
pub(super) struct Inside<'a>(&'a Gate);

impl Drop for Inside<'_> {
    fn drop(&mut self) {
        DEPTH.with(|d| d.set(d.get() - 1));
        self.0.inside.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Gate {
    pub(super) fn new() -> Gate {
        Gate {
            closed: AtomicBool::new(false),
            inside: AtomicUsize::new(0),
        }
    }

    /// Enters, or `None` while a fork has the gate closed (and this thread is not already
    /// inside).
    pub(super) fn try_enter(&self) -> Option<Inside<'_>> {
        let nested = DEPTH.with(|d| d.get()) > 0;
        self.inside.fetch_add(1, Ordering::SeqCst);
        if !nested && self.closed.load(Ordering::SeqCst) {
            self.inside.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        DEPTH.with(|d| d.set(d.get() + 1));
        Some(Inside(self))
    }

    /// Enters, waiting while a fork has the gate closed.
    pub(super) fn enter(&self) -> Inside<'_> {
        loop {
            if let Some(i) = self.try_enter() {
                return i;
            }
            while self.closed.load(Ordering::SeqCst) {
                std::thread::yield_now();
            }
        }
    }

    /// Closes the gate and waits until no thread is inside. The closing thread itself may
    /// still enter (as if inside): a fork handler of another library, run between this and
    /// the fork, may allocate or free managed memory.
    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        while self.inside.load(Ordering::SeqCst) != 0 {
            std::thread::yield_now();
        }
        DEPTH.with(|d| d.set(d.get() + 1));
    }

    /// Opens the gate (in the thread that closed it; in a forked child, its only thread).
    fn open(&self) {
        DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
        self.closed.store(false, Ordering::SeqCst);
    }
}

/// What [`Engine::fork_prepare`] decided, for the handlers after the fork.
pub enum ForkPlan {
    /// The engine is not tiering (or the fork was not seen in time): nothing to do.
    Nothing,
    /// The fallback ran: the parent's memory is all in DRAM, not registered.
    Detached,
    /// Both processes stay tiered: the child is member `member`, and receives its userfaultfd
    /// on `child_end` of a socket pair whose other end a handler thread sends on.
    Tiered {
        member: u32,
        parent_end: i32,
        child_end: i32,
    },
}

/// The descriptor of the socket a handler thread sends a fork's userfaultfd on (-1: no fork
/// expected; the descriptor of an unexpected one is closed).
pub(super) struct ForkLink {
    sock: AtomicI32,
}

impl ForkLink {
    pub(super) fn new() -> ForkLink {
        ForkLink {
            sock: AtomicI32::new(-1),
        }
    }
}

/// Closes one of memtide's descriptors (lifted high), forgetting it first.
fn close_ours(fd: i32) {
    crate::fds::forget(fd);
    // SAFETY: closing a descriptor of ours.
    unsafe { libc::close(fd) };
}

impl Engine {
    /// Called by a handler thread that read a fork event: passes the child's userfaultfd to
    /// the child (or closes it, when the fork was not made through `fork_prepare`: then the
    /// child's registrations go with it, and its memory reads as the kernel leaves it).
    pub(super) fn forked(&self, fd: i32) {
        let sock = self.fork_link.sock.load(Ordering::Acquire);
        if sock >= 0 {
            if let Err(e) = sys::send_fd(sock, fd) {
                // The child, waiting for it, reads the end of the stream and stops; the
                // parent then hears nothing from it and lets its slots go.
                // SAFETY: shutting down our own socket.
                unsafe { libc::shutdown(sock, libc::SHUT_RDWR) };
                self.warn(format!(
                    "passing a forked child its userfaultfd failed ({e}); the child stops"
                ));
            }
        }
        // SAFETY: the descriptor the kernel installed for us.
        unsafe { libc::close(fd) };
    }

    /// Before `fork` (the preload library's `pthread_atfork` prepare handler, which runs after
    /// every other prepare handler of the program): readies the engine for the child to
    /// copy. Nothing may enter the engine from here until [`fork_parent`](Self::fork_parent) or
    /// [`fork_child`](Self::fork_child).
    pub fn fork_prepare(&'static self) -> ForkPlan {
        if self.in_child() || self.is_detached() {
            return ForkPlan::Nothing;
        }
        if !self.uffd.fork_events() {
            if self.managed_pages() > 0 {
                self.detach_for_fork(if self.uffd.delivery() == crate::uffd::Delivery::Signal {
                    "faults are delivered as signals (--faults signal)"
                } else {
                    "the kernel does not report forks to memtide here (userfaultfd's fork events need CAP_SYS_PTRACE)"
                });
                return ForkPlan::Detached;
            }
            return ForkPlan::Nothing;
        }
        let family = self.file.slots().shared().family();
        let Some(member) = self.group.reserve(family, 0) else {
            self.detach_for_fork("every one of memtide's member numbers for a run is taken (64 processes with an engine at once)");
            return ForkPlan::Detached;
        };
        let (parent_end, child_end) = match sys::socket_pair() {
            // High, as memtide's other descriptors, out of the program's way.
            Ok((a, b)) => (crate::fds::lift_raw(a), crate::fds::lift_raw(b)),
            Err(e) => {
                self.group.unreserve(member);
                self.detach_for_fork(&format!("a socket for the child could not be made ({e})"));
                return ForkPlan::Detached;
            }
        };
        // Quiet: no thread inside the engine, the evictor parked.
        self.gate.close();
        self.pause_evictor();
        // The child holds every slot this process holds.
        let hw = self.high_water.load(Ordering::Acquire);
        self.file
            .slots()
            .share(member, (0..hw).filter_map(|i| self.pt.slot(i)));
        self.fork_link.sock.store(parent_end, Ordering::Release);
        ForkPlan::Tiered {
            member,
            parent_end,
            child_end,
        }
    }

    /// After `fork`, in the parent (also when the fork failed): the engine runs again; once
    /// the child says it runs its engine (or is gone), the socket is closed.
    pub fn fork_parent(&'static self, plan: ForkPlan) {
        let ForkPlan::Tiered {
            member,
            parent_end,
            child_end,
        } = plan
        else {
            return;
        };
        close_ours(child_end);
        self.gate.open();
        self.resume_evictor();
        // The child answers once its engine runs; a failed fork (no child) or a child that died
        // first closes the socket without a word.
        let ok = sys::recv_byte(parent_end).is_ok_and(|b| b == Some(1));
        self.fork_link.sock.store(-1, Ordering::Release);
        close_ours(parent_end);
        if !ok {
            // No child (the fork failed), or it died before its engine ran. A child that died
            // after its evictor took its number is the reaper's, as any dead member.
            if self.group.claim_reserved(member) {
                self.file.slots().forget_member(member);
                self.group.unreserve(member);
            }
        } else {
            crate::stats::Counters::bump(&self.counters.forks);
        }
    }

    /// After `fork`, in the child: takes the child's userfaultfd from the parent and starts
    /// this process's engine (handler threads, evictor) on the books the fork copied.
    pub fn fork_child(&'static self, plan: ForkPlan) {
        let ForkPlan::Tiered {
            member,
            parent_end,
            child_end,
        } = plan
        else {
            return;
        };
        close_ours(parent_end);
        let fd = match sys::recv_fd(child_end) {
            Ok(fd) => fd,
            Err(e) => fatal("receiving this forked process's userfaultfd failed", &e),
        };
        if let Err(e) = self.uffd.adopt(fd) {
            fatal("taking this forked process's userfaultfd failed", &e);
        }
        self.pid.store(std::process::id(), Ordering::Release);
        // SAFETY: getppid has no preconditions.
        self.forked_from
            .store(unsafe { libc::getppid() } as u32, Ordering::Release);
        if let Err(e) = self.pagemap.reopen() {
            fatal("opening this forked process's pagemap failed", &e);
        }
        self.file.backend.forked();
        self.counters.forked();
        if let Some(c) = &self.compressed {
            c.forked();
        }
        // Its peak DRAM starts at what it holds at the fork (not the parent's peak before it).
        self.counters
            .peak_resident_pages
            .store(self.quota.held(), Ordering::Relaxed);
        self.file.slots().become_member(member);
        // Pins were held by the parent's threads, which are not here; so were any waits.
        let hw = self.high_water.load(Ordering::Acquire);
        for i in 0..hw {
            if self.pt.load(i).state() != State::Free {
                self.pt.clear_pins(i);
            }
        }
        // Memory locks are not inherited: lock what the parent had locked (a move takes pages
        // only between ranges locked alike).
        if self.locked.load(Ordering::Acquire) {
            for (a, l) in [
                (self.arena.addr(), self.arena.len()),
                (self.ring.area().addr(), self.ring.area().len()),
            ] {
                if let Err(e) = sys::lock_on_fault(a, l) {
                    fatal("locking this forked process's managed memory failed", &e);
                }
            }
        }
        self.handler_tids
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        self.evictor_tid.store(0, Ordering::Relaxed);
        self.fork_link.sock.store(-1, Ordering::Release);
        self.member.store(member, Ordering::Release);
        self.parked.store(false, Ordering::Release);
        self.pause.store(false, Ordering::Release);
        if let Err(e) = self.start_threads() {
            fatal("starting this forked process's engine threads failed", &e);
        }
        // The evictor holds the member's mutex before the parent hears from us.
        while !self.group.is_live(member) {
            std::thread::yield_now();
        }
        let _ = sys::send_byte(child_end, 1);
        close_ours(child_end);
        self.gate.open();
    }

    /// Lets go of the slots of members whose process is gone (the evictor, every epoch).
    pub(super) fn reap_members(&self) {
        let family = self.file.slots().shared().family();
        self.group
            .reap(self.member.load(Ordering::Acquire), family, |m| {
                self.file.slots().forget_member(m);
            });
    }

    /// The run's quota, split (the evictor, every round): this member publishes the DRAM it
    /// holds, and its own quota is what it holds plus an even part of what is free (or, when
    /// the run is over its quota, what it holds less its part of the excess, in proportion),
    /// at least half an even share. The shares add up to the run's quota, so the run holds
    /// within it as one process would (up to a round's change); a page shared copy-on-write is
    /// counted by each process holding it, so the run errs towards less DRAM. Alone, a process
    /// has the whole quota.
    pub(super) fn share_quota(&self) {
        let me = self.member.load(Ordering::Acquire);
        let held = self.quota.held();
        self.group.set_held(me, held);
        let budget = self.group.budget();
        let members = self.group.live();
        let q = if members == 1 {
            budget
        } else {
            // What is free is split evenly among the members; what is over is taken from
            // each in proportion to what it holds. The shares add up to the quota.
            let total = held + self.group.held_by_others(me);
            let share = if total <= budget {
                held + (budget - total) / members
            } else {
                (held as u128 * budget as u128 / total as u128) as u64
            };
            share.max(budget / (2 * members))
        };
        let now = self.quota.wm().quota;
        // Small changes wait: each costs the pool a resize and the waiters a wake-up.
        if q != now && (members == 1 || q.abs_diff(now) > budget / 64) {
            self.apply_quota(q);
        }
    }

    /// The evictor's first step: this process is a live member from now on.
    pub(super) fn hold_member(&self) {
        self.group.hold(self.member.load(Ordering::Acquire));
    }
}
