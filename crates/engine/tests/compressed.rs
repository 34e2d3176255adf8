//! The compressed level on real userfaultfd and a real tier file: pages that compress go to
//! the pool in DRAM (within the quota), the pool writes its oldest back to the file when full,
//! pages that do not compress go straight to the file, same-filled pages are kept as one word,
//! and every page reads back as written — also when the file fails, and after the quota (and
//! with it the pool) shrinks. `Compress::Off` is the file alone.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use memtide_engine::tier::TierFaults;
use memtide_engine::{Compress, Engine};

mod common;

use common::{config, scratch, start, Rng, Scratch, PAGE};

/// What page `p` holds in round `r`: `kind` 0 compresses about 2:1 (its second half is
/// zero), 1 is random, 2 is one word repeated.
fn word(kind: u8, p: usize, r: u64, k: usize) -> u64 {
    let mut x = (p as u64) << 20 ^ r << 8 ^ kind as u64;
    if kind != 2 {
        x = x.wrapping_add((k as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9));
    }
    x = x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 29;
    if kind == 0 && k >= PAGE / 16 {
        0
    } else {
        x | 1
    }
}

fn write_page(base: usize, kind: u8, p: usize, r: u64) {
    let ptr = (base + p * PAGE) as *mut u64;
    for k in 0..PAGE / 8 {
        // SAFETY: page p of a managed block the test owns.
        unsafe { ptr.add(k).write_volatile(word(kind, p, r, k)) };
    }
}

/// The first wrong word of page `p`, if any.
fn wrong_word(base: usize, kind: u8, p: usize, r: u64) -> Option<usize> {
    let ptr = (base + p * PAGE) as *const u64;
    // SAFETY: as in write_page.
    (0..PAGE / 8).find(|&k| unsafe { ptr.add(k).read_volatile() } != word(kind, p, r, k))
}

/// An engine with `quota` of DRAM, compression `compress`, and a block of `pages` pages of
/// `kind`, written once (most of them evicted).
fn filled(
    name: &str,
    quota: u64,
    compress: Compress,
    kind: u8,
    pages: usize,
    faults: Option<Arc<TierFaults>>,
) -> (&'static Engine, usize, Scratch) {
    let dir = scratch(name);
    let mut cfg = config(&dir, quota);
    cfg.compress = compress;
    cfg.tier_faults = faults;
    let e = start(&cfg);
    let b = e.alloc(pages * PAGE, PAGE).unwrap();
    for p in 0..pages {
        write_page(b, kind, p, 1);
    }
    (e, b, dir)
}

fn check_all(e: &Engine, b: usize, kind: u8, pages: usize, r: u64) {
    for p in 0..pages {
        if let Some(k) = wrong_word(b, kind, p, r) {
            panic!(
                "page {p} word {k} is wrong ({})",
                e.describe_page(b + p * PAGE)
            );
        }
    }
}

#[test]
fn compressible_pages_fill_the_pool_within_the_quota_and_spill_to_the_file() {
    fill_and_spill(Compress::Lz4);
}

#[test]
fn zstd_fills_the_pool_and_spills_to_the_file_as_lz4_does() {
    fill_and_spill(Compress::Zstd);
}

fn fill_and_spill(compress: Compress) {
    let quota = 8u64 << 20;
    let pages = 16384; // 64 MiB: 8x the quota
    let (e, b, _dir) = filled(compress.name(), quota, compress, 0, pages, None);
    let s = e.snapshot();
    // The pool holds pages at about 2:1 within its size (a sixteenth of the quota); pool and
    // pages together stay within the quota (plus the staging slack).
    assert_eq!(s.compress, compress.name());
    assert_eq!(s.compressed_capacity_bytes, quota / 16, "{s:?}");
    assert!(
        s.compressed_pool_bytes <= s.compressed_capacity_bytes,
        "{s:?}"
    );
    // Either codec makes about 2:1 of these pages; the pool's chunks hold them at better
    // than 1.2:1 even just after a write-back has emptied part of them (it frees objects one
    // by one).
    let made = (s.compressed_pages * 4096) as f64 / s.compressed_data_bytes.max(1) as f64;
    assert!(
        made > 1.7,
        "2:1 pages: {compress:?} made {made:.2}:1 of them: {s:?}"
    );
    assert!(
        s.compression_ratio() > 1.2,
        "2:1 pages: the pool holds them at {}: {s:?}",
        s.compression_ratio()
    );
    assert!(s.peak_dram_bytes <= quota + (2 << 20), "{s:?}");
    assert!(s.dram_bytes >= s.compressed_pool_bytes, "{s:?}");
    // The pool filled, so its oldest pages went on to the file.
    assert!(
        s.compressed_stores > 4096 && s.compressed_spills > 1000,
        "{s:?}"
    );
    assert!(s.tier_bytes > 16 << 20, "{s:?}");
    assert_eq!(s.compressed_rejected, 0, "{s:?}");
    // Read back newest first: the pool serves the newest, the file the rest.
    for p in (0..pages).rev() {
        assert_eq!(wrong_word(b, 0, p, 1), None, "page {p}");
    }
    // The pool (a sixteenth of the quota: 512 KiB) held some 220 of the newest pages.
    let s = e.snapshot();
    assert!(s.faults_compressed > 50, "{s:?}");
    assert!(s.faults_tier - s.faults_compressed > 1000, "{s:?}");
    assert!(s.fault_compressed_latency_p50_us > 0.0, "{s:?}");
    // A round of writes over everything, read again: copies of rewritten pages are never
    // served.
    for p in 0..pages {
        write_page(b, 0, p, 2);
    }
    check_all(e, b, 0, pages, 2);
    e.audit().expect("books balance");
}

#[test]
fn incompressible_pages_go_to_the_file_mostly_untried_and_same_filled_ones_take_no_room() {
    let quota = 4u64 << 20;
    let pages = 4096;
    let (e, b, _dir) = filled("random", quota, Compress::Lz4, 1, pages, None);
    let s = e.snapshot();
    // The pool refuses the first pages it tries; once it has refused a run of them the
    // evictor tries one page in sixteen and sends the rest to the file untried.
    let out = s.compressed_rejected + s.compressed_skipped;
    assert!(out > 2048, "{s:?}");
    assert!(
        s.compressed_rejected >= 32 && s.compressed_skipped > 8 * s.compressed_rejected,
        "pages that keep being refused are sampled: {s:?}"
    );
    assert_eq!(s.compressed_pages, 0, "{s:?}");
    assert!(s.tier_bytes > 8 << 20, "{s:?}");
    check_all(e, b, 1, pages, 1);
    let s = e.snapshot();
    assert_eq!(s.faults_compressed, 0, "{s:?}");

    // Same-filled pages are still kept as their word while the evictor samples.
    let c = e.alloc(pages * PAGE, PAGE).unwrap();
    for p in 0..pages {
        write_page(c, 2, p, 1);
    }
    let s2 = e.snapshot();
    assert!(s2.compressed_same > 2048, "{s2:?}");
    assert_eq!(s2.compressed_pages, 0, "{s2:?}");
    check_all(e, c, 2, pages, 1);
    let s3 = e.snapshot();
    assert!(s3.faults_compressed > 2048, "{s3:?}");

    // Pages that compress again: the first one sampled is taken, and the evictor goes back to
    // trying every page.
    let d = e.alloc(pages * PAGE, PAGE).unwrap();
    for p in 0..pages {
        write_page(d, 0, p, 1);
    }
    let s4 = e.snapshot();
    assert!(
        s4.compressed_stores > 1024 && s4.compressed_pages > 0,
        "compressible pages fill the pool again: {s4:?}"
    );
    assert!(
        s4.compressed_skipped - s3.compressed_skipped < 64,
        "sampling ends at the first page taken: {s3:?} then {s4:?}"
    );
    check_all(e, d, 0, pages, 1);
    check_all(e, b, 1, pages, 1);
    e.audit().expect("books balance");
}

#[test]
fn compress_off_is_the_file_alone() {
    let (e, b, _dir) = filled("off", 4 << 20, Compress::Off, 0, 4096, None);
    check_all(e, b, 0, 4096, 1);
    let s = e.snapshot();
    assert_eq!(s.compress, "off");
    assert_eq!(
        (
            s.compressed_capacity_bytes,
            s.compressed_stores,
            s.faults_compressed
        ),
        (0, 0, 0),
        "{s:?}"
    );
    assert!(
        s.tier_read_bytes > 8 << 20 && s.tier_bytes > 8 << 20,
        "{s:?}"
    );
}

#[test]
fn pages_in_the_pool_stay_readable_when_the_file_fails() {
    let faults = Arc::new(TierFaults::default());
    // Pages that compress 2:1 into a pool of a sixteenth of 8 MiB: about 1 MiB of them fit.
    let quota = 8u64 << 20;
    let pages = 2048;
    let (e, b, _dir) = filled(
        "file-fails",
        quota,
        Compress::Lz4,
        0,
        pages,
        Some(faults.clone()),
    );
    // Every write to the file fails from now on. The pool fills, and then nothing can leave
    // DRAM: the program must run on above its quota, never wait for eviction that cannot come.
    faults
        .write_errors
        .store(TierFaults::ALWAYS, Ordering::Relaxed);
    let _w = common::watchdog(
        "writing with the file failed and the pool full",
        std::time::Duration::from_secs(60),
    );
    let c = e.alloc(4 * pages * PAGE, PAGE).unwrap();
    for p in 0..4 * pages {
        write_page(c, 0, p, 1);
    }
    let s = e.snapshot();
    assert!(s.tier_errors > 0, "the file failed: {s:?}");
    assert!(
        s.compressed_pool_bytes + (64 << 10) >= s.compressed_capacity_bytes,
        "the pool filled: {s:?}"
    );
    assert!(
        s.quota_overruns > 0,
        "the program ran on above its quota: {s:?}"
    );
    // Nothing was lost: pages the file refused stayed in DRAM (above the quota) or the pool.
    check_all(e, c, 0, 4 * pages, 1);
    check_all(e, b, 0, pages, 1);
    let s = e.snapshot();
    assert!(s.faults_compressed > 0, "{s:?}");
    e.audit().expect("books balance");
}

#[test]
fn a_lowered_quota_shrinks_the_pool_by_writing_back() {
    let quota = 16u64 << 20;
    let pages = 8192;
    let (e, b, _dir) = filled("lowered", quota, Compress::Lz4, 0, pages, None);
    let before = e.snapshot();
    assert!(
        before.compressed_pool_bytes > 3 << 18,
        "the pool filled: {before:?}"
    );
    e.set_quota_bytes(quota / 4);
    let t0 = std::time::Instant::now();
    loop {
        let s = e.snapshot();
        // The pool keeps its share of the smaller quota, and wrote back what it no longer
        // may hold.
        if s.compressed_pool_bytes <= s.compressed_capacity_bytes
            && s.dram_bytes <= quota / 4 + (1 << 20)
        {
            assert_eq!(s.compressed_capacity_bytes, quota / 64, "{s:?}");
            assert!(s.compressed_spills > before.compressed_spills, "{s:?}");
            assert!(
                s.compressed_pool_bytes < before.compressed_pool_bytes,
                "{s:?}"
            );
            break;
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(20),
            "the pool did not shrink: {s:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // Random reads and writes over the block at the new quota, then everything checked.
    let mut rng = Rng(0x5EED);
    let mut round = vec![1u64; pages];
    for _ in 0..20_000 {
        let p = rng.below(pages);
        if rng.below(4) == 0 {
            round[p] += 1;
            write_page(b, 0, p, round[p]);
        } else {
            assert_eq!(wrong_word(b, 0, p, round[p]), None, "page {p}");
        }
    }
    for (p, &r) in round.iter().enumerate() {
        assert_eq!(wrong_word(b, 0, p, r), None, "page {p}");
    }
    e.audit().expect("books balance");
}

#[test]
fn a_pool_left_full_of_holes_is_compacted_and_every_page_reads_back() {
    // A pool of 4 MiB within 16 MiB, full of 2:1 pages; then the program discards every
    // other page of its block (as a freeing allocator does), which leaves holes in the pool's
    // chunks and nothing to fill them: the next epoch compacts it.
    let quota = 16u64 << 20;
    let pages = 8192;
    let dir = scratch("holes");
    let mut cfg = config(&dir, quota);
    cfg.compressed_max_bytes = Some(4 << 20);
    let e = start(&cfg);
    let b = e.alloc(pages * PAGE, PAGE).unwrap();
    for p in 0..pages {
        write_page(b, 0, p, 1);
    }
    // Once the evictor has brought DRAM back within the quota, nothing more enters the pool.
    let t0 = std::time::Instant::now();
    let full = loop {
        let s = e.snapshot();
        if s.dram_bytes <= quota {
            break s;
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(20),
            "DRAM stayed above the quota: {s:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    assert!(
        full.compressed_pool_bytes > 3 << 20 && full.compressed_pages > 1000,
        "the pool filled: {full:?}"
    );
    for p in (0..pages).step_by(2) {
        e.discard(b + p * PAGE, PAGE).unwrap();
    }
    // Half the pool's objects are freed, scattered over its chunks: compaction moves the rest
    // together (it may have begun while the pages were discarded).
    let t0 = std::time::Instant::now();
    let s = loop {
        let s = e.snapshot();
        if s.compressed_compactions > full.compressed_compactions
            && s.compressed_hole_bytes * 8 <= s.compressed_pool_bytes
        {
            break s;
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(20),
            "the pool was not compacted: {s:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert!(s.compressed_moves > full.compressed_moves + 100, "{s:?}");
    // Half its pages were discarded; the evictor's last pages may have come in since.
    assert!(
        s.compressed_pool_bytes * 10 < full.compressed_pool_bytes * 8,
        "compaction gave the holes' DRAM back: {full:?} -> {s:?}"
    );
    let per_object = |s: &memtide_engine::Snapshot| s.compressed_pool_bytes / s.compressed_pages;
    assert!(
        per_object(&s) * 10 <= per_object(&full) * 11,
        "the pool holds its objects as densely as when it was full: {full:?} -> {s:?}"
    );
    // Every page kept reads back as written (the pool serves the moved objects), every
    // discarded one as zeros.
    for p in 0..pages {
        if p % 2 == 0 {
            let ptr = (b + p * PAGE) as *const u64;
            let zero = (0..PAGE / 8).all(|k| {
                // SAFETY: page p of the block, which stays allocated after the discard.
                unsafe { ptr.add(k).read_volatile() == 0 }
            });
            assert!(zero, "discarded page {p} is not zero");
        } else {
            assert_eq!(wrong_word(b, 0, p, 1), None, "page {p}");
        }
    }
    let s = e.snapshot();
    assert!(
        s.faults_compressed > full.faults_compressed + 300,
        "the pool served the pages kept: {s:?}"
    );
    e.audit().expect("books balance");
}
