//! The CLOCK sweep sees writes: where the kernel tracks them (asynchronous userfaultfd
//! write-protection), a page the program keeps writing keeps its place in DRAM without being
//! unmapped to prove it, so it costs no hint fault; with tracking off, the same program pays
//! a hint fault each time the sweep tests such a page. Both run the same steps; every page
//! read back holds its stamp.

use memtide_engine::{Engine, EvictionPolicy};

mod common;

use common::{config, scratch, start, Rng, PAGE};

/// 16 MiB of DRAM under a block of 64 MiB.
const QUOTA: u64 = 16 << 20;
const PAGES: usize = 16 << 10;
/// The first pages of the block are written over and over: a quarter of the quota.
const HOT: usize = 1024;
/// Steps: each writes the next 8 hot pages and reads one cold page at random.
const STEPS: usize = 40_000;

fn stamp(i: usize, round: u64) -> u64 {
    ((i as u64) << 24 | round).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1
}

struct Outcome {
    hint_faults: u64,
    seen_written: u64,
    tier_faults: u64,
    wrong: usize,
}

/// Runs the steps; `None` where tracking was asked for and the kernel cannot track writes.
fn run(name: &str, track_writes: bool) -> Option<Outcome> {
    let dir = scratch(name);
    let mut cfg = config(&dir, QUOTA);
    // What is tested is the CLOCK sweep's (placement's queues do not read writes).
    cfg.policy = EvictionPolicy::Sweep;
    cfg.track_writes = track_writes;
    let e: &Engine = start(&cfg);
    if e.tracks_writes() != track_writes {
        return None;
    }
    let base = e.alloc(PAGES * PAGE, PAGE).unwrap();
    let word = |i: usize| (base + i * PAGE) as *mut u64;
    for i in 0..PAGES {
        // SAFETY: managed memory we own.
        unsafe { word(i).write_volatile(stamp(i, 0)) };
    }
    let s0 = e.snapshot();
    let mut rng = Rng(0x5EED);
    let mut round = vec![0u64; HOT];
    let mut wrong = 0;
    let mut next = 0;
    for _ in 0..STEPS {
        for _ in 0..8 {
            let i = next;
            next = (next + 1) % HOT;
            // SAFETY: as above.
            unsafe {
                wrong += (word(i).read_volatile() != stamp(i, round[i])) as usize;
                round[i] += 1;
                word(i).write_volatile(stamp(i, round[i]));
            }
        }
        let c = HOT + rng.below(PAGES - HOT);
        // SAFETY: as above.
        wrong += (unsafe { word(c).read_volatile() } != stamp(c, 0)) as usize;
    }
    for (i, &r) in round.iter().enumerate() {
        // SAFETY: as above.
        wrong += (unsafe { word(i).read_volatile() } != stamp(i, r)) as usize;
    }
    let s1 = e.snapshot();
    e.audit()
        .unwrap_or_else(|err| panic!("{name}: the page table agrees with the hardware one: {err}"));
    Some(Outcome {
        hint_faults: s1.faults_inactive - s0.faults_inactive,
        seen_written: s1.pages_seen_written - s0.pages_seen_written,
        tier_faults: s1.faults_tier - s0.faults_tier,
        wrong,
    })
}

#[test]
fn pages_the_program_writes_keep_their_place_without_a_hint_fault() {
    let off = run("written-off", false).expect("tracking can always be off");
    let Some(on) = run("written-on", true) else {
        eprintln!("skipped: this kernel cannot track writes (UFFD_FEATURE_WP_ASYNC, Linux 6.7)");
        return;
    };
    for (what, o) in [("tracking off", &off), ("tracking on", &on)] {
        eprintln!(
            "{what}: {} hint faults, {} pages found written, {} tier faults",
            o.hint_faults, o.seen_written, o.tier_faults
        );
        assert_eq!(o.wrong, 0, "{what}: every page read back its stamp");
        assert!(
            o.tier_faults > STEPS as u64 / 2,
            "{what}: the cold reads came from below DRAM"
        );
    }
    assert_eq!(
        off.seen_written, 0,
        "nothing is found written with tracking off"
    );
    assert!(
        off.hint_faults > HOT as u64,
        "with tracking off the sweep tests the written pages by unmapping them"
    );
    assert!(
        on.seen_written > HOT as u64,
        "with tracking on the sweep finds the written pages"
    );
    assert!(
        on.hint_faults * 3 < off.hint_faults * 2,
        "written pages cost no hint fault: {} with tracking, {} without",
        on.hint_faults,
        off.hint_faults
    );
}
