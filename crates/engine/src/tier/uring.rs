//! Tier-1 I/O through io_uring on the tier file: the evictor submits every run of a write-back
//! batch at once (the runs overlap in the device instead of waiting on each other), and faulting
//! threads read through a small pool of rings taken without locks (a thread that finds every
//! ring busy reads with `pread` instead, so no fault ever waits for a ring). Where io_uring is
//! unavailable (an old kernel, `kernel.io_uring_disabled`, a seccomp filter), the engine keeps
//! the plain `pread`/`pwritev` backend and says so. Entry point: [`UringTier::new`].

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use io_uring::{opcode, types, IoUring};
use memtide_policy::PAGE_SIZE;

use super::{Backend, FileTier};

/// Rings for reads from the fault path.
const READ_RINGS: usize = 8;

struct ReadRing {
    busy: AtomicBool,
    ring: std::cell::UnsafeCell<IoUring>,
}

// SAFETY: a ReadRing's IoUring is used only by the thread that set `busy` (an acquire/release
// try-lock), so it is never shared between threads at the same time.
unsafe impl Sync for ReadRing {}

/// The tier file, with I/O through io_uring.
pub struct UringTier {
    file: FileTier,
    write_ring: Mutex<IoUring>,
    read_rings: Vec<ReadRing>,
}

impl UringTier {
    /// Sets up the rings on `file`, or gives the file back with the reason io_uring is unusable.
    pub fn new(file: FileTier) -> Result<UringTier, (FileTier, io::Error)> {
        let write_ring = match IoUring::new(64) {
            Ok(r) => r,
            Err(e) => return Err((file, e)),
        };
        let mut read_rings = Vec::with_capacity(READ_RINGS);
        for _ in 0..READ_RINGS {
            match IoUring::new(8) {
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
            read_rings,
        })
    }

    fn fd(&self) -> types::Fd {
        types::Fd(self.file.raw_fd())
    }
}

/// Waits for `n` completions on `ring`, returning the first error (a short transfer counts as
/// one: O_DIRECT transfers of whole pages on a preallocated file are never short otherwise).
fn reap(ring: &mut IoUring, n: usize, expect: &[(u64, usize)]) -> io::Result<()> {
    let mut done = 0;
    let mut first_err = None;
    while done < n {
        match ring.submit_and_wait(n - done) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
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
                    first_err = Some(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "short tier-1 transfer",
                    ));
                }
            }
        }
    }
    first_err.map_or(Ok(()), Err)
}

impl Backend for UringTier {
    unsafe fn read(&self, slot: u64, count: usize, buf: *mut u8) -> io::Result<()> {
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
            let sqe = opcode::Read::new(self.fd(), buf, len as u32)
                .offset(slot * PAGE_SIZE as u64)
                .build()
                .user_data(1);
            // SAFETY: the buffer outlives the operation: we wait for its completion below.
            let pushed = unsafe { ring.submission().push(&sqe) }.is_ok();
            let res = if pushed {
                reap(ring, 1, &[(1, len)])
            } else {
                Err(io::Error::from(io::ErrorKind::WouldBlock))
            };
            r.busy.store(false, Ordering::Release);
            return match res {
                // A short read or a full queue: do it the plain way.
                Err(e) if e.raw_os_error().is_none() => {
                    // SAFETY: the caller's buffer contract.
                    unsafe { self.file.read(slot, count, buf) }
                }
                other => other,
            };
        }
        // Every ring is in use by other faulting threads: do not wait for one.
        // SAFETY: the caller's buffer contract.
        unsafe { self.file.read(slot, count, buf) }
    }

    unsafe fn write(&self, slot: u64, pages: &[usize]) -> io::Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.write_runs(&[(slot, pages)]) }
    }

    unsafe fn write_runs(&self, runs: &[(u64, &[usize])]) -> io::Result<()> {
        let mut ring = self.write_ring.lock().unwrap_or_else(|e| e.into_inner());
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
        for (k, ((slot, _), iov)) in runs.iter().zip(&iovs).enumerate() {
            for (c, chunk) in iov.chunks(libc::UIO_MAXIOV as usize).enumerate() {
                let off = (slot + (c * libc::UIO_MAXIOV as usize) as u64) * PAGE_SIZE as u64;
                let id = ((k as u64) << 32) | c as u64;
                let sqe = opcode::Writev::new(self.fd(), chunk.as_ptr(), chunk.len() as u32)
                    .offset(off)
                    .build()
                    .user_data(id);
                // SAFETY: the iovecs and the pages they name outlive the operation: we wait
                // for every completion before returning.
                while unsafe { ring.submission().push(&sqe) }.is_err() {
                    // Queue full: drain what is in flight first.
                    reap(&mut ring, queued, &expect)?;
                    queued = 0;
                    expect.clear();
                }
                expect.push((id, chunk.len() * PAGE_SIZE));
                queued += 1;
            }
        }
        reap(&mut ring, queued, &expect)
    }

    fn grow(&self, slots: u64) -> io::Result<()> {
        self.file.grow(slots)
    }

    fn direct(&self) -> bool {
        self.file.direct()
    }

    fn describe(&self) -> String {
        format!("{} via io_uring", self.file.describe())
    }
}

/// The best backend for a tier file: io_uring where the kernel allows it, else plain system
/// calls, with a note saying why.
pub fn best(file: FileTier) -> (Box<dyn Backend>, Option<String>) {
    if std::env::var_os("MEMTIDE_NO_IO_URING").is_some() {
        return (
            Box::new(file),
            Some("io_uring disabled by MEMTIDE_NO_IO_URING; tier 1 uses pread/pwritev".into()),
        );
    }
    match UringTier::new(file) {
        Ok(u) => (Box::new(u), None),
        Err((file, e)) => (
            Box::new(file),
            Some(format!(
                "io_uring is unavailable ({e}); tier 1 uses pread/pwritev"
            )),
        ),
    }
}
