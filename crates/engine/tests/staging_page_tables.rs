//! The staging area gives back its page tables. Its address space is sized for the largest
//! quota the engine may be given (gigabytes, whatever the quota), and the head goes round all
//! of it; a page-table page stays after the pages it mapped are zapped, so without more, a
//! long run kept 2 KiB of page tables per MiB of staging area (4 MiB at any quota up to
//! 4 GiB), on top of the quota. Here 256 MiB go through 16 MiB of DRAM until the ring has
//! gone round more than once; the process's page tables may grow by those of the arena and
//! a live window of the ring, not by the ring's whole area, and its mappings stay merged.
//! (Alone in its file: the page tables measured are the whole process's.)

mod common;

use common::PAGE;

const PAGES: usize = 64 * 1024;
const QUOTA: u64 = 16 << 20;
/// Every this many pages holds a stamp (written once, so it travels to tier 1 and back
/// through the staging slots; the other pages stay zero, dropped without a write).
const STAMPED: usize = 16;

fn stamp(page: usize) -> u64 {
    (page as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x7AB1E
}

/// VmPTE (page tables, bytes) and the number of mappings of this process.
fn page_tables_and_maps() -> (u64, usize) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmPTE:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmPTE in /proc/self/status");
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    (kib << 10, maps.lines().count())
}

#[test]
fn the_staging_area_gives_back_its_page_tables() {
    let (engine, _dir) = common::engine("staging-pt", QUOTA);
    let base = engine.alloc(PAGES * PAGE, PAGE).unwrap();
    let page = |p: usize| (base + p * PAGE) as *mut u64;
    for p in (0..PAGES).step_by(STAMPED) {
        // SAFETY: page p lies in managed memory the test allocated.
        unsafe { page(p).write_volatile(stamp(p)) };
    }
    let pass = || {
        for p in 0..PAGES {
            let want = if p % STAMPED == 0 { stamp(p) } else { 0 };
            // SAFETY: as above.
            assert_eq!(unsafe { page(p).read_volatile() }, want, "page {p}");
        }
    };
    pass();
    let (pt0, maps0) = page_tables_and_maps();
    let staged0 = engine.snapshot().deactivations;
    // Round after round until the staging ring has gone round twice.
    let slots = engine.staging_slots();
    let mut rounds = 0;
    while engine.snapshot().deactivations - staged0 < 2 * slots {
        pass();
        rounds += 1;
        assert!(
            rounds < 100,
            "the ring should go round: {:?}",
            engine.snapshot()
        );
    }
    let (pt1, maps1) = page_tables_and_maps();
    engine.audit().unwrap();
    let ring_tables = slots / 512 * PAGE as u64;
    eprintln!(
        "{rounds} passes, {} pages staged through {slots} slots: page tables {} -> {} KiB (the whole ring's would be {} KiB), mappings {maps0} -> {maps1}",
        engine.snapshot().deactivations - staged0,
        pt0 >> 10,
        pt1 >> 10,
        ring_tables >> 10
    );
    assert!(
        ring_tables >= 2 << 20,
        "the test needs a ring whose page tables would show: {slots} slots"
    );
    assert!(
        pt1 < pt0 + ring_tables / 4,
        "page tables grew from {pt0} to {pt1} bytes: the ring's area keeps them ({ring_tables} bytes for all of it)"
    );
    assert!(
        maps1 <= maps0 + 8,
        "renewed chunks of the staging area merge back: {maps0} -> {maps1} mappings"
    );
}
