//! A touch of an inactive page under the CLOCK sweep copies the page back from its staging
//! slot, which stays dead, holding its DRAM, until the evictor's tail passes it: moving it
//! back would flush the slot's translation on every other CPU running the program. With
//! `copy_inactive_hits` off, every such page moves back. Each run rewrites pages of a block
//! four times the quota, mostly within a hot set the size of the quota, so that the sweep
//! stages hot pages the program touches again; every stamp must read back, the books must
//! balance (the dead slots' DRAM counted until the tail passes them), and DRAM stays within
//! the quota's hard limit.

use memtide_engine::{Delivery, Engine, EvictionPolicy};

mod common;

use common::{config, scratch, start, Rewrites, Rng, PAGE};

/// 16 MiB of DRAM under a block of 64 MiB.
const QUOTA: u64 = 16 << 20;
const PAGES: usize = 16 << 10;
/// The hot set: as many pages as the quota holds, so that the sweep keeps staging some.
const HOT: usize = (QUOTA as usize) / PAGE;
/// Steps: each reads one page, checks its stamp and writes the next one.
const STEPS: usize = 150_000;

struct Outcome {
    inactive: u64,
    copied: u64,
    wrong: usize,
}

fn run(name: &str, faults: Delivery, copy: bool) -> Outcome {
    let dir = scratch(name);
    let mut cfg = config(&dir, QUOTA);
    cfg.policy = EvictionPolicy::Sweep;
    cfg.faults = faults;
    cfg.copy_inactive_hits = copy;
    let e: &Engine = start(&cfg);
    let base = e.alloc(PAGES * PAGE, PAGE).unwrap();
    let mut pages = Rewrites::new(base, PAGES);
    let s0 = e.snapshot();
    let mut rng = Rng(0xC0B1);
    let mut wrong = 0;
    for _ in 0..STEPS {
        // Nine steps in ten within the hot set (the block's first pages), the rest anywhere.
        let i = if rng.below(10) < 9 {
            rng.below(HOT)
        } else {
            rng.below(PAGES)
        };
        wrong += pages.step(i);
    }
    wrong += pages.check_all();
    let s1 = e.snapshot();
    e.audit()
        .unwrap_or_else(|err| panic!("{name}: the page table agrees with the hardware one: {err}"));
    let hard_limit =
        QUOTA + memtide_policy::Watermarks::for_quota(QUOTA / PAGE as u64).batch * PAGE as u64;
    assert!(
        s1.peak_dram_bytes <= hard_limit,
        "{name}: DRAM peaked at {} bytes, over the quota's hard limit of {hard_limit}",
        s1.peak_dram_bytes
    );
    let o = Outcome {
        inactive: s1.faults_inactive - s0.faults_inactive,
        copied: s1.faults_inactive_copied - s0.faults_inactive_copied,
        wrong,
    };
    eprintln!(
        "{name}: {} inactive hits, {} copied back; peak DRAM {} KiB of {} KiB; {} wrong",
        o.inactive,
        o.copied,
        s1.peak_dram_bytes >> 10,
        QUOTA >> 10,
        o.wrong
    );
    o
}

#[test]
fn inactive_pages_touched_again_are_copied_back_and_read_right() {
    for (name, faults) in [
        ("inactive-copy-threads", Delivery::Threads),
        ("inactive-copy-signal", Delivery::Signal),
    ] {
        let on = run(name, faults, true);
        assert_eq!(on.wrong, 0, "{name}: every stamp reads back");
        assert!(
            on.inactive > 200,
            "{name}: the hot set is touched while staged: {} inactive hits",
            on.inactive
        );
        // Near the quota a hit finds no room for the copy and moves the page instead.
        assert!(
            on.copied * 2 > on.inactive,
            "{name}: most inactive hits copy the page back: {} of {}",
            on.copied,
            on.inactive
        );
    }
    let off = run("inactive-copy-off", Delivery::Threads, false);
    assert_eq!(off.wrong, 0, "every stamp reads back with pages moved back");
    assert!(off.inactive > 200, "{} inactive hits", off.inactive);
    assert_eq!(
        off.copied, 0,
        "with copying off every inactive page moves back"
    );
}
