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
//! Each process of the tree is a member (a number below [`MEMBERS`]) with a robust,
//! process-shared mutex that its evictor thread holds for as long as the process lives. When
//! the process exits, is killed or calls `exec`, the kernel marks the mutex's owner dead; the
//! next member to look (each evictor looks every epoch) takes it, lets go of every slot the dead
//! member held and frees its number.
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

use std::cell::{Cell, UnsafeCell};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicUsize, Ordering};

use super::fatal::fatal;
use super::Engine;
use crate::pages::State;
use crate::sys::{self, Mapping};
use crate::tier::MEMBERS;

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

    /// Closes the gate and waits until no thread is inside.
    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        while self.inside.load(Ordering::SeqCst) != 0 {
            std::thread::yield_now();
        }
    }

    fn open(&self) {
        self.closed.store(false, Ordering::SeqCst);
    }
}

/// Processes of one tree that hold slots of its file at once (see `tier::slots`).
const FREE: u32 = 0;
/// A parent took the number for a child it is forking.
const RESERVED: u32 = 1;
/// The member's evictor holds its mutex.
const LIVE: u32 = 2;

#[repr(C)]
struct Member {
    state: AtomicU32,
    pid: AtomicU32,
    lock: UnsafeCell<libc::pthread_mutex_t>,
}

/// The members of the process tree, in memory shared across fork.
pub(super) struct Tree {
    map: Mapping,
}

// SAFETY: the mutexes are process-shared pthread mutexes, made for concurrent use.
unsafe impl Sync for Tree {}
// SAFETY: as above; the mapping is plain memory.
unsafe impl Send for Tree {}

impl Tree {
    /// The tree of a process that started the engine: it is member 0.
    pub(super) fn new() -> io::Result<Tree> {
        let t = Tree {
            map: Mapping::shared_anon(MEMBERS as usize * std::mem::size_of::<Member>())?,
        };
        // SAFETY: initializing each mutex, in memory of ours, as robust and process-shared.
        unsafe {
            let mut attr: libc::pthread_mutexattr_t = std::mem::zeroed();
            libc::pthread_mutexattr_init(&mut attr);
            libc::pthread_mutexattr_setpshared(&mut attr, libc::PTHREAD_PROCESS_SHARED);
            libc::pthread_mutexattr_setrobust(&mut attr, libc::PTHREAD_MUTEX_ROBUST);
            for m in 0..MEMBERS {
                let r = libc::pthread_mutex_init(t.member(m).lock.get(), &attr);
                if r != 0 {
                    return Err(io::Error::from_raw_os_error(r));
                }
            }
            libc::pthread_mutexattr_destroy(&mut attr);
        }
        t.member(0).state.store(RESERVED, Ordering::Release);
        t.member(0).pid.store(std::process::id(), Ordering::Release);
        Ok(t)
    }

    fn member(&self, m: u32) -> &Member {
        // SAFETY: the mapping holds MEMBERS members, zero-initialized then initialized in new.
        unsafe { &*(self.map.addr() as *const Member).add(m as usize) }
    }

    /// Takes a free number for a child about to be forked.
    fn reserve(&self, pid: u32) -> Option<u32> {
        (0..MEMBERS).find(|&m| {
            let ok = self
                .member(m)
                .state
                .compare_exchange(FREE, RESERVED, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok();
            if ok {
                self.member(m).pid.store(pid, Ordering::Release);
            }
            ok
        })
    }

    /// The calling thread (the member's evictor, which lives as long as the process) holds
    /// member `m`'s mutex from now on: the member is live.
    pub(super) fn hold(&self, m: u32) {
        let mb = self.member(m);
        // SAFETY: a robust process-shared mutex initialized in `new`.
        let r = unsafe { libc::pthread_mutex_lock(mb.lock.get()) };
        if r == libc::EOWNERDEAD {
            // The number's previous holder died and was not reaped yet; its slots were let go
            // when the number was given out again (see `reap`), so the mutex is just taken over.
            // SAFETY: we own the mutex now.
            unsafe { libc::pthread_mutex_consistent(mb.lock.get()) };
        }
        mb.pid.store(std::process::id(), Ordering::Release);
        mb.state.store(LIVE, Ordering::Release);
    }

    /// Live members whose process is gone: their numbers, each taken (its mutex held by the
    /// caller until [`release`](Self::release)).
    fn dead(&self, me: u32, out: &mut Vec<u32>) {
        for m in 0..MEMBERS {
            if m == me || self.member(m).state.load(Ordering::Acquire) != LIVE {
                continue;
            }
            // SAFETY: a robust process-shared mutex initialized in `new`.
            let r = unsafe { libc::pthread_mutex_trylock(self.member(m).lock.get()) };
            match r {
                libc::EOWNERDEAD => out.push(m),
                0 => {
                    // Live but not held: its evictor is between taking the number and
                    // holding it. Leave it.
                    // SAFETY: we hold it.
                    unsafe { libc::pthread_mutex_unlock(self.member(m).lock.get()) };
                }
                _ => {}
            }
        }
    }

    /// Frees number `m` after its slots were let go; `held` says whether the caller holds its
    /// mutex (taken from a dead owner).
    fn release(&self, m: u32, held: bool) {
        let mb = self.member(m);
        if held {
            // SAFETY: we hold the mutex, taken with EOWNERDEAD.
            unsafe {
                libc::pthread_mutex_consistent(mb.lock.get());
                libc::pthread_mutex_unlock(mb.lock.get());
            }
        }
        mb.pid.store(0, Ordering::Release);
        mb.state.store(FREE, Ordering::Release);
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

impl Engine {
    /// Called by a handler thread that read a fork event: passes the child's userfaultfd to
    /// the child (or closes it, when the fork was not made through `fork_prepare`: then the
    /// child's registrations go with it, and its memory reads as the kernel leaves it).
    pub(super) fn forked(&self, fd: i32) {
        let sock = self.fork_link.sock.load(Ordering::Acquire);
        if sock >= 0 {
            if let Err(e) = sys::send_fd(sock, fd) {
                self.warn(format!(
                    "passing the forked child its userfaultfd failed ({e}); the child will stop"
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
        let Some(member) = self.tree.reserve(0) else {
            self.detach_for_fork("every one of memtide's member numbers for a process tree is taken (64 processes at once)");
            return ForkPlan::Detached;
        };
        let (parent_end, child_end) = match sys::socket_pair() {
            Ok(p) => p,
            Err(e) => {
                self.tree.release(member, false);
                self.detach_for_fork(&format!("a socket for the child could not be made ({e})"));
                return ForkPlan::Detached;
            }
        };
        // Quiet: no thread inside the engine, the evictor parked.
        self.gate.close();
        self.pause_evictor();
        // The child holds every slot this process holds.
        let hw = self.high_water.load(Ordering::Acquire);
        let slots = self.file.slots();
        slots.share(member, (0..hw).filter_map(|i| self.pt.slot(i)));
        slots.shared().members().fetch_add(1, Ordering::AcqRel);
        drop(slots);
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
        // SAFETY: our end for the child; the child has its own copy.
        unsafe { libc::close(child_end) };
        self.gate.open();
        self.resume_evictor();
        // The child answers once its engine runs; a failed fork (no child) or a child that died
        // first closes the socket without a word.
        let ok = sys::recv_byte(parent_end).is_ok_and(|b| b == Some(1));
        self.fork_link.sock.store(-1, Ordering::Release);
        // SAFETY: our socket.
        unsafe { libc::close(parent_end) };
        if !ok {
            let slots = self.file.slots();
            slots.forget_member(member);
            slots.shared().members().fetch_sub(1, Ordering::AcqRel);
            drop(slots);
            self.tree.release(member, false);
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
        // SAFETY: the parent's end, which is not ours in the child.
        unsafe { libc::close(parent_end) };
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
        while self.tree.member(member).state.load(Ordering::Acquire) != LIVE {
            std::thread::yield_now();
        }
        let _ = sys::send_byte(child_end, 1);
        // SAFETY: our socket.
        unsafe { libc::close(child_end) };
        self.gate.open();
    }

    /// Lets go of the slots of members whose process is gone (the evictor, every epoch).
    pub(super) fn reap_members(&self) {
        if self.file.slots().shared().members().load(Ordering::Acquire) <= 1 {
            return;
        }
        let mut dead = Vec::new();
        self.tree
            .dead(self.member.load(Ordering::Acquire), &mut dead);
        for m in dead {
            let slots = self.file.slots();
            slots.forget_member(m);
            slots.shared().members().fetch_sub(1, Ordering::AcqRel);
            drop(slots);
            self.tree.release(m, true);
        }
    }

    /// The evictor's first step: this process is a live member from now on.
    pub(super) fn hold_member(&self) {
        self.tree.hold(self.member.load(Ordering::Acquire));
    }
}
