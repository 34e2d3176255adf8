//! The file's read-ahead keeps its books: a sequential run of tier faults reads the pages
//! that follow in growing windows, every page it brings in is counted in `readahead_pages`,
//! and the pages read ahead that the program never touches cost nothing more. They leave
//! DRAM again without a write (their copy in the file is still good), and hold their bytes
//! when they are read later.

use memtide_engine::Engine;
use memtide_policy::ahead::{readahead_window, READAHEAD};

mod common;

use common::{file_only, read_stamp, stamp, write_stamp, Rng, PAGE};

/// 4 MiB of DRAM under a block of 64 MiB: almost every page lives in tier 1.
const QUOTA: u64 = 4 << 20;
const PAGES: usize = 16 << 10;
/// Where a sequential run may start (each far from the others, in the block's second half),
/// and how many pages it touches.
const STARTS: [usize; 4] = [8 << 10, 10 << 10, 12 << 10, 14 << 10];
const RUN: usize = 49;
/// Pages written before the run that may still leave DRAM with a write after it: fewer than
/// the run's.
const STRAGGLERS: usize = 16;

/// Whether page `i` is mapped (mincore), without touching it.
fn resident(base: usize, i: usize) -> bool {
    let mut v = 0u8;
    // SAFETY: asking about one page of our own mapping.
    let r = unsafe { libc::mincore((base + i * PAGE) as *mut libc::c_void, PAGE, &mut v) };
    assert_eq!(r, 0, "mincore");
    v & 1 != 0
}

/// Reads `n` random pages of the block's first quarter, never two neighbours in a row (no
/// run, so nothing is read ahead): what was in DRAM is pushed back to tier 1. Returns how
/// many read back wrong.
fn push_out(base: usize, rng: &mut Rng, n: usize) -> usize {
    let mut wrong = 0;
    let mut last = usize::MAX - 8;
    for _ in 0..n {
        let i = loop {
            let i = rng.below(PAGES / 4);
            if i.abs_diff(last) > 2 {
                break i;
            }
        };
        wrong += (read_stamp(base, i) != stamp(i)) as usize;
        last = i;
    }
    wrong
}

/// Pages a run of `touched` sequential tier faults' worth of pages reads ahead: each fault
/// reads `readahead_window(run)` pages and the next fault comes at the first page it did not
/// read. Returns (pages read ahead, pages read ahead beyond the last one touched).
fn expected(touched: usize) -> (usize, usize) {
    let (mut next, mut run, mut ahead) = (0, 0, 0);
    while next < touched {
        run += 1;
        let w = readahead_window(run);
        ahead += w - 1;
        next += w;
    }
    (ahead, next - touched)
}

#[test]
fn pages_read_ahead_and_never_touched_cost_no_write_and_stay_right() {
    let (e, _dir) = file_only("readahead", QUOTA);
    let e: &Engine = e;
    let base = e.alloc(PAGES * PAGE, PAGE).unwrap();
    for i in 0..PAGES {
        write_stamp(base, i);
    }
    let mut rng = Rng(0xA4EAD);
    // Everything written is in tier 1 now, or gets there as the block's first quarter is read.
    assert_eq!(push_out(base, &mut rng, 4 * (QUOTA as usize / PAGE)), 0);

    // A window reads only pages whose slots follow on, so a run that ends just where the
    // evictor began a new batch of slots has nothing read beyond it: such a run is counted and
    // checked, and another run, elsewhere, is read.
    let (mut start, mut beyond, mut s1) = (0, 0, e.snapshot());
    for &at in &STARTS {
        let s0 = e.snapshot();
        let mut wrong = 0;
        for i in at..at + RUN {
            wrong += (read_stamp(base, i) != stamp(i)) as usize;
        }
        s1 = e.snapshot();
        // What is mapped past the run now came in ahead of it: nothing else touched those
        // pages.
        beyond = (at + RUN..at + RUN + 2 * READAHEAD)
            .take_while(|&i| resident(base, i))
            .count();
        let faults = (s1.faults_tier - s0.faults_tier) as usize;
        let ahead = (s1.readahead_pages - s0.readahead_pages) as usize;
        let (expected_ahead, expected_beyond) = expected(RUN);
        eprintln!(
            "run of {RUN} pages at {at}: {faults} tier faults, {ahead} pages read ahead, \
             {beyond} of them beyond the run (a run whose slots all follow on: \
             {expected_ahead}, {expected_beyond})"
        );
        assert_eq!(wrong, 0, "the run read back its stamps");
        // Every page brought in is counted, those never touched too: the run's pages and
        // those still mapped past it came in by a fault or ahead of one, and no more came in
        // than the windows read (placement can send a page of the run back before the run
        // ends, which is then read again; the evictor may already have taken some of those
        // past the run).
        assert!(
            faults + ahead >= RUN + beyond && faults + ahead <= RUN + expected_beyond + 2,
            "{faults} tier faults and {ahead} pages read ahead for {RUN} pages touched and \
             {beyond} mapped beyond them (windows reaching {expected_beyond} past the run)"
        );
        assert!(
            ahead > RUN / 2 && faults < RUN / 2,
            "the run was read mostly ahead of its faults"
        );
        start = at;
        if beyond > 0 {
            break;
        }
    }
    assert!(
        beyond > 0,
        "the last window reaches past the run, for at least one of {} runs",
        STARTS.len()
    );

    // Reading only: everything read (the run and the pages beyond it) leaves DRAM again
    // without a write.
    let reads = 8 * (QUOTA as usize / PAGE);
    assert_eq!(push_out(base, &mut rng, reads), 0);
    let s2 = e.snapshot();
    eprintln!(
        "pushed out: {} pages demoted, {} of them clean; {} bytes written",
        s2.demotions - s1.demotions,
        s2.demotions_clean - s1.demotions_clean,
        s2.tier_write_bytes - s1.tier_write_bytes
    );
    // A few pages written before the run may still have been in DRAM, or on their way to
    // the file, when the run began (the evictor writes in batches); the run's pages and
    // those read ahead (RUN + beyond, 64 pages here) are not among them.
    let written = (s2.tier_write_bytes - s1.tier_write_bytes) as usize;
    assert!(
        written <= STRAGGLERS * PAGE,
        "pages that were only read are dropped, not written: {written} bytes written"
    );
    assert!(
        (s2.demotions_clean - s1.demotions_clean) as usize >= RUN + beyond,
        "the run's pages and those read ahead of it were dropped clean"
    );

    // The pages read ahead and never touched come back from tier 1 with their bytes.
    let f0 = e.snapshot().faults_tier;
    let mut wrong = 0;
    for i in (start + RUN..start + RUN + beyond).rev() {
        wrong += (read_stamp(base, i) != stamp(i)) as usize;
    }
    let f1 = e.snapshot().faults_tier;
    assert_eq!(
        wrong, 0,
        "pages read ahead and dropped read back their stamps"
    );
    assert!(
        f1 - f0 >= beyond as u64 / 2,
        "they came from tier 1: {} faults for {beyond} pages",
        f1 - f0
    );
}
