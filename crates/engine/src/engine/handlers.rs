//! Handler threads: with faults delivered to threads (the default), a fault in managed memory
//! — the program's own, or the kernel's on its behalf: a system call, an io_uring or AIO
//! worker, `process_vm_readv` from another process, KVM — waits in the kernel while the fault
//! is queued on the userfaultfd. A handler thread reads it, resolves it on the fault path
//! (`Engine::handle_fault`, the same code a SIGBUS handler runs) and wakes the waiting thread.
//! One handler per CPU, each pinned to its CPU: the faulting thread sleeps, so the handler on
//! its CPU runs at once and answers in about the time of an in-thread fault, where a handler
//! on another CPU would pay a cross-CPU wake-up (measured on these machines with a 4 KiB
//! `UFFDIO_COPY` per fault: 4.4 µs p50 against 63 µs). Every handler waiting on the
//! userfaultfd is woken by every fault, so only those on the CPUs the program's threads fault
//! on wait there ([`Follow`]). Entry point: [`Engine::start_handlers`].

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

/// Most handler threads whose waiting follows the program's threads (one per CPU, one bit
/// each of [`Follow`]'s mask); on a machine with more CPUs every handler waits on the
/// userfaultfd, as on a machine with one.
const FOLLOWED_CPUS: usize = 64;

/// Faults served on other CPUs, with no fault from a thread on a handler's own CPU among them,
/// before that handler stops waiting on the userfaultfd.
const IDLE_WAKES: u32 = 64;

/// How long a waiting handler polls the userfaultfd before it looks at whether it should
/// still wait there (ms): a handler disarmed while it polls leaves the userfaultfd's queue
/// then.
const RECHECK_MS: i32 = 50;

/// How long a disarmed handler sleeps before it looks again (ns): arming it wakes it at
/// once; this is only a safety net.
const DISARMED_NS: u64 = 1_000_000_000;

/// Faults in a row a handler may take to come from its own CPU without reading where they
/// came from (see [`Known`]).
const CPU_READS_SKIPPED_MAX: u32 = 16;

/// The program thread whose faults a handler last found to come from its own CPU. Reading a
/// faulting thread's CPU costs a system call (`process_vm_readv`, about 1.4 µs on these VMs,
/// a tenth of a compressed hit); while a thread faults back to back on one CPU, its handler
/// finds each next fault already queued when it comes back from mapping the last one, and
/// the thread is where it was. So the CPU is read only for another thread, after a wait (the
/// handler was idle, so the fault may have come from anywhere: a thread that moved to a CPU
/// whose handler stands aside wakes this one), and at least every
/// [`CPU_READS_SKIPPED_MAX`]th fault; a thread that moved between two back-to-back faults is
/// found at the next of these.
#[derive(Clone, Copy)]
struct Known {
    tid: u32,
    skipped: u32,
}

impl Known {
    const NONE: Known = Known { tid: 0, skipped: 0 };
}

/// Which handler threads wait on the userfaultfd. Every thread waiting on it is woken by
/// every fault, and one takes it: on a machine whose program thread faults on one CPU, the
/// handler on the other CPU is woken for nothing each time, an inter-processor interrupt to
/// a CPU that is often halted (about 13% of a one-thread program's accesses on these VMs).
/// So the handlers follow the program's threads: the handler that serves a fault reads the
/// faulting thread's CPU (`threads::program_thread_cpu`; not while the thread faults back to
/// back on the handler's own CPU, see [`Known`]); a handler whose CPU's threads have
/// not faulted while [`IDLE_WAKES`] faults were served on other CPUs stops waiting on the
/// userfaultfd ("disarmed") and sleeps on a futex, until a fault from a thread on its CPU,
/// seen by whichever handler serves it, arms it again. At least one handler stays armed; a
/// read that finds several faults at once, and a fault read while a fork has the engine's
/// gate closed, arm them all. A fault whose thread's CPU cannot be read (the kernel's
/// workers, threads memtide did not see start, a thread whose rseq area is in managed
/// memory) changes nothing. The state is atomics only, so a fork that copies it mid-change
/// leaves nothing locked; the child's handlers start it afresh.
pub(super) struct Follow {
    /// Whether following was asked for (`Config::follow_threads`).
    wanted: bool,
    on: AtomicBool,
    n: AtomicUsize,
    cpus: [AtomicU32; FOLLOWED_CPUS],
    /// Bit k: handler k waits on the userfaultfd.
    armed: AtomicU64,
    idle_wakes: [AtomicU32; FOLLOWED_CPUS],
    /// Bumped to arm a handler (the futex it sleeps on while disarmed).
    bell: [AtomicU32; FOLLOWED_CPUS],
    arms: AtomicU64,
    disarms: AtomicU64,
    /// Faults whose thread's CPU was taken to be the handler's own, unread (see [`Known`]).
    cpu_reads_skipped: AtomicU64,
}

impl Follow {
    pub(super) fn new(wanted: bool) -> Follow {
        Follow {
            wanted,
            on: AtomicBool::new(false),
            n: AtomicUsize::new(0),
            cpus: [const { AtomicU32::new(0) }; FOLLOWED_CPUS],
            armed: AtomicU64::new(u64::MAX),
            idle_wakes: [const { AtomicU32::new(0) }; FOLLOWED_CPUS],
            bell: [const { AtomicU32::new(0) }; FOLLOWED_CPUS],
            arms: AtomicU64::new(0),
            disarms: AtomicU64::new(0),
            cpu_reads_skipped: AtomicU64::new(0),
        }
    }

    /// Whether handlers on `cpus` should follow the program's threads: asked for, and more
    /// than one CPU, at most [`FOLLOWED_CPUS`].
    fn can_follow(&self, cpus: &[usize]) -> bool {
        self.wanted && cpus.len() > 1 && cpus.len() <= FOLLOWED_CPUS
    }

    /// Sets the handlers' CPUs up before they start, every one armed.
    fn start(&self, cpus: &[usize], on: bool) {
        for (k, &c) in cpus.iter().enumerate().take(FOLLOWED_CPUS) {
            self.cpus[k].store(c as u32, Ordering::Relaxed);
            self.idle_wakes[k].store(0, Ordering::Relaxed);
        }
        self.n
            .store(cpus.len().min(FOLLOWED_CPUS), Ordering::Relaxed);
        self.armed.store(u64::MAX, Ordering::Relaxed);
        self.arms.store(0, Ordering::Relaxed);
        self.disarms.store(0, Ordering::Relaxed);
        self.cpu_reads_skipped.store(0, Ordering::Relaxed);
        self.on.store(on, Ordering::Release);
    }

    /// Handlers made to wait on the userfaultfd again, and handlers that stopped.
    pub(super) fn arms(&self) -> u64 {
        self.arms.load(Ordering::Relaxed)
    }

    pub(super) fn disarms(&self) -> u64 {
        self.disarms.load(Ordering::Relaxed)
    }

    /// Faults whose thread's CPU was not read (see [`Known`]).
    pub(super) fn cpu_reads_skipped(&self) -> u64 {
        self.cpu_reads_skipped.load(Ordering::Relaxed)
    }

    fn on(&self) -> bool {
        self.on.load(Ordering::Acquire)
    }

    fn armed(&self, k: usize) -> bool {
        self.armed.load(Ordering::Acquire) & (1 << k) != 0
    }

    fn handler_on(&self, cpu: u32) -> Option<usize> {
        (0..self.n.load(Ordering::Relaxed)).find(|&j| self.cpus[j].load(Ordering::Relaxed) == cpu)
    }

    fn arm(&self, j: usize) {
        if self.armed(j) {
            return;
        }
        self.idle_wakes[j].store(0, Ordering::Relaxed);
        if self.armed.fetch_or(1 << j, Ordering::AcqRel) & (1 << j) == 0 {
            self.arms.fetch_add(1, Ordering::Relaxed);
            self.bell[j].fetch_add(1, Ordering::Release);
            crate::sys::futex_wake(&self.bell[j]);
        }
    }

    fn arm_all(&self) {
        for j in 0..self.n.load(Ordering::Relaxed) {
            self.arm(j);
        }
    }

    /// Disarms handler `j`, unless it is the last one armed.
    fn disarm(&self, j: usize) {
        let mut m = self.armed.load(Ordering::Acquire);
        let n = self.n.load(Ordering::Relaxed);
        let all = if n >= 64 { u64::MAX } else { (1u64 << n) - 1 };
        loop {
            if m & (1 << j) == 0 || m & all & !(1 << j) == 0 {
                return;
            }
            match self.armed.compare_exchange_weak(
                m,
                m & !(1 << j),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break,
                Err(now) => m = now,
            }
        }
        self.disarms.fetch_add(1, Ordering::Relaxed);
    }

    /// Handler `k` read `faults`, from a thread last on `cpu` (when one fault and its
    /// thread's CPU could be read): arms the handler of that CPU, and counts a wake-up for
    /// nothing against every other armed handler.
    fn saw(&self, k: usize, faults: usize, cpu: Option<u32>) {
        if faults > 1 {
            self.arm_all();
            return;
        }
        let Some(cpu) = cpu else {
            return;
        };
        let n = self.n.load(Ordering::Relaxed);
        if self.cpus[k].load(Ordering::Relaxed) == cpu {
            // (A handler disarmed while it polled can still serve its own CPU's fault.)
            self.idle_wakes[k].store(0, Ordering::Relaxed);
            self.arm(k);
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

    /// Disarmed handler `k` sleeps until it is armed.
    fn wait_armed(&self, k: usize) {
        let v = self.bell[k].load(Ordering::Acquire);
        if self.armed(k) {
            return;
        }
        crate::sys::futex_wait(&self.bell[k], v, DISARMED_NS);
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
        // Following needs to poll the userfaultfd, which works on a non-blocking one only
        // (and only then are its reads made not to wait).
        let follow = self.follow.can_follow(&cpus) && self.uffd.set_nonblocking().is_ok();
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
        let follow = self.follow.on();
        let mut faults = [PageFault { address: 0, tid: 0 }; 16];
        // Faults read while a fork had the engine's gate closed, served once it opens. The
        // handler keeps reading meanwhile: the fork's own event comes through the same
        // userfaultfd, and the fork waits until it is read.
        let mut held = vec![PageFault { address: 0, tid: 0 }; HELD];
        let mut n_held = 0;
        let mut known = Known::NONE;
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
                    known = Known::NONE;
                }
            }
            let mut waited = false;
            let n = if follow && n_held == 0 {
                if !self.follow.armed(k) {
                    // After a sleep, the next fault may come from anywhere.
                    self.follow.wait_armed(k);
                    known = Known::NONE;
                    continue;
                }
                // The descriptor is non-blocking. Serving faults back to back, the next one
                // is usually queued already: read first, and wait only when nothing is
                // there, looking again at whether to wait at all after a while without a
                // message.
                match self.read_faults(&mut faults, true) {
                    0 => {
                        if !self.uffd.wait_readable(RECHECK_MS) {
                            known = Known::NONE;
                            continue;
                        }
                        waited = true;
                        self.read_faults(&mut faults, true)
                    }
                    n => n,
                }
            } else {
                // Holding faults, a handler must not sleep in read: another handler may take
                // the message that woke it, and nothing else would wake it when the gate
                // opens.
                self.read_faults(&mut faults, n_held > 0 || follow)
            };
            if follow && n > 0 {
                let cpu = if n == 1 {
                    self.fault_cpu(k, &faults[0], waited, &mut known)
                } else {
                    known = Known::NONE;
                    None
                };
                self.follow.saw(k, n, cpu);
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

    /// Reads the faults waiting on the userfaultfd into `faults` (see `Uffd::read_faults`).
    fn read_faults(&self, faults: &mut [PageFault], nowait: bool) -> usize {
        self.uffd
            .read_faults(faults, nowait, |fd| self.forked(fd))
            .unwrap_or_else(|e| fatal("reading faults from the userfaultfd failed", &e))
    }

    /// The CPU fault `f`, read by handler `k` (after a wait for it if `waited`), came from:
    /// taken to be the handler's own, unread, while `known` says its thread faults back to
    /// back there (see [`Known`]).
    fn fault_cpu(&self, k: usize, f: &PageFault, waited: bool, known: &mut Known) -> Option<u32> {
        let mine = self.follow.cpus[k].load(Ordering::Relaxed);
        if !waited && known.tid == f.tid && known.skipped < CPU_READS_SKIPPED_MAX {
            known.skipped += 1;
            self.follow
                .cpu_reads_skipped
                .fetch_add(1, Ordering::Relaxed);
            return Some(mine);
        }
        let cpu = self.faulting_cpu(f.tid);
        *known = if cpu == Some(mine) {
            Known {
                tid: f.tid,
                skipped: 0,
            }
        } else {
            Known::NONE
        };
        cpu
    }

    /// The CPU program thread `tid` faulted on, where it can be read without touching
    /// managed memory: a thread whose rseq area lies in managed memory (a stack the program
    /// allocated from it) is not followed, since reading an evicted area would make this
    /// handler wait on a fault only a handler can serve.
    fn faulting_cpu(&self, tid: u32) -> Option<u32> {
        let area = crate::threads::program_thread_rseq(tid)?;
        if self.contains(area) || self.contains(area + 8) {
            return None;
        }
        crate::threads::rseq_cpu(area)
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
