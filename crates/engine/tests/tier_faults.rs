//! Tier-device faults: reads that fail, reads that return wrong bytes, a ring that loses track
//! of a read, and a tier filesystem that fills up while the program runs. A page is never
//! served wrong: a transient failure is read again, a lasting one stops the program with one
//! line naming the page and the tier slot, and the fault path allocates nothing on the way
//! (it runs in a signal handler). Faults are injected by the engine's tier fault layer (these
//! machines have no device-mapper for a failing device) in front of a real tier file; the full
//! filesystem is a real, small, loop-mounted ext4.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{config, in_child, is_child, scratch, start, Scratch, PAGE};
use memtide_engine::tier::{Backend, Encrypted, FileTier, TierFaults, UringTier};
use memtide_engine::Engine;

/// Counts the allocations made by threads that asked to be watched.
struct Counting;

thread_local! {
    static WATCHED: Cell<bool> = const { Cell::new(false) };
}
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator; counting has no effect on the memory returned.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if WATCHED.with(|w| w.get()) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: forwarded contract.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: forwarded contract.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations this thread made while running `f`.
fn allocations_in(f: impl FnOnce()) -> u64 {
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    WATCHED.with(|w| w.set(true));
    f();
    WATCHED.with(|w| w.set(false));
    ALLOCATIONS.load(Ordering::Relaxed) - before
}

const PAGES: usize = 2048;

fn stamp(i: usize) -> u64 {
    (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1
}

/// An engine with 2 MiB of DRAM whose tier has `faults` in front of it, and a block of
/// `PAGES` stamped pages (8 MiB), most of them evicted.
fn evicted_block(name: &str, faults: &Arc<TierFaults>) -> (&'static Engine, usize, Scratch) {
    let dir = scratch(name);
    let mut cfg = config(&dir, 2 << 20);
    cfg.tier_faults = Some(faults.clone());
    // The file's device faults are what is tested: the pool would hold these pages.
    cfg.compress = memtide_engine::Compress::Off;
    let e = start(&cfg);
    let b = e.alloc(PAGES * PAGE, PAGE).unwrap();
    for i in 0..PAGES {
        // SAFETY: managed memory we own.
        unsafe { ((b + i * PAGE) as *mut u64).write_volatile(stamp(i)) };
    }
    (e, b, dir)
}

/// Reads page `i` of the block; true if it holds its stamp.
fn holds_stamp(b: usize, i: usize) -> bool {
    // SAFETY: managed memory we own.
    unsafe { ((b + i * PAGE) as *const u64).read_volatile() == stamp(i) }
}

fn evicted(e: &Engine, addr: usize) -> bool {
    e.page_info(addr).unwrap().state == "Evicted"
}

#[test]
fn transient_read_failures_and_wrong_bytes_are_read_again_without_allocating() {
    let faults = Arc::new(TierFaults::default());
    let (e, b, _dir) = evicted_block("transient", &faults);
    // Random pages, so that reads do not run ahead: each fault reads its own page.
    let pages = [7usize, 300, 901, 1300];
    for &i in &pages {
        assert!(evicted(e, b + i * PAGE), "page {i} is in tier 1");
    }
    let cases: [(&str, &dyn Fn()); 4] = [
        ("two failed reads", &|| {
            faults.read_errors.store(2, Ordering::Relaxed)
        }),
        ("wrong bytes once", &|| {
            faults.read_corrupt.store(1, Ordering::Relaxed)
        }),
        ("a read the ring lost", &|| {
            faults.read_lost.store(1, Ordering::Relaxed)
        }),
        ("all of them", &|| {
            faults.read_errors.store(1, Ordering::Relaxed);
            faults.read_lost.store(1, Ordering::Relaxed);
            faults.read_corrupt.store(2, Ordering::Relaxed);
        }),
    ];
    for (&i, (what, arm)) in pages.iter().zip(cases) {
        arm();
        let mut right = false;
        let n = allocations_in(|| right = holds_stamp(b, i));
        assert!(right, "{what}: page {i} is served right");
        assert_eq!(n, 0, "{what}: the fault path allocated {n} times");
    }
    let s = e.snapshot();
    assert_eq!(s.tier_errors, 2 + 1 + 2, "failed reads counted: {s:?}");
    assert_eq!(s.tier_read_mismatches, 1 + 2, "wrong reads counted: {s:?}");
    for i in 0..PAGES {
        assert!(holds_stamp(b, i), "page {i} after the faults");
    }
}

/// A lasting fault stops the program with one line; runs in a child process.
fn lasting(kind: &str) -> String {
    const CHILD: &str = "MEMTIDE_TEST_LASTING_FAULT";
    let test = format!("a_lasting_{kind}_stops_the_program_naming_the_page");
    let out = in_child(&test, CHILD, Duration::from_secs(60));
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "the child went on: {err}");
    assert!(!err.contains("was served"), "{err}");
    let fatal: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("memtide: fatal"))
        .collect();
    assert_eq!(fatal.len(), 1, "one line says what failed: {err}");
    assert!(
        fatal[0].contains("page 7,") && fatal[0].contains("tier slot "),
        "{err}"
    );
    err
}

fn lasting_child(set: impl FnOnce(&TierFaults)) {
    let faults = Arc::new(TierFaults::default());
    let (e, b, _dir) = evicted_block("lasting", &faults);
    assert!(evicted(e, b + 7 * PAGE));
    set(&faults);
    let right = holds_stamp(b, 7);
    panic!("page 7 was served (right: {right}) although tier 1 cannot give it back");
}

#[test]
fn a_lasting_read_error_stops_the_program_naming_the_page() {
    if is_child("MEMTIDE_TEST_LASTING_FAULT") {
        lasting_child(|f| f.read_errors.store(TierFaults::ALWAYS, Ordering::Relaxed));
        return;
    }
    let err = lasting("read_error");
    assert!(
        err.contains("reading an evicted page from tier 1 failed (errno 5"),
        "{err}"
    );
}

#[test]
fn a_lasting_wrong_read_stops_the_program_naming_the_page() {
    if is_child("MEMTIDE_TEST_LASTING_FAULT") {
        lasting_child(|f| f.read_corrupt.store(TierFaults::ALWAYS, Ordering::Relaxed));
        return;
    }
    let err = lasting("wrong_read");
    assert!(err.contains("does not match the checksum"), "{err}");
}

/// When waiting on an io_uring read failed, the ring was handed back with the read still in
/// flight: the next read on that ring took the stale completion and returned before its own
/// bytes landed.
#[test]
fn a_ring_that_lost_a_read_is_never_used_again() {
    let dir = scratch("uring-lost");
    let Ok(tier) = UringTier::new(FileTier::create(&dir.0).unwrap(), true) else {
        panic!("io_uring is available on these machines");
    };
    let pages: Vec<Vec<u8>> = (0..8u8)
        .map(|k| {
            let mut v = vec![0u8; 2 * PAGE];
            let off = v.as_ptr().align_offset(PAGE);
            v[off..off + PAGE].fill(k + 1);
            v
        })
        .collect();
    let aligned = |v: &Vec<u8>| v.as_ptr() as usize + v.as_ptr().align_offset(PAGE);
    tier.grow(8).unwrap();
    let addrs: Vec<usize> = pages.iter().map(aligned).collect();
    // SAFETY: every address is a readable, aligned page.
    unsafe { tier.write(0, &addrs) }.unwrap();
    let mut buf = vec![0u8; 2 * PAGE];
    let b = aligned(&buf) as *mut u8;
    let rings = tier.read_ring_count();
    assert!((2..=8).contains(&rings), "{rings} read rings");
    for round in 0..rings {
        tier.inject_lost_waits(1);
        // SAFETY: `b` is a writable, aligned page.
        let lost = unsafe { tier.read(0, 1, b) }.expect_err("the wait was made to fail");
        assert!(
            lost.buffer_lost,
            "the caller is told the buffer may still be written"
        );
        let mut other = vec![0u8; 2 * PAGE];
        let o = aligned(&other) as *mut u8;
        for slot in 1..8u64 {
            // SAFETY: as above.
            unsafe { std::ptr::write_bytes(o, 0xff, PAGE) };
            // SAFETY: as above.
            unsafe { tier.read(slot, 1, o) }.unwrap();
            // SAFETY: `o` points at PAGE readable bytes.
            let got = unsafe { std::slice::from_raw_parts(o, PAGE) };
            assert!(
                got.iter().all(|&x| x == slot as u8 + 1),
                "round {round}: slot {slot} read back {:#x}..",
                got[0]
            );
        }
        other.clear();
    }
    // Every ring is retired now: reads go through pread, and still read right.
    tier.inject_lost_waits(1);
    // SAFETY: `b` is a writable, aligned page.
    unsafe { tier.read(3, 1, b) }.expect("a read with every ring retired uses pread");
    // SAFETY: `b` points at PAGE readable bytes.
    assert!(unsafe { std::slice::from_raw_parts(b, PAGE) }
        .iter()
        .all(|&x| x == 4));
    buf.clear();
}

/// A read past what was written comes back short: an error, reported without allocating (the
/// fault path runs in a signal handler; the io_uring path once built a boxed error here).
#[test]
fn a_short_read_is_an_error_and_allocates_nothing() {
    let dir = scratch("uring-short");
    let Ok(tier) = UringTier::new(FileTier::create(&dir.0).unwrap(), true) else {
        panic!("io_uring is available on these machines");
    };
    tier.grow(1).unwrap();
    let buf = vec![0u8; 2 * PAGE];
    let b = (buf.as_ptr() as usize + buf.as_ptr().align_offset(PAGE)) as *mut u8;
    let mut res = None;
    // SAFETY: `b` is a writable, aligned page; slot 5 lies past the end of the file.
    let n = allocations_in(|| res = Some(unsafe { tier.read(5, 1, b) }));
    assert!(res.unwrap().is_err(), "a read past the end fails");
    assert_eq!(n, 0, "the short read allocated {n} times");
}

/// A small loop-mounted ext4 as tier 1, unmounted (and its image removed) at the end.
struct SmallFs {
    mount: std::path::PathBuf,
    image: std::path::PathBuf,
}

impl SmallFs {
    fn new(name: &str, mib: u64) -> SmallFs {
        let base = std::env::temp_dir().join(format!("memtide-{name}-{}", std::process::id()));
        let image = base.with_extension("img");
        let mount = base.with_extension("mnt");
        std::fs::create_dir_all(&mount).unwrap();
        let f = std::fs::File::create(&image).unwrap();
        f.set_len(mib << 20).unwrap();
        let run = |cmd: &mut Command| {
            let o = cmd.output().unwrap();
            assert!(
                o.status.success(),
                "{cmd:?}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        };
        run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&image));
        run(Command::new("mount")
            .args(["-o", "loop"])
            .arg(&image)
            .arg(&mount));
        SmallFs { mount, image }
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mount).status();
        let _ = std::fs::remove_dir(&self.mount);
        let _ = std::fs::remove_file(&self.image);
    }
}

#[test]
fn a_tier_filesystem_that_fills_up_mid_run_keeps_data_in_dram_and_resumes_when_freed() {
    // 24 MiB of filesystem (about 20 usable), 4 MiB of DRAM, 48 MiB of data.
    let fs = SmallFs::new("tierfs", 24);
    let mut cfg = memtide_engine::Config::new(4 << 20, &fs.mount);
    // A full file is what is tested: the pool would hold these pages.
    cfg.compress = memtide_engine::Compress::Off;
    cfg.policy = common::policy();
    cfg.arena_bytes = 1 << 30;
    cfg.epoch_ms = 50;
    let e = start(&cfg);
    const BIG: usize = 48 << 20 >> 12;
    let b = e.alloc(BIG * PAGE, PAGE).unwrap();
    for i in 0..BIG {
        // SAFETY: managed memory we own.
        unsafe { ((b + i * PAGE) as *mut u64).write_volatile(stamp(i)) };
    }
    let full = e.snapshot();
    let warned = |w: &[String]| w.iter().filter(|w| w.contains("tier 1 is full")).count();
    assert_eq!(
        warned(&full.warnings),
        1,
        "warned once: {:?}",
        full.warnings
    );
    assert!(full.tier_bytes < 24 << 20, "{full:?}");
    assert!(
        full.dram_bytes > 16 << 20,
        "what tier 1 could not take stayed in DRAM: {full:?}"
    );
    for i in 0..BIG {
        assert!(holds_stamp(b, i), "page {i} with a full tier");
    }
    // The program frees most of its memory: tier 1 has room again and eviction resumes.
    e.release(b + 8 * PAGE * 256, (BIG - 8 * 256) * PAGE)
        .unwrap();
    let c = e.alloc(8 << 20, PAGE).unwrap();
    for i in 0..(8 << 20) / PAGE {
        // SAFETY: managed memory we own.
        unsafe { ((c + i * PAGE) as *mut u64).write_volatile(stamp(i)) };
    }
    let after = e.snapshot();
    assert!(
        after.dram_bytes <= (4 << 20) + (1 << 20),
        "back within the quota once tier 1 had room: {after:?}"
    );
    for i in 0..8 * 256 {
        assert!(holds_stamp(b, i), "page {i} after eviction resumed");
    }
    for i in 0..(8 << 20) / PAGE {
        assert!(holds_stamp(c, i), "page {i} of the new block");
    }
    assert_eq!(warned(&after.warnings), 1, "{:?}", after.warnings);
    drop(fs);
}

/// When waiting on the write ring failed, the writes still in flight were left to land
/// whenever they did, while the encrypted tier sealed the next batch into the same scratch
/// page: a late write then put another slot's ciphertext into the first slot, which no longer
/// authenticated (a false "altered on the device", fatal to the program).
#[test]
fn writes_a_lost_ring_still_held_land_before_their_pages_are_reused() {
    let dir = scratch("uring-lost-write");
    let Ok(uring) = UringTier::new(FileTier::create(&dir.0).unwrap(), true) else {
        panic!("io_uring is available on these machines");
    };
    uring.inject_lost_write(300);
    let tier = Encrypted::new(Box::new(uring), 16).unwrap();
    tier.grow(2).unwrap();
    let page = |fill: u8| {
        let mut v = vec![0u8; 2 * PAGE];
        let off = v.as_ptr().align_offset(PAGE);
        v[off..off + PAGE].fill(fill);
        (v, off)
    };
    let (a, a_off) = page(0xA1);
    let (b, b_off) = page(0xB2);
    let t0 = std::time::Instant::now();
    // SAFETY: readable, aligned pages.
    unsafe { tier.write(0, &[a.as_ptr() as usize + a_off]) }.unwrap();
    assert!(
        t0.elapsed() >= std::time::Duration::from_millis(250),
        "the write returned while its lost request was still held ({:?})",
        t0.elapsed()
    );
    // SAFETY: as above.
    unsafe { tier.write(1, &[b.as_ptr() as usize + b_off]) }.unwrap();
    std::thread::sleep(std::time::Duration::from_millis(500));
    let (mut buf, off) = page(0);
    for (slot, want) in [(0u64, 0xA1u8), (1, 0xB2)] {
        let p = buf[off..].as_mut_ptr();
        // SAFETY: `p` is a writable, aligned page.
        unsafe { tier.read(slot, 1, p) }.unwrap_or_else(|e| panic!("slot {slot}: {}", e.error));
        assert!(
            buf[off..off + PAGE].iter().all(|&x| x == want),
            "slot {slot} read back {:#x}",
            buf[off]
        );
    }
}
