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

impl Engine {
    /// Starts one handler thread per CPU this process may run on, each pinned to its CPU.
    pub(super) fn start_handlers(&'static self) -> io::Result<usize> {
        let cpus = crate::threads::allowed_cpus()?;
        self.handler_tids
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .reserve(cpus.len());
        for (k, &cpu) in cpus.iter().enumerate() {
            crate::threads::spawn(&format!("memtide-fault-{k}"), move || {
                // Pinning is an optimisation; a handler that cannot pin still serves.
                let _ = crate::threads::pin_to_cpu(cpu);
                self.handler_tids
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(crate::threads::gettid());
                self.handler_main()
            })?;
        }
        Ok(cpus.len())
    }

    fn handler_main(&self) -> ! {
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
            // Holding faults, a handler must not sleep in read: another handler may take the
            // message that woke it, and nothing else would wake it when the gate opens.
            let n = self
                .uffd
                .read_faults(&mut faults, n_held > 0, |fd| self.forked(fd))
                .unwrap_or_else(|e| fatal("reading faults from the userfaultfd failed", &e));
            for f in &faults[..n] {
                match self.gate.try_enter() {
                    Some(_inside) => self.serve(f),
                    None if n_held < HELD => {
                        held[n_held] = *f;
                        n_held += 1;
                    }
                    None => {
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
