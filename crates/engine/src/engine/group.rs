//! The engines of one run: every process of a program started with `memtide run` that runs an
//! engine (the program, the children it forks, the programs they `exec`) shares one DRAM
//! quota, as a memory cgroup covers a process tree. Entry point: [`Group`].
//!
//! The group lives in a file in the run's statistics directory (`memtide-group.shm`), mapped
//! shared by every engine of the run: a forked child inherits the mapping, a program started
//! with `exec` maps the same file by its path. (An engine started without a statistics
//! directory has a group of its own, in memory shared with the children it forks.) It holds
//! the quota and, per member (at most [`MEMBERS`] at once), its state, the DRAM it holds, the
//! family it belongs to (the processes that share one tier file: a process and the children
//! it forks) and a robust, process-shared mutex.
//!
//! # Members that die
//!
//! A member's evictor thread holds its mutex for as long as the process lives. When the
//! process exits, is killed or calls `exec`, the kernel marks the mutex's owner dead; the next
//! member to look (each evictor looks every epoch) marks it dead and stops counting its DRAM.
//! Its tier slots are then let go by a member of its own family (the only ones that hold slots
//! of the same file), once, under a claim; when no member of its family is left, its number is
//! simply freed.

use std::cell::UnsafeCell;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::sys::Mapping;
use crate::tier::MEMBERS;

/// A number nobody holds.
const FREE: u32 = 0;
/// Taken for a process whose evictor does not hold the mutex yet (a child being forked, an
/// engine starting).
const RESERVED: u32 = 1;
/// The member's evictor holds its mutex.
const LIVE: u32 = 2;
/// The member's process is gone; its slots are still to be let go.
const DEAD: u32 = 3;
/// A member of its family is letting its slots go.
const REAPING: u32 = 4;

/// The group file's head: whether it is ready, and the quota.
#[repr(C)]
struct Head {
    /// 0: new; 1: being set up; 2: ready.
    ready: AtomicU32,
    _pad: u32,
    /// The quota in pages (`--dram`, or a host daemon's share).
    budget: AtomicU64,
}

#[repr(C)]
struct Member {
    state: AtomicU32,
    pid: AtomicU32,
    /// Pages of DRAM the member holds (its evictor publishes it; 0 once dead).
    held: AtomicU64,
    /// The family (the tier file) it belongs to.
    family: AtomicU64,
    lock: UnsafeCell<libc::pthread_mutex_t>,
}

const HEAD: usize = 64;

/// The engines of one run (see the module's documentation).
pub(super) struct Group {
    map: Mapping,
}

// SAFETY: the mutexes are process-shared pthread mutexes, made for concurrent use; the rest
// is atomics.
unsafe impl Sync for Group {}
// SAFETY: as above.
unsafe impl Send for Group {}

impl Group {
    fn len() -> usize {
        HEAD + MEMBERS as usize * std::mem::size_of::<Member>()
    }

    /// The group of the run whose statistics directory holds `file` (created by the first
    /// engine there), or, without one, a group of this process's own; an engine joining it
    /// brings a quota of `budget` pages, which the first one sets.
    pub(super) fn open(file: Option<&Path>, budget: u64) -> io::Result<Group> {
        let map = match file {
            Some(path) => {
                use std::os::unix::ffi::OsStrExt;
                let c = std::ffi::CString::new(path.as_os_str().as_bytes())
                    .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
                // SAFETY: opening a file by a NUL-terminated path.
                let fd = unsafe {
                    libc::open(
                        c.as_ptr(),
                        libc::O_RDWR | libc::O_CREAT | libc::O_CLOEXEC,
                        0o600,
                    )
                };
                if fd < 0 {
                    return Err(io::Error::last_os_error());
                }
                let m = Mapping::shared_file(fd, Group::len());
                // SAFETY: the mapping keeps the file; the descriptor is ours.
                unsafe { libc::close(fd) };
                m?
            }
            None => Mapping::shared_anon(Group::len())?,
        };
        let g = Group { map };
        g.set_up(budget)?;
        Ok(g)
    }

    fn head(&self) -> &Head {
        // SAFETY: the mapping starts with a Head (zero bytes are a valid one).
        unsafe { &*(self.map.addr() as *const Head) }
    }

    fn member(&self, m: u32) -> &Member {
        // SAFETY: the mapping holds MEMBERS members after the head; all-zero bytes are a valid
        // Member, and `set_up` initialized the mutexes before `ready`.
        unsafe { &*((self.map.addr() + HEAD) as *const Member).add(m as usize) }
    }

    /// The first engine initializes the mutexes and the quota; the others wait until it has.
    fn set_up(&self, budget: u64) -> io::Result<()> {
        let h = self.head();
        if h.ready
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            // SAFETY: initializing each mutex, in the shared mapping, as robust and
            // process-shared; nobody uses them before `ready` is 2.
            unsafe {
                let mut attr: libc::pthread_mutexattr_t = std::mem::zeroed();
                libc::pthread_mutexattr_init(&mut attr);
                libc::pthread_mutexattr_setpshared(&mut attr, libc::PTHREAD_PROCESS_SHARED);
                libc::pthread_mutexattr_setrobust(&mut attr, libc::PTHREAD_MUTEX_ROBUST);
                for m in 0..MEMBERS {
                    let r = libc::pthread_mutex_init(self.member(m).lock.get(), &attr);
                    if r != 0 {
                        return Err(io::Error::from_raw_os_error(r));
                    }
                }
                libc::pthread_mutexattr_destroy(&mut attr);
            }
            h.budget.store(budget, Ordering::Release);
            h.ready.store(2, Ordering::Release);
            return Ok(());
        }
        let t0 = crate::sys::now_ns();
        while h.ready.load(Ordering::Acquire) != 2 {
            if crate::sys::now_ns() - t0 > 2_000_000_000 {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the engine setting up the run's group did not finish",
                ));
            }
            std::thread::yield_now();
        }
        Ok(())
    }

    pub(super) fn budget(&self) -> u64 {
        self.head().budget.load(Ordering::Acquire)
    }

    pub(super) fn set_budget(&self, pages: u64) {
        self.head().budget.store(pages, Ordering::Release);
    }

    /// Takes a free number for a process of `family` (this one, starting its engine, or a
    /// child about to be forked).
    pub(super) fn reserve(&self, family: u64, pid: u32) -> Option<u32> {
        (0..MEMBERS).find(|&m| {
            let mb = self.member(m);
            let ok = mb
                .state
                .compare_exchange(FREE, RESERVED, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok();
            if ok {
                mb.family.store(family, Ordering::Release);
                mb.pid.store(pid, Ordering::Release);
                mb.held.store(0, Ordering::Release);
            }
            ok
        })
    }

    /// Takes member `m` for letting go of its slots if it is still only reserved (its
    /// process never held its mutex); false when it is live or dead, and so the reaper's.
    pub(super) fn claim_reserved(&self, m: u32) -> bool {
        self.member(m)
            .state
            .compare_exchange(RESERVED, REAPING, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    }

    /// Gives back a number reserved for a child that never ran its engine.
    pub(super) fn unreserve(&self, m: u32) {
        let mb = self.member(m);
        mb.held.store(0, Ordering::Release);
        mb.pid.store(0, Ordering::Release);
        mb.state.store(FREE, Ordering::Release);
    }

    /// The calling thread (the member's evictor, which lives as long as the process) holds
    /// member `m`'s mutex from now on: the member is live.
    pub(super) fn hold(&self, m: u32) {
        let mb = self.member(m);
        // SAFETY: a robust process-shared mutex initialized in `set_up`.
        let r = unsafe { libc::pthread_mutex_lock(mb.lock.get()) };
        if r == libc::EOWNERDEAD {
            // A previous holder of the number died after it was reaped (its mutex was left
            // marked): the number is ours now.
            // SAFETY: we own the mutex now.
            unsafe { libc::pthread_mutex_consistent(mb.lock.get()) };
        }
        mb.pid.store(std::process::id(), Ordering::Release);
        mb.state.store(LIVE, Ordering::Release);
    }

    /// Whether member `m` is live (its evictor holds its mutex).
    pub(super) fn is_live(&self, m: u32) -> bool {
        self.member(m).state.load(Ordering::Acquire) == LIVE
    }

    /// Member `me` holds `pages` of DRAM.
    pub(super) fn set_held(&self, me: u32, pages: u64) {
        self.member(me).held.store(pages, Ordering::Release);
    }

    /// Live members (at least 1: the caller).
    pub(super) fn live(&self) -> u64 {
        (0..MEMBERS)
            .filter(|&m| self.member(m).state.load(Ordering::Acquire) == LIVE)
            .count()
            .max(1) as u64
    }

    /// Pages of DRAM the members other than `me` hold.
    pub(super) fn held_by_others(&self, me: u32) -> u64 {
        (0..MEMBERS)
            .filter(|&m| {
                m != me
                    && matches!(
                        self.member(m).state.load(Ordering::Acquire),
                        LIVE | RESERVED
                    )
            })
            .map(|m| self.member(m).held.load(Ordering::Acquire))
            .sum()
    }

    /// Looks for members whose process is gone (member `me`, of `family`, every epoch):
    /// marks them dead, and lets go of the slots of dead members of its own family with
    /// `forget` (once each: under a claim); frees the numbers of dead members no member of
    /// whose family is left.
    pub(super) fn reap(&self, me: u32, family: u64, mut forget: impl FnMut(u32)) {
        for m in 0..MEMBERS {
            if m == me {
                continue;
            }
            let mb = self.member(m);
            match mb.state.load(Ordering::Acquire) {
                LIVE => {
                    // SAFETY: a robust process-shared mutex initialized in `set_up`.
                    let r = unsafe { libc::pthread_mutex_trylock(mb.lock.get()) };
                    if r == libc::EOWNERDEAD || r == 0 {
                        // SAFETY: we hold it (EOWNERDEAD: its owner died).
                        unsafe {
                            if r == libc::EOWNERDEAD {
                                libc::pthread_mutex_consistent(mb.lock.get());
                            }
                            libc::pthread_mutex_unlock(mb.lock.get());
                        }
                        if r == libc::EOWNERDEAD {
                            mb.held.store(0, Ordering::Release);
                            let _ = mb.state.compare_exchange(
                                LIVE,
                                DEAD,
                                Ordering::AcqRel,
                                Ordering::Relaxed,
                            );
                        }
                    }
                }
                DEAD => {
                    let f = mb.family.load(Ordering::Acquire);
                    if f == family {
                        if mb
                            .state
                            .compare_exchange(DEAD, REAPING, Ordering::AcqRel, Ordering::Relaxed)
                            .is_ok()
                        {
                            forget(m);
                            mb.pid.store(0, Ordering::Release);
                            mb.state.store(FREE, Ordering::Release);
                        }
                    } else if !(0..MEMBERS).any(|o| {
                        o != m
                            && self.member(o).family.load(Ordering::Acquire) == f
                            && matches!(
                                self.member(o).state.load(Ordering::Acquire),
                                LIVE | RESERVED | REAPING
                            )
                    }) {
                        // Nobody holds slots of its file any more.
                        let _ = mb.state.compare_exchange(
                            DEAD,
                            FREE,
                            Ordering::AcqRel,
                            Ordering::Relaxed,
                        );
                    }
                }
                _ => {}
            }
        }
    }
}
