//! Allocations stay apart: the zero-fill of sequential first touches, which maps a few pages
//! ahead of the faulting one, never maps pages of the next allocation. (It once did, and an
//! `mremap` that moved a block's evicted pages into such a pre-filled range then left those
//! pages reading zeros instead of the program's data.)

use memtide_engine::{Config, Engine};

mod common;

fn resident_pages(addr: usize, pages: usize) -> Vec<bool> {
    let mut v = vec![0u8; pages];
    // SAFETY: mincore writes one byte per page of the range into `v`, which has that many.
    let r = unsafe { libc::mincore(addr as *mut libc::c_void, pages * 4096, v.as_mut_ptr()) };
    assert_eq!(r, 0, "mincore: {}", std::io::Error::last_os_error());
    v.into_iter().map(|b| b & 1 != 0).collect()
}

#[test]
fn zero_fill_stays_inside_its_allocation() {
    let dir = std::env::temp_dir().join(format!("memtide-bounds-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut cfg = Config::new(64 << 20, &dir);
    cfg.policy = common::policy();
    cfg.arena_bytes = 1 << 30;
    let e = Engine::start(&cfg).expect("engine starts (needs userfaultfd: run as root)");
    let a = e.alloc(2 * 4096, 4096).unwrap();
    let b = e.alloc(64 * 4096, 4096).unwrap();
    assert_eq!(
        b,
        a + 2 * 4096,
        "the arena places the second block right after the first"
    );

    // A first touch at an allocation's start fills ahead: the rest of `a`, but nothing of `b`.
    // SAFETY: `a` is managed memory we own.
    unsafe { (a as *mut u64).write_volatile(7) };
    assert_eq!(
        resident_pages(a, 2),
        vec![true, true],
        "the fill ahead covers `a`"
    );
    assert_eq!(
        resident_pages(b, 64).iter().filter(|&&r| r).count(),
        0,
        "no page of the next allocation was mapped"
    );
    // And `b`'s own first touch still reads zeros and fills ahead inside `b`.
    // SAFETY: `b` is managed memory we own.
    assert_eq!(unsafe { (b as *const u64).read_volatile() }, 0);
    assert!(resident_pages(b, 64)[1], "the fill ahead works inside `b`");
    e.audit().expect("page table agrees with the hardware one");
    let _ = std::fs::remove_dir_all(&dir);
}
