//! Handler threads: with faults delivered to threads (the default), a fault in managed memory
//! — the program's own, or the kernel's on its behalf: a system call, an io_uring or AIO
//! worker, `process_vm_readv` from another process, KVM — waits in the kernel while the fault
//! is queued on the userfaultfd. A handler thread reads it, resolves it on the fault path
//! (`Engine::handle_fault`, the same code a SIGBUS handler runs) and wakes the waiting thread.
//! One handler per CPU, each pinned to its CPU: the faulting thread sleeps, so the handler on
//! its CPU runs at once and answers in about the time of an in-thread fault, where a handler
//! on another CPU would pay a cross-CPU wake-up (measured on these machines with a 4 KiB
//! `UFFDIO_COPY` per fault: 4.4 µs p50 against 63 µs). Entry point: [`Engine::start_handlers`].

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use memtide_policy::PAGE_SIZE;

use super::fatal::{fatal, fatal_with};
use super::{Engine, Fault};
use crate::uffd::PageFault;

/// Faults in a row at one unmanaged address before the engine stops the process: the program
/// keeps touching memory it freed, and the signal sent to it changes nothing (it is blocked
/// or handled and the access retried).
const STRAY_LIMIT: u32 = 1000;

/// Faults in a row by one thread at one address that holds no memory before that thread gets
/// SIGSEGV. A fault message can be stale: a thread that faulted on a page is woken by whatever
/// maps the page (a neighbour's zero-fill or read-ahead maps a run of pages and wakes every
/// thread waiting on the run), goes on, and the page may be freed before a handler reads the
/// message. Signalling then would kill the thread wherever it is now. So the thread is woken
/// to retry instead: one that really touches freed memory faults again at once, a stale
/// message does not repeat.
const STRAY_RETRIES: u32 = 3;

/// Faults a handler thread holds while a fork has the engine's gate closed (about one per
/// thread waiting). A handler holding this many waits at the gate, leaving the fork's event
/// to the other handlers: with one handler (one CPU) and more threads faulting at once during
/// a fork, the fork would wait for good.
const HELD: usize = 4096;

/// The latest stray faults per thread (a few threads at a time; a thread whose entry was
/// taken by another just needs more retries). Fixed size: a handler thread must not allocate
/// (a thread waiting on a fault may hold the allocator's lock).
pub(super) struct Strays(Mutex<[(u32, usize, u32); 64]>);

impl Strays {
    pub(super) fn new() -> Strays {
        Strays(Mutex::new([(0, 0, 0); 64]))
    }

    /// Counts a stray fault by thread `tid` at `addr`: how many in a row there.
    fn count(&self, tid: u32, addr: usize) -> u32 {
        let mut t = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let e = &mut t[tid as usize % 64];
        if e.0 != tid || e.1 != addr {
            *e = (tid, addr, 0);
        }
        e.2 = e.2.saturating_add(1);
        e.2
    }
}

/// Most handler threads whose waiting follows the program's threads (one per CPU); on a
/// machine with more CPUs every handler waits on the userfaultfd.
const FOLLOWED_CPUS: usize = 64;

/// Faults in a row that a handler was woken for and another handler served on its own CPU,
/// with no fault from a thread on the first handler's CPU meanwhile, before it stops waiting.
const IDLE_WAKES: u32 = 64;

/// How long a handler waits on the userfaultfd, or for its CPU to need it again, before it
/// looks at whether it should still wait there (ms).
const RECHECK_MS: i32 = 50;

/// Which handler threads wait on the userfaultfd. Every thread waiting on it is woken by
/// every fault, and one takes it: on a machine whose program thread faults on one CPU, the
/// handler on the other CPU is woken for nothing each time, an inter-processor interrupt to
/// a CPU that is often halted (about 13% of a one-thread program's accesses on these VMs).
/// So the handlers follow the program's threads: a handler whose CPU's threads have not
/// faulted for [`IDLE_WAKES`] faults stops waiting on the userfaultfd (it is "disarmed")
/// and sleeps on a futex until a fault comes from a thread on its CPU again, which the handler
/// that serves it sees (from the thread's rseq area) and arms it. At least one handler always
/// waits; a read that finds several faults at once arms them all. Faults from threads whose
/// CPU cannot be read (the kernel's workers, threads memtide did not see start) change
/// nothing.
pub(super) struct Follow {
    on: AtomicBool,
    n: AtomicUsize,
    cpus: [AtomicU32; FOLLOWED_CPUS],
    armed: [AtomicBool; FOLLOWED_CPUS],
    idle_wakes: [AtomicU32; FOLLOWED_CPUS],
    /// Bumped to arm a handler (the futex it sleeps on while disarmed).
    bell: [AtomicU32; FOLLOWED_CPUS],
    /// Held while arming or disarming, so that the last armed handler is never disarmed.
    change: Mutex<()>,
    arms: AtomicU64,
    disarms: AtomicU64,
}

impl Follow {
    pub(super) fn new() -> Follow {
        Follow {
            on: AtomicBool::new(false),
            n: AtomicUsize::new(0),
            cpus: [const { AtomicU32::new(0) }; FOLLOWED_CPUS],
            armed: [const { AtomicBool::new(true) }; FOLLOWED_CPUS],
            idle_wakes: [const { AtomicU32::new(0) }; FOLLOWED_CPUS],
            bell: [const { AtomicU32::new(0) }; FOLLOWED_CPUS],
            change: Mutex::new(()),
            arms: AtomicU64::new(0),
            disarms: AtomicU64::new(0),
        }
    }

    /// Handlers made to wait on the userfaultfd again, and handlers that stopped.
    pub(super) fn arms(&self) -> u64 {
        self.arms.load(Ordering::Relaxed)
    }

    pub(super) fn disarms(&self) -> u64 {
        self.disarms.load(Ordering::Relaxed)
    }

    /// Sets the handlers' CPUs up before they start (each armed).
    fn start(&self, cpus: &[usize], on: bool) {
        let on = on && cpus.len() > 1 && cpus.len() <= FOLLOWED_CPUS;
        for (k, &c) in cpus.iter().enumerate().take(FOLLOWED_CPUS) {
            self.cpus[k].store(c as u32, Ordering::Relaxed);
            self.armed[k].store(true, Ordering::Relaxed);
            self.idle_wakes[k].store(0, Ordering::Relaxed);
        }
        self.n
            .store(cpus.len().min(FOLLOWED_CPUS), Ordering::Relaxed);
        self.arms.store(0, Ordering::Relaxed);
        self.disarms.store(0, Ordering::Relaxed);
        self.on.store(on, Ordering::Release);
    }

    fn on(&self) -> bool {
        self.on.load(Ordering::Acquire)
    }

    fn armed(&self, k: usize) -> bool {
        self.armed[k].load(Ordering::Acquire)
    }

    fn handler_on(&self, cpu: u32) -> Option<usize> {
        (0..self.n.load(Ordering::Relaxed)).find(|&j| self.cpus[j].load(Ordering::Relaxed) == cpu)
    }

    fn arm(&self, j: usize) {
        if self.armed(j) {
            return;
        }
        let _g = self.change.lock().unwrap_or_else(|e| e.into_inner());
        if self.armed(j) {
            return;
        }
        self.idle_wakes[j].store(0, Ordering::Relaxed);
        self.armed[j].store(true, Ordering::Release);
        self.arms.fetch_add(1, Ordering::Relaxed);
        self.bell[j].fetch_add(1, Ordering::Release);
        crate::sys::futex_wake(&self.bell[j]);
    }

    fn arm_all(&self) {
        for j in 0..self.n.load(Ordering::Relaxed) {
            self.arm(j);
        }
    }

    fn disarm(&self, j: usize) {
        let _g = self.change.lock().unwrap_or_else(|e| e.into_inner());
        let n = self.n.load(Ordering::Relaxed);
        let armed = (0..n).filter(|&i| self.armed(i)).count();
        if armed > 1 && self.armed(j) {
            self.armed[j].store(false, Ordering::Release);
            self.disarms.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Handler `k` read `faults`: arms the handler of the CPU they came from, and counts the
    /// wake-ups the other armed handlers had for nothing.
    fn saw(&self, k: usize, faults: &[PageFault]) {
        if faults.len() > 1 {
            self.arm_all();
            return;
        }
        let Some(cpu) = faults
            .first()
            .and_then(|f| crate::threads::program_thread_cpu(f.tid))
        else {
            return;
        };
        let n = self.n.load(Ordering::Relaxed);
        if self.cpus[k].load(Ordering::Relaxed) == cpu {
            self.idle_wakes[k].store(0, Ordering::Relaxed);
            for j in (0..n).filter(|&j| j != k && self.armed(j)) {
                if self.idle_wakes[j].fetch_add(1, Ordering::Relaxed) + 1 >= IDLE_WAKES {
                    self.disarm(j);
                }
            }
        } else if let Some(j) = self.handler_on(cpu) {
            self.idle_wakes[j].store(0, Ordering::Relaxed);
            self.arm(j);
        }
    }

    /// Disarmed handler `k` sleeps until it is armed (or a while passes).
    fn wait_armed(&self, k: usize) {
        let v = self.bell[k].load(Ordering::Acquire);
        if self.armed(k) {
            return;
        }
        crate::sys::futex_wait(&self.bell[k], v, RECHECK_MS as u64 * 1_000_000);
    }
}

impl Engine {
    /// Starts one handler thread per CPU this process may run on, each pinned to its CPU.
    pub(super) fn start_handlers(&'static self) -> io::Result<usize> {
        let cpus = crate::threads::allowed_cpus()?;
        self.handler_tids
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .reserve(cpus.len());
        // Following needs to poll the userfaultfd, which works on a non-blocking one only.
        let follow = self.follow_threads && self.uffd.set_nonblocking().is_ok();
        self.follow.start(&cpus, follow);
        for (k, &cpu) in cpus.iter().enumerate() {
            crate::threads::spawn(&format!("memtide-fault-{k}"), move || {
                // Pinning is an optimisation; a handler that cannot pin still serves.
                let _ = crate::threads::pin_to_cpu(cpu);
                self.handler_tids
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(crate::threads::gettid());
                self.handler_main(k)
            })?;
        }
        Ok(cpus.len())
    }

    fn handler_main(&self, k: usize) -> ! {
        let follow = self.follow.on() && k < FOLLOWED_CPUS;
        let mut faults = [PageFault { address: 0, tid: 0 }; 16];
        // Faults read while a fork had the engine's gate closed, served once it opens. The
        // handler keeps reading meanwhile: the fork's own event comes through the same
        // userfaultfd, and the fork waits until it is read.
        let mut held = vec![PageFault { address: 0, tid: 0 }; HELD];
        let mut n_held = 0;
        loop {
            if n_held > 0 {
                if let Some(_inside) = self.gate.try_enter() {
                    for f in &held[..n_held] {
                        self.serve(f);
                    }
                    n_held = 0;
                } else {
                    // (poll(2) cannot say whether a blocking userfaultfd has a message.)
                    std::thread::sleep(std::time::Duration::from_micros(100));
                }
            }
            if follow && n_held == 0 {
                if !self.follow.armed(k) {
                    self.follow.wait_armed(k);
                    continue;
                }
                // The descriptor is non-blocking: wait here, and look again at whether to
                // wait at all after a while without a message.
                if !self.uffd.wait_readable(RECHECK_MS) {
                    continue;
                }
            }
            // Holding faults, a handler must not sleep in read: another handler may take the
            // message that woke it, and nothing else would wake it when the gate opens.
            let n = self
                .uffd
                .read_faults(&mut faults, n_held > 0 || follow, |fd| self.forked(fd))
                .unwrap_or_else(|e| fatal("reading faults from the userfaultfd failed", &e));
            if follow && n > 0 {
                self.follow.saw(k, &faults[..n]);
            }
            for f in &faults[..n] {
                match self.gate.try_enter() {
                    Some(_inside) => self.serve(f),
                    None if n_held < HELD => {
                        held[n_held] = *f;
                        n_held += 1;
                        // A fork has the gate closed: its event must be read by whichever
                        // handler can, so every handler waits on the userfaultfd again.
                        self.follow.arm_all();
                    }
                    None => {
                        self.follow.arm_all();
                        let _inside = self.gate.enter();
                        self.serve(f);
                    }
                }
            }
        }
    }

    /// Resolves one queued fault. Mapping the page (UFFDIO_COPY or UFFDIO_MOVE) wakes whoever
    /// waits on it; where the page was already there, or is no memory at all, the waiting
    /// thread is woken here to retry.
    fn serve(&self, f: &PageFault) {
        let wake = match self.handle_fault(f.address) {
            Fault::Handled => false,
            Fault::Raced => true,
            Fault::NotManaged => {
                self.stray(f);
                true
            }
        };
        if wake {
            let page = f.address & !(PAGE_SIZE - 1);
            if let Err(e) = self.uffd.wake(page, PAGE_SIZE) {
                fatal("waking a thread after its fault failed", &e);
            }
        }
    }

    /// A fault at managed address space that holds no memory: the program touched memory it
    /// freed (natively: SIGSEGV, or EFAULT for a system call), or the message is stale (see
    /// [`STRAY_RETRIES`]). The thread is woken to retry; once it has faulted there
    /// `STRAY_RETRIES` times in a row it gets SIGSEGV; if it keeps faulting there regardless,
    /// the engine stops it rather than spin.
    fn stray(&self, f: &PageFault) {
        let n = self.strays.count(f.tid, f.address & !(PAGE_SIZE - 1));
        if n < STRAY_RETRIES {
            return;
        }
        if n >= STRAY_LIMIT {
            fatal_with(
                "the program keeps touching managed memory it freed",
                &[("address", f.address as u64), ("thread", f.tid as u64)],
                &io::Error::from_raw_os_error(libc::EFAULT),
            );
        }
        // SAFETY: sending a signal to a thread of this process.
        unsafe {
            libc::syscall(
                libc::SYS_tgkill,
                self.pid.load(std::sync::atomic::Ordering::Relaxed) as libc::c_long,
                f.tid as libc::c_long,
                libc::SIGSEGV as libc::c_long,
            )
        };
    }
}
