//! End-to-end checks of the engine on real userfaultfd and a real tier file: data written to
//! managed memory reads back intact after being evicted to tier 1 and fetched again.

use memtide_engine::{Config, Engine};

mod common;

fn tmpdir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("memtide-test-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn engine(dram_mib: u64) -> &'static Engine {
    let mut cfg = Config::new(dram_mib << 20, tmpdir());
    cfg.policy = common::policy();
    cfg.arena_bytes = 16 << 30;
    cfg.epoch_ms = 50;
    Engine::start(&cfg).expect("engine starts (needs userfaultfd: run as root)")
}

fn stamp(page: usize, round: u64) -> u64 {
    (page as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ round
}

#[test]
fn data_survives_eviction_and_fetch() {
    let e = engine(16);
    let len = 128usize << 20; // 8x the quota
    let base = e.alloc_malloc(len, 4096).unwrap();
    let pages = len / 4096;
    for p in 0..pages {
        let ptr = (base + p * 4096) as *mut u64;
        // SAFETY: the page lies in managed memory we just allocated.
        unsafe {
            ptr.write_volatile(stamp(p, 1));
            ptr.add(511).write_volatile(!stamp(p, 1));
        }
    }
    let s = e.snapshot();
    assert!(s.demotions > 0, "filling 8x the quota must evict: {s:?}");
    assert!(
        s.peak_dram_bytes <= (16 << 20) + (1 << 20) * 2,
        "quota respected: {s:?}"
    );
    for p in (0..pages).rev() {
        let ptr = (base + p * 4096) as *const u64;
        // SAFETY: as above.
        let (a, b) = unsafe { (ptr.read_volatile(), ptr.add(511).read_volatile()) };
        assert_eq!(a, stamp(p, 1), "page {p} first word");
        assert_eq!(b, !stamp(p, 1), "page {p} last word");
    }
    let s = e.snapshot();
    assert!(
        s.faults_tier > 0,
        "reading evicted data must fetch from tier 1: {s:?}"
    );
    // Faults went to handler threads (the default delivery), which the scheduler ran; the
    // evictor ran too.
    assert!(
        s.handler_runs > 0 && s.handler_cpu_seconds > 0.0 && s.handler_wait_seconds >= 0.0,
        "{s:?}"
    );
    assert!(s.evictor_runs > 0, "{s:?}");
    // Read backwards, against the order the pages were evicted in: no fault follows the
    // previous read in slot order.
    assert!(
        s.faults_tier_slot_follows_only <= s.faults_tier_slot_follows
            && s.faults_tier_slot_follows < s.faults_tier / 2,
        "{s:?}"
    );
    eprintln!("{s:#?}");
}
