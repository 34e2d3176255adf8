//! Tier-1 I/O through io_uring on the tier file: the evictor submits every run of a write-back
//! batch at once (the runs overlap in the device instead of waiting on each other), and faulting
//! threads read through a small pool of rings taken without locks (a thread that finds every
//! ring busy reads with `pread` instead, so no fault ever waits for a ring). Where io_uring is
//! unavailable (an old kernel, `kernel.io_uring_disabled`, a seccomp filter), the engine keeps
//! the plain `pread`/`pwritev` backend and says so. Entry point: [`UringTier::new`].
//!
//! A fault's read is waited for by polling its completion, for about twice the device's usual
//! read time, before sleeping ([`ReadPoll`]): sleeping lets the CPU halt, and on a virtual
//! machine waking a halted CPU costs about a fifth of a 50 µs read, more when the device's
//! interrupt lands on another CPU than the waiting thread's (BENCHMARKS.md, "Waiting for a
//! tier read"). A thread that finds it was preempted while polling (another thread wanted its
//! CPU) stops polling and sleeps, and sleeps on the next reads too.
//!
//! # Invariants
//!
//! - A ring is handed back only when none of its requests can still complete: a read ring
//!   whose wait failed with a request outstanding is retired for good (it stays taken), and
//!   its caller is told that the buffer may still be written ([`ReadError::buffer_lost`]).
//! - A write returns only when none of its requests can still complete: when waiting on the
//!   write ring fails, the writes the kernel took are waited for by watching the completion
//!   queue before the pages (and the iovecs naming them) go back to the caller, who may reuse
//!   them at once (the encrypted tier seals the next batch into the same scratch pages).
//! - Every read carries its own id, and a completion is taken only by the request it names.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use io_uring::{opcode, squeue, types, IoUring};

use crate::fds::{self, Lifted};
use memtide_policy::PAGE_SIZE;

use super::{Backend, FileTier, ReadError};

/// Rings for reads from the fault path: one per CPU this process may run on (that many
/// handler threads read at once under the default delivery), at least 2, at most 8. Each is a
/// descriptor of memtide's in the program; a thread that finds them all busy reads with
/// `pread`, which costs the same at one read in flight.
fn read_rings() -> usize {
    crate::threads::allowed_cpus().map_or(8, |c| c.len().clamp(2, 8))
}

struct ReadRing {
    /// Taken by the thread using the ring; never given back once the ring is retired.
    busy: AtomicBool,
    ring: std::cell::UnsafeCell<Lifted<IoUring>>,
}

// SAFETY: a ReadRing's IoUring is used only by the thread that set `busy` (an acquire/release
// try-lock), so it is never shared between threads at the same time.
unsafe impl Sync for ReadRing {}

/// The longest a fault polls for its read before sleeping. A device whose usual read takes
/// longer than half of this is waited for by sleeping only: polling it would burn more CPU
/// than the wake-up it saves.
const POLL_MAX: Duration = Duration::from_micros(150);
/// A gap this long between two looks at the completion queue is an interrupt or another
/// thread taking the CPU. If the thread was preempted, the poller stops and sleeps: a CPU
/// another thread wants goes back to it after at most one slice.
const POLL_GAP: Duration = Duration::from_micros(10);
/// Reads waited for by sleeping after a poll was preempted, before polling again.
const POLL_BACKOFF: u32 = 64;

/// The calling thread's involuntary context switches so far.
fn involuntary_switches() -> i64 {
    // SAFETY: rusage is plain data; getrusage fills it.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid out-pointer for the calling thread's usage.
    unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) };
    u.ru_nivcsw
}

/// How a fault waits for its read: it polls the completion queue for up to twice the usual
/// read time (an average of recent reads), and stops when it finds it was preempted.
pub struct ReadPoll {
    on: bool,
    /// Recent reads' time from submission to completion, an exponential average in ns.
    usual_ns: AtomicU64,
    /// Reads left to sleep on before polling again (after a poll was preempted).
    backoff: AtomicU32,
    /// Reads whose completion the poll saw, and reads waited for by sleeping.
    polled: AtomicU64,
    slept: AtomicU64,
}

impl ReadPoll {
    fn new(on: bool) -> ReadPoll {
        ReadPoll {
            on,
            usual_ns: AtomicU64::new(0),
            backoff: AtomicU32::new(0),
            polled: AtomicU64::new(0),
            slept: AtomicU64::new(0),
        }
    }

    /// How long the next read may be polled for, in ns (0: sleep at once).
    fn budget_ns(&self) -> u64 {
        if !self.on {
            return 0;
        }
        if self.backoff.load(Ordering::Relaxed) > 0 {
            let _ = self
                .backoff
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
            return 0;
        }
        let usual = self.usual_ns.load(Ordering::Relaxed);
        let max = POLL_MAX.as_nanos() as u64;
        match usual {
            // No read measured yet: poll the longest.
            0 => max,
            u if 2 * u > max => 0,
            u => 2 * u,
        }
    }

    /// A read took `ns` from submission to its waiter seeing the completion (polled or
    /// woken: every read counts, so a device that speeds up is polled again).
    fn took(&self, ns: u64) {
        let old = self.usual_ns.load(Ordering::Relaxed);
        let new = if old == 0 { ns } else { old - old / 8 + ns / 8 };
        self.usual_ns.store(new, Ordering::Relaxed);
    }

    /// A poll was preempted: sleep on the next reads.
    fn preempted(&self) {
        self.backoff.store(POLL_BACKOFF, Ordering::Relaxed);
    }
}

/// The tier file, with I/O through io_uring.
pub struct UringTier {
    file: FileTier,
    write_ring: Mutex<Lifted<IoUring>>,
    /// Set when the write ring failed with writes possibly in flight: later writes use
    /// `pwritev`.
    write_ring_broken: AtomicBool,
    read_rings: Vec<ReadRing>,
    /// Ids for reads.
    next_id: AtomicU64,
    poll: ReadPoll,
    /// Fault injection for tests: the next N read waits fail after submitting, with the read
    /// in flight (as a failing `io_uring_enter` leaves it).
    lose_waits: AtomicU32,
    /// Fault injection for tests: the next write batch's wait fails, its writes held in flight
    /// this many milliseconds (0: none).
    lose_write_ms: AtomicU64,
}

impl UringTier {
    /// Sets up the rings on `file`, or gives the file back with the reason io_uring is unusable.
    /// With `poll_reads`, a fault polls for its read's completion before sleeping
    /// ([`ReadPoll`]).
    pub fn new(file: FileTier, poll_reads: bool) -> Result<UringTier, (FileTier, io::Error)> {
        let write_ring = match IoUring::new(64).and_then(fds::lift_ring) {
            Ok(r) => r,
            Err(e) => return Err((file, e)),
        };
        let n = read_rings();
        let mut read_rings = Vec::with_capacity(n);
        for _ in 0..n {
            match IoUring::new(8).and_then(fds::lift_ring) {
                Ok(r) => read_rings.push(ReadRing {
                    busy: AtomicBool::new(false),
                    ring: std::cell::UnsafeCell::new(r),
                }),
                Err(e) => return Err((file, e)),
            }
        }
        Ok(UringTier {
            file,
            write_ring: Mutex::new(write_ring),
            write_ring_broken: AtomicBool::new(false),
            read_rings,
            next_id: AtomicU64::new(1),
            poll: ReadPoll::new(poll_reads),
            lose_waits: AtomicU32::new(0),
            lose_write_ms: AtomicU64::new(0),
        })
    }

    /// Rings for reads (retired ones included).
    pub fn read_ring_count(&self) -> usize {
        self.read_rings.len()
    }

    /// For tests: the next `n` read waits fail with EIO after submitting their read.
    #[doc(hidden)]
    pub fn inject_lost_waits(&self, n: u32) {
        self.lose_waits.store(n, Ordering::Relaxed);
    }

    /// For tests: the next write batch's wait fails after submitting it, each write held in
    /// flight for `ms` milliseconds behind a timeout (as a failing `io_uring_enter` leaves
    /// writes the device has not finished).
    #[doc(hidden)]
    pub fn inject_lost_write(&self, ms: u64) {
        self.lose_write_ms.store(ms, Ordering::Relaxed);
    }

    /// Waits for the completion of read `id` (of `len` bytes) on `ring` and returns its
    /// outcome; `Err` when the ring failed while the read may still be in flight.
    fn wait_read(
        &self,
        ring: &mut IoUring,
        id: u64,
        len: usize,
    ) -> Result<io::Result<()>, io::Error> {
        let t0 = crate::sys::now_ns();
        // A read is polled, and counted, on the first pass only (a wait retried after EINTR
        // or another's completion sleeps).
        let mut first = true;
        loop {
            if self.lose_waits.load(Ordering::Relaxed) > 0
                && self
                    .lose_waits
                    .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| n.checked_sub(1))
                    .is_ok()
            {
                ring.submit()?;
                return Err(io::Error::from_raw_os_error(libc::EIO));
            }
            let mut polled = false;
            if first {
                first = false;
                let budget = self.poll.budget_ns();
                polled = budget > 0 && self.poll_read(ring, budget)?;
                let n = if polled {
                    &self.poll.polled
                } else {
                    &self.poll.slept
                };
                n.fetch_add(1, Ordering::Relaxed);
            }
            if !polled {
                match ring.submit_and_wait(1) {
                    Ok(_) => {}
                    Err(e) if transient(&e) => continue,
                    Err(e) => return Err(e),
                }
            }
            for cqe in ring.completion() {
                if cqe.user_data() != id {
                    // Not ours (there is never another read in flight on a ring that was
                    // handed back, but a completion is only ever taken by its own request).
                    continue;
                }
                self.poll.took(crate::sys::now_ns() - t0);
                let r = cqe.result();
                return Ok(if r < 0 {
                    Err(io::Error::from_raw_os_error(-r))
                } else if r as usize != len {
                    Err(io::Error::from(io::ErrorKind::UnexpectedEof))
                } else {
                    Ok(())
                });
            }
        }
    }

    /// Submits what `ring` holds and polls its completion queue for up to `budget` ns:
    /// whether a completion arrived (else the caller sleeps for it). The kernel posts a read's
    /// completion through this thread's task work, which the interrupt of the device's
    /// completion makes it run, polling or not.
    fn poll_read(&self, ring: &mut IoUring, budget: u64) -> io::Result<bool> {
        loop {
            match ring.submit() {
                Ok(_) => break,
                Err(e) if transient(&e) => continue,
                Err(e) => return Err(e),
            }
        }
        // This thread's involuntary context switches before the poll: a gap in the polling
        // that came with one more was another thread taking the CPU, not an interrupt.
        let switches = involuntary_switches();
        let t0 = crate::sys::now_ns();
        let mut last = t0;
        loop {
            if !ring.completion().is_empty() {
                return Ok(true);
            }
            let now = crate::sys::now_ns();
            if now - last > POLL_GAP.as_nanos() as u64 && involuntary_switches() != switches {
                self.poll.preempted();
                return Ok(false);
            }
            if now - t0 > budget {
                return Ok(false);
            }
            last = now;
            std::hint::spin_loop();
        }
    }

    fn fd(&self) -> types::Fd {
        types::Fd(self.file.raw_fd())
    }
}

/// An `io_uring_enter` error after which waiting again is right.
fn transient(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY)
    )
}

/// Why waiting for writes failed.
enum Reap {
    /// A write completed with an error.
    Failed(io::Error),
    /// The ring failed; the writes the kernel had taken have completed since (see [`lost`]).
    Lost,
}

/// Waits for `n` completions on `ring`, returning the first error (a short transfer counts as
/// one: O_DIRECT transfers of whole pages on a preallocated file are never short otherwise).
fn reap(ring: &mut IoUring, n: usize, expect: &[(u64, usize)]) -> Result<(), Reap> {
    let mut done = 0;
    let mut first_err = None;
    while done < n {
        match ring.submit_and_wait(n - done) {
            Ok(_) => {}
            Err(e) if transient(&e) => continue,
            Err(_) => return Err(lost(ring, n - done)),
        }
        for cqe in ring.completion() {
            done += 1;
            let want = expect
                .iter()
                .find(|(id, _)| *id == cqe.user_data())
                .map_or(0, |&(_, len)| len);
            let r = cqe.result();
            if first_err.is_none() {
                if r < 0 {
                    first_err = Some(io::Error::from_raw_os_error(-r));
                } else if r as usize != want {
                    first_err = Some(io::Error::from(io::ErrorKind::UnexpectedEof));
                }
            }
        }
    }
    first_err.map_or(Ok(()), |e| Err(Reap::Failed(e)))
}

/// After waiting on `ring` failed with `outstanding` requests queued or in flight: waits until
/// every request the kernel took has completed, watching the completion queue (completions are
/// posted without `io_uring_enter`; this thread's sleeps let it run the kernel's task work
/// that posts some of them), so that no write lands after its pages went back to the caller.
/// Requests still in the submission queue were never taken and never will be: the ring is not
/// used again.
fn lost(ring: &mut IoUring, outstanding: usize) -> Reap {
    let untaken = ring.submission().len();
    let mut left = outstanding.saturating_sub(untaken);
    while left > 0 {
        let got = ring.completion().count();
        left = left.saturating_sub(got);
        if left > 0 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
    Reap::Lost
}

impl Backend for UringTier {
    unsafe fn read(&self, slot: u64, count: usize, buf: *mut u8) -> Result<(), ReadError> {
        let len = count * PAGE_SIZE;
        for r in &self.read_rings {
            if r.busy
                .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
            {
                continue;
            }
            // SAFETY: we hold this ring's try-lock, so no other thread uses it.
            let ring = unsafe { &mut *r.ring.get() };
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            let sqe = opcode::Read::new(self.fd(), buf, len as u32)
                .offset(slot * PAGE_SIZE as u64)
                .build()
                .user_data(id);
            // SAFETY: the buffer outlives the operation: we wait for its completion below,
            // or tell the caller it is lost.
            if unsafe { ring.submission().push(&sqe) }.is_err() {
                r.busy.store(false, Ordering::Release);
                break;
            }
            return match self.wait_read(ring, id, len) {
                Ok(res) => {
                    r.busy.store(false, Ordering::Release);
                    match res {
                        // A short read: do it the plain way.
                        Err(e) if e.raw_os_error().is_none() => {
                            // SAFETY: the caller's buffer contract.
                            unsafe { self.file.read(slot, count, buf) }
                        }
                        other => other.map_err(ReadError::from),
                    }
                }
                // The read may still land: retire the ring (it stays taken), and the buffer.
                Err(error) => Err(ReadError {
                    error,
                    buffer_lost: true,
                }),
            };
        }
        // Every ring is in use by other faulting threads (or its queue was full): do not wait
        // for one.
        // SAFETY: the caller's buffer contract.
        unsafe { self.file.read(slot, count, buf) }
    }

    unsafe fn write(&self, slot: u64, pages: &[usize]) -> io::Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.write_runs(&[(slot, pages)]) }
    }

    unsafe fn write_runs(&self, runs: &[(u64, &[usize])]) -> io::Result<()> {
        if self.write_ring_broken.load(Ordering::Acquire) {
            // SAFETY: forwarded contract.
            return unsafe { self.file.write_runs(runs) };
        }
        let mut ring = self.write_ring.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: forwarded contract.
        match unsafe { self.submit_writes(&mut ring, runs) } {
            Ok(()) => Ok(()),
            Err(Reap::Failed(e)) => Err(e),
            Err(Reap::Lost) => {
                // Every write the ring took has completed (`lost`): write the same bytes to
                // the same slots the plain way, and keep to the plain way.
                self.write_ring_broken.store(true, Ordering::Release);
                // SAFETY: forwarded contract.
                unsafe { self.file.write_runs(runs) }
            }
        }
    }

    fn grow(&self, slots: u64) -> io::Result<()> {
        self.file.grow(slots)
    }

    fn shrink(&self, slots: u64) -> io::Result<()> {
        self.file.shrink(slots)
    }

    fn direct(&self) -> bool {
        self.file.direct()
    }

    fn forked(&self) {
        // The rings are the parent's (their memory is shared with it): this process gets its
        // own, or reads and writes with plain calls where it cannot.
        let mut w = self.write_ring.lock().unwrap_or_else(|e| e.into_inner());
        match IoUring::new(64).and_then(fds::lift_ring) {
            Ok(r) => *w = r,
            Err(_) => self.write_ring_broken.store(true, Ordering::Release),
        }
        for r in &self.read_rings {
            if r.busy.load(Ordering::Acquire) {
                // Retired in the parent: stays so.
                continue;
            }
            match IoUring::new(8).and_then(fds::lift_ring) {
                // SAFETY: the child's only thread runs this, before any read: no other
                // user of the ring exists.
                Ok(fresh) => unsafe { *r.ring.get() = fresh },
                Err(_) => r.busy.store(true, Ordering::Release),
            }
        }
    }

    fn describe(&self) -> String {
        format!("{} via io_uring", self.file.describe())
    }

    fn reads_polled(&self) -> (u64, u64) {
        (
            self.poll.polled.load(Ordering::Relaxed),
            self.poll.slept.load(Ordering::Relaxed),
        )
    }
}

impl UringTier {
    /// Submits every run of a batch on the write ring and waits for all of them.
    ///
    /// # Safety
    ///
    /// As [`Backend::write`], for every page.
    unsafe fn submit_writes(
        &self,
        ring: &mut IoUring,
        runs: &[(u64, &[usize])],
    ) -> Result<(), Reap> {
        let iovs: Vec<Vec<libc::iovec>> = runs
            .iter()
            .map(|(_, pages)| {
                pages
                    .iter()
                    .map(|&p| libc::iovec {
                        iov_base: p as *mut libc::c_void,
                        iov_len: PAGE_SIZE,
                    })
                    .collect()
            })
            .collect();
        let mut expect = Vec::new();
        let mut queued = 0;
        let hold_ms = match self.lose_write_ms.load(Ordering::Relaxed) {
            0 => 0,
            _ => self.lose_write_ms.swap(0, Ordering::Relaxed),
        };
        let hold = types::Timespec::new()
            .sec(hold_ms / 1000)
            .nsec((hold_ms % 1000) as u32 * 1_000_000);
        for (k, ((slot, _), iov)) in runs.iter().zip(&iovs).enumerate() {
            for (c, chunk) in iov.chunks(libc::UIO_MAXIOV as usize).enumerate() {
                let off = (slot + (c * libc::UIO_MAXIOV as usize) as u64) * PAGE_SIZE as u64;
                let id = ((k as u64) << 32) | c as u64;
                let sqe = opcode::Writev::new(self.fd(), chunk.as_ptr(), chunk.len() as u32)
                    .offset(off)
                    .build()
                    .user_data(id);
                if hold_ms > 0 {
                    // Injected: the write waits behind a timeout (a hard link survives the
                    // timeout's -ETIME).
                    let t = opcode::Timeout::new(&hold)
                        .build()
                        .flags(squeue::Flags::IO_HARDLINK)
                        .user_data(u64::MAX);
                    // SAFETY: `hold` is read when the timeout is prepared, at submission.
                    if unsafe { ring.submission().push(&t) }.is_ok() {
                        queued += 1;
                    }
                }
                // SAFETY: the iovecs and the pages they name outlive the operation: we wait
                // for every completion before returning.
                while unsafe { ring.submission().push(&sqe) }.is_err() {
                    // Queue full: drain what is in flight first.
                    reap(ring, queued, &expect)?;
                    queued = 0;
                    expect.clear();
                }
                expect.push((id, chunk.len() * PAGE_SIZE));
                queued += 1;
            }
        }
        if hold_ms > 0 {
            ring.submit().map_err(|_| Reap::Lost)?;
            return Err(lost(ring, queued));
        }
        reap(ring, queued, &expect)
    }
}

/// The best backend for a tier file: io_uring where the kernel allows it, else plain system
/// calls, with a note saying why. `poll_reads`: see [`UringTier::new`].
pub fn best(file: FileTier, poll_reads: bool) -> (Box<dyn Backend>, Option<String>) {
    if std::env::var_os("MEMTIDE_NO_IO_URING").is_some() {
        return (
            Box::new(file),
            Some("io_uring disabled by MEMTIDE_NO_IO_URING; tier 1 uses pread/pwritev".into()),
        );
    }
    match UringTier::new(file, poll_reads) {
        Ok(u) => (Box::new(u), None),
        Err((file, e)) => (
            Box::new(file),
            Some(format!(
                "io_uring is unavailable ({e}); tier 1 uses pread/pwritev"
            )),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_are_polled_for_twice_the_usual_read_while_that_is_short() {
        assert_eq!(ReadPoll::new(false).budget_ns(), 0, "off: never polled");
        let p = ReadPoll::new(true);
        assert_eq!(
            p.budget_ns(),
            POLL_MAX.as_nanos() as u64,
            "before any read: the longest poll"
        );
        for _ in 0..64 {
            p.took(40_000);
        }
        let near = |b: u64, want: u64| b.abs_diff(want) <= want / 20;
        assert!(
            near(p.budget_ns(), 80_000),
            "twice a 40 µs device's usual read"
        );
        for _ in 0..64 {
            p.took(100_000);
        }
        assert_eq!(p.budget_ns(), 0, "a 100 µs device is not polled");
        for _ in 0..64 {
            p.took(30_000);
        }
        assert!(
            near(p.budget_ns(), 60_000),
            "polled again once it speeds up"
        );
        p.preempted();
        for k in 0..POLL_BACKOFF {
            assert_eq!(p.budget_ns(), 0, "read {k} after a preempted poll sleeps");
        }
        assert!(near(p.budget_ns(), 60_000), "then polls again");
    }
}
