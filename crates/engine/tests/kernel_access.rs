//! Kernel accesses to managed memory: system calls reading into and writing from evicted and
//! never-touched pages, io_uring reading into them, and another process reading them with
//! `process_vm_readv`. With faults delivered to handler threads (the default) each waits for
//! its page and succeeds with the right bytes; with SIGBUS delivery the same system call
//! fails with EFAULT (why the default is what it is).

mod common;

use std::os::fd::AsRawFd;
use std::time::Duration;

use common::{config, in_child_with, is_child, scratch, start, PAGE};
use io_uring::{opcode, types, IoUring};
use memtide_engine::{Delivery, Engine};

const PAGES: usize = 8192; // 32 MiB, 8x the quota

fn stamp(i: usize) -> u64 {
    (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1
}

/// An engine with 4 MiB of DRAM and faults delivered as `faults`, and a 32 MiB block whose
/// pages hold their stamps, most of them evicted.
fn evicted_block(name: &str, faults: Delivery) -> (&'static Engine, usize, common::Scratch) {
    let dir = scratch(name);
    let mut cfg = config(&dir, 4 << 20);
    cfg.faults = faults;
    let e = start(&cfg);
    let b = e.alloc(PAGES * PAGE, PAGE).unwrap();
    for i in 0..PAGES {
        // SAFETY: managed memory we own.
        unsafe { ((b + i * PAGE) as *mut u64).write_volatile(stamp(i)) };
    }
    (e, b, dir)
}

fn evicted(e: &Engine, addr: usize) -> bool {
    e.page_info(addr).unwrap().state == "Evicted"
}

/// A pipe's two ends.
fn pipe() -> (i32, i32) {
    let mut fds = [0; 2];
    // SAFETY: a valid out-array of two fds.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    (fds[0], fds[1])
}

#[test]
fn system_calls_wait_for_evicted_and_untouched_pages() {
    let (e, b, _dir) = evicted_block("kernel-syscalls", Delivery::Threads);
    let src = b + 11 * PAGE;
    let dst = b + 4000 * PAGE;
    assert!(evicted(e, src) && evicted(e, dst));
    let (r, w) = pipe();
    // write(2) from an evicted page: the kernel reads it.
    // SAFETY: `src` is a managed page of ours; the kernel reads it.
    let n = unsafe { libc::write(w, src as *const libc::c_void, PAGE) };
    assert_eq!(
        n,
        PAGE as isize,
        "write(2): {}",
        std::io::Error::last_os_error()
    );
    // read(2) into another evicted page: the kernel writes it.
    // SAFETY: `dst` is a managed page of ours.
    let n = unsafe { libc::read(r, dst as *mut libc::c_void, PAGE) };
    assert_eq!(
        n,
        PAGE as isize,
        "read(2): {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: managed memory we own.
    assert_eq!(unsafe { (dst as *const u64).read_volatile() }, stamp(11));
    // getrandom(2) into 2 MiB never touched: every page's first touch is the kernel's.
    let fresh = e.alloc(2 << 20, PAGE).unwrap();
    // SAFETY: `fresh` is 2 MiB of managed memory of ours.
    let n = unsafe { libc::getrandom(fresh as *mut libc::c_void, 2 << 20, 0) };
    assert_eq!(n, 2 << 20, "getrandom: {}", std::io::Error::last_os_error());
    // SAFETY: as above.
    let nonzero = (0..512).filter(|k| unsafe { *((fresh + k * PAGE) as *const u64) } != 0);
    assert!(nonzero.count() > 500, "getrandom filled the pages");
    // SAFETY: closing our own fds.
    unsafe {
        libc::close(r);
        libc::close(w);
    }
    e.audit().expect("books balance");
}

#[test]
fn with_sigbus_delivery_a_system_call_into_an_evicted_page_fails() {
    let (e, b, _dir) = evicted_block("kernel-sigbus", Delivery::Signal);
    let dst = b + 4000 * PAGE;
    assert!(evicted(e, dst));
    let (r, w) = pipe();
    let data = vec![7u8; PAGE];
    // SAFETY: writing our own buffer into our pipe.
    let n = unsafe { libc::write(w, data.as_ptr() as *const libc::c_void, PAGE) };
    assert_eq!(n, PAGE as isize);
    // SAFETY: `dst` is a managed page of ours, evicted: the kernel's write into it faults.
    let n = unsafe { libc::read(r, dst as *mut libc::c_void, PAGE) };
    assert_eq!(n, -1);
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::EFAULT)
    );
}

#[test]
fn io_uring_reads_into_evicted_pages() {
    let (e, b, dir) = evicted_block("kernel-uring", Delivery::Threads);
    let path = dir.0.join("data");
    let content: Vec<u8> = (0..64 * PAGE).map(|k| (k % 251) as u8).collect();
    std::fs::write(&path, &content).unwrap();
    let f = std::fs::File::open(&path).unwrap();
    let dst = b + 5000 * PAGE;
    assert!(evicted(e, dst));
    let mut ring = IoUring::new(4).unwrap();
    let sqe = opcode::Read::new(types::Fd(f.as_raw_fd()), dst as *mut u8, (64 * PAGE) as u32)
        .offset(0)
        .build()
        .user_data(1);
    // SAFETY: the buffer (64 managed pages of ours) outlives the read: we wait for it below.
    unsafe { ring.submission().push(&sqe) }.unwrap();
    ring.submit_and_wait(1).unwrap();
    let cqe = ring.completion().next().unwrap();
    assert_eq!(cqe.result(), (64 * PAGE) as i32, "io_uring read result");
    // SAFETY: 64 managed pages of ours, just read into.
    let got = unsafe { std::slice::from_raw_parts(dst as *const u8, 64 * PAGE) };
    assert!(got == &content[..], "the bytes io_uring read");
}

#[test]
fn another_process_reads_evicted_pages_with_process_vm_readv() {
    const CHILD: &str = "MEMTIDE_TEST_VM_READV";
    if is_child(CHILD) {
        // The reader: another process, reading the parent's evicted pages.
        let pid: i32 = std::env::var("READ_PID").unwrap().parse().unwrap();
        let addr: usize = std::env::var("READ_ADDR").unwrap().parse().unwrap();
        let mut buf = vec![0u64; 16 * PAGE / 8];
        let local = libc::iovec {
            iov_base: buf.as_mut_ptr() as *mut libc::c_void,
            iov_len: 16 * PAGE,
        };
        let remote = libc::iovec {
            iov_base: addr as *mut libc::c_void,
            iov_len: 16 * PAGE,
        };
        // SAFETY: valid iovecs; the kernel checks the remote range.
        let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
        assert_eq!(
            n,
            (16 * PAGE) as isize,
            "process_vm_readv: {}",
            std::io::Error::last_os_error()
        );
        for k in 0..16 {
            assert_eq!(buf[k * PAGE / 8], stamp(6000 + k), "page {k}");
        }
        eprintln!("read 16 evicted pages of process {pid}");
        return;
    }
    let (e, b, _dir) = evicted_block("kernel-vmreadv", Delivery::Threads);
    let addr = b + 6000 * PAGE;
    assert!(evicted(e, addr));
    let out = in_child_with(
        "another_process_reads_evicted_pages_with_process_vm_readv",
        CHILD,
        Duration::from_secs(60),
        &[
            ("READ_PID", std::process::id().to_string()),
            ("READ_ADDR", addr.to_string()),
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("read 16 evicted pages"), "{err}");
}

/// With SIGBUS delivery, a program well within its quota keeps every page mapped: the
/// active-memory sampler unmaps none (before, it unmapped up to 1024 pages a window, and a
/// futex on a condition variable in managed memory then failed with EFAULT, which glibc
/// takes as fatal).
#[test]
fn with_sigbus_delivery_a_futex_within_the_quota_never_faults() {
    let dir = scratch("kernel-futex");
    let mut cfg = config(&dir, 64 << 20);
    cfg.faults = Delivery::Signal;
    let e = start(&cfg);
    let pages = 2048; // 8 MiB, an eighth of the quota
    let b = e.alloc(pages * PAGE, PAGE).unwrap();
    for i in 0..pages {
        // SAFETY: a managed page of ours.
        unsafe { ((b + i * PAGE) as *mut u64).write_volatile(stamp(i)) };
    }
    let epochs = e.snapshot().epochs;
    let t0 = std::time::Instant::now();
    let mut waits = 0u64;
    while e.snapshot().epochs < epochs + 20 {
        assert!(t0.elapsed() < Duration::from_secs(60), "no epochs ended");
        for i in 0..pages {
            let word = (b + i * PAGE) as *const u32;
            let timeout = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            // SAFETY: FUTEX_WAIT reads the word at `word` (a managed page of ours) and, since
            // it does not hold `!stamp`, returns at once with EAGAIN.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_futex,
                    word,
                    libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
                    !(stamp(i) as u32),
                    &timeout as *const libc::timespec,
                )
            };
            assert_eq!(r, -1);
            let errno = std::io::Error::last_os_error().raw_os_error();
            assert_eq!(errno, Some(libc::EAGAIN), "futex on page {i}");
            waits += 1;
        }
    }
    let s = e.snapshot();
    assert_eq!(s.faults_inactive, 0, "no page was unmapped: {s:?}");
    // What it reports as active is what it holds (nothing was measured).
    assert_eq!(s.active_bytes, (pages * PAGE) as u64, "{s:?}");
    assert!(waits > 0);
}
