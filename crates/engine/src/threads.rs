//! The engine's own threads: fault handlers, the evictor, the stats writer. They are started
//! with `pthread_create` rather than `std::thread`, so each is marked as the engine's before
//! it runs any code at all. std's thread start registers thread-local destructors through
//! glibc, which allocates with the public `calloc`; in a program under the preload library
//! that is the program's allocator (jemalloc in redis), whose memory is managed. A handler
//! thread in there could wait on a lock held by a thread that is itself waiting for that
//! handler (a thread that faulted on managed memory inside jemalloc): a deadlock. The preload
//! library asks [`is_engine_thread`] and sends these threads to glibc's own allocator.
//!
//! The engine's threads never exit (the process ends them).

use std::cell::Cell;
use std::ffi::CString;
use std::io;

thread_local! {
    // Const-initialised and without a destructor: reading it never allocates or registers.
    static ENGINE_THREAD: Cell<bool> = const { Cell::new(false) };
}

/// Whether the calling thread is one of the engine's own.
pub fn is_engine_thread() -> bool {
    ENGINE_THREAD.with(Cell::get)
}

/// Runs `f` as if on one of the engine's threads: what C code in it allocates through the
/// public `malloc` (zstd's contexts) comes from glibc's allocator, as on the threads that go
/// on to use and free it, never from the program's.
pub fn as_engine<T>(f: impl FnOnce() -> T) -> T {
    let was = ENGINE_THREAD.with(|c| c.replace(true));
    let out = f();
    ENGINE_THREAD.with(|c| c.set(was));
    out
}

struct Start {
    name: String,
    main: Box<dyn FnOnce() + Send>,
}

/// Starts an engine thread named `name` (at most 15 bytes show) running `main`, which must not
/// return. A panic in it ends the process with one line: a dead handler or evictor would leave
/// faulting threads waiting forever.
pub fn spawn(name: &str, main: impl FnOnce() + Send + 'static) -> io::Result<()> {
    let start = Box::into_raw(Box::new(Start {
        name: name.to_owned(),
        main: Box::new(main),
    }));
    // SAFETY: attr is initialised before use and destroyed after; `start` is handed to the
    // new thread, or taken back here if none was created.
    unsafe {
        let mut attr: libc::pthread_attr_t = std::mem::zeroed();
        libc::pthread_attr_init(&mut attr);
        libc::pthread_attr_setdetachstate(&mut attr, libc::PTHREAD_CREATE_DETACHED);
        let mut id: libc::pthread_t = 0;
        let rc = libc::pthread_create(&mut id, &attr, run, start.cast());
        libc::pthread_attr_destroy(&mut attr);
        if rc != 0 {
            drop(Box::from_raw(start));
            return Err(io::Error::from_raw_os_error(rc));
        }
    }
    Ok(())
}

extern "C" fn run(arg: *mut libc::c_void) -> *mut libc::c_void {
    ENGINE_THREAD.with(|c| c.set(true));
    // SAFETY: `arg` is the Start leaked by `spawn` for this thread alone.
    let start = unsafe { Box::from_raw(arg.cast::<Start>()) };
    let Start { name, main } = *start;
    if let Ok(c) = CString::new(
        name.as_bytes()
            .iter()
            .copied()
            .take(15)
            .collect::<Vec<u8>>(),
    ) {
        // SAFETY: a NUL-terminated name of at most 15 bytes for the calling thread.
        unsafe { libc::pthread_setname_np(libc::pthread_self(), c.as_ptr()) };
    }
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(main)).is_err() {
        crate::say::line(&format!(
            "memtide: fatal: the engine's {name} thread panicked"
        ));
    } else {
        crate::say::line(&format!(
            "memtide: fatal: the engine's {name} thread stopped"
        ));
    }
    std::process::abort();
}

/// The CPUs this process may run on.
pub fn allowed_cpus() -> io::Result<Vec<usize>> {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity fills it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: a valid out-pointer of the size given.
    let r = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
        // SAFETY: reading a bit of a valid set.
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect();
    Ok(if cpus.is_empty() { vec![0] } else { cpus })
}

/// Pins the calling thread to `cpu` (one of [`allowed_cpus`]).
pub fn pin_to_cpu(cpu: usize) -> io::Result<()> {
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    // SAFETY: cpu_set_t is plain data.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: setting a bit of a valid set; `cpu` is below CPU_SETSIZE (checked above).
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: a valid set of the size given, for the calling thread.
    if unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The kernel's id of the calling thread.
pub fn gettid() -> u32 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::gettid() as u32 }
}

/// What the scheduler says of thread `tid` of this process (/proc/self/task/TID/schedstat):
/// time on a CPU, time runnable but waiting for one, and how many times it was given one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedStat {
    pub run_ns: u64,
    pub wait_ns: u64,
    pub runs: u64,
}

impl SchedStat {
    pub fn of(tid: u32) -> Option<SchedStat> {
        let text = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")).ok()?;
        let mut f = text.split_whitespace().map(|v| v.parse::<u64>().ok());
        Some(SchedStat {
            run_ns: f.next()??,
            wait_ns: f.next()??,
            runs: f.next()??,
        })
    }
}

impl std::ops::Add for SchedStat {
    type Output = SchedStat;

    fn add(self, o: SchedStat) -> SchedStat {
        SchedStat {
            run_ns: self.run_ns + o.run_ns,
            wait_ns: self.wait_ns + o.wait_ns,
            runs: self.runs + o.runs,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_the_scheduler_says_of_a_thread_is_read() {
        use std::sync::mpsc;
        let (tell, told) = mpsc::channel();
        let (stop, stopped) = mpsc::channel::<()>();
        let worker = std::thread::spawn(move || {
            // Runs at least 5 ms on a CPU (by its own CPU clock: on a busy machine wall time
            // is not CPU time), then blocks: the kernel adds up its time as it sleeps.
            let ran = || {
                let mut t = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                };
                // SAFETY: a valid out-pointer for the calling thread's CPU clock.
                unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
                t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
            };
            while ran() < 5_000_000 {
                std::hint::spin_loop();
            }
            tell.send((gettid(), ran())).unwrap();
            stopped.recv().unwrap();
        });
        let (tid, ran_ns) = told.recv().unwrap();
        // Once the worker sleeps on `stopped`, the kernel has added up the time it ran (a
        // running thread's time is brought up to date only at ticks and switches).
        let sleeping = || {
            crate::sys::stat_fields(&format!("/proc/self/task/{tid}/stat"))
                .is_some_and(|f| f.first().is_some_and(|s| s == "S"))
        };
        while !sleeping() {
            std::thread::yield_now();
        }
        let s = SchedStat::of(tid).expect("schedstat of the worker");
        assert!(s.run_ns >= ran_ns && s.runs >= 1, "{s:?} after {ran_ns} ns");
        stop.send(()).unwrap();
        worker.join().unwrap();
        assert_eq!(SchedStat::of(0), None);
    }
}

/// Where the program's threads run: each thread's rseq area (which glibc registers for every
/// thread, and in which the kernel writes the CPU the thread last ran on), by thread id. The
/// preload library notes each program thread as it starts ([`note_program_thread`]) and as
/// it ends ([`forget_program_thread`]); a handler thread asks [`program_thread_rseq`] and
/// [`rseq_cpu`] which CPU a fault came from. Fixed size and lock-free: a handler must not
/// allocate or wait, and a thread that finds the table full is simply not followed.
mod rseq_areas {
    use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

    const SLOTS: usize = 1024;
    /// A slot whose thread ended: lookups go on past it, a new thread may take it.
    const ENDED: u32 = u32::MAX;

    pub(super) struct Table {
        tids: [AtomicU32; SLOTS],
        areas: [AtomicUsize; SLOTS],
    }

    pub(super) static TABLE: Table = Table {
        tids: [const { AtomicU32::new(0) }; SLOTS],
        areas: [const { AtomicUsize::new(0) }; SLOTS],
    };

    fn probe(tid: u32) -> impl Iterator<Item = usize> {
        (0..SLOTS).map(move |k| (tid as usize + k) % SLOTS)
    }

    impl Table {
        pub(super) fn insert(&self, tid: u32, area: usize) {
            // An entry of an earlier thread with this id (one that ended without a word, or
            // the parent's before a fork) is brought up to date.
            if let Some(i) = self.find(tid) {
                self.areas[i].store(area, Ordering::Release);
                return;
            }
            for i in probe(tid) {
                let t = self.tids[i].load(Ordering::Acquire);
                if (t == 0 || t == ENDED)
                    && self.tids[i]
                        .compare_exchange(t, tid, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                {
                    self.areas[i].store(area, Ordering::Release);
                    return;
                }
            }
        }

        pub(super) fn remove(&self, tid: u32) {
            if let Some(i) = self.find(tid) {
                // The area first: a reader that still finds the tid finds no area.
                self.areas[i].store(0, Ordering::Release);
                self.tids[i].store(ENDED, Ordering::Release);
            }
        }

        fn find(&self, tid: u32) -> Option<usize> {
            for i in probe(tid) {
                match self.tids[i].load(Ordering::Acquire) {
                    t if t == tid => return Some(i),
                    0 => return None,
                    _ => {}
                }
            }
            None
        }

        pub(super) fn area(&self, tid: u32) -> Option<usize> {
            let a = self.areas[self.find(tid)?].load(Ordering::Acquire);
            (a != 0).then_some(a)
        }
    }
}

/// The calling thread's rseq area, where glibc registered one (glibc 2.35 and later, on
/// x86-64): the thread pointer plus `__rseq_offset`.
fn own_rseq_area() -> Option<usize> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        // Read once from glibc's exported symbols; none where rseq is not registered.
        static OFFSET: OnceLock<Option<isize>> = OnceLock::new();
        let offset = (*OFFSET.get_or_init(|| {
            // SAFETY: looking up glibc's data symbols by name; they are read-only after start.
            unsafe {
                let off = libc::dlsym(libc::RTLD_DEFAULT, c"__rseq_offset".as_ptr());
                let size = libc::dlsym(libc::RTLD_DEFAULT, c"__rseq_size".as_ptr());
                if off.is_null() || size.is_null() || *(size as *const u32) < 8 {
                    return None;
                }
                Some(*(off as *const isize))
            }
        }))?;
        let tp: usize;
        // SAFETY: on x86-64 the first word of the thread control block points to itself.
        unsafe { std::arch::asm!("mov {}, fs:0", out(reg) tp, options(nostack, readonly)) };
        Some(tp.wrapping_add_signed(offset))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

/// Notes the calling thread as one of the program's, so handlers can tell which CPU its
/// faults come from.
pub fn note_program_thread() {
    if let Some(area) = own_rseq_area() {
        rseq_areas::TABLE.insert(gettid(), area);
    }
}

/// The calling thread is ending: its rseq area goes with it.
pub fn forget_program_thread() {
    rseq_areas::TABLE.remove(gettid());
}

/// Program thread `tid`'s rseq area, or none for a thread not noted (the kernel's own
/// workers, threads started before the preload library, a glibc without rseq, another
/// architecture than x86-64).
pub fn program_thread_rseq(tid: u32) -> Option<usize> {
    rseq_areas::TABLE.area(tid)
}

/// The CPU the thread whose rseq area is at `area` last ran on (for a thread waiting on a
/// fault: the CPU it faulted on). Read with `process_vm_readv`, so an area that is no longer
/// mapped gives an error, not a fault; but an area in memory the kernel must fault in (an
/// evicted page of managed memory) makes the caller wait for that fault.
pub fn rseq_cpu(area: usize) -> Option<u32> {
    let mut cpu = 0u32;
    let local = libc::iovec {
        iov_base: (&mut cpu as *mut u32).cast(),
        iov_len: 4,
    };
    // struct rseq: cpu_id_start (u32), then cpu_id (u32).
    let remote = libc::iovec {
        iov_base: (area + 4) as *mut libc::c_void,
        iov_len: 4,
    };
    // SAFETY: reading 4 bytes of this process into a local u32; the kernel checks the remote
    // address. The calling thread's id names the process even after its main thread ended.
    let n = unsafe { libc::process_vm_readv(gettid() as libc::pid_t, &local, 1, &remote, 1, 0) };
    // cpu_id is negative (u32 ≥ 2^31) while the thread is not registered.
    (n == 4 && cpu < 1 << 16).then_some(cpu)
}

/// [`rseq_cpu`] of program thread `tid` (see [`program_thread_rseq`]).
pub fn program_thread_cpu(tid: u32) -> Option<u32> {
    rseq_cpu(program_thread_rseq(tid)?)
}
