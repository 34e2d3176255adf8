//! The staging area gives back its page tables. Its address space is sized for the largest
//! quota the engine may be given (gigabytes, whatever the quota), and the head goes round all
//! of it; a page-table page stays after the pages it mapped are zapped, so without more, a
//! long run kept 2 KiB of page tables per MiB of staging area (4 MiB at any quota up to
//! 4 GiB), on top of the quota. Here 256 MiB go through 16 MiB of DRAM until the ring has
//! gone round more than once; the process's page tables may grow by those of the arena and
//! a live window of the ring, not by the ring's whole area, its memory besides managed DRAM
//! not by the ring's entries (4 bytes a slot, 2 MiB for this ring) nor, under placement, by
//! the arrivals queue (4 MiB, also a ring), and its mappings stay merged.
//! (Alone in its file: the page tables measured are the whole process's.)

mod common;

use common::PAGE;
use memtide_engine::Engine;

const PAGES: usize = 64 * 1024;
const QUOTA: u64 = 16 << 20;
/// Every this many pages holds a stamp (written once, so it travels to tier 1 and back
/// through the staging slots; the other pages stay zero, dropped without a write).
const STAMPED: usize = 16;

fn stamp(page: usize) -> u64 {
    (page as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x7AB1E
}

/// What this process holds: page tables (VmPTE), anonymous memory other than the engine's
/// managed DRAM (smaps_rollup's Anonymous less the pages the engine holds), both in bytes, and
/// its mappings. Anonymous memory is counted by walking the page tables: status's RssAnon is
/// read from per-CPU counters without summing them.
struct Held {
    page_tables: u64,
    anon_outside: u64,
    maps: usize,
}

fn held(engine: &Engine) -> Held {
    // Measured with the evictor parked: in the middle of a batch it has given back the DRAM of
    // up to 256 pages not yet taken off the count, which then hides a megabyte of the rest.
    engine.pause_evictor();
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let rollup = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap();
    let field = |text: &str, name: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("{name} in /proc/self"))
            << 10
    };
    let managed = engine.resident_pages() * PAGE as u64;
    let maps = std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .count();
    engine.resume_evictor();
    Held {
        page_tables: field(&status, "VmPTE:"),
        anon_outside: field(&rollup, "Anonymous:").saturating_sub(managed),
        maps,
    }
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
    let before = held(engine);
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
    let after = held(engine);
    engine.audit().unwrap();
    // What the ring's area and its entries (4 bytes a slot) would hold, all of them used.
    let ring_tables = slots / 512 * PAGE as u64;
    let ring_entries = slots * 4;
    eprintln!(
        "{rounds} passes, {} pages staged through {slots} slots: page tables {} -> {} KiB (the whole ring's would be {} KiB), anonymous memory besides managed DRAM {} -> {} KiB (the ring's entries: {} KiB), mappings {} -> {}",
        engine.snapshot().deactivations - staged0,
        before.page_tables >> 10,
        after.page_tables >> 10,
        ring_tables >> 10,
        before.anon_outside >> 10,
        after.anon_outside >> 10,
        ring_entries >> 10,
        before.maps,
        after.maps,
    );
    assert!(
        ring_tables >= 2 << 20,
        "the test needs a ring whose page tables would show: {slots} slots"
    );
    assert!(
        after.page_tables < before.page_tables + ring_tables / 4,
        "page tables grew from {} to {} bytes: the ring's area keeps them ({ring_tables} bytes for all of it)",
        before.page_tables,
        after.page_tables
    );
    assert!(
        after.anon_outside < before.anon_outside + ring_entries / 4,
        "memory besides managed DRAM grew from {} to {} bytes: the ring's entries stay ({ring_entries} bytes for all of them)",
        before.anon_outside,
        after.anon_outside
    );
    assert!(
        after.maps <= before.maps + 8,
        "renewed chunks of the staging area merge back: {} -> {} mappings",
        before.maps,
        after.maps
    );
}
