//! `mprotect` of managed memory: the engine's books keep up with the program's protections.
//! Read-only pages stay in DRAM while they are read-only (their VMA refuses the moves that
//! eviction makes), become evictable again when made writable, and no call leaves a pin
//! behind (once, each call leaked one, and at 255 a pin could never be taken again).

mod common;

use common::{engine, PAGE};

const PAGES: usize = 4096;
const R: std::ops::Range<usize> = 100..356;

fn churn(b: usize, round: u64) {
    for i in (0..PAGES).filter(|i| !R.contains(i)) {
        // SAFETY: managed memory we own, outside the protected range.
        unsafe { ((b + i * PAGE + 8) as *mut u64).write_volatile(round) };
    }
}

#[test]
fn protected_pages_stay_put_and_calls_leave_no_pins() {
    let (e, _dir) = engine("protect", 4 << 20);
    let b = e.alloc(PAGES * PAGE, PAGE).unwrap();
    let r = (b + R.start * PAGE, R.len() * PAGE);
    let word = |i: usize| (b + i * PAGE) as *mut u64;
    for i in 0..PAGES {
        // SAFETY: managed memory we own.
        unsafe { word(i).write_volatile(i as u64) };
    }
    for round in 0..300u64 {
        e.protect(r.0, r.1, libc::PROT_READ).unwrap();
        let i = R.start + (round as usize * 7) % R.len();
        // SAFETY: a readable page of ours.
        assert_eq!(unsafe { word(i).read_volatile() } & 0xffff, i as u64);
        if round % 10 == 0 {
            churn(b, round);
        }
        e.protect(r.0, r.1, libc::PROT_READ | libc::PROT_WRITE)
            .unwrap();
        // SAFETY: writable again.
        unsafe { word(i).write_volatile(round << 16 | i as u64) };
    }
    for i in R {
        let info = e.page_info(b + i * PAGE).unwrap();
        assert_eq!(
            (info.pins, info.protected),
            (0, false),
            "page {i}: {info:?}"
        );
    }
    // Read-only and in DRAM: it stays there however hard the rest is pushed out.
    e.protect(r.0, r.1, libc::PROT_READ).unwrap();
    for i in R {
        // SAFETY: a readable page of ours.
        assert_eq!(unsafe { word(i).read_volatile() } & 0xffff, i as u64);
    }
    for round in 0..3 {
        churn(b, 1000 + round);
    }
    for i in R {
        let info = e.page_info(b + i * PAGE).unwrap();
        assert_eq!(info.state, "Mapped", "read-only page {i} stayed in DRAM");
    }
    // Writable again: it is evicted like any other page. (A quota below the range's size
    // makes it leave whatever the policy thinks of its use: it was read 300 times.)
    e.protect(r.0, r.1, libc::PROT_READ | libc::PROT_WRITE)
        .unwrap();
    e.set_quota_bytes((R.len() * PAGE / 4) as u64);
    for round in 0..3 {
        churn(b, 2000 + round);
    }
    let out = R
        .filter(|&i| e.page_info(b + i * PAGE).unwrap().state != "Mapped")
        .count();
    assert!(
        out > R.len() / 2,
        "only {out} pages left DRAM once writable"
    );
    for i in 0..PAGES {
        // SAFETY: managed memory we own.
        let got = unsafe { word(i).read_volatile() };
        assert_eq!(got & 0xffff, i as u64, "page {i}");
    }
    e.audit().expect("books balance");
}
