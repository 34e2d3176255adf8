//! A page the engine's books call mapped but that is gone from the page tables (zapped behind
//! the engine's back, or a bug in its books) must stop the program loudly, with the page's
//! state, instead of re-faulting forever with the faulting thread spinning at 100% CPU.

use std::process::Command;

use memtide_engine::{Config, Engine};

mod common;

const CHILD: &str = "MEMTIDE_TEST_MISSING_MAPPED_CHILD";

/// Runs in a child process: maps a page, zaps it with a raw madvise the engine does not see,
/// and reads it.
fn child() {
    let dir = std::env::temp_dir().join(format!("memtide-missing-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut cfg = Config::new(16 << 20, &dir);
    cfg.policy = common::policy();
    cfg.arena_bytes = 64 << 20;
    let e = Engine::start(&cfg).expect("engine starts (needs userfaultfd: run as root)");
    let a = e.alloc(4096, 4096).unwrap();
    // SAFETY: `a` is managed memory we own.
    unsafe { (a as *mut u64).write_volatile(42) };
    // MADV_DONTNEED_LOCKED (managed memory is locked): the page is gone, the books say mapped.
    // SAFETY: discarding our own page.
    let r = unsafe { libc::madvise(a as *mut libc::c_void, 4096, 24) };
    assert_eq!(r, 0, "madvise: {}", std::io::Error::last_os_error());
    let _ = std::fs::remove_dir_all(&dir);
    // SAFETY: as above; this read faults, and the engine must stop the process.
    let v = unsafe { (a as *const u64).read_volatile() };
    panic!("the read returned {v} instead of stopping the process");
}

#[test]
fn a_mapped_page_missing_from_the_page_tables_stops_the_program() {
    if std::env::var_os(CHILD).is_some() {
        child();
        return;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_mapped_page_missing_from_the_page_tables_stops_the_program",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the child went on: {err}");
    assert!(
        err.contains("a page the engine had mapped is missing from the program's page tables"),
        "{err}"
    );
    assert!(err.contains("faults on it in a row 1000"), "{err}");
    assert!(!err.contains("instead of stopping"), "{err}");
}
