//! Every symbol this library overrides, in one file: the malloc family (large blocks become
//! managed memory), the mmap family (large private anonymous mappings become managed memory;
//! calls on managed ranges keep their meaning), SIGBUS disposition and masks (the engine's
//! fault handler stays first and SIGBUS is never blocked), and the system calls that read or
//! write user memory from the kernel (their managed buffers are brought in and pinned first,
//! because in SIGBUS mode a kernel access to a missing page fails the call with EFAULT).

#![allow(clippy::missing_safety_doc)]

use std::sync::atomic::Ordering;

use libc::{c_char, c_int, c_void, iovec, msghdr, off_t, size_t, sockaddr, socklen_t, ssize_t};
use memtide_engine::{signal, Engine, MemError};

use crate::next::{self, next};
use crate::{engine, engine_or_start, signal_faults, IO_CHUNK, THRESHOLD};

const PAGE: usize = 4096;

fn set_errno(e: c_int) {
    // SAFETY: errno is always valid for the calling thread.
    unsafe { *libc::__errno_location() = e };
}

fn threshold() -> usize {
    THRESHOLD.load(Ordering::Relaxed)
}

/// The engine, if `p` is managed memory.
fn managed(p: *const c_void) -> Option<&'static Engine> {
    engine().filter(|e| e.contains(p as usize))
}

/// A managed block of at least `n` bytes aligned to `align`, if `n` is large enough and the
/// engine runs.
fn managed_alloc(n: usize, align: usize) -> Option<*mut c_void> {
    if n < threshold() {
        return None;
    }
    let e = engine_or_start()?;
    e.alloc_malloc(n, align.max(PAGE))
        .ok()
        .map(|p| p as *mut c_void)
}

// ----- the malloc family -----

/// The engine's own threads allocate from glibc, never from the program's allocator nor from
/// managed memory (see `memtide_engine::threads`).
fn engine_thread() -> bool {
    memtide_engine::threads::is_engine_thread()
}

#[no_mangle]
pub unsafe extern "C" fn malloc(n: size_t) -> *mut c_void {
    if engine_thread() {
        // SAFETY: glibc's allocator.
        return unsafe { crate::__libc_malloc(n) };
    }
    if let Some(p) = managed_alloc(n, PAGE) {
        return p;
    }
    match next() {
        // SAFETY: the program's own allocator (the next definition of malloc).
        Some(f) => unsafe { (f.malloc)(n) },
        None => next::bootstrap_alloc(n, 16),
    }
}

#[no_mangle]
pub unsafe extern "C" fn free(p: *mut c_void) {
    if p.is_null() {
        return;
    }
    if engine_thread() {
        // SAFETY: an engine thread frees only what it allocated, from glibc.
        return unsafe { crate::__libc_free(p) };
    }
    if let Some(e) = managed(p) {
        if let Some(len) = e.malloc_len(p as usize) {
            let _ = e.release(p as usize, len);
            return;
        }
        // Otherwise a block of the program's allocator placed in a managed mapping.
    }
    if next::is_bootstrap(p) {
        return;
    }
    if let Some(f) = next() {
        // SAFETY: not managed and not ours, so the program's allocator's.
        unsafe { (f.free)(p) }
    }
}

#[no_mangle]
pub unsafe extern "C" fn calloc(n: size_t, size: size_t) -> *mut c_void {
    let Some(total) = n.checked_mul(size) else {
        set_errno(libc::ENOMEM);
        return std::ptr::null_mut();
    };
    if engine_thread() {
        // SAFETY: glibc's allocator.
        return unsafe { crate::__libc_calloc(n, size) };
    }
    // Managed memory reads as zeros already.
    if let Some(p) = managed_alloc(total, PAGE) {
        return p;
    }
    match next() {
        // SAFETY: the program's own allocator.
        Some(f) => unsafe { (f.calloc)(n, size) },
        // The bootstrap area is zeroed static memory, never reused.
        None => next::bootstrap_alloc(total, 16),
    }
}

#[no_mangle]
pub unsafe extern "C" fn realloc(p: *mut c_void, n: size_t) -> *mut c_void {
    if engine_thread() {
        // SAFETY: glibc's allocator, which allocated p.
        return unsafe { crate::__libc_realloc(p, n) };
    }
    if p.is_null() {
        // SAFETY: as malloc.
        return unsafe { malloc(n) };
    }
    if n == 0 {
        // SAFETY: as free; glibc's realloc(p, 0) frees and returns NULL.
        unsafe { free(p) };
        return std::ptr::null_mut();
    }
    if next::is_bootstrap(p) {
        // SAFETY: a fresh block; the old one is readable up to its recorded size.
        unsafe {
            let q = malloc(n);
            if !q.is_null() {
                std::ptr::copy_nonoverlapping(
                    p as *const u8,
                    q as *mut u8,
                    next::bootstrap_len(p).min(n),
                );
            }
            return q;
        }
    }
    if let Some((e, old)) = managed(p).and_then(|e| Some((e, e.malloc_len(p as usize)?))) {
        if n >= threshold() {
            if let Ok(q) = e.remap(p as usize, old, n, true) {
                return q as *mut c_void;
            }
        }
        // Shrinking below the threshold, or the engine cannot grow it (after fork): copy.
        // SAFETY: a fresh block of n bytes; `old` bytes of p are readable managed memory.
        unsafe {
            let q = if n >= threshold() && !e.in_child() && !e.is_detached() {
                malloc(n)
            } else {
                match next() {
                    Some(f) => (f.malloc)(n),
                    None => next::bootstrap_alloc(n, 16),
                }
            };
            if q.is_null() {
                return q;
            }
            std::ptr::copy_nonoverlapping(p as *const u8, q as *mut u8, old.min(n));
            let _ = e.release(p as usize, old);
            return q;
        }
    }
    let Some(f) = next() else {
        return std::ptr::null_mut();
    };
    if n >= threshold() {
        if let Some(q) = managed_alloc(n, PAGE) {
            // SAFETY: p is a live block of the program's allocator of usable_size(p) bytes.
            unsafe {
                let old = (f.usable_size)(p);
                std::ptr::copy_nonoverlapping(p as *const u8, q as *mut u8, old.min(n));
                (f.free)(p);
            }
            return q;
        }
    }
    // SAFETY: the program's allocator's block.
    unsafe { (f.realloc)(p, n) }
}

#[no_mangle]
pub unsafe extern "C" fn reallocarray(p: *mut c_void, n: size_t, size: size_t) -> *mut c_void {
    match n.checked_mul(size) {
        // SAFETY: as realloc.
        Some(total) => unsafe { realloc(p, total) },
        None => {
            set_errno(libc::ENOMEM);
            std::ptr::null_mut()
        }
    }
}

fn aligned(align: usize, n: usize) -> *mut c_void {
    if engine_thread() {
        // SAFETY: glibc's allocator.
        return unsafe { crate::__libc_memalign(align.max(16), n) };
    }
    if let Some(p) = managed_alloc(n, align) {
        return p;
    }
    match next() {
        Some(f) => {
            let mut out = std::ptr::null_mut();
            // posix_memalign wants a multiple of the pointer size.
            let align = align.max(std::mem::size_of::<usize>());
            // SAFETY: the program's own allocator with a valid out-pointer.
            match unsafe { (f.posix_memalign)(&mut out, align, n) } {
                0 => out,
                e => fail(e, std::ptr::null_mut()),
            }
        }
        None => next::bootstrap_alloc(n, align),
    }
}

#[no_mangle]
pub unsafe extern "C" fn posix_memalign(out: *mut *mut c_void, align: size_t, n: size_t) -> c_int {
    if !align.is_power_of_two() || !align.is_multiple_of(std::mem::size_of::<usize>()) {
        return libc::EINVAL;
    }
    let p = aligned(align, n);
    if p.is_null() {
        return libc::ENOMEM;
    }
    // SAFETY: the caller passes a valid out-pointer.
    unsafe { *out = p };
    0
}

#[no_mangle]
pub unsafe extern "C" fn aligned_alloc(align: size_t, n: size_t) -> *mut c_void {
    aligned(align, n)
}

#[no_mangle]
pub unsafe extern "C" fn memalign(align: size_t, n: size_t) -> *mut c_void {
    aligned(align, n)
}

#[no_mangle]
pub unsafe extern "C" fn valloc(n: size_t) -> *mut c_void {
    aligned(PAGE, n)
}

#[no_mangle]
pub unsafe extern "C" fn pvalloc(n: size_t) -> *mut c_void {
    aligned(PAGE, n.next_multiple_of(PAGE))
}

#[no_mangle]
pub unsafe extern "C" fn malloc_usable_size(p: *mut c_void) -> size_t {
    if p.is_null() {
        return 0;
    }
    if let Some(n) = managed(p).and_then(|e| e.malloc_len(p as usize)) {
        return n;
    }
    if next::is_bootstrap(p) {
        return next::bootstrap_len(p);
    }
    match next() {
        // SAFETY: the program's allocator's block.
        Some(f) => unsafe { (f.usable_size)(p) },
        None => 0,
    }
}

// ----- the mmap family -----

fn fail<T>(e: c_int, v: T) -> T {
    set_errno(e);
    v
}

fn mem_errno(e: MemError) -> c_int {
    match e {
        MemError::NoRoom => libc::ENOMEM,
        MemError::NotManaged | MemError::Unsupported => libc::EINVAL,
    }
}

#[no_mangle]
pub unsafe extern "C" fn mmap(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: off_t,
) -> *mut c_void {
    let fixed = flags & (libc::MAP_FIXED | libc::MAP_FIXED_NOREPLACE) != 0;
    let anon_private = flags & libc::MAP_ANONYMOUS != 0
        && flags & libc::MAP_PRIVATE != 0
        && flags & (libc::MAP_STACK | libc::MAP_GROWSDOWN | libc::MAP_HUGETLB) == 0;
    if fixed {
        if let Some(e) = managed(addr) {
            if flags & libc::MAP_FIXED_NOREPLACE != 0 {
                // The range is mapped (it is the arena's), as the kernel would say.
                return fail(libc::EEXIST, libc::MAP_FAILED);
            }
            // Fresh private anonymous memory over memory the program reserved or had: the
            // commit (or decommit) of reserve-then-commit runtimes; it stays managed.
            // Anything else (a file, shared memory) is the program's own mapping there.
            let res = if anon_private {
                e.commit(addr as usize, len, prot)
            } else {
                e.lend(addr as usize, len, || {
                    // SAFETY: the program's own MAP_FIXED request over memory it owns.
                    unsafe {
                        memtide_engine::sys::mmap(addr as usize, len, prot, flags, fd, off)
                            .map(drop)
                    }
                })
            };
            return match res {
                Ok(()) => addr,
                Err(err) => fail(err.raw_os_error().unwrap_or(libc::EINVAL), libc::MAP_FAILED),
            };
        }
    } else if anon_private && len >= threshold() {
        // Read-write memory, or a reservation (PROT_NONE) a runtime commits piece by piece
        // later with MAP_FIXED or mprotect: QEMU's guest RAM, a JVM's heap.
        let reserve = prot == libc::PROT_NONE;
        if reserve || prot == libc::PROT_READ | libc::PROT_WRITE {
            if let Some(p) = engine_or_start().and_then(|e| reserved(e, len, reserve)) {
                return p as *mut c_void;
            }
        }
    }
    // SAFETY: the program's own mmap request, passed through.
    match unsafe { memtide_engine::sys::mmap(addr as usize, len, prot, flags, fd, off) } {
        Ok(p) => p as *mut c_void,
        Err(e) => fail(e.raw_os_error().unwrap_or(libc::EINVAL), libc::MAP_FAILED),
    }
}

/// Managed memory for an anonymous mapping: read-write, or `PROT_NONE` when `reserve`.
fn reserved(e: &Engine, len: usize, reserve: bool) -> Option<usize> {
    let p = e.alloc(len, PAGE).ok()?;
    if reserve && e.protect(p, len, libc::PROT_NONE).is_err() {
        let _ = e.release(p, len);
        return None;
    }
    Some(p)
}

#[no_mangle]
pub unsafe extern "C" fn mmap64(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: off_t,
) -> *mut c_void {
    // SAFETY: same contract as mmap.
    unsafe { mmap(addr, len, prot, flags, fd, off) }
}

#[no_mangle]
pub unsafe extern "C" fn munmap(addr: *mut c_void, len: size_t) -> c_int {
    if let Some(e) = managed(addr) {
        if !(addr as usize).is_multiple_of(PAGE) {
            return fail(libc::EINVAL, -1);
        }
        return match e.release(addr as usize, len) {
            Ok(()) => 0,
            Err(err) => fail(mem_errno(err), -1),
        };
    }
    // SAFETY: the program's own munmap, passed through.
    match unsafe { memtide_engine::sys::munmap(addr as usize, len) } {
        Ok(()) => 0,
        Err(e) => fail(e.raw_os_error().unwrap_or(libc::EINVAL), -1),
    }
}

/// `mremap` is variadic in C; on x86-64 the optional fifth argument arrives in the fifth
/// integer register either way, so a five-argument definition reads it.
#[no_mangle]
pub unsafe extern "C" fn mremap(
    old: *mut c_void,
    old_len: size_t,
    new_len: size_t,
    flags: c_int,
    new_addr: *mut c_void,
) -> *mut c_void {
    if let Some(e) = managed(old) {
        if flags & (libc::MREMAP_FIXED | libc::MREMAP_DONTUNMAP) != 0 {
            return fail(libc::EINVAL, libc::MAP_FAILED);
        }
        let may_move = flags & libc::MREMAP_MAYMOVE != 0;
        return match e.remap(old as usize, old_len, new_len, may_move) {
            Ok(p) => p as *mut c_void,
            Err(MemError::NoRoom) if may_move && (e.in_child() || e.is_detached()) => {
                // Plain memory now: move by copying.
                // SAFETY: a fresh mapping; old_len bytes of old are readable.
                unsafe {
                    let q = memtide_engine::sys::mmap(
                        0,
                        new_len,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                        -1,
                        0,
                    );
                    match q {
                        Ok(q) => {
                            std::ptr::copy_nonoverlapping(
                                old as *const u8,
                                q as *mut u8,
                                old_len.min(new_len),
                            );
                            let _ = e.release(old as usize, old_len);
                            q as *mut c_void
                        }
                        Err(_) => fail(libc::ENOMEM, libc::MAP_FAILED),
                    }
                }
            }
            Err(err) => fail(mem_errno(err), libc::MAP_FAILED),
        };
    }
    // SAFETY: the program's own mremap, passed through.
    match unsafe {
        memtide_engine::sys::mremap(old as usize, old_len, new_len, flags, new_addr as usize)
    } {
        Ok(p) => p as *mut c_void,
        Err(e) => fail(e.raw_os_error().unwrap_or(libc::EINVAL), libc::MAP_FAILED),
    }
}

#[no_mangle]
pub unsafe extern "C" fn madvise(addr: *mut c_void, len: size_t, advice: c_int) -> c_int {
    if let Some(e) = managed(addr) {
        if !(addr as usize).is_multiple_of(PAGE) {
            return fail(libc::EINVAL, -1);
        }
        return match advice {
            libc::MADV_DONTNEED | libc::MADV_FREE | libc::MADV_REMOVE => {
                match e.discard(addr as usize, len) {
                    Ok(()) => 0,
                    Err(err) => fail(mem_errno(err), -1),
                }
            }
            // Placement advice is memtide's job on managed memory: accepted, ignored.
            _ => 0,
        };
    }
    // SAFETY: the program's own madvise, passed through.
    match unsafe { memtide_engine::sys::madvise(addr as usize, len, advice) } {
        Ok(()) => 0,
        Err(e) => fail(e.raw_os_error().unwrap_or(libc::EINVAL), -1),
    }
}

#[no_mangle]
pub unsafe extern "C" fn mprotect(addr: *mut c_void, len: size_t, prot: c_int) -> c_int {
    if let Some(e) = managed(addr) {
        return match e.protect(addr as usize, len, prot) {
            Ok(()) => 0,
            Err(err) => fail(err.raw_os_error().unwrap_or(libc::EINVAL), -1),
        };
    }
    // SAFETY: the program's own mprotect, passed through.
    match unsafe { memtide_engine::sys::mprotect(addr as usize, len, prot) } {
        Ok(()) => 0,
        Err(e) => fail(e.raw_os_error().unwrap_or(libc::EINVAL), -1),
    }
}

// ----- SIGBUS: the engine's handler stays first -----

#[no_mangle]
pub unsafe extern "C" fn sigaction(
    sig: c_int,
    act: *const libc::sigaction,
    old: *mut libc::sigaction,
) -> c_int {
    if sig == libc::SIGBUS && signal_faults() && engine().is_some() {
        // SAFETY: the caller passes valid or null pointers.
        unsafe { signal::set_program_handler(act.as_ref(), old.as_mut()) };
        return 0;
    }
    let f = real!(
        "sigaction",
        unsafe extern "C" fn(c_int, *const libc::sigaction, *mut libc::sigaction) -> c_int
    );
    // SAFETY: passed through.
    unsafe { f(sig, act, old) }
}

#[no_mangle]
pub unsafe extern "C" fn signal(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    if sig == libc::SIGBUS && signal_faults() && engine().is_some() {
        // SAFETY: sigaction structs are plain data.
        let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        act.sa_sigaction = handler;
        act.sa_flags = libc::SA_RESTART;
        signal::set_program_handler(Some(&act), Some(&mut old));
        return old.sa_sigaction;
    }
    let f = real!(
        "signal",
        unsafe extern "C" fn(c_int, libc::sighandler_t) -> libc::sighandler_t
    );
    // SAFETY: passed through.
    unsafe { f(sig, handler) }
}

/// A copy of `set` without SIGBUS: a blocked SIGBUS raised by a fault kills the process, and
/// the engine needs it to serve faults.
unsafe fn without_sigbus(
    set: *const libc::sigset_t,
    copy: &mut libc::sigset_t,
) -> *const libc::sigset_t {
    if set.is_null() {
        return set;
    }
    // SAFETY: set points at a valid sigset_t.
    unsafe {
        *copy = *set;
        libc::sigdelset(copy, libc::SIGBUS);
    }
    copy
}

#[no_mangle]
pub unsafe extern "C" fn sigprocmask(
    how: c_int,
    set: *const libc::sigset_t,
    old: *mut libc::sigset_t,
) -> c_int {
    // SAFETY: plain data.
    let mut copy: libc::sigset_t = unsafe { std::mem::zeroed() };
    let set = if how == libc::SIG_UNBLOCK || !signal_faults() {
        set
    } else {
        // SAFETY: set is valid or null.
        unsafe { without_sigbus(set, &mut copy) }
    };
    let f = real!(
        "sigprocmask",
        unsafe extern "C" fn(c_int, *const libc::sigset_t, *mut libc::sigset_t) -> c_int
    );
    // SAFETY: passed through.
    unsafe { f(how, set, old) }
}

#[no_mangle]
pub unsafe extern "C" fn pthread_sigmask(
    how: c_int,
    set: *const libc::sigset_t,
    old: *mut libc::sigset_t,
) -> c_int {
    // SAFETY: plain data.
    let mut copy: libc::sigset_t = unsafe { std::mem::zeroed() };
    let set = if how == libc::SIG_UNBLOCK || !signal_faults() {
        set
    } else {
        // SAFETY: set is valid or null.
        unsafe { without_sigbus(set, &mut copy) }
    };
    let f = real!(
        "pthread_sigmask",
        unsafe extern "C" fn(c_int, *const libc::sigset_t, *mut libc::sigset_t) -> c_int
    );
    // SAFETY: passed through.
    unsafe { f(how, set, old) }
}

// ----- system calls that touch user memory from the kernel -----

/// The engine, if `buf..buf+len` overlaps managed memory that a system call must have pinned
/// (with faults delivered as SIGBUS; with handler threads the kernel waits for the page).
fn touches_managed(buf: *const c_void, len: usize) -> Option<&'static Engine> {
    let e = engine().filter(|e| e.kernel_access_needs_pins())?;
    let a = buf as usize;
    (len > 0 && (e.contains(a) || e.contains(a.saturating_add(len - 1)))).then_some(e)
}

fn is_regular(fd: c_int) -> bool {
    // SAFETY: plain data; fstat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer.
    unsafe { libc::fstat(fd, &mut st) == 0 && st.st_mode & libc::S_IFMT == libc::S_IFREG }
}

/// Runs a one-buffer call with its managed part pinned, in chunks of at most `IO_CHUNK` bytes
/// so that a huge buffer does not have to fit in the DRAM quota. `call(offset, len)` does the
/// call for `[buf+offset, buf+offset+len)`. Chunks continue only on regular files (elsewhere
/// a short count is the normal answer and another call could block).
fn pinned_io(
    fd: c_int,
    buf: *const c_void,
    len: usize,
    call: impl FnMut(usize, usize) -> ssize_t,
) -> ssize_t {
    pinned_chunks(buf, len, |chunk| len > chunk && is_regular(fd), call)
}

/// [`pinned_io`], where `may_loop(chunk)` says whether chunks continue after the first (asked
/// only when the buffer is managed).
fn pinned_chunks(
    buf: *const c_void,
    len: usize,
    may_loop: impl FnOnce(usize) -> bool,
    mut call: impl FnMut(usize, usize) -> ssize_t,
) -> ssize_t {
    let Some(e) = touches_managed(buf, len) else {
        return call(0, len);
    };
    let chunk = IO_CHUNK.load(Ordering::Relaxed);
    let may_loop = may_loop(chunk);
    let mut done = 0usize;
    loop {
        let n = (len - done).min(chunk);
        let r = {
            let _pin = e.pin(buf as usize + done, n);
            call(done, n)
        };
        if r < 0 {
            return if done > 0 { done as ssize_t } else { r };
        }
        done += r as usize;
        if !may_loop || (r as usize) < n || done >= len {
            return done as ssize_t;
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t {
    let f = real!(
        "read",
        unsafe extern "C" fn(c_int, *mut c_void, size_t) -> ssize_t
    );
    // SAFETY: the program's buffer, passed through in pieces.
    pinned_io(fd, buf, n, |o, l| unsafe {
        f(fd, (buf as usize + o) as *mut c_void, l)
    })
}

#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t {
    let f = real!(
        "write",
        unsafe extern "C" fn(c_int, *const c_void, size_t) -> ssize_t
    );
    // SAFETY: as read.
    pinned_io(fd, buf, n, |o, l| unsafe {
        f(fd, (buf as usize + o) as *const c_void, l)
    })
}

#[no_mangle]
pub unsafe extern "C" fn pread(fd: c_int, buf: *mut c_void, n: size_t, off: off_t) -> ssize_t {
    let f = real!(
        "pread",
        unsafe extern "C" fn(c_int, *mut c_void, size_t, off_t) -> ssize_t
    );
    // SAFETY: as read.
    pinned_io(fd, buf, n, |o, l| unsafe {
        f(fd, (buf as usize + o) as *mut c_void, l, off + o as off_t)
    })
}

#[no_mangle]
pub unsafe extern "C" fn pread64(fd: c_int, buf: *mut c_void, n: size_t, off: off_t) -> ssize_t {
    // SAFETY: same as pread on 64-bit.
    unsafe { pread(fd, buf, n, off) }
}

#[no_mangle]
pub unsafe extern "C" fn pwrite(fd: c_int, buf: *const c_void, n: size_t, off: off_t) -> ssize_t {
    let f = real!(
        "pwrite",
        unsafe extern "C" fn(c_int, *const c_void, size_t, off_t) -> ssize_t
    );
    // SAFETY: as read.
    pinned_io(fd, buf, n, |o, l| unsafe {
        f(fd, (buf as usize + o) as *const c_void, l, off + o as off_t)
    })
}

#[no_mangle]
pub unsafe extern "C" fn pwrite64(fd: c_int, buf: *const c_void, n: size_t, off: off_t) -> ssize_t {
    // SAFETY: same as pwrite on 64-bit.
    unsafe { pwrite(fd, buf, n, off) }
}

/// getrandom(2) fills the buffer in the kernel: under signal delivery a page of it that is not
/// in DRAM would fail the call with EFAULT (python's `os.urandom` did), so the managed part is
/// pinned, a chunk at a time; the chunks go on while each is filled whole, as one call would.
#[no_mangle]
pub unsafe extern "C" fn getrandom(buf: *mut c_void, n: size_t, flags: libc::c_uint) -> ssize_t {
    let f = real!(
        "getrandom",
        unsafe extern "C" fn(*mut c_void, size_t, libc::c_uint) -> ssize_t
    );
    // SAFETY: the program's buffer, passed through in pieces.
    pinned_chunks(
        buf,
        n,
        |_| true,
        |o, l| unsafe { f((buf as usize + o) as *mut c_void, l, flags) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t {
    let f = real!(
        "recv",
        unsafe extern "C" fn(c_int, *mut c_void, size_t, c_int) -> ssize_t
    );
    // SAFETY: as read; sockets never loop.
    pinned_io(fd, buf, n, |o, l| unsafe {
        f(fd, (buf as usize + o) as *mut c_void, l, flags)
    })
}

#[no_mangle]
pub unsafe extern "C" fn send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t {
    let f = real!(
        "send",
        unsafe extern "C" fn(c_int, *const c_void, size_t, c_int) -> ssize_t
    );
    // SAFETY: as read.
    pinned_io(fd, buf, n, |o, l| unsafe {
        f(fd, (buf as usize + o) as *const c_void, l, flags)
    })
}

#[no_mangle]
pub unsafe extern "C" fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
) -> ssize_t {
    let f = real!(
        "recvfrom",
        unsafe extern "C" fn(
            c_int,
            *mut c_void,
            size_t,
            c_int,
            *mut sockaddr,
            *mut socklen_t,
        ) -> ssize_t
    );
    // SAFETY: as read.
    pinned_io(fd, buf, n, |o, l| unsafe {
        f(fd, (buf as usize + o) as *mut c_void, l, flags, addr, alen)
    })
}

#[no_mangle]
pub unsafe extern "C" fn sendto(
    fd: c_int,
    buf: *const c_void,
    n: size_t,
    flags: c_int,
    addr: *const sockaddr,
    alen: socklen_t,
) -> ssize_t {
    let f = real!(
        "sendto",
        unsafe extern "C" fn(
            c_int,
            *const c_void,
            size_t,
            c_int,
            *const sockaddr,
            socklen_t,
        ) -> ssize_t
    );
    // SAFETY: as read.
    pinned_io(fd, buf, n, |o, l| unsafe {
        f(
            fd,
            (buf as usize + o) as *const c_void,
            l,
            flags,
            addr,
            alen,
        )
    })
}

/// Pins the managed parts of an iovec array (all of it: vectored calls are not split) and
/// runs `call`.
unsafe fn pinned_iov(iov: *const iovec, cnt: c_int, call: impl FnOnce() -> ssize_t) -> ssize_t {
    let Some(e) = engine().filter(|e| e.kernel_access_needs_pins()) else {
        return call();
    };
    if iov.is_null() || cnt <= 0 {
        return call();
    }
    // SAFETY: the caller passes `cnt` valid iovecs.
    let v = unsafe { std::slice::from_raw_parts(iov, cnt as usize) };
    if !v
        .iter()
        .any(|x| touches_managed(x.iov_base, x.iov_len).is_some())
    {
        return call();
    }
    let pins: Vec<_> = v
        .iter()
        .filter(|x| touches_managed(x.iov_base, x.iov_len).is_some())
        .map(|x| e.pin(x.iov_base as usize, x.iov_len))
        .collect();
    let r = call();
    drop(pins);
    r
}

#[no_mangle]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    let f = real!(
        "readv",
        unsafe extern "C" fn(c_int, *const iovec, c_int) -> ssize_t
    );
    // SAFETY: passed through with pins held.
    unsafe { pinned_iov(iov, cnt, || f(fd, iov, cnt)) }
}

#[no_mangle]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    let f = real!(
        "writev",
        unsafe extern "C" fn(c_int, *const iovec, c_int) -> ssize_t
    );
    // SAFETY: passed through with pins held.
    unsafe { pinned_iov(iov, cnt, || f(fd, iov, cnt)) }
}

#[no_mangle]
pub unsafe extern "C" fn preadv(fd: c_int, iov: *const iovec, cnt: c_int, off: off_t) -> ssize_t {
    let f = real!(
        "preadv",
        unsafe extern "C" fn(c_int, *const iovec, c_int, off_t) -> ssize_t
    );
    // SAFETY: passed through with pins held.
    unsafe { pinned_iov(iov, cnt, || f(fd, iov, cnt, off)) }
}

#[no_mangle]
pub unsafe extern "C" fn pwritev(fd: c_int, iov: *const iovec, cnt: c_int, off: off_t) -> ssize_t {
    let f = real!(
        "pwritev",
        unsafe extern "C" fn(c_int, *const iovec, c_int, off_t) -> ssize_t
    );
    // SAFETY: passed through with pins held.
    unsafe { pinned_iov(iov, cnt, || f(fd, iov, cnt, off)) }
}

#[no_mangle]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    let f = real!(
        "sendmsg",
        unsafe extern "C" fn(c_int, *const msghdr, c_int) -> ssize_t
    );
    // SAFETY: msg is valid or null, as the kernel would require.
    let (iov, cnt) = unsafe { msg.as_ref() }.map_or((std::ptr::null(), 0), |m| {
        (m.msg_iov as *const iovec, m.msg_iovlen as c_int)
    });
    // SAFETY: passed through with pins held.
    unsafe { pinned_iov(iov, cnt, || f(fd, msg, flags)) }
}

#[no_mangle]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    let f = real!(
        "recvmsg",
        unsafe extern "C" fn(c_int, *mut msghdr, c_int) -> ssize_t
    );
    // SAFETY: as sendmsg.
    let (iov, cnt) = unsafe { msg.as_ref() }.map_or((std::ptr::null(), 0), |m| {
        (m.msg_iov as *const iovec, m.msg_iovlen as c_int)
    });
    // SAFETY: passed through with pins held.
    unsafe { pinned_iov(iov, cnt, || f(fd, msg, flags)) }
}

// ----- stdio's block calls -----
//
// glibc's stdio moves a request larger than the stream's buffer straight between the file and
// the program's buffer, in the kernel (`read`/`write` inside libc, which the wrappers above do
// not see), and `fputs`/`puts` write a long string the same way. coreutils reach these through
// the `_unlocked` forms. So each call pins the buffer's managed part, a chunk of whole items at
// a time with the stream locked across the chunks, so the call stays one call to other threads.

extern "C" {
    static mut stdout: *mut libc::FILE;
    fn flockfile(s: *mut libc::FILE);
    fn funlockfile(s: *mut libc::FILE);
}

type BlockIo = unsafe extern "C" fn(*mut c_void, size_t, size_t, *mut libc::FILE) -> size_t;

/// A block call over `n` items of `size` bytes at `p`: libc's own call `direct` when the buffer
/// is not managed memory; otherwise its `_unlocked` form `f`, pinning the managed part of the
/// buffer `IO_CHUNK` bytes (whole items, at least one) at a time and stopping at the first
/// short count, as the call itself would. With `lock`, the stream is locked across the chunks
/// (the locking forms: `fread`, `fwrite`).
unsafe fn pinned_items(
    direct: BlockIo,
    f: BlockIo,
    p: *mut c_void,
    size: size_t,
    n: size_t,
    s: *mut libc::FILE,
    lock: bool,
) -> size_t {
    let Some(e) = touches_managed(p, size.saturating_mul(n)) else {
        // SAFETY: passed through.
        return unsafe { direct(p, size, n, s) };
    };
    let per = (IO_CHUNK.load(Ordering::Relaxed) / size).max(1);
    if lock {
        // SAFETY: `s` is the program's stream, as the call requires.
        unsafe { flockfile(s) };
    }
    let mut done = 0;
    while done < n {
        let k = (n - done).min(per);
        let at = p as usize + done * size;
        let _pin = e.pin(at, k * size);
        // SAFETY: a part of the program's buffer, pinned; the stream is the program's.
        let got = unsafe { f(at as *mut c_void, size, k, s) };
        done += got;
        if got < k {
            break;
        }
    }
    if lock {
        // SAFETY: locked above.
        unsafe { funlockfile(s) };
    }
    done
}

/// The four block calls: `fread`, `fwrite` and their `_unlocked` forms, through
/// `pinned_items` (libc's own call, or its `_unlocked` form in pinned chunks).
macro_rules! block_io {
    ($name:ident, $ptr:ty, $direct:literal, $unlocked:literal, $lock:expr) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            p: $ptr,
            size: size_t,
            n: size_t,
            s: *mut libc::FILE,
        ) -> size_t {
            let direct = real!($direct, BlockIo);
            let f = real!($unlocked, BlockIo);
            // SAFETY: the program's buffer and stream, passed through.
            unsafe { pinned_items(direct, f, p as *mut c_void, size, n, s, $lock) }
        }
    };
}

block_io!(fread, *mut c_void, "fread", "fread_unlocked", true);
block_io!(
    fread_unlocked,
    *mut c_void,
    "fread_unlocked",
    "fread_unlocked",
    false
);
block_io!(fwrite, *const c_void, "fwrite", "fwrite_unlocked", true);
block_io!(
    fwrite_unlocked,
    *const c_void,
    "fwrite_unlocked",
    "fwrite_unlocked",
    false
);

/// `fputs` (and `puts`, which adds a newline) of a managed string: written as `fwrite` of its
/// bytes, pinned in chunks, under the stream's lock; libc's own call for any other string.
unsafe fn pinned_puts(text: *const c_char, s: *mut libc::FILE, newline: bool, lock: bool) -> c_int {
    // SAFETY: a NUL-terminated string, as the call requires; reading it in user space faults
    // its pages in as any access would.
    let len = unsafe { libc::strlen(text) };
    let w = real!("fwrite_unlocked", BlockIo);
    if lock {
        // SAFETY: the program's stream.
        unsafe { flockfile(s) };
    }
    // SAFETY: the string's bytes and the program's stream.
    let mut ok = unsafe { pinned_items(w, w, text as *mut c_void, 1, len, s, false) } == len;
    if ok && newline {
        // SAFETY: as above.
        ok = unsafe { libc::fputc(b'\n' as c_int, s) } != libc::EOF;
    }
    if lock {
        // SAFETY: locked above.
        unsafe { funlockfile(s) };
    }
    // What glibc returns: 1 from `fputs`, the bytes written from `puts`.
    match (ok, newline) {
        (false, _) => libc::EOF,
        (true, false) => 1,
        (true, true) => len.saturating_add(1).min(c_int::MAX as usize) as c_int,
    }
}

/// `fputs` and `fputs_unlocked`: libc's own call unless the string is managed memory.
macro_rules! puts_io {
    ($name:ident, $real:literal, $lock:expr) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name(text: *const c_char, s: *mut libc::FILE) -> c_int {
            if touches_managed(text as *const c_void, 1).is_none() {
                let f = real!(
                    $real,
                    unsafe extern "C" fn(*const c_char, *mut libc::FILE) -> c_int
                );
                // SAFETY: passed through.
                return unsafe { f(text, s) };
            }
            // SAFETY: the program's string and stream.
            unsafe { pinned_puts(text, s, false, $lock) }
        }
    };
}

puts_io!(fputs, "fputs", true);
puts_io!(fputs_unlocked, "fputs_unlocked", false);

#[no_mangle]
pub unsafe extern "C" fn puts(text: *const c_char) -> c_int {
    if touches_managed(text as *const c_void, 1).is_none() {
        let f = real!("puts", unsafe extern "C" fn(*const c_char) -> c_int);
        // SAFETY: passed through.
        return unsafe { f(text) };
    }
    // SAFETY: libc's stdout, read once; the program's string.
    unsafe { pinned_puts(text, stdout, true, true) }
}

// ----- descriptors: memtide's own stay open and out of the program's way -----
//
// memtide's descriptors sit at high numbers (`memtide_engine::fds`). A program that closes
// the descriptors it does not know (daemons, process supervisors, test runners) would close
// them too and leave the engine without its userfaultfd or tier; these wrappers pass every
// call through except on memtide's descriptors, which the program never opened: `close`
// says EBADF, as it would for a number not open, and the range calls skip them.

#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    if memtide_engine::fds::is_ours(fd) {
        return fail(libc::EBADF, -1);
    }
    let real = real!("close", unsafe extern "C" fn(c_int) -> c_int);
    // SAFETY: libc's close, passed through.
    unsafe { real(fd) }
}

/// `close_range(2)` over `first..=last` less memtide's descriptors: one system call per
/// stretch between them.
fn close_range_sparing(first: u32, last: u32, flags: c_int) -> c_int {
    let raw = |a: u32, b: u32| -> c_int {
        // SAFETY: the close_range system call on a range of descriptor numbers.
        unsafe { libc::syscall(libc::SYS_close_range, a, b, flags) as c_int }
    };
    if first > last {
        return raw(first, last);
    }
    let mut ours = [0; 32];
    let lo = first.min(i32::MAX as u32) as i32;
    let hi = last.min(i32::MAX as u32) as i32;
    let n = memtide_engine::fds::ours_in(lo, hi, &mut ours);
    let mut from = first;
    for &fd in &ours[..n] {
        let fd = fd as u32;
        if fd > from && raw(from, fd - 1) < 0 {
            return -1;
        }
        from = fd + 1;
    }
    if from <= last {
        return raw(from, last);
    }
    0
}

#[no_mangle]
pub unsafe extern "C" fn close_range(
    first: libc::c_uint,
    last: libc::c_uint,
    flags: c_int,
) -> c_int {
    close_range_sparing(first, last, flags)
}

#[no_mangle]
pub unsafe extern "C" fn closefrom(low: c_int) {
    close_range_sparing(low.max(0) as u32, u32::MAX, 0);
}

/// Replacing one of memtide's descriptors would take the engine's userfaultfd or tier away
/// from under it: refused with EBUSY (which the kernel also gives `dup2` in a race with an
/// open of the same number). memtide's numbers are high, so a program rarely asks for one.
fn replacing_ours(old: c_int, new: c_int) -> bool {
    old != new && memtide_engine::fds::is_ours(new)
}

#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    if replacing_ours(old, new) {
        return fail(libc::EBUSY, -1);
    }
    let real = real!("dup2", unsafe extern "C" fn(c_int, c_int) -> c_int);
    // SAFETY: libc's dup2, passed through.
    unsafe { real(old, new) }
}

#[no_mangle]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    if replacing_ours(old, new) {
        return fail(libc::EBUSY, -1);
    }
    let real = real!("dup3", unsafe extern "C" fn(c_int, c_int, c_int) -> c_int);
    // SAFETY: libc's dup3, passed through.
    unsafe { real(old, new, flags) }
}
