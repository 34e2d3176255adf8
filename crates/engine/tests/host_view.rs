//! What a host daemon relies on: the DRAM quota changes at run time and the engine converges to
//! it (shrinking demotes the coldest pages, no byte lost), so does the tier's size (a lower one
//! drops tier copies of pages also in DRAM and cuts the file), and the active-memory estimate
//! follows a known hot set.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::PAGE;
use memtide_engine::Engine;

fn stamp(page: usize) -> u64 {
    (page as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5EED
}

/// Whether page `i` of `pages` is in a scattered hot set of `pct` percent.
fn hot(i: usize, pct: usize) -> bool {
    (i.wrapping_mul(2_654_435_761) >> 7) % 100 < pct
}

fn fill(base: usize, pages: usize) {
    for p in 0..pages {
        // SAFETY: the page lies in managed memory the test allocated.
        unsafe { ((base + p * PAGE) as *mut u64).write_volatile(stamp(p)) };
    }
}

fn verify(base: usize, pages: usize) {
    for p in 0..pages {
        // SAFETY: as in `fill`.
        let v = unsafe { ((base + p * PAGE) as *const u64).read_volatile() };
        assert_eq!(v, stamp(p), "page {p} lost its bytes");
    }
}

/// A thread reading one word of every hot page over and over, until told to stop.
struct Toucher {
    stop: Arc<AtomicBool>,
    pct: Arc<AtomicUsize>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Toucher {
    fn start(base: usize, pages: usize, pct: usize) -> Toucher {
        let stop = Arc::new(AtomicBool::new(false));
        let shared = Arc::new(AtomicUsize::new(pct));
        let handle = {
            let (stop, pct) = (stop.clone(), shared.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let pct = pct.load(Ordering::Relaxed);
                    for p in (0..pages).filter(|&p| hot(p, pct)) {
                        // SAFETY: as in `fill`.
                        let v = unsafe { ((base + p * PAGE) as *const u64).read_volatile() };
                        assert_eq!(v, stamp(p), "page {p} lost its bytes");
                    }
                }
            })
        };
        Toucher {
            stop,
            pct: shared,
            handle: Some(handle),
        }
    }
}

impl Drop for Toucher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            h.join().expect("toucher thread");
        }
    }
}

/// Waits until `epochs` more epochs have ended (the evictor's own clock, not wall time).
fn wait_epochs(e: &Engine, epochs: u64) {
    let start = e.snapshot().epochs;
    let t0 = Instant::now();
    while e.snapshot().epochs < start + epochs {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the evictor stopped counting epochs"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits until `cond` holds, failing with `what` after 30 s.
fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < Duration::from_secs(30), "{what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn quota_shrinks_to_the_coldest_pages_and_grows_back() {
    let (e, _dir) = common::engine("quota-change", 32 << 20);
    let pages = (24 << 20) / PAGE;
    let base = e.alloc(pages * PAGE, PAGE).unwrap();
    fill(base, pages);
    assert_eq!(e.snapshot().demotions, 0, "24 MiB fit a 32 MiB quota");
    let hot_pct = 20;
    let toucher = Toucher::start(base, pages, hot_pct);
    // Let the hot set show itself before the quota shrinks.
    wait_epochs(e, 10);

    let now = e.set_quota_bytes(12 << 20);
    assert_eq!(now, 12 << 20);
    assert_eq!(e.snapshot().quota_bytes, 12 << 20);
    let limit = (12 << 20) / PAGE as u64;
    wait_for("resident pages never came down to the new quota", || {
        e.resident_pages() <= limit
    });
    // The hot pages are the ones that stayed.
    wait_epochs(e, 10);
    let hot_pages: Vec<usize> = (0..pages).filter(|&p| hot(p, hot_pct)).collect();
    let in_dram = hot_pages
        .iter()
        .filter(|&&p| {
            let s = e.page_info(base + p * PAGE).unwrap().state;
            s == "Mapped" || s == "Staged"
        })
        .count();
    drop(toucher);
    assert!(
        in_dram * 10 >= hot_pages.len() * 9,
        "only {in_dram} of {} hot pages stayed in DRAM after the quota shrank",
        hot_pages.len()
    );
    let s = e.snapshot();
    assert!(s.demotions > 0, "shrinking demoted nothing: {s:?}");
    verify(base, pages);
    assert!(
        e.resident_pages() <= limit + 256,
        "reading everything back kept to the quota (plus a batch in flight)"
    );

    // Grow: everything fits again, and once it is back nothing more is demoted.
    e.set_quota_bytes(64 << 20);
    verify(base, pages);
    let demoted = e.snapshot().demotions;
    verify(base, pages);
    wait_epochs(e, 5);
    let s = e.snapshot();
    assert_eq!(
        s.demotions, demoted,
        "pages left DRAM under a quota they fit: {s:?}"
    );
    assert_eq!(s.quota_bytes, 64 << 20);
    assert!(
        s.dram_bytes >= (pages * PAGE) as u64,
        "all of it is back in DRAM: {s:?}"
    );
    e.audit().unwrap();
}

#[test]
fn tier_size_changes_at_run_time_and_is_kept() {
    let dir = common::scratch("tier-change");
    let mut cfg = common::config(&dir, 32 << 20);
    cfg.tier_bytes = Some(64 << 20);
    cfg.tier_max_bytes = Some(128 << 20);
    // The file alone: its slots and limit are what is tested (these pages would compress).
    cfg.compress = memtide_engine::Compress::Off;
    let e = common::start(&cfg);
    assert_eq!(e.tier_limit_bytes(), 64 << 20);
    let pages = (24 << 20) / PAGE;
    let base = e.alloc(pages * PAGE, PAGE).unwrap();
    fill(base, pages);
    // Push most of it out, then bring it all back: the pages keep their tier copies.
    e.set_quota_bytes(8 << 20);
    wait_for("resident pages never came down to 8 MiB", || {
        e.resident_pages() <= (8 << 20) / PAGE as u64
    });
    e.set_quota_bytes(64 << 20);
    verify(base, pages);
    let s = e.snapshot();
    assert!(
        s.tier_bytes >= 12 << 20,
        "the promoted pages kept their tier copies: {s:?}"
    );

    // A tier of 4 MiB: copies go (those above 4 MiB first) and the file is cut.
    assert_eq!(e.set_tier_bytes(4 << 20), 4 << 20);
    wait_for("tier 1 never came within 4 MiB", || {
        let s = e.snapshot();
        s.tier_bytes <= 4 << 20 && s.tier_file_bytes <= 4 << 20
    });
    let s = e.snapshot();
    assert!(
        s.tier_copies_dropped * PAGE as u64 >= s.tier_bytes.max(8 << 20),
        "copies dropped: {s:?}"
    );
    assert_eq!(s.tier_limit_bytes, 4 << 20);

    // The quota cannot be kept with 4 MiB of tier: the engine holds DRAM above it rather than
    // exceed the tier or lose a page.
    e.set_quota_bytes(8 << 20);
    wait_epochs(e, 10);
    verify(base, pages);
    wait_epochs(e, 5);
    let s = e.snapshot();
    assert!(s.tier_bytes <= 4 << 20, "tier over its limit: {s:?}");
    assert!(
        s.dram_bytes > 16 << 20,
        "24 MiB in 8 MiB of DRAM and 4 MiB of tier? {s:?}"
    );

    // Given room again (asked for more than its maximum: it gets the maximum), it keeps the
    // quota.
    assert_eq!(e.set_tier_bytes(1 << 30), 128 << 20);
    wait_for("resident pages never came down to the quota", || {
        e.resident_pages() <= (8 << 20) / PAGE as u64
    });
    verify(base, pages);
    assert!(e.resident_pages() <= (8 << 20) / PAGE as u64 + 256);
    e.audit().unwrap();
}

#[test]
fn active_memory_estimate_follows_the_hot_set() {
    let (e, _dir) = common::engine("active-estimate", 64 << 20);
    let pages = (48 << 20) / PAGE;
    let base = e.alloc(pages * PAGE, PAGE).unwrap();
    fill(base, pages);
    let toucher = Toucher::start(base, pages, 10);
    for pct in [10usize, 30, 60] {
        toucher.pct.store(pct, Ordering::Relaxed);
        let truth = (0..pages).filter(|&p| hot(p, pct)).count() as f64 * PAGE as f64;
        // Four windows of five epochs make the estimate; wait for a fifth so that none of
        // them saw the previous hot set.
        wait_epochs(e, 30);
        let est = e.snapshot().active_bytes as f64;
        eprintln!(
            "hot {pct}%: true active {:.1} MiB, estimated {:.1} MiB",
            truth / (1 << 20) as f64,
            est / (1 << 20) as f64
        );
        assert!(
            (est - truth).abs() <= 0.2 * truth,
            "hot set {pct}%: estimated {est} bytes active, truly {truth}"
        );
    }
    drop(toucher);
    verify(base, pages);
    e.audit().unwrap();
}

/// The tier file as the filesystem holds it: unlinked once open, so found among this
/// process's descriptors.
fn tier_file(dir: &common::Scratch) -> std::fs::Metadata {
    let d = dir.0.canonicalize().unwrap();
    for f in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        if std::fs::read_link(f.path()).is_ok_and(|t| t.starts_with(&d)) {
            return std::fs::metadata(f.path()).unwrap();
        }
    }
    panic!("no tier file open under {}", d.display());
}

/// A tier limit lowered to exactly what lives only in tier 1, all of it in slots far above the
/// limit: the copies move below it and the file is cut to the limit (before, the file stayed
/// as long as the highest slot, for good, while the host daemon gave the space to others).
fn lowered_limit_cuts_the_file(name: &str, encrypt: bool) {
    let dir = common::scratch(name);
    let mut cfg = common::config(&dir, 8 << 20);
    cfg.tier_bytes = Some(64 << 20);
    cfg.tier_max_bytes = Some(128 << 20);
    cfg.encrypt_tier = encrypt;
    // The file alone: its slots and limit are what is tested (these pages would compress).
    cfg.compress = memtide_engine::Compress::Off;
    let e = common::start(&cfg);
    let pages = (24 << 20) / PAGE;
    let base = e.alloc(pages * PAGE, PAGE).unwrap();
    fill(base, pages);
    wait_for("resident pages never came down to 8 MiB", || {
        e.resident_pages() <= (8 << 20) / PAGE as u64
    });
    // Keep the 256 evicted pages in the highest slots (1 MiB); free every other page.
    let mut evicted: Vec<(usize, u64)> = (0..pages)
        .filter_map(|p| {
            let i = e.page_info(base + p * PAGE)?;
            (i.state == "Evicted").then_some((p, i.tier_slot?))
        })
        .collect();
    evicted.sort_by_key(|&(_, s)| std::cmp::Reverse(s));
    evicted.truncate(256);
    assert_eq!(evicted.len(), 256);
    let lowest = evicted.last().unwrap().1;
    assert!(lowest >= 1024, "the kept pages start at slot {lowest}");
    for p in 0..pages {
        if !evicted.iter().any(|&(q, _)| q == p) {
            e.discard(base + p * PAGE, PAGE).unwrap();
        }
    }
    assert_eq!(
        e.snapshot().tier_bytes,
        1 << 20,
        "only the kept pages are in tier 1"
    );
    assert_eq!(e.set_tier_bytes(1 << 20), 1 << 20);
    wait_for("the tier file was never cut to 1 MiB", || {
        e.snapshot().tier_file_bytes <= 1 << 20
    });
    let f = tier_file(&dir);
    assert!(f.len() <= 1 << 20, "the file holds {} bytes", f.len());
    assert_eq!(e.snapshot().tier_copies_moved, 256);
    for &(p, _) in &evicted {
        let i = e.page_info(base + p * PAGE).unwrap();
        assert_eq!(i.state, "Evicted", "moved within the tier, not into DRAM");
        assert!(i.tier_slot.unwrap() < 256, "{i:?}");
    }
    for &(p, _) in &evicted {
        // SAFETY: the page lies in managed memory the test allocated.
        let v = unsafe { ((base + p * PAGE) as *const u64).read_volatile() };
        assert_eq!(v, stamp(p), "page {p} lost its bytes in the move");
    }
    e.audit().unwrap();
}

#[test]
fn a_lowered_tier_limit_cuts_the_file() {
    lowered_limit_cuts_the_file("tier-cut", false);
}

#[test]
fn a_lowered_tier_limit_cuts_an_encrypted_file() {
    lowered_limit_cuts_the_file("tier-cut-enc", true);
}
