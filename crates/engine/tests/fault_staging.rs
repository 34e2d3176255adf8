//! Faults resolved in the faulting thread (SIGBUS delivery) fill the inactive list for the
//! evictor under the CLOCK sweep: the thread unmaps pages of its own process on its own CPU,
//! so no other CPU is interrupted to flush its TLB. With handler threads, or with
//! `stage_in_faults` off, the evictor stages every page. Each run rewrites random pages of a
//! block four times the quota and reads every stamp back; the books must balance after.

use memtide_engine::{Delivery, Engine, EvictionPolicy};

mod common;

use common::{config, round_stamp, scratch, start, Rewrites, Rng, PAGE};

/// 16 MiB of DRAM under a block of 64 MiB.
const QUOTA: u64 = 16 << 20;
const PAGES: usize = 16 << 10;
/// Steps: each reads one page at random, checks its stamp and writes the next one.
const STEPS: usize = 60_000;

struct Outcome {
    deactivations: u64,
    in_faults: u64,
    tier_faults: u64,
    wrong: usize,
}

fn run(name: &str, faults: Delivery, stage_in_faults: bool) -> Outcome {
    let dir = scratch(name);
    let mut cfg = config(&dir, QUOTA);
    cfg.policy = EvictionPolicy::Sweep;
    cfg.faults = faults;
    cfg.stage_in_faults = stage_in_faults;
    let e: &Engine = start(&cfg);
    let base = e.alloc(PAGES * PAGE, PAGE).unwrap();
    let mut pages = Rewrites::new(base, PAGES);
    let s0 = e.snapshot();
    let mut rng = Rng(0xFA17);
    let mut wrong = 0;
    for _ in 0..STEPS {
        wrong += pages.step(rng.below(PAGES));
    }
    wrong += pages.check_all();
    let s1 = e.snapshot();
    e.audit()
        .unwrap_or_else(|err| panic!("{name}: the page table agrees with the hardware one: {err}"));
    Outcome {
        deactivations: s1.deactivations - s0.deactivations,
        in_faults: s1.deactivations_in_faults - s0.deactivations_in_faults,
        tier_faults: s1.faults_tier - s0.faults_tier,
        wrong,
    }
}

#[test]
fn faults_in_the_faulting_thread_stage_pages_for_the_evictor() {
    let runs = [
        ("in-thread", run("stage-signal", Delivery::Signal, true)),
        (
            "in-thread, off",
            run("stage-signal-off", Delivery::Signal, false),
        ),
        (
            "handler threads",
            run("stage-threads", Delivery::Threads, true),
        ),
    ];
    for (what, o) in &runs {
        eprintln!(
            "{what}: {} pages unmapped, {} of them by faults; {} tier faults",
            o.deactivations, o.in_faults, o.tier_faults
        );
        assert_eq!(o.wrong, 0, "{what}: every page read back its stamps");
        assert!(
            o.tier_faults > STEPS as u64 / 2,
            "{what}: most reads came from below DRAM"
        );
    }
    let [(_, on), (_, off), (_, threads)] = &runs;
    assert!(
        on.in_faults * 2 > on.deactivations,
        "faults that keep coming fill the inactive list themselves: {} of {} pages",
        on.in_faults,
        on.deactivations
    );
    assert_eq!(off.in_faults, 0, "turned off, only the evictor stages");
    assert_eq!(
        threads.in_faults, 0,
        "handler threads leave the staging to the evictor"
    );
}

/// A page the program zapped behind memtide's back (a raw `madvise`) is still mapped in the
/// books; a fault whose sweep picks it cannot unmap it, and must not free its copy below DRAM
/// itself (that takes locks a signal handler must not wait on): it leaves the page to the
/// evictor, which finds it gone. Once it is, the page reads as zeros, as the program asked.
#[test]
fn a_page_zapped_behind_the_engines_back_is_left_to_the_evictor() {
    const ZAPPED: usize = 256;
    let dir = scratch("stage-zapped");
    let mut cfg = config(&dir, QUOTA);
    cfg.policy = EvictionPolicy::Sweep;
    cfg.faults = Delivery::Signal;
    let e: &Engine = start(&cfg);
    let base = e.alloc(PAGES * PAGE, PAGE).unwrap();
    let word = |i: usize| (base + i * PAGE) as *mut u64;
    for i in 0..PAGES {
        // SAFETY: managed memory we own.
        unsafe { word(i).write_volatile(round_stamp(i, 0)) };
    }
    // Bring the first pages back (each keeps its copy below DRAM), then zap them with a raw
    // madvise the engine does not see (MADV_DONTNEED_LOCKED: managed memory is locked).
    for i in 0..ZAPPED {
        // SAFETY: as above.
        assert_eq!(unsafe { word(i).read_volatile() }, round_stamp(i, 0));
    }
    // With eviction paused (faults do not stage then either), the pages mapped now are those
    // the zap takes; a page already unmapped keeps its bytes in the engine's care.
    e.pause_evictor();
    let zapped: Vec<bool> = (0..ZAPPED)
        .map(|i| e.page_info(base + i * PAGE).unwrap().state == "Mapped")
        .collect();
    // SAFETY: discarding our own pages.
    let r = unsafe { libc::madvise(base as *mut libc::c_void, ZAPPED * PAGE, 24) };
    assert_eq!(r, 0, "madvise: {}", std::io::Error::last_os_error());
    e.resume_evictor();
    let mapped = zapped.iter().filter(|&&z| z).count();
    assert!(mapped > ZAPPED / 2, "the pages read are mapped: {mapped}");
    // Fault on the rest until the sweep has been past every zapped page.
    let mut rng = Rng(0x2A9);
    let t0 = std::time::Instant::now();
    let mut wrong = 0;
    loop {
        let left = (0..ZAPPED)
            .filter(|&i| e.page_info(base + i * PAGE).unwrap().state == "Mapped")
            .count();
        if left == 0 {
            break;
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(60),
            "{left} zapped pages still count as mapped"
        );
        for _ in 0..1000 {
            let i = ZAPPED + rng.below(PAGES - ZAPPED);
            // SAFETY: as above.
            wrong += (unsafe { word(i).read_volatile() } != round_stamp(i, 0)) as usize;
        }
    }
    let s = e.snapshot();
    eprintln!(
        "{} pages left to the evictor by faults, {} staged by faults",
        s.fault_stage_orphans, s.deactivations_in_faults
    );
    assert_eq!(wrong, 0, "every other page reads its stamp");
    assert!(
        s.fault_stage_orphans > 0,
        "faults met zapped pages and left them to the evictor"
    );
    for (i, &z) in zapped.iter().enumerate() {
        let want = if z { 0 } else { round_stamp(i, 0) };
        // SAFETY: as above.
        let got = unsafe { word(i).read_volatile() };
        assert_eq!(got, want, "page {i} (zapped: {z})");
    }
    e.audit()
        .unwrap_or_else(|err| panic!("the page table agrees with the hardware one: {err}"));
}
