//! Races a review of the engine found, each played out step by step: the engine's injection
//! gates hold one thread at the point where the race opens, the test does what another thread
//! could do meanwhile, then lets it go. Each of these failed before its fix.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{engine, in_child, is_child, PAGE};
use memtide_engine::{sys, Engine};

fn state(e: &Engine, addr: usize) -> String {
    e.page_info(addr).expect("managed").state
}

/// `munmap` claims its range in address order and waits on pages being written; write-back
/// holds the pages of its batch `Writing` and met a page the free had claimed. Where the sweep
/// wrapped, the batch holds high pages before low ones, so each waited for the other, forever
/// (and every faulting thread behind them for DRAM).
#[test]
fn a_free_across_a_write_back_batch_where_the_sweep_wrapped_does_not_deadlock() {
    const CHILD: &str = "MEMTIDE_TEST_WRAP_CHILD";
    if is_child(CHILD) {
        free_across_the_wrap();
        return;
    }
    let out = in_child(
        "a_free_across_a_write_back_batch_where_the_sweep_wrapped_does_not_deadlock",
        CHILD,
        Duration::from_secs(120),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("the free finished"), "{err}");
}

fn free_across_the_wrap() {
    const PAGES: usize = 4096;
    // The CLOCK sweep's write-back, which takes the ring's oldest pages in order (placement
    // names the pages it evicts, and has no wrap).
    let dir = common::scratch("wrap");
    let mut cfg = common::config(&dir, 4 << 20);
    cfg.policy = memtide_engine::EvictionPolicy::Sweep;
    let e = common::start(&cfg);
    let base = e.alloc(PAGES * PAGE, PAGE).unwrap();
    for i in 0..PAGES {
        // SAFETY: managed memory we own; nothing else touches it yet.
        unsafe { ((base + i * PAGE) as *mut u64).write_volatile(i as u64 + 1) };
    }
    e.inject().writeback_wrap.arm();
    // Keep eviction going with touches that cannot fault on freed memory (a pin of a page
    // that is no longer managed does nothing).
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut x = 12345u64;
            while !stop.load(Ordering::Relaxed) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                drop(e.pin(base + (x as usize % PAGES) * PAGE, 8));
            }
        });
        let [held, low] = e
            .inject()
            .writeback_wrap
            .wait_held(Duration::from_secs(60))
            .expect("a write-back batch crosses the sweep's wrap");
        stop.store(true, Ordering::Relaxed);
        let (held, low) = (held as usize, low as usize);
        eprintln!("write-back holds page {held} and is about to take page {low}");
        // The free starts at the low page: the batch may also hold pages below it (where the
        // sweep started), which a free from the block's start would wait for before it
        // reached the low page.
        let free = s.spawn(move || e.release(base + low * PAGE, (PAGES - low) * PAGE).unwrap());
        // The free claims the low page first, then waits for the held one.
        let t0 = Instant::now();
        while state(e, base + low * PAGE) != "Busy" {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the free did not claim page {low}: {}",
                state(e, base + low * PAGE)
            );
            std::thread::yield_now();
        }
        e.inject().writeback_wrap.open();
        let t0 = Instant::now();
        while !free.is_finished() {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "deadlock: the free waits for write-back and write-back for the free"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        free.join().unwrap();
        eprintln!("the free finished");
    });
    e.audit().expect("books balance after the free");
}

/// Read-ahead looked at a neighbour's state and tier slot, then reserved DRAM (which can
/// sleep) and claimed it. Meanwhile the neighbour could be fetched, rewritten and evicted to
/// another slot: read-ahead then mapped its old slot's bytes, losing the write.
#[test]
fn read_ahead_never_maps_a_neighbour_that_moved_to_another_slot() {
    const PAGES: usize = 4096;
    // The file's read-ahead is what is raced: the pool would hold these pages.
    let (e, _dir) = common::file_only("readahead", 4 << 20);
    let stamp = |i: usize, v: u64| (i as u64) << 32 | v;
    let word = |base: usize, i: usize| (base + i * PAGE) as *mut u64;
    let b = e.alloc(PAGES * PAGE, PAGE).unwrap();
    for i in 0..PAGES {
        // SAFETY: managed memory we own.
        unsafe { word(b, i).write_volatile(stamp(i, 0)) };
    }
    // A sequential run of tier faults over pages p0.. reads ahead from the third on.
    let p0 = 100;
    for i in p0..p0 + 4 {
        let info = e.page_info(b + i * PAGE).unwrap();
        assert_eq!(
            info.state, "Evicted",
            "page {i} is in tier 1 after the fill"
        );
        assert_eq!(
            info.tier_slot,
            e.page_info(b + p0 * PAGE)
                .unwrap()
                .tier_slot
                .map(|s| s + (i - p0) as u64),
            "pages {p0}.. sit in consecutive tier slots"
        );
    }
    e.inject().readahead.arm();
    std::thread::scope(|s| {
        let reader = s.spawn(|| {
            for i in p0..p0 + 3 {
                // SAFETY: as above.
                assert_eq!(unsafe { word(b, i).read_volatile() }, stamp(i, 0));
            }
        });
        let [q, seen] = e
            .inject()
            .readahead
            .wait_held(Duration::from_secs(10))
            .expect("the third fault reads ahead");
        let q = q as usize;
        // Meanwhile: the neighbour is read, rewritten, and evicted to another slot.
        // SAFETY: as above.
        unsafe {
            assert_eq!(word(b, q).read_volatile(), stamp(q, 0));
            word(b, q).write_volatile(stamp(q, 1));
        }
        let c = e.alloc(2 * PAGES * PAGE, PAGE).unwrap();
        let t0 = Instant::now();
        let mut round = 0;
        loop {
            let info = e.page_info(b + q * PAGE).unwrap();
            let (st, slot) = (info.state, info.tier_slot);
            if st == "Evicted" && slot != Some(seen) {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "page {q} did not leave DRAM again: {st} in slot {slot:?}"
            );
            round += 1;
            for i in 0..2 * PAGES {
                // SAFETY: managed memory we own.
                unsafe { word(c, i).write_volatile(stamp(i, round)) };
            }
        }
        e.inject().readahead.open();
        reader.join().unwrap();
    });
    // SAFETY: as above.
    let got = unsafe { word(b, p0 + 3).read_volatile() };
    assert_eq!(
        got,
        stamp(p0 + 3, 1),
        "the neighbour holds its last write (got version {})",
        got & 0xffff_ffff
    );
    e.audit().expect("books balance");
}

/// `munmap` of a range with a hole in it zapped the whole range after claiming its pages; a
/// page another thread allocated in the hole and touched meanwhile was zapped too, while the
/// engine's books said it was mapped.
#[test]
fn a_free_never_zaps_a_page_it_did_not_claim() {
    let (e, _dir) = engine("zap", 4 << 20);
    let x = e.alloc(2 * PAGE, PAGE).unwrap();
    let y = e.alloc(PAGE, PAGE).unwrap();
    let _z = e.alloc(PAGE, PAGE).unwrap();
    assert_eq!(y, x + 2 * PAGE);
    // SAFETY: managed memory we own.
    unsafe {
        (x as *mut u64).write_volatile(1);
        ((x + PAGE) as *mut u64).write_volatile(2);
    }
    e.release(y, PAGE).unwrap();
    e.inject().taken.arm();
    std::thread::scope(|s| {
        // munmap of x's two pages and the hole after them.
        let free = s.spawn(|| e.release(x, 3 * PAGE).unwrap());
        e.inject()
            .taken
            .wait_held(Duration::from_secs(10))
            .expect("the free claims its pages");
        // Meanwhile another allocation lands in the hole and is touched.
        let n = e.alloc(PAGE, PAGE).unwrap();
        assert_eq!(n, y, "the new page lands in the hole");
        // SAFETY: managed memory we own.
        unsafe { (n as *mut u64).write_volatile(42) };
        e.inject().taken.open();
        free.join().unwrap();
    });
    assert_eq!(
        sys::presence_of(y),
        Some(sys::Presence::Present),
        "the page allocated in the hole is still mapped"
    );
    // SAFETY: managed memory we own.
    assert_eq!(unsafe { (y as *const u64).read_volatile() }, 42);
    e.audit().expect("books balance");
}

/// UFFDIO_COPY answers EEXIST when a page is already there, and also when a page-table level
/// is missing for a moment. A fill took EEXIST for "mapped", published the page as mapped
/// while it was missing, and the program's access faulted forever (stopped after 1000).
#[test]
fn a_fill_answered_with_eexist_for_a_missing_page_maps_it() {
    let (e, _dir) = engine("eexist", 4 << 20);
    let a = e.alloc(16 * PAGE, PAGE).unwrap();
    e.uffd().inject_copy_eexist(2);
    let p = a + 5 * PAGE;
    // SAFETY: managed memory we own.
    unsafe {
        assert_eq!((p as *const u64).read_volatile(), 0);
        (p as *mut u64).write_volatile(42);
        assert_eq!((p as *const u64).read_volatile(), 42);
    }
    e.audit().expect("books balance");
}

/// A thread that touches managed memory the program freed gets SIGSEGV, as natively (after a
/// few retries: the engine first takes the fault for a stale message, see `STRAY_RETRIES`).
#[test]
fn touching_freed_memory_gets_sigsegv() {
    const CHILD: &str = "MEMTIDE_TEST_STRAY_CHILD";
    if is_child(CHILD) {
        let (e, _dir) = engine("stray", 4 << 20);
        let base = e.alloc(16 * PAGE, PAGE).unwrap();
        for i in 0..16 {
            // SAFETY: managed memory we own.
            unsafe { ((base + i * PAGE) as *mut u64).write_volatile(i as u64 + 1) };
        }
        e.release(base, 16 * PAGE).unwrap();
        eprintln!("released");
        // SAFETY: none: this read of freed memory is meant to end the process with SIGSEGV.
        let v = unsafe { ((base + 3 * PAGE) as *const u64).read_volatile() };
        eprintln!("read {v} from freed memory");
        return;
    }
    let out = in_child(
        "touching_freed_memory_gets_sigsegv",
        CHILD,
        Duration::from_secs(60),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    use std::os::unix::process::ExitStatusExt;
    assert!(err.contains("released"), "{err}");
    assert_eq!(out.status.signal(), Some(libc::SIGSEGV), "{err}");
}
