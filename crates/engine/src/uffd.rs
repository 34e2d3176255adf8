//! Minimal userfaultfd bindings: open (with either way of delivering faults, [`Delivery`]),
//! register, COPY, MOVE, WAKE, reading fault messages, and the one move primitive the engine
//! uses, [`Uffd::move_verified`], which says what moved as the page tables say it.
//!
//! Own bindings rather than the `userfaultfd` crate: that crate needs libclang at build time and
//! has no `UFFDIO_MOVE`, which is the engine's atomic unmap-for-eviction primitive. Struct sizes
//! are asserted at compile time against the kernel ABI (include/uapi/linux/userfaultfd.h).
//! Entry point: [`Uffd::open`].

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};

use crate::sys::{Pagemap, Presence};

const UFFD_API: u64 = 0xAA;
const UFFDIO: u64 = 0xAA;

pub const FEATURE_SIGBUS: u64 = 1 << 7;
pub const FEATURE_THREAD_ID: u64 = 1 << 8;
pub const FEATURE_MOVE: u64 = 1 << 16;
/// The process's forks are reported with a userfaultfd of the child's (needs CAP_SYS_PTRACE).
pub const FEATURE_EVENT_FORK: u64 = 1 << 1;

/// `uffd_msg.event` of a page fault.
const EVENT_PAGEFAULT: u8 = 0x12;
/// `uffd_msg.event` of a fork: `arg.fork.ufd` (the low word of `flags` here) is a new
/// descriptor, in the reading process, of the child's userfaultfd.
const EVENT_FORK: u8 = 0x13;

/// How faults in registered memory reach whoever resolves them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// Queued on the userfaultfd for handler threads to read; the faulting thread, or the
    /// kernel on its behalf (a system call, io_uring, KVM), waits until the page is there.
    Threads,
    /// SIGBUS in the faulting thread, which resolves the fault itself. A fault the kernel takes
    /// on a program's behalf fails that access with EFAULT instead.
    Signal,
}

impl Delivery {
    /// The name `--faults` and the launched program's settings use.
    pub fn name(self) -> &'static str {
        match self {
            Delivery::Threads => "threads",
            Delivery::Signal => "signal",
        }
    }

    pub fn from_name(name: &str) -> Option<Delivery> {
        match name {
            "threads" => Some(Delivery::Threads),
            "signal" => Some(Delivery::Signal),
            _ => None,
        }
    }
}

/// A page fault read from the userfaultfd.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageFault {
    pub address: usize,
    /// The faulting thread (kernel thread id).
    pub tid: u32,
}

const REGISTER_MODE_MISSING: u64 = 1;
const REGISTER_MODE_WP: u64 = 2;
/// UFFDIO_COPY: map the page write-protected.
const COPY_MODE_WP: u64 = 2;
/// Write-protect faults resolved by the kernel itself, with no message (Linux 6.7): a write
/// to a protected page only clears its protection, which `PAGEMAP_SCAN` then reports.
const FEATURE_WP_ASYNC: u64 = 1 << 15;
/// madvise: fault the range in writable, as a write would (breaking copy-on-write sharing),
/// without writing.
const MADV_POPULATE_WRITE: i32 = 23;

const PAGE: usize = 4096;

#[repr(C)]
#[derive(Default)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioRange {
    start: u64,
    len: u64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}

/// `struct uffd_msg` (packed, 32 bytes), as a page fault message lays it out.
#[repr(C, packed)]
#[derive(Clone, Copy, Default)]
struct UffdMsg {
    event: u8,
    reserved1: u8,
    reserved2: u16,
    reserved3: u32,
    flags: u64,
    address: u64,
    ptid: u32,
    pad: u32,
}

#[repr(C)]
#[derive(Default)]
struct UffdioMove {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    moved: i64,
}

const _: () = assert!(std::mem::size_of::<UffdioApi>() == 24);
const _: () = assert!(std::mem::size_of::<UffdioRange>() == 16);
const _: () = assert!(std::mem::size_of::<UffdioRegister>() == 32);
const _: () = assert!(std::mem::size_of::<UffdioCopy>() == 40);
const _: () = assert!(std::mem::size_of::<UffdioMove>() == 40);
const _: () = assert!(std::mem::size_of::<UffdMsg>() == 32);

const fn iowr(nr: u64, size: usize) -> u64 {
    (3 << 30) | ((size as u64) << 16) | (UFFDIO << 8) | nr
}

const fn ior(nr: u64, size: usize) -> u64 {
    (2 << 30) | ((size as u64) << 16) | (UFFDIO << 8) | nr
}

const UFFDIO_API: u64 = iowr(0x3F, std::mem::size_of::<UffdioApi>());
const UFFDIO_REGISTER: u64 = iowr(0x00, std::mem::size_of::<UffdioRegister>());
const UFFDIO_UNREGISTER: u64 = ior(0x01, std::mem::size_of::<UffdioRange>());
const UFFDIO_WAKE: u64 = ior(0x02, std::mem::size_of::<UffdioRange>());
const UFFDIO_COPY: u64 = iowr(0x03, std::mem::size_of::<UffdioCopy>());
const UFFDIO_MOVE: u64 = iowr(0x05, std::mem::size_of::<UffdioMove>());
const UFFDIO_MOVE_MODE_DONTWAKE: u64 = 1 << 0;
/// `_IO(0xAA, 0)` on /dev/userfaultfd.
const USERFAULTFD_IOC_NEW: u64 = UFFDIO << 8;

/// Why a userfaultfd could not be opened: the cases a user can act on are told apart.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(
        "no permission to use userfaultfd: run as root, or set `sysctl vm.unprivileged_userfaultfd=1`, or grant read-write access to /dev/userfaultfd"
    )]
    Permission,
    #[error("this kernel has no userfaultfd")]
    Unsupported,
    #[error("userfaultfd lacks features memtide needs (UFFDIO_MOVE, Linux 6.8 or later)")]
    MissingFeatures,
    #[error("userfaultfd failed: {0}")]
    Other(io::Error),
}

/// An open, initialized userfaultfd.
pub struct Uffd {
    fd: crate::fds::Lifted<OwnedFd>,
    delivery: Delivery,
    /// Whether forks are reported (see [`FEATURE_EVENT_FORK`]).
    fork_events: bool,
    /// Whether writes are tracked by the kernel (see [`FEATURE_WP_ASYNC`]).
    wp_async: bool,
    /// Fault injection for tests: every Nth move that moved pages reports one page fewer and
    /// fails with EEXIST, as 6.18's batched move can after an internal retry (0: off).
    underreport_every: AtomicU32,
    moves: AtomicU32,
    /// Fault injection for tests: the next N copies fail with EEXIST without copying, as
    /// the kernel does when a page-table level is missing.
    copy_eexist: AtomicU32,
}

/// Outcome of a COPY or MOVE that may have done only part of the range.
#[derive(Debug)]
pub struct Partial {
    /// Bytes done before the error.
    pub done: usize,
    pub error: io::Error,
}

/// What [`Uffd::move_verified`] found.
#[derive(Debug)]
pub struct MoveReport {
    /// Pages that moved.
    pub moved: usize,
    /// Of those, pages the kernel did not report as moved.
    pub underreported: usize,
    /// The error that stopped the move, if it did not complete.
    pub error: Option<io::Error>,
}

impl Uffd {
    /// Opens a userfaultfd with UFFDIO_MOVE and the given [`Delivery`] of faults.
    ///
    /// With handler threads, forks are reported too where the kernel allows it (it asks for
    /// CAP_SYS_PTRACE): a child then keeps its registered memory and gets a userfaultfd of its
    /// own, and the engine tiers both processes. Without, see [`fork_events`](Self::fork_events).
    ///
    /// With `track_writes`, and where the kernel offers it (Linux 6.7), registered memory is
    /// also write-protected with the kernel resolving the write faults itself, so that the
    /// engine can read which pages were written ([`tracks_writes`](Self::tracks_writes)).
    pub fn open(delivery: Delivery, track_writes: bool) -> Result<Uffd, OpenError> {
        let want = FEATURE_MOVE
            | match delivery {
                Delivery::Signal => FEATURE_SIGBUS,
                Delivery::Threads => FEATURE_THREAD_ID,
            };
        // Features memtide does without where the kernel refuses them, most wanted first.
        let fork = match delivery {
            Delivery::Threads => FEATURE_EVENT_FORK,
            Delivery::Signal => 0,
        };
        let wp = if track_writes { FEATURE_WP_ASYNC } else { 0 };
        let mut tries: Vec<u64> = Vec::with_capacity(4);
        for extra in [fork | wp, fork, wp, 0] {
            if !tries.contains(&extra) {
                tries.push(extra);
            }
        }
        let mut last = OpenError::MissingFeatures;
        for extra in tries {
            match Self::open_api(delivery, want | extra) {
                Ok(fd) => {
                    return Ok(Uffd {
                        fd: crate::fds::lift(fd),
                        delivery,
                        fork_events: extra & FEATURE_EVENT_FORK != 0,
                        wp_async: extra & FEATURE_WP_ASYNC != 0,
                        underreport_every: AtomicU32::new(0),
                        moves: AtomicU32::new(0),
                        copy_eexist: AtomicU32::new(0),
                    })
                }
                Err(e @ (OpenError::Other(_) | OpenError::MissingFeatures)) => last = e,
                Err(e) => return Err(e),
            }
        }
        Err(last)
    }

    /// A userfaultfd with the `want`ed features.
    fn open_api(delivery: Delivery, want: u64) -> Result<OwnedFd, OpenError> {
        let fd = Self::open_fd(delivery)?;
        let mut api = UffdioApi {
            api: UFFD_API,
            features: want,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_API reads and writes a UffdioApi, which `api` is.
        let ret = unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_API as _, &mut api) };
        if ret < 0 {
            let e = io::Error::last_os_error();
            return Err(if e.raw_os_error() == Some(libc::EINVAL) {
                OpenError::MissingFeatures
            } else {
                OpenError::Other(e)
            });
        }
        if api.features & want != want {
            return Err(OpenError::MissingFeatures);
        }
        Ok(fd)
    }

    pub fn delivery(&self) -> Delivery {
        self.delivery
    }

    /// Whether writes are tracked without faults: registered memory is write-protected for
    /// userfaultfd with the kernel resolving the faults itself, so that
    /// [`Pagemap::written`](crate::sys::Pagemap::written) tells which pages were written.
    pub fn tracks_writes(&self) -> bool {
        self.wp_async
    }

    /// Whether the kernel reports this process's forks (userfaultfd's fork events: handler
    /// threads, and the privilege the kernel asks for them, CAP_SYS_PTRACE).
    pub fn fork_events(&self) -> bool {
        self.fork_events
    }

    /// In a forked child: from now on this is `fd`, the child's own userfaultfd (which the
    /// parent's fork event carried), at the same descriptor number. `fd` is closed.
    pub fn adopt(&self, fd: i32) -> io::Result<()> {
        // SAFETY: dup3 (the system call: the preload library refuses dup3 onto memtide's own) onto our own descriptor, then closing the one we were given.
        let ret =
            unsafe { libc::syscall(libc::SYS_dup3, fd, self.fd.as_raw_fd(), libc::O_CLOEXEC) };
        let e = io::Error::last_os_error();
        // SAFETY: `fd` is ours to close.
        unsafe { libc::close(fd) };
        if ret < 0 {
            return Err(e);
        }
        Ok(())
    }

    /// Reads the page faults waiting on the userfaultfd into `out` (as many as fit) and returns
    /// how many, waiting for one if none is there (0 if the wait was interrupted). Other events
    /// are not asked for and are skipped. Allocates nothing.
    ///
    /// A fork event's descriptor (the child's userfaultfd) goes to `forked`.
    /// With `nowait`, returns 0 at once when nothing is there (where the kernel can read a
    /// userfaultfd without waiting: RWF_NOWAIT; otherwise it waits).
    pub fn read_faults(
        &self,
        out: &mut [PageFault],
        nowait: bool,
        mut forked: impl FnMut(i32),
    ) -> io::Result<usize> {
        let mut msgs = [UffdMsg::default(); 16];
        let want = out.len().min(msgs.len());
        let iov = libc::iovec {
            iov_base: msgs.as_mut_ptr() as *mut libc::c_void,
            iov_len: want * std::mem::size_of::<UffdMsg>(),
        };
        // SAFETY: reading at most `want` whole messages into our array (offset -1: a read at
        // the file's position, as read(2)).
        let mut ret = unsafe {
            libc::preadv2(
                self.fd.as_raw_fd(),
                &iov,
                1,
                -1,
                if nowait { libc::RWF_NOWAIT } else { 0 },
            )
        };
        if ret < 0 && nowait && io::Error::last_os_error().raw_os_error() == Some(libc::EOPNOTSUPP)
        {
            // SAFETY: as above, waiting.
            ret = unsafe { libc::preadv2(self.fd.as_raw_fd(), &iov, 1, -1, 0) };
        }
        if ret < 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(0),
                _ => Err(e),
            };
        }
        let mut n = 0;
        for m in &msgs[..ret as usize / std::mem::size_of::<UffdMsg>()] {
            if m.event == EVENT_PAGEFAULT {
                out[n] = PageFault {
                    address: m.address as usize,
                    tid: m.ptid,
                };
                n += 1;
            } else if m.event == EVENT_FORK {
                forked(m.flags as u32 as i32);
            }
        }
        Ok(n)
    }

    /// Makes reads never wait, so that [`Uffd::wait_readable`] can say when a message is
    /// there (poll(2) on a blocking userfaultfd always reports an error).
    pub fn set_nonblocking(&self) -> io::Result<()> {
        let fd = self.fd.as_raw_fd();
        // SAFETY: F_GETFL/F_SETFL on our own descriptor.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above.
        if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Waits up to `timeout_ms` for a message (the descriptor non-blocking: see
    /// [`Uffd::set_nonblocking`]). Whether one may be there: a woken reader can still find
    /// it taken by another.
    pub fn wait_readable(&self, timeout_ms: i32) -> bool {
        let mut p = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: polling one descriptor of ours.
        let r = unsafe { libc::poll(&mut p, 1, timeout_ms) };
        r > 0
    }

    /// Wakes the threads waiting on faults in `[start, start+len)` (to retry their access).
    pub fn wake(&self, start: usize, len: usize) -> io::Result<()> {
        let mut range = UffdioRange {
            start: start as u64,
            len: len as u64,
        };
        // SAFETY: UFFDIO_WAKE reads a UffdioRange.
        let ret = unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_WAKE as _, &mut range) };
        if ret < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// For tests: from now on every `every`th move that moves pages reports one page fewer
    /// than it moved, with EEXIST (0: off).
    #[doc(hidden)]
    pub fn inject_underreport(&self, every: u32) {
        self.underreport_every.store(every, Ordering::Relaxed);
    }

    /// For tests: the next `n` copies fail with EEXIST and copy nothing.
    #[doc(hidden)]
    pub fn inject_copy_eexist(&self, n: u32) {
        self.copy_eexist.store(n, Ordering::Relaxed);
    }

    fn open_fd(delivery: Delivery) -> Result<OwnedFd, OpenError> {
        // Handler threads block in read(2); nothing reads a SIGBUS-mode userfaultfd.
        let flags = libc::O_CLOEXEC
            | match delivery {
                Delivery::Threads => 0,
                Delivery::Signal => libc::O_NONBLOCK,
            };
        // SAFETY: plain system call; returns a new fd or -1.
        let ret = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) };
        if ret >= 0 {
            // SAFETY: the kernel just gave us this fd.
            return Ok(unsafe { OwnedFd::from_raw_fd(ret as i32) });
        }
        let first = io::Error::last_os_error();
        if first.raw_os_error() == Some(libc::ENOSYS) {
            return Err(OpenError::Unsupported);
        }
        // The syscall is refused to unprivileged users unless the sysctl allows it; access to
        // /dev/userfaultfd is the other way in.
        // SAFETY: NUL-terminated path; returns a new fd or -1.
        let dev =
            unsafe { libc::open(c"/dev/userfaultfd".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if dev < 0 {
            return Err(if first.raw_os_error() == Some(libc::EPERM) {
                OpenError::Permission
            } else {
                OpenError::Other(first)
            });
        }
        // SAFETY: `dev` was just opened by us.
        let dev = unsafe { OwnedFd::from_raw_fd(dev) };
        // SAFETY: USERFAULTFD_IOC_NEW takes the flags as its argument.
        let ret = unsafe { libc::ioctl(dev.as_raw_fd(), USERFAULTFD_IOC_NEW as _, flags) };
        if ret < 0 {
            return Err(OpenError::Other(io::Error::last_os_error()));
        }
        // SAFETY: the ioctl returned a new fd.
        Ok(unsafe { OwnedFd::from_raw_fd(ret) })
    }

    /// Registers `[start, start+len)` for missing-page faults.
    pub fn register(&self, start: usize, len: usize) -> io::Result<()> {
        let mut reg = UffdioRegister {
            range: UffdioRange {
                start: start as u64,
                len: len as u64,
            },
            mode: REGISTER_MODE_MISSING | if self.wp_async { REGISTER_MODE_WP } else { 0 },
            ioctls: 0,
        };
        // SAFETY: UFFDIO_REGISTER reads and writes a UffdioRegister.
        let ret = unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_REGISTER as _, &mut reg) };
        if ret < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Unregisters a range (used before handing memory back to the program untiered).
    pub fn unregister(&self, start: usize, len: usize) -> io::Result<()> {
        let mut range = UffdioRange {
            start: start as u64,
            len: len as u64,
        };
        // SAFETY: UFFDIO_UNREGISTER reads a UffdioRange.
        let ret = unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_UNREGISTER as _, &mut range) };
        if ret < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Atomically fills `[dst, dst+len)` (missing pages) with a copy of `src`.
    ///
    /// # Safety
    ///
    /// `src..src+len` must be readable; `dst` must lie in a registered range whose pages the
    /// caller owns (no other thread fills them concurrently).
    pub unsafe fn copy(&self, dst: usize, src: usize, len: usize) -> Result<(), Partial> {
        if self.copy_eexist.load(Ordering::Relaxed) > 0
            && self
                .copy_eexist
                .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_ok()
        {
            return Err(Partial {
                done: 0,
                error: io::Error::from_raw_os_error(libc::EEXIST),
            });
        }
        let mut done = 0;
        while done < len {
            let mut c = UffdioCopy {
                dst: (dst + done) as u64,
                src: (src + done) as u64,
                len: (len - done) as u64,
                // Mapped protected: the page's first write is what shows it written.
                mode: if self.wp_async { COPY_MODE_WP } else { 0 },
                copy: 0,
            };
            // SAFETY: UFFDIO_COPY reads and writes a UffdioCopy; the ranges are the caller's.
            let ret = unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_COPY as _, &mut c) };
            if c.copy > 0 {
                done += c.copy as usize;
            }
            if ret < 0 {
                let error = io::Error::last_os_error();
                if error.raw_os_error() == Some(libc::EAGAIN) {
                    continue;
                }
                return Err(Partial { done, error });
            }
        }
        Ok(())
    }

    /// Atomically moves the pages of `[src, src+len)` to `[dst, dst+len)`: the source becomes
    /// missing (the next access there faults) and the destination maps the same physical pages.
    /// This is the engine's unmap: no write to the source can be lost, because after the move
    /// no thread can reach the old mapping. The count in an error is the kernel's and is not
    /// the truth on every kernel: use [`move_verified`](Self::move_verified) where it matters.
    ///
    /// # Safety
    ///
    /// Both ranges must lie in ranges registered with this userfaultfd and belong to the caller;
    /// `dst` must be missing.
    pub unsafe fn move_pages(&self, dst: usize, src: usize, len: usize) -> Result<(), Partial> {
        // An injected under-report wakes only what it reports, as the kernel does.
        let injecting = self.underreport_every.load(Ordering::Relaxed) != 0;
        // SAFETY: the caller's contract.
        let result = unsafe { self.move_pages_mode(dst, src, len, injecting) };
        if injecting {
            let done = match &result {
                Ok(()) => len,
                Err(p) => p.done,
            };
            if done > 0 {
                self.wake(dst, done)
                    .map_err(|error| Partial { done, error })?;
            }
        }
        result
    }

    /// [`move_pages`](Self::move_pages); the kernel wakes the destination's waiters unless
    /// `dontwake`.
    ///
    /// # Safety
    ///
    /// As [`move_pages`](Self::move_pages).
    unsafe fn move_pages_mode(
        &self,
        dst: usize,
        src: usize,
        len: usize,
        dontwake: bool,
    ) -> Result<(), Partial> {
        let mut done = 0;
        // Where the sharing with a forked process was last broken (once per page: `done`
        // only grows).
        let mut cow_broken = usize::MAX;
        while done < len {
            let mut m = UffdioMove {
                dst: (dst + done) as u64,
                src: (src + done) as u64,
                len: (len - done) as u64,
                // Wakes threads waiting on faults in the destination (a page moved back for
                // a fault queued to a handler thread); moves into staging have none.
                mode: if dontwake {
                    UFFDIO_MOVE_MODE_DONTWAKE
                } else {
                    0
                },
                moved: 0,
            };
            // SAFETY: UFFDIO_MOVE reads and writes a UffdioMove; the ranges are the caller's.
            let ret = unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_MOVE as _, &mut m) };
            if m.moved > 0 {
                done += m.moved as usize;
            }
            if ret < 0 {
                let error = io::Error::last_os_error();
                if error.raw_os_error() == Some(libc::EAGAIN) {
                    continue;
                }
                if error.raw_os_error() == Some(libc::EBUSY) && cow_broken != done {
                    // The page is shared with a process forked from this one (or this one
                    // with its parent), copy-on-write: a move takes only a page this process
                    // holds alone. Breaking the sharing gives this process its own copy,
                    // with the same bytes, without touching them; then the move goes on.
                    // Any other reason to refuse (a page pinned for I/O) is refused again.
                    cow_broken = done;
                    // Only a page that is there: populating a missing one would fault on a
                    // page the caller holds (the kernel's count can be short of what moved).
                    if crate::sys::resident(src + done) {
                        // SAFETY: advice on a page of the caller's range, present.
                        let broke =
                            unsafe { crate::sys::madvise(src + done, PAGE, MADV_POPULATE_WRITE) };
                        if broke.is_ok() {
                            continue;
                        }
                    }
                }
                return Err(self.maybe_underreport(Partial { done, error }));
            }
        }
        match self.maybe_underreport(Partial {
            done,
            error: io::Error::from_raw_os_error(0),
        }) {
            p if p.done == len => Ok(()),
            p => Err(p),
        }
    }

    /// The injected under-report (see `underreport_every`).
    fn maybe_underreport(&self, p: Partial) -> Partial {
        let every = self.underreport_every.load(Ordering::Relaxed);
        if every == 0
            || p.done < PAGE
            || !self
                .moves
                .fetch_add(1, Ordering::Relaxed)
                .is_multiple_of(every)
        {
            return p;
        }
        Partial {
            done: p.done - PAGE,
            error: io::Error::from_raw_os_error(libc::EEXIST),
        }
    }

    /// Moves the pages of `[src, src+PAGE*moved.len())` to `dst` as [`move_pages`] does and
    /// says which moved: `moved[j]` for page `j`. When the kernel reports success every page
    /// moved; after a failure, which pages moved is read from the page tables (a page moved
    /// when its source is empty and its destination holds a page), because the kernel's count
    /// is not the truth on 6.18 (after an internal retry it can move pages it does not report).
    /// Threads waiting on faults at pages that moved unreported are woken here (the kernel
    /// wakes only what it reports). An error is returned only when the page tables cannot be
    /// read or a wake fails. Async-signal-safe.
    ///
    /// # Safety
    ///
    /// As [`move_pages`]; and no other thread maps or unmaps pages in either range meanwhile
    /// (the caller owns them), so that what the page tables say is this move's doing.
    ///
    /// [`move_pages`]: Self::move_pages
    pub unsafe fn move_verified(
        &self,
        pagemap: &Pagemap,
        dst: usize,
        src: usize,
        moved: &mut [bool],
    ) -> io::Result<MoveReport> {
        let n = moved.len();
        // SAFETY: forwarded contract.
        let error = match unsafe { self.move_pages(dst, src, n * PAGE) } {
            Ok(()) => {
                moved.fill(true);
                return Ok(MoveReport {
                    moved: n,
                    underreported: 0,
                    error: None,
                });
            }
            Err(e) => e,
        };
        let reported = error.done / PAGE;
        let mut report = MoveReport {
            moved: 0,
            underreported: 0,
            error: Some(error.error),
        };
        const CHUNK: usize = 64;
        let mut from = [Presence::Absent; CHUNK];
        let mut to = [Presence::Absent; CHUNK];
        for first in (0..n).step_by(CHUNK) {
            let k = CHUNK.min(n - first);
            pagemap.read(src + first * PAGE, &mut from[..k])?;
            pagemap.read(dst + first * PAGE, &mut to[..k])?;
            for j in 0..k {
                let m = from[j] == Presence::Absent && to[j] != Presence::Absent;
                moved[first + j] = m;
                if m {
                    report.moved += 1;
                    if first + j >= reported {
                        report.underreported += 1;
                    }
                }
            }
        }
        // The kernel wakes the threads waiting on the pages it reports as moved; a page that
        // moved without being reported would leave a thread faulting there asleep for good.
        let mut j = reported;
        while j < n {
            if !moved[j] {
                j += 1;
                continue;
            }
            let start = j;
            while j < n && moved[j] {
                j += 1;
            }
            self.wake(dst + start * PAGE, (j - start) * PAGE)?;
        }
        Ok(report)
    }
}
