//! Thin, async-signal-safe wrappers over the system calls the engine uses.
//!
//! The engine runs inside programs whose `mmap`, `read`, `write` and `sigaction` may be
//! interposed by memtide's own preload library, so it never calls those through libc: it issues
//! the raw system calls here. Everything in this file is safe to call from a signal handler
//! (no allocation, no locks). Entry points: [`Mapping`], [`Pagemap`], [`futex_wait`], [`futex_wake`],
//! [`now_ns`].

use std::io;
use std::sync::atomic::AtomicU32;

use memtide_policy::PAGE_SIZE;

/// Turns a raw system-call return value into a result, keeping errno.
fn check(ret: libc::c_long) -> io::Result<usize> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret as usize)
    }
}

/// `mmap(2)` as a raw system call.
///
/// # Safety
///
/// The caller must uphold `mmap`'s contract: with `MAP_FIXED`, nothing of value may live in the
/// target range.
pub unsafe fn mmap(
    addr: usize,
    len: usize,
    prot: i32,
    flags: i32,
    fd: i32,
    off: i64,
) -> io::Result<usize> {
    // SAFETY: forwarded contract of this function.
    let ret = unsafe { libc::syscall(libc::SYS_mmap, addr, len, prot, flags, fd, off) };
    check(ret)
}

/// `munmap(2)` as a raw system call.
///
/// # Safety
///
/// Nothing may use the range afterwards.
pub unsafe fn munmap(addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: forwarded contract of this function.
    check(unsafe { libc::syscall(libc::SYS_munmap, addr, len) }).map(drop)
}

/// `madvise(2)` as a raw system call.
///
/// # Safety
///
/// Advice that discards memory (`MADV_DONTNEED`) destroys the range's contents.
pub unsafe fn madvise(addr: usize, len: usize, advice: i32) -> io::Result<()> {
    // SAFETY: forwarded contract of this function.
    check(unsafe { libc::syscall(libc::SYS_madvise, addr, len, advice) }).map(drop)
}

/// `mremap(2)` as a raw system call.
///
/// # Safety
///
/// As `mremap`: the old range is invalid afterwards when the mapping moves.
pub unsafe fn mremap(
    old: usize,
    old_len: usize,
    new_len: usize,
    flags: i32,
    new_addr: usize,
) -> io::Result<usize> {
    // SAFETY: forwarded contract of this function.
    check(unsafe { libc::syscall(libc::SYS_mremap, old, old_len, new_len, flags, new_addr) })
}

/// `mprotect(2)` as a raw system call.
///
/// # Safety
///
/// Removing access from memory in use makes later accesses fault.
pub unsafe fn mprotect(addr: usize, len: usize, prot: i32) -> io::Result<()> {
    // SAFETY: forwarded contract of this function.
    check(unsafe { libc::syscall(libc::SYS_mprotect, addr, len, prot) }).map(drop)
}

/// Reads `len` bytes at `off` of `fd` into `buf`, retrying on EINTR and short reads.
///
/// # Safety
///
/// `buf..buf+len` must be writable memory that nothing else uses meanwhile.
pub unsafe fn pread_full(fd: i32, buf: *mut u8, len: usize, off: u64) -> io::Result<()> {
    let mut done = 0;
    while done < len {
        // SAFETY: the caller guarantees the buffer; we stay inside it.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_pread64,
                fd,
                buf.add(done),
                len - done,
                (off + done as u64) as i64,
            )
        };
        match check(ret) {
            Ok(0) => return Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes all of `iov` at `off` of `fd` (one `pwritev` per attempt, retried on short writes).
///
/// # Safety
///
/// Every iovec must describe readable memory.
pub unsafe fn pwritev_full(fd: i32, iov: &mut [libc::iovec], mut off: u64) -> io::Result<()> {
    let mut first = 0;
    while first < iov.len() {
        let batch = &mut iov[first..];
        let cnt = batch.len().min(libc::UIO_MAXIOV as usize);
        // SAFETY: the caller guarantees the iovecs point at readable memory.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_pwritev,
                fd,
                batch.as_ptr(),
                cnt,
                off as libc::c_long,
                (off >> 32 >> 32) as libc::c_long,
            )
        };
        let mut n = match check(ret) {
            Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        off += n as u64;
        while n > 0 {
            let v = &mut iov[first];
            if n >= v.iov_len {
                n -= v.iov_len;
                first += 1;
            } else {
                v.iov_base = (v.iov_base as usize + n) as *mut libc::c_void;
                v.iov_len -= n;
                n = 0;
            }
        }
    }
    Ok(())
}

/// Blocks while `*word == expected`, at most `timeout_ns` (0: no limit). Spurious returns happen;
/// callers re-check their condition.
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout_ns: u64) {
    let ts = libc::timespec {
        tv_sec: (timeout_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (timeout_ns % 1_000_000_000) as libc::c_long,
    };
    let tsp = if timeout_ns == 0 {
        std::ptr::null()
    } else {
        &ts as *const libc::timespec
    };
    // SAFETY: `word` is a valid, aligned u32 for the duration of the call; FUTEX_WAIT only reads it.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            expected,
            tsp,
        );
    }
}

/// Wakes every thread blocked in [`futex_wait`] on `word`.
pub fn futex_wake(word: &AtomicU32) {
    // SAFETY: `word` is a valid, aligned u32; FUTEX_WAKE does not access it.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            i32::MAX,
        );
    }
}

fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer; clock_gettime is async-signal-safe.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Gives up the CPU to another runnable thread (async-signal-safe).
pub fn yield_cpu() {
    // SAFETY: no arguments; it cannot fail in a way that matters here.
    unsafe { libc::sched_yield() };
}

/// Monotonic time in nanoseconds.
pub fn now_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// CPU time of the calling thread in nanoseconds.
pub fn thread_cpu_ns() -> u64 {
    clock_ns(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// Blocks every signal that can be blocked in the calling thread and returns the previous mask.
/// Used around sections that hold a page busy in normal context, so that a program's own signal
/// handler cannot touch that page on the same thread and wait for itself.
pub fn block_signals() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigfillset initializes it fully.
    let mut all: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointers to sigset_t values.
    unsafe {
        libc::sigfillset(&mut all);
        libc::sigdelset(&mut all, libc::SIGBUS);
        libc::sigdelset(&mut all, libc::SIGSEGV);
        libc::syscall(
            libc::SYS_rt_sigprocmask,
            libc::SIG_BLOCK,
            &all as *const libc::sigset_t,
            &mut old as *mut libc::sigset_t,
            8usize,
        );
    }
    old
}

/// Restores a mask returned by [`block_signals`].
pub fn restore_signals(old: &libc::sigset_t) {
    // SAFETY: `old` is a valid sigset_t.
    unsafe {
        libc::syscall(
            libc::SYS_rt_sigprocmask,
            libc::SIG_SETMASK,
            old as *const libc::sigset_t,
            std::ptr::null_mut::<libc::sigset_t>(),
            8usize,
        );
    }
}

/// An anonymous private mapping owned by the engine, unmapped on drop.
pub struct Mapping {
    addr: usize,
    len: usize,
}

impl Mapping {
    /// Maps `len` bytes (rounded up to pages) of zeroed, read-write, never-reserved memory.
    pub fn anon(len: usize) -> io::Result<Mapping> {
        Mapping::fresh(
            len,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
        )
    }

    /// Maps `len` bytes (rounded up to pages), read-write, with `flags`, of file `fd` (-1:
    /// anonymous memory), at a kernel-chosen address.
    fn fresh(len: usize, flags: i32, fd: i32) -> io::Result<Mapping> {
        let len = round_up(len.max(1), PAGE_SIZE);
        // SAFETY: a fresh mapping at a kernel-chosen address cannot clobber anything.
        let addr = unsafe { mmap(0, len, libc::PROT_READ | libc::PROT_WRITE, flags, fd, 0)? };
        Ok(Mapping { addr, len })
    }

    /// Maps `len` bytes (rounded up to pages) of zeroed memory shared with the children this
    /// process forks (`MAP_SHARED`): what one writes, the others see.
    pub fn shared_anon(len: usize) -> io::Result<Mapping> {
        Mapping::fresh(
            len,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
        )
    }

    /// Maps the first `len` bytes of file `fd` (grown to that length if shorter), shared: what
    /// any process mapping the file writes, the others see.
    pub fn shared_file(fd: i32, len: usize) -> io::Result<Mapping> {
        let len = round_up(len.max(1), PAGE_SIZE);
        // SAFETY: all-zero bytes are a valid stat struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat fills a stat struct of ours.
        check(unsafe { libc::fstat(fd, &mut st) } as libc::c_long)?;
        if (st.st_size as usize) < len {
            // SAFETY: growing a file of ours.
            check(unsafe { libc::ftruncate(fd, len as libc::off_t) } as libc::c_long)?;
        }
        Mapping::fresh(len, libc::MAP_SHARED, fd)
    }

    pub fn addr(&self) -> usize {
        self.addr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Views the mapping as a slice of `T` (zero bytes must be a valid `T`, as for atomics).
    pub fn as_slice<T>(&self) -> &[T] {
        // SAFETY: the mapping is readable and writable, page aligned, zero-initialized, and lives
        // as long as `self`; callers use types whose all-zero bit pattern is valid (atomics).
        unsafe {
            std::slice::from_raw_parts(self.addr as *const T, self.len / std::mem::size_of::<T>())
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping is owned by self and nothing refers to it after drop.
        let _ = unsafe { munmap(self.addr, self.len) };
    }
}

/// Rounds `x` up to a multiple of `to` (a power of two).
pub fn round_up(x: usize, to: usize) -> usize {
    (x + to - 1) & !(to - 1)
}

/// Whether the 4 KiB page at `addr` is all zero bytes.
///
/// # Safety
///
/// `addr` must point at a readable, page-aligned page.
pub unsafe fn page_is_zero(addr: usize) -> bool {
    // SAFETY: the caller guarantees a readable, aligned page.
    let words = unsafe { std::slice::from_raw_parts(addr as *const u64, PAGE_SIZE / 8) };
    words.iter().all(|&w| w == 0)
}

/// The fields of a /proc stat file (`/proc/PID/stat`, `/proc/self/task/TID/stat`) after the
/// command name, which may hold spaces and ')': the first is the state (field 3 in proc(5)).
pub fn stat_fields(path: &str) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(path).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    Some(rest.split_whitespace().map(String::from).collect())
}

/// Where the kernel keeps a page of this process's memory (from `/proc/self/pagemap`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Presence {
    /// In DRAM and mapped.
    Present,
    /// Swapped out by Linux: when swap is on, reclaim and DAMON may page out any anonymous
    /// page, managed memory included. A touch swaps it back in (not a missing-page fault).
    Swapped,
    /// Nothing there: a touch is a missing-page fault.
    Absent,
}

/// This process's `/proc/self/pagemap`, kept open: the engine reads it after every failed
/// move, from the fault path too, and must not need a free file descriptor at that moment.
pub struct Pagemap {
    fd: i32,
}

impl Pagemap {
    pub fn open() -> io::Result<Pagemap> {
        Ok(Pagemap {
            fd: crate::fds::lift_raw(Pagemap::open_raw()?),
        })
    }

    /// In a forked child: reads this process's page tables from now on (the descriptor
    /// inherited from the parent reads the parent's), at the same descriptor number.
    pub fn reopen(&self) -> io::Result<()> {
        let fresh = Pagemap::open_raw()?;
        // SAFETY: dup3 (the system call: the preload library refuses dup3 onto memtide's own) onto our own descriptor, then closing the fresh one.
        let ret = unsafe { libc::syscall(libc::SYS_dup3, fresh, self.fd, libc::O_CLOEXEC) };
        let e = io::Error::last_os_error();
        // SAFETY: `fresh` is ours.
        unsafe { libc::close(fresh) };
        if ret < 0 {
            return Err(e);
        }
        Ok(())
    }

    fn open_raw() -> io::Result<i32> {
        const PATH: &[u8] = b"/proc/self/pagemap\0";
        // SAFETY: opening a file by a NUL-terminated path.
        Ok(check(unsafe {
            libc::syscall(
                libc::SYS_openat,
                libc::AT_FDCWD,
                PATH.as_ptr(),
                libc::O_RDONLY | libc::O_CLOEXEC,
            )
        })? as i32)
    }

    /// Fills `out` with the presence of the pages from `addr` on, one entry per page.
    pub fn read(&self, addr: usize, out: &mut [Presence]) -> io::Result<()> {
        // Small enough for a signal handler's stack.
        let mut buf = [0u64; 64];
        let mut done = 0;
        while done < out.len() {
            let n = (out.len() - done).min(buf.len());
            let off = ((addr / PAGE_SIZE + done) * 8) as i64;
            // SAFETY: reading at most `buf`'s size into `buf`.
            let ret =
                unsafe { libc::syscall(libc::SYS_pread64, self.fd, buf.as_mut_ptr(), n * 8, off) };
            match check(ret) {
                Ok(b) if b >= 8 => {
                    for (k, &e) in buf[..b / 8].iter().enumerate() {
                        // Bit 63: present; bit 62: swapped.
                        out[done + k] = if e >> 63 & 1 == 1 {
                            Presence::Present
                        } else if e >> 62 & 1 == 1 {
                            Presence::Swapped
                        } else {
                            Presence::Absent
                        };
                    }
                    done += b / 8;
                }
                Ok(_) => return Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Calls `written(start, end)` for each run of pages in `[start, end)` written since they
    /// were last write-protected (or mapped unprotected), and write-protects them again, at
    /// once (`PAGEMAP_SCAN`, Linux 6.7; only memory registered for asynchronous
    /// write-protection is read, [`Uffd::tracks_writes`](crate::uffd::Uffd::tracks_writes);
    /// the rest of the range is skipped). Allocates nothing.
    pub fn written(
        &self,
        start: usize,
        end: usize,
        mut written: impl FnMut(usize, usize),
    ) -> io::Result<()> {
        #[repr(C)]
        #[derive(Clone, Copy, Default)]
        struct PageRegion {
            start: u64,
            end: u64,
            categories: u64,
        }
        #[repr(C)]
        #[derive(Default)]
        struct PmScanArg {
            size: u64,
            flags: u64,
            start: u64,
            end: u64,
            walk_end: u64,
            vec: u64,
            vec_len: u64,
            max_pages: u64,
            category_inverted: u64,
            category_mask: u64,
            category_anyof_mask: u64,
            return_mask: u64,
        }
        const PM_SCAN_WP_MATCHING: u64 = 1;
        const PAGE_IS_WRITTEN: u64 = 2;
        const PAGE_IS_PRESENT: u64 = 8;
        const PAGEMAP_SCAN: u64 =
            (3 << 30) | ((std::mem::size_of::<PmScanArg>() as u64) << 16) | (b'f' as u64) << 8 | 16;
        let mut regions = [PageRegion::default(); 64];
        let mut at = start;
        while at < end {
            let mut arg = PmScanArg {
                size: std::mem::size_of::<PmScanArg>() as u64,
                // Not PM_SCAN_CHECK_WPASYNC: a mapping of the program's own over managed
                // memory (MAP_FIXED) is not registered, and is skipped rather than refused.
                flags: PM_SCAN_WP_MATCHING,
                start: at as u64,
                end: end as u64,
                vec: regions.as_mut_ptr() as u64,
                vec_len: regions.len() as u64,
                // Present pages only: write-protecting a missing one would leave a marker
                // there, onto which UFFDIO_MOVE and UFFDIO_ZEROPAGE then fail with EEXIST.
                category_mask: PAGE_IS_WRITTEN | PAGE_IS_PRESENT,
                return_mask: PAGE_IS_WRITTEN,
                ..PmScanArg::default()
            };
            // SAFETY: PAGEMAP_SCAN reads `arg` and writes at most `vec_len` regions into our
            // array and `walk_end` into `arg`.
            let ret = unsafe { libc::ioctl(self.fd, PAGEMAP_SCAN as _, &mut arg) };
            if ret < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            for r in &regions[..ret as usize] {
                written(r.start as usize, r.end as usize);
            }
            if arg.walk_end as usize <= at {
                break;
            }
            at = arg.walk_end as usize;
        }
        Ok(())
    }

    /// Presence of the one page at `addr`.
    pub fn of(&self, addr: usize) -> io::Result<Presence> {
        let mut one = [Presence::Absent];
        self.read(addr, &mut one).map(|()| one[0])
    }
}

impl Drop for Pagemap {
    fn drop(&mut self) {
        crate::fds::forget(self.fd);
        // SAFETY: closing the descriptor this value owns.
        unsafe { libc::syscall(libc::SYS_close, self.fd) };
    }
}

/// Fills `out` with the presence of the pages from `addr` on, one entry per page (opening
/// pagemap for the call).
pub fn presence(addr: usize, out: &mut [Presence]) -> io::Result<()> {
    Pagemap::open()?.read(addr, out)
}

/// Presence of the one page at `addr`; `None` if pagemap cannot be read.
pub fn presence_of(addr: usize) -> Option<Presence> {
    let mut one = [Presence::Absent];
    presence(addr, &mut one).ok().map(|()| one[0])
}

/// `MADV_DONTNEED_LOCKED` (Linux 5.18): `MADV_DONTNEED` that also works on locked memory.
const MADV_DONTNEED_LOCKED: i32 = 24;

/// Drops the pages of a range (they read as missing afterwards), locked or not.
///
/// # Safety
///
/// The range's contents are destroyed.
pub unsafe fn discard(addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: forwarded contract of this function.
    match unsafe { madvise(addr, len, MADV_DONTNEED_LOCKED) } {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            // An older kernel: plain DONTNEED (the range is then not locked: see `lock_on_fault`).
            // SAFETY: as above.
            unsafe { madvise(addr, len, libc::MADV_DONTNEED) }
        }
        r => r,
    }
}

/// Locks a range's pages in DRAM as they are faulted in (`mlock2(MLOCK_ONFAULT)`), so that
/// Linux never swaps them out; `unlock` undoes it.
/// Creates `path`, which must not exist (mode 0600, close-on-exec), for reading and writing,
/// and asks for O_DIRECT on it afterwards, so that a filesystem without O_DIRECT (ramfs, some
/// network filesystems) refuses only that. Returns the file and whether O_DIRECT took.
pub fn create_new_direct(path: &std::path::Path) -> io::Result<(std::fs::File, bool)> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    // SAFETY: plain fcntl calls on our own fd.
    let direct = unsafe {
        let fl = libc::fcntl(f.as_raw_fd(), libc::F_GETFL);
        libc::fcntl(f.as_raw_fd(), libc::F_SETFL, fl | libc::O_DIRECT) == 0
    };
    Ok((f, direct))
}

pub fn lock_on_fault(addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: mlock2 changes only the range's flags.
    check(unsafe { libc::syscall(libc::SYS_mlock2, addr, len, libc::MLOCK_ONFAULT) }).map(drop)
}

pub fn unlock(addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: munlock changes only the range's flags.
    check(unsafe { libc::syscall(libc::SYS_munlock, addr, len) }).map(drop)
}

/// The process, user and group at the other end of a connected Unix socket (`SO_PEERCRED`:
/// what the kernel recorded when it connected, not what the peer claims).
pub fn peer_credentials(sock: &std::os::unix::net::UnixStream) -> io::Result<(u32, u32, u32)> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, which is that large.
    check(unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            &mut cred as *mut libc::ucred as *mut libc::c_void,
            &mut len,
        ) as i64
    })?;
    Ok((cred.pid as u32, cred.uid, cred.gid))
}

/// This process's effective user id.
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// Fills `buf` from the kernel's random source (getrandom(2)).
pub fn random_bytes(buf: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        // SAFETY: getrandom writes at most the given length into the buffer.
        let n = unsafe {
            libc::getrandom(
                buf[done..].as_mut_ptr() as *mut libc::c_void,
                buf.len() - done,
                0,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        done += n as usize;
    }
    Ok(())
}

/// Sends `sig` to process `pid` (the caller's own child, not yet reaped: a reaped pid may be
/// another process's by now).
pub fn kill(pid: u32, sig: i32) -> io::Result<()> {
    // SAFETY: kill has no memory-safety preconditions.
    if unsafe { libc::kill(pid as libc::pid_t, sig) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// What a process used, from `getrusage` or `wait4`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Usage {
    /// Peak resident set (VmHWM), bytes.
    pub peak_rss: u64,
    /// Faults that waited for a read (swap-ins, file reads).
    pub major_faults: u64,
    /// User plus system CPU time.
    pub cpu_seconds: f64,
}

impl Usage {
    fn of(ru: &libc::rusage) -> Usage {
        let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
        Usage {
            peak_rss: ru.ru_maxrss.max(0) as u64 * 1024,
            major_faults: ru.ru_majflt.max(0) as u64,
            cpu_seconds: secs(ru.ru_utime) + secs(ru.ru_stime),
        }
    }
}

/// This process's own usage so far.
pub fn usage_of_self() -> Usage {
    // SAFETY: plain data, filled by getrusage.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid out-pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    Usage::of(&ru)
}

/// Waits for child `pid` to end: its wait status and what it used.
pub fn wait_child(pid: u32) -> io::Result<(i32, Usage)> {
    let mut status = 0;
    // SAFETY: plain data, filled by wait4.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: waiting for the caller's child, with valid out-pointers.
        let r = unsafe { libc::wait4(pid as libc::pid_t, &mut status, 0, &mut ru) };
        if r >= 0 {
            return Ok((status, Usage::of(&ru)));
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Gives the file `fd` refers to `bytes` of allocated blocks (fallocate), as a swap file or
/// a tier file needs.
pub fn allocate(fd: &impl std::os::fd::AsRawFd, bytes: u64) -> io::Result<()> {
    // SAFETY: fallocate on a descriptor the caller owns.
    if unsafe { libc::fallocate(fd.as_raw_fd(), 0, 0, bytes as libc::off_t) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Sets `sig`'s disposition to `handler` (a plain `extern "C"` function, or `SIG_IGN`).
pub fn set_signal_handler(sig: i32, handler: libc::sighandler_t) {
    // SAFETY: installing a disposition; a handler given here must be async-signal-safe.
    unsafe { libc::signal(sig, handler) };
}

/// Starts a new session for this process (it leaves the terminal's signals behind).
pub fn new_session() {
    // SAFETY: setsid has no memory-safety preconditions.
    unsafe { libc::setsid() };
}

/// Whether the page at `addr` is in this process's page tables (`mincore`: no fault, no
/// allocation; async-signal-safe).
pub fn resident(addr: usize) -> bool {
    let mut v = 0u8;
    // SAFETY: mincore writes one byte for one page into `v`.
    let r = unsafe { libc::mincore(addr as *mut libc::c_void, PAGE_SIZE, &mut v) };
    r == 0 && v & 1 != 0
}

/// A connected pair of Unix stream sockets, close-on-exec (a forking parent passes its child
/// the child's userfaultfd on one).
pub fn socket_pair() -> io::Result<(i32, i32)> {
    let mut fds = [-1i32; 2];
    // SAFETY: socketpair writes two descriptors into `fds`.
    check(unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        ) as libc::c_long
    })?;
    Ok((fds[0], fds[1]))
}

/// Sends descriptor `fd` over socket `sock` (SCM_RIGHTS, with one byte of data).
pub fn send_fd(sock: i32, fd: i32) -> io::Result<()> {
    let mut byte = 1u8;
    let mut iov = libc::iovec {
        iov_base: &mut byte as *mut u8 as *mut libc::c_void,
        iov_len: 1,
    };
    // Room for one descriptor's control message, aligned for cmsghdr.
    let mut cbuf = [0u64; 8];
    // SAFETY: building a msghdr over our own buffers; CMSG_* compute within `cbuf`.
    unsafe {
        let space = libc::CMSG_SPACE(std::mem::size_of::<i32>() as u32) as usize;
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = space;
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<i32>() as u32) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut i32, fd);
        loop {
            let r = libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL);
            if r >= 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINTR) {
                return Err(e);
            }
        }
    }
}

/// Receives a descriptor sent with [`send_fd`] (close-on-exec).
pub fn recv_fd(sock: i32) -> io::Result<i32> {
    let mut byte = 0u8;
    let mut iov = libc::iovec {
        iov_base: &mut byte as *mut u8 as *mut libc::c_void,
        iov_len: 1,
    };
    let mut cbuf = [0u64; 8];
    // SAFETY: a msghdr over our own buffers; the control message is read within `cbuf`.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = std::mem::size_of_val(&cbuf);
        loop {
            let r = libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC);
            if r > 0 {
                break;
            }
            if r == 0 {
                return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
            }
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINTR) {
                return Err(e);
            }
        }
        let c = libc::CMSG_FIRSTHDR(&msg);
        if c.is_null() || (*c).cmsg_level != libc::SOL_SOCKET || (*c).cmsg_type != libc::SCM_RIGHTS
        {
            return Err(io::Error::other("no descriptor in the message"));
        }
        Ok(std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const i32))
    }
}

/// Writes one byte to socket `sock`.
pub fn send_byte(sock: i32, b: u8) -> io::Result<()> {
    loop {
        // SAFETY: sending one byte from our own variable.
        let r = unsafe {
            libc::send(
                sock,
                &b as *const u8 as *const libc::c_void,
                1,
                libc::MSG_NOSIGNAL,
            )
        };
        if r >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

/// Reads one byte from socket `sock`: `None` at end of stream.
pub fn recv_byte(sock: i32) -> io::Result<Option<u8>> {
    let mut b = 0u8;
    loop {
        // SAFETY: reading one byte into our own variable.
        let r = unsafe { libc::recv(sock, &mut b as *mut u8 as *mut libc::c_void, 1, 0) };
        if r > 0 {
            return Ok(Some(b));
        }
        if r == 0 {
            return Ok(None);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

#[cfg(test)]
mod usage_tests {
    use super::*;

    #[test]
    #[allow(clippy::zombie_processes)] // reaped by wait_child, which clippy cannot see
    fn a_childs_usage_and_status_come_back_from_the_wait() {
        let child = std::process::Command::new("sh")
            .args(["-c", "exit 3"])
            .spawn()
            .unwrap();
        let (status, usage) = wait_child(child.id()).unwrap();
        assert!(libc::WIFEXITED(status));
        assert_eq!(libc::WEXITSTATUS(status), 3);
        assert!(usage.peak_rss > 0, "{usage:?}");
        assert!(usage_of_self().peak_rss > 0);
        assert!(kill(child.id(), 0).is_err(), "reaped: no such process");
    }
}
