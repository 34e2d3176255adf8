//! Sequential writers chasing the evictor: each pass walks a block four times the DRAM quota
//! page by page, checking every page's stamp and writing a new one, so the program touches
//! pages while the evictor is moving runs of their neighbours out (the pattern of the python
//! end-to-end test, where the engine once lost track of a page). Every page is checked on
//! every pass, and the page table must agree with the hardware one after each pass.
//!
//! The second test runs the same chase with the page tables disturbed: a thread clears
//! accessed bits all along (as DAMON does on these machines), the kernel's move count is made
//! short every seventh move (as 6.18's batched move can be after an internal retry, which
//! then wakes no thread waiting on the unreported page), and the block grows by realloc
//! after every pass, so its contents move (mremap's page moves).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use memtide_engine::{Config, Engine};

mod common;

const PAGE: usize = 4096;
const QUOTA: u64 = 8 << 20;
const PAGES: usize = 4 * (QUOTA as usize) / PAGE;
const PASSES: u64 = 24;

/// The stamp of page `i` after pass `pass` (0 = as filled), in the page's first and last word.
fn stamp(i: usize, pass: u64) -> u64 {
    ((i as u64) << 20 | pass).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1
}

fn engine(name: &str) -> (&'static Engine, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("memtide-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut cfg = Config::new(QUOTA, &dir);
    cfg.policy = common::policy();
    cfg.arena_bytes = 1 << 30;
    cfg.epoch_ms = 50;
    let e = Engine::start(&cfg).expect("engine starts (needs userfaultfd: run as root)");
    (e, dir)
}

/// Two writers walk the block at `base` once, each its half, forwards on odd passes and
/// backwards on even ones, checking every page's stamp and writing the next. Returns the
/// pages whose stamp was wrong.
fn walk(base: usize, pass: u64) -> u64 {
    let word =
        |i: usize, last: bool| (base + i * PAGE + if last { PAGE - 8 } else { 0 }) as *mut u64;
    let mismatches = AtomicU64::new(0);
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
                    // SAFETY: the block is managed memory we own.
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
    mismatches.load(Ordering::Relaxed)
}

/// Writes every page's first stamp.
fn fill(base: usize) {
    for i in 0..PAGES {
        let p = (base + i * PAGE) as *mut u64;
        // SAFETY: the block is managed memory we own.
        unsafe {
            p.write_volatile(stamp(i, 0));
            p.byte_add(PAGE - 8).write_volatile(stamp(i, 0));
        }
    }
}

#[test]
fn sequential_writers_chasing_the_evictor_lose_nothing() {
    let (e, dir) = engine("chase");
    let base = e.alloc(PAGES * PAGE, PAGE).unwrap();
    fill(base);
    let mut mismatches = 0;
    for pass in 1..=PASSES {
        mismatches += walk(base, pass);
        e.audit()
            .unwrap_or_else(|err| panic!("after pass {pass}: {err}"));
    }
    let snap = e.snapshot();
    eprintln!(
        "chase (not a benchmark): {PASSES} passes over {PAGES} pages, {} tier faults, {} read ahead, {} moves underreported",
        snap.faults_tier, snap.readahead_pages, snap.moves_underreported
    );
    assert_eq!(mismatches, 0, "pages with a wrong stamp");
    assert!(
        snap.faults_tier > PASSES * 100,
        "the walk went through tier 1: {} tier faults",
        snap.faults_tier
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_chase_survives_cleared_accessed_bits_short_move_counts_and_reallocs() {
    // A page moved but not reported wakes nobody unless the engine does: a thread faulting
    // there would sleep for good.
    let _watchdog = common::watchdog("the disturbed chase", std::time::Duration::from_secs(600));
    let (e, dir) = engine("chase-disturbed");
    e.uffd().inject_underreport(7);
    let mut len = PAGES * PAGE;
    let mut base = e.alloc(len, PAGE).unwrap();
    // A page right after the block, so that growing it cannot happen in place.
    e.alloc(PAGE, PAGE).unwrap();
    fill(base);
    let stop = AtomicBool::new(false);
    let mut mismatches = 0;
    let mut moved_blocks = 0;
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                std::fs::write("/proc/self/clear_refs", "1").expect("clear accessed bits");
            }
        });
        for pass in 1..=PASSES {
            mismatches += walk(base, pass);
            e.audit()
                .unwrap_or_else(|err| panic!("after pass {pass}: {err}"));
            // realloc growth: the block moves to a new range, every page's contents with it,
            // wherever each page is (mapped, inactive, in tier 1).
            let grown = len + 16 * PAGE;
            let to = e.remap(base, len, grown, true).unwrap();
            if to != base {
                moved_blocks += 1;
                // Fill the hole the block left, then block growth in place again.
                e.alloc(len, PAGE).unwrap();
                e.alloc(PAGE, PAGE).unwrap();
            }
            base = to;
            len = grown;
        }
        stop.store(true, Ordering::Relaxed);
    });
    let snap = e.snapshot();
    eprintln!(
        "disturbed chase (not a benchmark): {PASSES} passes, {moved_blocks} moves of the whole block, {} tier faults, {} pages moved beyond the kernel's count",
        snap.faults_tier, snap.moves_underreported
    );
    assert_eq!(mismatches, 0, "pages with a wrong stamp");
    assert_eq!(moved_blocks, PASSES, "every realloc moved the block");
    assert!(
        snap.moves_underreported > 0,
        "short move counts were injected and seen through"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
