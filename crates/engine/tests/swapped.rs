//! Linux must not swap managed memory out behind memtide's back: with swap on, reclaim and the
//! host's DAMON page out any cold anonymous page, and a page UFFDIO_MOVE moved while swapped
//! out came back as zeros (found by this test, before memtide locked its DRAM). Here a swap
//! file is switched on and every anonymous mapping of the process is paged out over and over
//! while one thread reads and writes stamped pages through a small DRAM budget: plain memory
//! beside it does go to swap, managed memory never does, every page reads back as last
//! written, and the engine's page table agrees with the kernel's. Needs root (swapon,
//! locking), as CI runs.

use std::path::{Path, PathBuf};
use std::process::Command;

use memtide_engine::{Config, Engine};

mod common;

const PAGE: usize = 4096;

/// A swap file switched on for the test's lifetime.
struct Swap(PathBuf);

impl Swap {
    fn on(dir: &Path, bytes: u64) -> Swap {
        let path = dir.join("test.swap");
        let f = std::fs::File::create(&path).unwrap();
        f.set_len(0).unwrap();
        drop(f);
        let ok = Command::new("fallocate")
            .arg("-l")
            .arg(bytes.to_string())
            .arg(&path)
            .status()
            .unwrap()
            .success();
        assert!(ok, "fallocate of the swap file");
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
        let swap = Swap(path);
        for cmd in ["mkswap", "swapon"] {
            let o = Command::new(cmd).arg(&swap.0).output().unwrap();
            assert!(
                o.status.success(),
                "{cmd}: {} (this test needs root, as CI runs)",
                String::from_utf8_lossy(&o.stderr)
            );
        }
        swap
    }
}

impl Drop for Swap {
    /// Turns the swap file off and removes it, and its directory once empty (an active swap
    /// file cannot be unlinked, so the test's own cleanup cannot remove either before this).
    fn drop(&mut self) {
        let _ = Command::new("swapoff").arg(&self.0).status();
        let _ = std::fs::remove_file(&self.0);
        if let Some(dir) = self.0.parent() {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// Pages out every private anonymous writable mapping of this process (as DAMON's
/// physical-address pageout would, whoever owns the pages). Returns how many bytes it asked
/// for.
fn page_out_everything() -> usize {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let mut asked = 0;
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms), Some(_), Some(_), Some(inode)) =
            (f.next(), f.next(), f.next(), f.next(), f.next())
        else {
            continue;
        };
        if !perms.starts_with("rw") || !perms.ends_with('p') || inode != "0" || f.next().is_some() {
            continue;
        }
        let (a, b) = range.split_once('-').unwrap();
        let (a, b) = (
            usize::from_str_radix(a, 16).unwrap(),
            usize::from_str_radix(b, 16).unwrap(),
        );
        // SAFETY: MADV_PAGEOUT only moves pages to swap; contents are kept.
        if unsafe { libc::madvise(a as *mut libc::c_void, b - a, libc::MADV_PAGEOUT) } == 0 {
            asked += b - a;
        }
    }
    asked
}

/// How many of the `pages` pages from `addr` are swapped out (from /proc/self/pagemap).
fn swapped_pages(addr: usize, pages: usize) -> usize {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open("/proc/self/pagemap").unwrap();
    let mut buf = vec![0u8; pages * 8];
    f.read_exact_at(&mut buf, (addr / PAGE * 8) as u64).unwrap();
    buf.chunks(8)
        .filter(|e| u64::from_le_bytes((*e).try_into().unwrap()) >> 62 & 3 == 1)
        .count()
}

#[test]
fn pages_linux_swaps_out_are_neither_lost_nor_fatal() {
    let dir = PathBuf::from("/var/tmp").join(format!("memtide-swapped-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let _swap = Swap::on(&dir, 256 << 20);

    let pages = 4096; // 16 MiB through a 4 MiB budget
    let mut cfg = Config::new(4 << 20, &dir);
    cfg.policy = common::policy();
    cfg.arena_bytes = 1 << 30;
    let e = Engine::start(&cfg).expect("engine starts (needs userfaultfd: run as root)");
    let base = e.alloc(pages * PAGE, PAGE).unwrap();
    let word = |p: usize, k: usize| (base + p * PAGE + k * 8) as *mut u64;
    let mut version = vec![0u64; pages];
    for p in 0..pages {
        // SAFETY: inside our managed allocation.
        unsafe { word(p, 0).write_volatile(p as u64) };
    }

    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    // Plain memory beside it, to show that the pageout works.
    let plain_pages = 1024;
    // SAFETY: a fresh private anonymous mapping, not managed.
    let plain = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            plain_pages * PAGE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    } as usize;
    assert_ne!(plain, libc::MAP_FAILED as usize);
    for p in 0..plain_pages {
        // SAFETY: inside the plain mapping.
        unsafe { ((plain + p * PAGE) as *mut u64).write_volatile(p as u64 + 1) };
    }
    let mut plain_swapped = 0;
    for round in 0..60 {
        assert!(page_out_everything() > 0);
        plain_swapped = plain_swapped.max(swapped_pages(plain, plain_pages));
        assert_eq!(
            swapped_pages(base, pages),
            0,
            "Linux swapped out managed pages (round {round})"
        );
        for _ in 0..2000 {
            let r = next();
            let p = (r % pages as u64) as usize;
            // SAFETY: inside our managed allocation.
            unsafe {
                let got = word(p, 0).read_volatile();
                assert_eq!(
                    got,
                    p as u64,
                    "page {p} (round {round}): {}; {:?}",
                    e.describe_page(base + p * PAGE),
                    e.snapshot()
                );
                assert_eq!(
                    word(p, 1).read_volatile(),
                    version[p],
                    "page {p} (round {round})"
                );
                if r >> 40 & 3 == 0 {
                    version[p] += 1;
                    word(p, 1).write_volatile(version[p]);
                }
            }
        }
        if round % 20 == 19 {
            e.audit().expect("page table agrees with the kernel's");
        }
    }
    assert!(
        plain_swapped > plain_pages / 2,
        "Linux swapped out only {plain_swapped} of {plain_pages} plain pages: the pageout did not work"
    );
    for (p, &v) in version.iter().enumerate() {
        // SAFETY: inside our managed allocation.
        unsafe {
            assert_eq!(word(p, 0).read_volatile(), p as u64);
            assert_eq!(word(p, 1).read_volatile(), v, "page {p}");
        }
    }
    e.audit().expect("page table agrees with the kernel's");
    let _ = std::fs::remove_dir_all(&dir);
}
