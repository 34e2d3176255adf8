//! Objects that span two pages, read back from tier 1: once most faults that start a run are
//! followed by one on the next page (a program reading values of a few KiB), such a fault
//! reads both pages, so an object costs one tier fault instead of two; random single pages
//! read nothing ahead, before and after. Every page read is checked against its stamp.

use memtide_engine::Engine;

mod common;

use common::{file_only, read_stamp, stamp, write_stamp, Rng, PAGE};

/// 4 MiB of DRAM under a block of 64 MiB: almost every page read comes from tier 1.
const QUOTA: u64 = 4 << 20;
const PAGES: usize = 16 << 10;
/// Reads per phase.
const READS: u64 = 3000;

/// Tier faults, pages read ahead, and of those pages read as the next page of a pair, while
/// `f` runs.
fn counting(e: &Engine, f: impl FnOnce()) -> (u64, u64, u64) {
    let s0 = e.snapshot();
    f();
    let s1 = e.snapshot();
    (
        s1.faults_tier - s0.faults_tier,
        s1.readahead_pages - s0.readahead_pages,
        s1.readahead_pairs - s0.readahead_pairs,
    )
}

#[test]
fn objects_spanning_two_pages_are_read_in_one_fault() {
    // The file's read-ahead is what is tested: the pool would hold these pages.
    let (e, _dir) = file_only("pairs", QUOTA);
    let base = e.alloc(PAGES * PAGE, PAGE).unwrap();
    for i in 0..PAGES {
        write_stamp(base, i);
    }
    let mut rng = Rng(0x5EED);
    let mut wrong = 0;
    let mut check = |i: usize| {
        if read_stamp(base, i) != stamp(i) {
            wrong += 1;
        }
    };
    // Random single pages (never two neighbours in a row): one fault each, nothing ahead.
    let singles = |rng: &mut Rng, check: &mut dyn FnMut(usize)| {
        let mut last = usize::MAX - 8;
        for _ in 0..READS {
            let i = loop {
                let i = rng.below(PAGES);
                if i.abs_diff(last) > 2 {
                    break i;
                }
            };
            check(i);
            last = i;
        }
    };
    // A phase of them: the reads come from tier 1, and nothing is read ahead.
    let read_alone = |rng: &mut Rng, check: &mut dyn FnMut(usize), what: &str| {
        let (faults, ahead, _) = counting(e, || singles(rng, check));
        eprintln!("{what}: {faults} tier faults, {ahead} pages read ahead");
        assert!(
            faults > READS * 8 / 10,
            "{what}: the reads came from tier 1: {faults}"
        );
        assert_eq!(ahead, 0, "{what}: nothing read ahead");
    };
    read_alone(&mut rng, &mut check, "random single pages");

    // Objects: a page and the next. The first few hundred measure; then one fault in eight
    // still does, and pages whose tier slots do not follow on are read alone.
    let objects = |rng: &mut Rng, check: &mut dyn FnMut(usize), n: u64| {
        for _ in 0..n {
            let i = rng.below(PAGES - 1);
            check(i);
            check(i + 1);
        }
    };
    objects(&mut rng, &mut check, READS);
    let (faults, ahead, pairs) = counting(e, || objects(&mut rng, &mut check, READS));
    eprintln!("objects of two pages: {faults} tier faults for {READS}, {ahead} pages read ahead, {pairs} as pairs");
    assert!(
        faults < READS * 3 / 2,
        "an object costs about one fault once pairs are on: {faults} faults for {READS} objects"
    );
    assert!(ahead > READS / 2, "{ahead} pages read ahead");
    assert_eq!(
        pairs, ahead,
        "every page read ahead was the next page of a pair"
    );

    // Back to single pages: pairs turn off within a decision's worth of faults.
    singles(&mut rng, &mut check);
    read_alone(
        &mut rng,
        &mut check,
        "single pages again (pairs turned off)",
    );
    assert_eq!(wrong, 0, "pages read back with a wrong stamp");
}
