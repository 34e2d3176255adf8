//! Sequential writers chasing the evictor: each pass walks a block four times the DRAM quota
//! page by page, checking every page's stamp and writing a new one, so the program touches
//! pages while the evictor is moving runs of their neighbours out (the pattern of the python
//! end-to-end test, where the engine once lost track of a page). Every page is checked on
//! every pass, and the page table must agree with the hardware one after each pass.

use std::sync::atomic::{AtomicU64, Ordering};

use memtide_engine::{Config, Engine};

const PAGE: usize = 4096;
const QUOTA: u64 = 8 << 20;
const PAGES: usize = 4 * (QUOTA as usize) / PAGE;
const PASSES: u64 = 24;

/// The stamp of page `i` after pass `pass` (0 = as filled), in the page's first and last word.
fn stamp(i: usize, pass: u64) -> u64 {
    ((i as u64) << 20 | pass).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1
}

#[test]
fn sequential_writers_chasing_the_evictor_lose_nothing() {
    let dir = std::env::temp_dir().join(format!("memtide-chase-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut cfg = Config::new(QUOTA, &dir);
    cfg.arena_bytes = 1 << 30;
    cfg.epoch_ms = 50;
    let e = Engine::start(&cfg).expect("engine starts (needs userfaultfd: run as root)");
    let base = e.alloc(PAGES * PAGE, PAGE).unwrap();
    let word =
        |i: usize, last: bool| (base + i * PAGE + if last { PAGE - 8 } else { 0 }) as *mut u64;
    for i in 0..PAGES {
        // SAFETY: the block is managed memory we own.
        unsafe {
            word(i, false).write_volatile(stamp(i, 0));
            word(i, true).write_volatile(stamp(i, 0));
        }
    }
    let mismatches = AtomicU64::new(0);
    for pass in 1..=PASSES {
        // Two writers, each walking its half forwards (odd passes) or backwards (even ones).
        std::thread::scope(|s| {
            for half in 0..2 {
                let mismatches = &mismatches;
                s.spawn(move || {
                    let range = half * PAGES / 2..(half + 1) * PAGES / 2;
                    let order: Vec<usize> = if pass % 2 == 1 {
                        range.collect()
                    } else {
                        range.rev().collect()
                    };
                    for i in order {
                        // SAFETY: as above.
                        unsafe {
                            let want = stamp(i, pass - 1);
                            if word(i, false).read_volatile() != want
                                || word(i, true).read_volatile() != want
                            {
                                mismatches.fetch_add(1, Ordering::Relaxed);
                            }
                            word(i, false).write_volatile(stamp(i, pass));
                            word(i, true).write_volatile(stamp(i, pass));
                        }
                    }
                });
            }
        });
        e.audit()
            .unwrap_or_else(|err| panic!("after pass {pass}: {err}"));
    }
    let snap = e.snapshot();
    eprintln!(
        "chase (not a benchmark): {PASSES} passes over {PAGES} pages, {} tier faults, {} read ahead, {} moves underreported",
        snap.faults_tier, snap.readahead_pages, snap.moves_underreported
    );
    assert_eq!(
        mismatches.load(Ordering::Relaxed),
        0,
        "pages with a wrong stamp"
    );
    assert!(
        snap.faults_tier > PASSES * 100,
        "the walk went through tier 1: {} tier faults",
        snap.faults_tier
    );
    let _ = std::fs::remove_dir_all(&dir);
}
