//! memtide's own file descriptors, kept out of the program's way. The kernel gives every new
//! descriptor the lowest free number, so the userfaultfd, the tier file, its io_uring rings
//! and the pagemap reader would otherwise take numbers the program expects to be its own: a
//! program started with its standard input closed would find the userfaultfd as fd 0. Each is
//! moved at once to a high number ([`floor`]: 64 below the soft `RLIMIT_NOFILE`, at most 960),
//! close-on-exec, and recorded here; the preload library's `close`, `close_range` and
//! `closefrom` leave recorded descriptors alone (a program closing every descriptor it does not
//! know would otherwise close memtide's), and its `dup2`/`dup3` refuse to replace one.
//! Entry points: [`lift`], [`Lifted`], [`is_ours`].

use std::ops::{Deref, DerefMut};
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, RawFd};
use std::sync::atomic::{AtomicI32, Ordering};

/// Most descriptors memtide records (it holds 4 + one read ring per CPU, at most 12).
const SLOTS: usize = 32;

/// memtide's descriptors; -1 marks a free slot. Read by the preload library's `close` wrappers,
/// so lock-free and allocation-free.
static OURS: [AtomicI32; SLOTS] = [const { AtomicI32::new(-1) }; SLOTS];

/// The lowest number memtide's descriptors take: 64 below the soft limit on open files (at
/// most 1024 counted, so that `select`-sized tables stay clear), and never below 3.
pub fn floor() -> RawFd {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit.
    let cur = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        lim.rlim_cur.min(1024) as RawFd
    } else {
        1024
    };
    (cur - 64).max(3)
}

/// Whether `fd` is one of memtide's descriptors.
pub fn is_ours(fd: RawFd) -> bool {
    fd >= 0 && OURS.iter().any(|s| s.load(Ordering::Acquire) == fd)
}

/// memtide's descriptors in `first..=last`, ascending, into `out`; returns how many.
pub fn ours_in(first: RawFd, last: RawFd, out: &mut [RawFd; SLOTS]) -> usize {
    let mut n = 0;
    for s in &OURS {
        let fd = s.load(Ordering::Acquire);
        if fd >= first && fd <= last {
            out[n] = fd;
            n += 1;
        }
    }
    out[..n].sort_unstable();
    n
}

fn record(fd: RawFd) {
    for s in &OURS {
        if s.compare_exchange(-1, fd, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            return;
        }
    }
    // All slots taken: the descriptor is still high and close-on-exec, only unguarded.
}

/// Forgets `fd` as memtide's, before memtide closes it.
pub(crate) fn forget(fd: RawFd) {
    for s in &OURS {
        if s.compare_exchange(fd, -1, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            return;
        }
    }
}

/// A close-on-exec duplicate of `fd` at or above [`floor`], if the table has room there.
fn dup_high(fd: RawFd) -> Option<RawFd> {
    // SAFETY: F_DUPFD_CLOEXEC duplicates a descriptor the caller owns; a new one or -1.
    let high = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, floor()) };
    (high >= 0).then_some(high)
}

/// Moves `fd` to a number at or above [`floor`], close-on-exec, and records it as memtide's.
/// Where it cannot move (the table is full up there), it stays where it is, recorded.
pub fn lift_raw(fd: RawFd) -> RawFd {
    let kept = match dup_high(fd) {
        Some(high) => {
            // SAFETY: closing the low duplicate we own (raw: it is not recorded, and
            // memtide's own close must not depend on the wrappers).
            unsafe { libc::syscall(libc::SYS_close, fd) };
            high
        }
        None => fd,
    };
    record(kept);
    kept
}

/// A value owning one of memtide's descriptors, moved high and recorded ([`lift`]); dropping
/// it forgets the record before the value closes the descriptor.
pub struct Lifted<T: AsRawFd>(T);

impl<T: AsRawFd> Lifted<T> {
    pub fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

impl<T: AsRawFd> Deref for Lifted<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T: AsRawFd> DerefMut for Lifted<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.0
    }
}

impl<T: AsRawFd> Drop for Lifted<T> {
    fn drop(&mut self) {
        forget(self.0.as_raw_fd());
    }
}

/// Moves the descriptor a value owns (an `OwnedFd`, a `File`) high and records it.
pub fn lift<T: AsRawFd + IntoRawFd + FromRawFd>(owner: T) -> Lifted<T> {
    let raw = owner.into_raw_fd();
    // SAFETY: lift_raw returns a descriptor we own in place of `raw`.
    Lifted(unsafe { T::from_raw_fd(lift_raw(raw)) })
}

/// Forgets every record: in a child forked without exec, whose engine serves nothing, the
/// descriptors it inherited are the program's to close (they hold the parent's tier file).
pub fn forget_all() {
    for s in &OURS {
        s.store(-1, Ordering::Release);
    }
}

/// Moves an io_uring's descriptor high and records it: the ring is mapped again from the
/// high descriptor with the parameters the kernel filled in.
pub fn lift_ring(ring: io_uring::IoUring) -> std::io::Result<Lifted<io_uring::IoUring>> {
    let params = ring.params().clone();
    let Some(high) = dup_high(ring.as_raw_fd()) else {
        record(ring.as_raw_fd());
        return Ok(Lifted(ring));
    };
    drop(ring);
    // SAFETY: `high` is a descriptor we own referring to the ring set up with `params`.
    let ring = unsafe { io_uring::IoUring::from_fd(high, params) }?;
    record(high);
    Ok(Lifted(ring))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::OwnedFd;

    #[test]
    fn a_lifted_descriptor_is_high_close_on_exec_and_recorded_until_dropped() {
        let f = std::fs::File::open("/proc/self/stat").unwrap();
        let low = f.as_raw_fd();
        let l = lift(OwnedFd::from(f));
        let fd = l.fd();
        assert!(fd >= floor(), "{fd} below {}", floor());
        assert!(is_ours(fd));
        assert!(!is_ours(low));
        // SAFETY: F_GETFD reads the descriptor's flags.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
        assert_eq!(flags & libc::FD_CLOEXEC, libc::FD_CLOEXEC);
        let mut out = [0; SLOTS];
        let n = ours_in(0, RawFd::MAX, &mut out);
        assert!(out[..n].contains(&fd));
        assert!(out[..n].windows(2).all(|w| w[0] < w[1]), "ascending");
        // (Not checked after the drop: a test running beside this one may lift a descriptor
        // to the number just freed.)
        drop(l);
    }

    #[test]
    fn a_lifted_ring_still_works() {
        let Ok(ring) = io_uring::IoUring::new(4) else {
            return; // io_uring refused here; the engine falls back to plain reads
        };
        let mut ring = lift_ring(ring).unwrap();
        assert!(ring.fd() >= floor());
        let nop = io_uring::opcode::Nop::new().build().user_data(7);
        // SAFETY: a NOP references no memory.
        unsafe { ring.submission().push(&nop).unwrap() };
        ring.submit_and_wait(1).unwrap();
        assert_eq!(ring.completion().next().unwrap().user_data(), 7);
    }
}
