//! Stress test of the engine — not a benchmark.
//!
//! Models a program whose threads randomly read and write pages of a footprint 8x the DRAM
//! quota while the engine evicts and fetches underneath them, and which also discards ranges
//! (`madvise(DONTNEED)`), protects ranges read-only and back (`mprotect`), frees and
//! reallocates blocks (`munmap` + `mmap`), grows and shrinks them (`mremap`, moving or in
//! place), moves data through the kernel (`write(2)` from managed memory into a pipe, `read(2)`
//! back into managed memory), and forks: about every second one thread forks while the others
//! go on, and the child, running its own engine, checks the pages the forking thread held
//! (faulting them in from the levels below DRAM it shares with the parent), overwrites and
//! checks them again, while the parent keeps evicting and rewriting. Meanwhile a thread clears the accessed bits
//! of every page table entry (as DAMON does on these machines). Every page's whole content is
//! derived from a version kept in a shadow table, so any lost or corrupted write, or a page
//! that reads back stale or non-zero after a discard, is a mismatch. Half the pages compress
//! about 2:1 and an eighth 3:1 (they go to the compressed pool, which fills and writes its
//! oldest back to the file all along, and is compacted as frees leave holes in it; lz4 under
//! the sweep, zstd under placement), a quarter
//! not at all (straight to the file), and an eighth are one word repeated. The test fails on
//! any mismatch, and audits the engine's
//! books against the page tables at the end.
//!
//! Faults go to handler threads. A third run, of half the time, delivers them in the faulting
//! thread (SIGBUS), where faults also stage pages for the evictor; it does not fork (a fork
//! there brings memory back untiered).
//!
//! Runs 40 s by default: `cargo test --release -p memtide-engine --test stress -- --minutes 60`
//! (or `--seconds N`, or `MEMTIDE_STRESS_SECS`) for a soak. It prints its counts every minute
//! and at the end.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::RwLock;
use std::time::{Duration, Instant};

use memtide_engine::{Config, Delivery, Engine, EvictionPolicy, ForkPlan};

mod common;

use common::Rng;

const PAGE: usize = 4096;
const QUOTA: u64 = 16 << 20;
const BLOCKS: usize = 32;
/// Pages per block at its normal size; blocks may grow to twice this.
const BLOCK_PAGES: usize = 1024; // 4 MiB; 32 blocks = 128 MiB = 8x the quota
const LOCKED: u32 = 1 << 31;

fn word(gen: u64, page: usize, version: u32, k: usize) -> u64 {
    if version == 0 {
        return 0;
    }
    let mix = |k: u64| {
        let mut x = gen
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add((page as u64) << 32 | version as u64)
            .wrapping_add(k.wrapping_mul(0xBF58_476D_1CE4_E5B9));
        x ^= x >> 31;
        x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^ (x >> 29)
    };
    // Pages of every kind the levels below DRAM treat differently: most compress (into the
    // pool), some not at all (straight to the file), some are one word repeated (kept as
    // that word). One block in eight holds none that compress: the pool refuses runs of
    // them, so the evictor samples (tries one page in several) and stops sampling again.
    // (Each block is written in address order at the start, so the evictor meets such runs
    // under either policy.)
    if gen % 8 == 5 {
        return mix(k as u64);
    }
    match page % 8 {
        0..=3 if k >= PAGE / 16 => 0,
        6 => mix(0),
        7 if !k.is_multiple_of(3) => 0,
        _ => mix(k as u64),
    }
}

struct Layout {
    addr: usize,
    pages: usize,
    gen: u64,
}

struct Block {
    layout: RwLock<Layout>,
    versions: Vec<AtomicU32>,
}

struct World {
    engine: &'static Engine,
    blocks: Vec<Block>,
    mismatches: AtomicU64,
    ops: AtomicU64,
    stop: AtomicBool,
    /// When the next fork is due (ns since the start), and how many children ran.
    next_fork: AtomicU64,
    forks: AtomicU64,
    start: Instant,
    /// Where the workers run, changed every 200 ms: all CPUs, the first only, the last only
    /// (so the handler threads' following of the program's threads races with the faults).
    phase: AtomicU32,
    /// The CPU set the test started with.
    cpus: libc::cpu_set_t,
}

impl World {
    fn page_ptr(l: &Layout, p: usize) -> *mut u64 {
        (l.addr + p * PAGE) as *mut u64
    }

    fn fill(l: &Layout, p: usize, version: u32) {
        let ptr = Self::page_ptr(l, p);
        for k in 0..PAGE / 8 {
            // SAFETY: page p of a live block in managed memory, locked by this thread.
            unsafe { ptr.add(k).write_volatile(word(l.gen, p, version, k)) };
        }
    }

    fn check(&self, l: &Layout, p: usize, version: u32, what: &str) -> bool {
        let ptr = Self::page_ptr(l, p);
        for k in 0..PAGE / 8 {
            // SAFETY: as in fill.
            let got = unsafe { ptr.add(k).read_volatile() };
            let want = word(l.gen, p, version, k);
            if got != want {
                if self.mismatches.fetch_add(1, Ordering::Relaxed) < 10 {
                    eprintln!(
                        "MISMATCH ({what}) gen {} page {p} version {version} word {k}: got {got:#x} want {want:#x}",
                        l.gen
                    );
                }
                return false;
            }
        }
        true
    }

    /// Locks page `p` of block `b` (spinning on its version word) and returns its version.
    fn lock(&self, b: usize, p: usize) -> u32 {
        let v = &self.blocks[b].versions[p];
        loop {
            let cur = v.load(Ordering::Acquire);
            if cur & LOCKED == 0
                && v.compare_exchange(cur, cur | LOCKED, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            {
                return cur;
            }
            std::thread::yield_now();
        }
    }

    fn unlock(&self, b: usize, p: usize, version: u32) {
        self.blocks[b].versions[p].store(version, Ordering::Release);
    }

    /// Whether this thread forks now (one fork about every second, in one thread at a time).
    fn fork_due(&self) -> bool {
        let now = self.start.elapsed().as_nanos() as u64;
        let due = self.next_fork.load(Ordering::Acquire);
        now >= due
            && self
                .next_fork
                .compare_exchange(
                    due,
                    now + 1_000_000_000,
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                )
                .is_ok()
    }

    /// Forks while holding a run of pages of block `b`: the child runs its own engine and checks
    /// them (as they were at the fork: their locks are held), overwrites and checks them; the
    /// parent lets them go at once and goes on. A wrong page in the child is a mismatch.
    fn fork_and_check(&self, b: usize, rng: &mut Rng) {
        let l = self.blocks[b].layout.read().unwrap();
        let first = rng.below(l.pages);
        let n = 64.min(l.pages - first);
        let vs: Vec<u32> = (first..first + n).map(|p| self.lock(b, p)).collect();
        let plan = self.engine.fork_prepare();
        assert!(
            matches!(plan, ForkPlan::Tiered { .. }),
            "fork events are available here (root, handler threads)"
        );
        // SAFETY: the child reads and writes managed memory, runs its engine, and _exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            self.engine.fork_child(plan);
            let mut bad = 0;
            for (p, &v) in (first..first + n).zip(&vs) {
                bad += !self.check(&l, p, v, "child: what it inherited") as i32;
                Self::fill(&l, p, v + 7);
            }
            for (p, &v) in (first..first + n).zip(&vs) {
                bad += !self.check(&l, p, v + 7, "child: its own write") as i32;
            }
            // SAFETY: leaving the child without running the parent's destructors.
            unsafe { libc::_exit(if bad == 0 { 0 } else { 1 }) };
        }
        assert!(pid > 0, "fork failed");
        self.engine.fork_parent(plan);
        for (p, &v) in (first..first + n).zip(&vs) {
            self.unlock(b, p, v);
        }
        drop(l);
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
            eprintln!("MISMATCH (fork): the child saw wrong data (status {status})");
            self.mismatches.fetch_add(1, Ordering::Relaxed);
        }
        self.forks.fetch_add(1, Ordering::Relaxed);
    }

    /// Moves the calling thread to the CPUs of `phase`.
    fn run_on(&self, phase: u32) {
        let all: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
            // SAFETY: reading a bit of a valid set.
            .filter(|&c| unsafe { libc::CPU_ISSET(c, &self.cpus) })
            .collect();
        let mut set = self.cpus;
        if !phase.is_multiple_of(3) && all.len() > 1 {
            let only = if phase % 3 == 1 {
                all[0]
            } else {
                all[all.len() - 1]
            };
            // SAFETY: clearing and setting bits of a valid set (`only` is one of its CPUs).
            unsafe {
                libc::CPU_ZERO(&mut set);
                libc::CPU_SET(only, &mut set);
            }
        }
        // SAFETY: a valid set of the size given, for the calling thread.
        unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    }

    fn worker(&self, seed: u64) {
        // A program thread: the handler threads follow the CPUs its faults come from.
        memtide_engine::threads::note_program_thread();
        let mut rng = Rng(seed | 1);
        let mut next_version = 1u32 + (seed as u32 % 1000) * 1_000_000;
        let mut phase = 0;
        while !self.stop.load(Ordering::Relaxed) {
            let now = self.phase.load(Ordering::Relaxed);
            if now != phase {
                phase = now;
                self.run_on(phase);
            }
            let b = rng.below(BLOCKS);
            let op = rng.below(1000);
            self.ops.fetch_add(1, Ordering::Relaxed);
            if self.fork_due() {
                self.fork_and_check(b, &mut rng);
            } else if op < 980 {
                // Skewed page choice: a quarter of the pages get most of the accesses.
                let l = self.blocks[b].layout.read().unwrap();
                let p = if rng.below(10) < 8 {
                    rng.below(l.pages / 4)
                } else {
                    rng.below(l.pages)
                };
                let v = self.lock(b, p);
                if op < 600 {
                    self.check(&l, p, v, "read");
                    self.unlock(b, p, v);
                } else {
                    next_version += 1;
                    Self::fill(&l, p, next_version);
                    self.unlock(b, p, next_version);
                }
            } else if op < 983 {
                // mprotect a few pages read-only, read them, and make them writable again
                // (nobody writes them meanwhile: their locks are held).
                let l = self.blocks[b].layout.read().unwrap();
                let first = rng.below(l.pages);
                let n = (1 + rng.below(16)).min(l.pages - first);
                let vs: Vec<u32> = (first..first + n).map(|p| self.lock(b, p)).collect();
                let (a, len) = (l.addr + first * PAGE, n * PAGE);
                self.engine.protect(a, len, libc::PROT_READ).unwrap();
                for (p, &v) in (first..first + n).zip(&vs) {
                    self.check(&l, p, v, "read-only");
                }
                self.engine
                    .protect(a, len, libc::PROT_READ | libc::PROT_WRITE)
                    .unwrap();
                for (p, &v) in (first..first + n).zip(&vs) {
                    self.unlock(b, p, v);
                }
            } else if op < 990 {
                // madvise(DONTNEED) of a few pages: they must read back as zeros.
                let l = self.blocks[b].layout.read().unwrap();
                let first = rng.below(l.pages);
                let n = (1 + rng.below(32)).min(l.pages - first);
                for p in first..first + n {
                    self.lock(b, p);
                }
                self.engine
                    .discard(l.addr + first * PAGE, n * PAGE)
                    .unwrap();
                for p in first..first + n {
                    self.check(&l, p, 0, "after discard");
                    self.unlock(b, p, 0);
                }
            } else if op < 994 {
                // munmap the block and map a fresh one.
                let mut l = self.blocks[b].layout.write().unwrap();
                self.engine.release(l.addr, l.pages * PAGE).unwrap();
                l.pages = BLOCK_PAGES;
                l.addr = self.engine.alloc(l.pages * PAGE, PAGE).unwrap();
                l.gen += 1000;
                for v in &self.blocks[b].versions {
                    v.store(0, Ordering::Release);
                }
            } else if op < 997 {
                // mremap: grow (moving if needed) or shrink back; contents must follow.
                let mut l = self.blocks[b].layout.write().unwrap();
                let new_pages = if l.pages == BLOCK_PAGES {
                    BLOCK_PAGES + 1 + rng.below(BLOCK_PAGES - 1)
                } else {
                    BLOCK_PAGES
                };
                let to = self
                    .engine
                    .remap(l.addr, l.pages * PAGE, new_pages * PAGE, true)
                    .unwrap();
                for p in l.pages.min(new_pages)..l.pages.max(new_pages) {
                    self.blocks[b].versions[p].store(0, Ordering::Release);
                }
                let moved_from = l.addr;
                l.addr = to;
                l.pages = new_pages;
                // Spot-check a few pages right after the move.
                for _ in 0..8 {
                    let p = rng.below(l.pages);
                    let v = self.blocks[b].versions[p].load(Ordering::Acquire);
                    self.check(
                        &l,
                        p,
                        v,
                        if to == moved_from {
                            "mremap in place"
                        } else {
                            "mremap moved"
                        },
                    );
                }
            } else {
                // The kernel reads and writes managed memory: write(2) one page into a pipe
                // and read(2) it back into another page.
                let l = self.blocks[b].layout.read().unwrap();
                let src = rng.below(l.pages);
                let mut dst = rng.below(l.pages);
                if dst == src {
                    dst = (src + 1) % l.pages;
                }
                let (a, c) = if src < dst { (src, dst) } else { (dst, src) };
                let va = self.lock(b, a);
                let vc = self.lock(b, c);
                let (vs, _vd) = if src < dst { (va, vc) } else { (vc, va) };
                let mut fds = [0; 2];
                // SAFETY: valid out-array of two fds.
                assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
                let sp = Self::page_ptr(&l, src) as usize;
                let dp = Self::page_ptr(&l, dst) as usize;
                {
                    let _pin = self.engine.pin(sp, PAGE);
                    // SAFETY: sp is a pinned, mapped page of ours.
                    let n = unsafe { libc::write(fds[1], sp as *const libc::c_void, PAGE) };
                    assert_eq!(n, PAGE as isize, "write(2) from managed memory");
                }
                {
                    let _pin = self.engine.pin(dp, PAGE);
                    // SAFETY: dp is a pinned, mapped page of ours, locked by this thread.
                    let n = unsafe { libc::read(fds[0], dp as *mut libc::c_void, PAGE) };
                    assert_eq!(n, PAGE as isize, "read(2) into managed memory");
                }
                // SAFETY: closing our own fds.
                unsafe {
                    libc::close(fds[0]);
                    libc::close(fds[1]);
                }
                // dst now holds src's bytes: same pattern except the page index in the words,
                // so check it word by word against src's version at src's index.
                let ptr = dp as *const u64;
                for k in 0..PAGE / 8 {
                    // SAFETY: dst is ours and locked.
                    let got = unsafe { ptr.add(k).read_volatile() };
                    if got != word(l.gen, src, vs, k) {
                        self.mismatches.fetch_add(1, Ordering::Relaxed);
                        eprintln!("MISMATCH (pipe copy) page {dst} word {k}");
                        break;
                    }
                }
                // Restore dst to a well-defined version of its own.
                next_version += 1;
                Self::fill(&l, dst, next_version);
                if src < dst {
                    self.unlock(b, c, next_version);
                    self.unlock(b, a, va);
                } else {
                    self.unlock(b, a, next_version);
                    self.unlock(b, c, vc);
                }
            }
        }
    }

    fn verify_all(&self, what: &str) -> u64 {
        let before = self.mismatches.load(Ordering::Relaxed);
        for (b, blk) in self.blocks.iter().enumerate() {
            let l = blk.layout.read().unwrap();
            for p in 0..l.pages {
                let v = blk.versions[p].load(Ordering::Acquire);
                let _ = b;
                self.check(&l, p, v, what);
            }
        }
        self.mismatches.load(Ordering::Relaxed) - before
    }
}

/// How long to run: `--minutes N`, `--seconds N`, `MEMTIDE_STRESS_SECS`, or 40 s. Other
/// arguments (those cargo passes every test binary) are ignored.
fn duration() -> Duration {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse::<f64>().ok())
    };
    let secs = flag("--minutes")
        .map(|m| m * 60.0)
        .or_else(|| flag("--seconds"))
        .or_else(|| {
            std::env::var("MEMTIDE_STRESS_SECS")
                .ok()
                .and_then(|s| s.parse().ok())
        })
        .unwrap_or(40.0);
    Duration::from_secs_f64(secs)
}

/// The eviction policy to stress: `--policy sweep|placement`; without it, both: the CLOCK
/// sweep here, then placement in a child process (an engine lives as long as its process).
fn policy() -> Option<EvictionPolicy> {
    let args: Vec<String> = std::env::args().collect();
    let i = args.iter().position(|a| a == "--policy")?;
    let name = args.get(i + 1).expect("--policy needs a name");
    Some(EvictionPolicy::from_name(name).expect("--policy sweep or placement"))
}

/// How faults are delivered: `--faults signal|threads` (default: handler threads).
fn delivery() -> Delivery {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == "--faults") {
        Some(i) => Delivery::from_name(args.get(i + 1).expect("--faults needs a name"))
            .expect("--faults threads or signal"),
        None => Delivery::Threads,
    }
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        println!("stress_eviction_racing_with_access: test");
        return;
    }
    let run_for = duration();
    match policy() {
        Some(p) => stress_eviction_racing_with_access(run_for, p, delivery()),
        None => {
            stress_eviction_racing_with_access(run_for, EvictionPolicy::Sweep, Delivery::Threads);
            let child = |args: &[&str], secs: f64, what: &str| {
                let status = std::process::Command::new(std::env::current_exe().unwrap())
                    .args(args)
                    .arg("--seconds")
                    .arg(secs.to_string())
                    .status()
                    .expect("run a stress test in a child");
                assert!(status.success(), "{what} stress test: {status}");
            };
            child(
                &["--policy", "placement"],
                run_for.as_secs_f64(),
                "placement",
            );
            child(
                &["--policy", "sweep", "--faults", "signal"],
                run_for.as_secs_f64() / 2.0,
                "in-thread faults",
            );
        }
    }
    // The line cargo's test harness prints, for the suite's totals.
    println!("test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out");
}

fn counts(world: &World, snap: &memtide_engine::Snapshot) -> String {
    format!(
        "ops {} forks {} mismatches {} | faults zero {} tier {} (pool {}) inactive {} ({} copied back) wait {} | pool: {} stored, {} same, {} rejected, {} untried, {} written back, {} steps up, {} down, {} moved by {} compactions | demotions {} (clean {}, zero {}), staged by faults {} | moves underreported {} | handlers disarmed {}, armed {} | tier errors {}, mismatched reads {} | peak DRAM {} KiB of {} KiB quota",
        world.ops.load(Ordering::Relaxed),
        world.forks.load(Ordering::Relaxed),
        world.mismatches.load(Ordering::Relaxed),
        snap.faults_zero,
        snap.faults_tier,
        snap.faults_compressed,
        snap.faults_inactive,
        snap.faults_inactive_copied,
        snap.faults_wait,
        snap.compressed_stores,
        snap.compressed_same,
        snap.compressed_rejected,
        snap.compressed_skipped,
        snap.compressed_spills,
        snap.compressed_grows,
        snap.compressed_shrinks,
        snap.compressed_moves,
        snap.compressed_compactions,
        snap.demotions,
        snap.demotions_clean,
        snap.demotions_zero,
        snap.deactivations_in_faults,
        snap.moves_underreported,
        snap.handlers_disarmed,
        snap.handlers_armed,
        snap.tier_errors,
        snap.tier_read_mismatches,
        snap.peak_dram_bytes >> 10,
        snap.quota_bytes >> 10
    )
}

fn stress_eviction_racing_with_access(run_for: Duration, policy: EvictionPolicy, faults: Delivery) {
    let forking = faults == Delivery::Threads;
    let dir = std::env::temp_dir().join(format!("memtide-stress-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut cfg = Config::new(QUOTA, &dir);
    cfg.arena_bytes = 8 << 30;
    cfg.epoch_ms = 50;
    cfg.policy = policy;
    cfg.faults = faults;
    // Under the sweep the pool sizes itself, so that its moves (and the write-backs a step
    // down makes) race with the faults too.
    cfg.compressed_adaptive = policy == EvictionPolicy::Sweep;
    // Under placement the pool compresses with zstd, whose decompression contexts the fault
    // paths take without a lock.
    if policy == EvictionPolicy::Placement {
        cfg.compress = memtide_engine::Compress::Zstd;
    }
    let engine = Engine::start(&cfg).expect("engine starts (needs userfaultfd: run as root)");
    let blocks = (0..BLOCKS)
        .map(|b| Block {
            layout: RwLock::new(Layout {
                addr: engine.alloc(BLOCK_PAGES * PAGE, PAGE).unwrap(),
                pages: BLOCK_PAGES,
                gen: b as u64,
            }),
            versions: (0..2 * BLOCK_PAGES).map(|_| AtomicU32::new(0)).collect(),
        })
        .collect();
    let world = World {
        engine,
        blocks,
        mismatches: AtomicU64::new(0),
        ops: AtomicU64::new(0),
        stop: AtomicBool::new(false),
        next_fork: AtomicU64::new(if forking { 1_000_000_000 } else { u64::MAX }),
        forks: AtomicU64::new(0),
        start: Instant::now(),
        phase: AtomicU32::new(0),
        cpus: {
            // SAFETY: cpu_set_t is plain data; sched_getaffinity fills it.
            let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
            // SAFETY: a valid out-pointer of the size given.
            unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
            set
        },
    };
    eprintln!(
        "stress test (not a benchmark): {:.0} s, eviction policy {}, faults to {}, 4 threads, footprint 8x the quota, accessed bits cleared all along",
        run_for.as_secs_f64(),
        policy.name(),
        faults.name()
    );
    let start = Instant::now();
    let mut report = Instant::now();
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let w = &world;
            s.spawn(move || w.worker(0x1234_5678 + t * 7919));
        }
        s.spawn(|| {
            while !world.stop.load(Ordering::Relaxed) {
                std::fs::write("/proc/self/clear_refs", "1").expect("clear accessed bits");
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        while start.elapsed() < run_for {
            std::thread::sleep(Duration::from_millis(200));
            world.phase.fetch_add(1, Ordering::Relaxed);
            if report.elapsed() >= Duration::from_secs(60) {
                report = Instant::now();
                eprintln!(
                    "  {:.0} min: {}",
                    start.elapsed().as_secs_f64() / 60.0,
                    counts(&world, &engine.snapshot())
                );
            }
        }
        world.stop.store(true, Ordering::Relaxed);
    });
    let final_mismatches = world.verify_all("final sweep");
    let snap = engine.snapshot();
    eprintln!("{}", counts(&world, &snap));
    assert_eq!(
        world.mismatches.load(Ordering::Relaxed),
        0,
        "lost or corrupted bytes"
    );
    assert_eq!(final_mismatches, 0);
    assert!(
        snap.faults_tier > 1000,
        "the run must exercise tier-1 fetches: {snap:?}"
    );
    assert!(
        snap.demotions > 1000,
        "the run must exercise eviction: {snap:?}"
    );
    // Where threads can be followed: 2 to 64 CPUs and an rseq area to read a CPU from.
    let cpus = memtide_engine::threads::allowed_cpus().map_or(0, |c| c.len());
    memtide_engine::threads::note_program_thread();
    let rseq = memtide_engine::threads::program_thread_cpu(memtide_engine::threads::gettid());
    if forking && (2..=64).contains(&cpus) && rseq.is_some() {
        assert!(
            snap.handlers_disarmed > 0 && snap.handlers_armed > 0,
            "the run must exercise handlers following the workers' CPUs: {snap:?}"
        );
    }
    if forking {
        assert!(
            world.forks.load(Ordering::Relaxed) >= run_for.as_secs() / 2,
            "the run must fork about every second"
        );
    }
    // Faults stage pages for the evictor where they are resolved in the faulting thread
    // under the sweep, and only there.
    if faults == Delivery::Signal && policy == EvictionPolicy::Sweep {
        assert!(
            snap.deactivations_in_faults > 1000,
            "the run must exercise faults staging pages: {snap:?}"
        );
    } else {
        assert_eq!(snap.deactivations_in_faults, 0, "{snap:?}");
    }
    // Every child is gone: once the engine has found them dead, the tier's slots in use are
    // the parent's own (a child's are let go, those it shared stay the parent's).
    let t0 = Instant::now();
    while engine.snapshot().tier_family_bytes != engine.snapshot().tier_bytes {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "slots of dead children are left: {:?}",
            engine.snapshot()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        snap.faults_inactive > 0,
        "the run must exercise hint faults: {snap:?}"
    );
    assert!(
        snap.faults_compressed > 1000
            && snap.faults_tier - snap.faults_compressed > 1000
            && snap.compressed_spills > 1000
            && snap.compressed_same > 100
            && snap.compressed_rejected > 100
            && snap.compressed_skipped > 100
            && snap.compressed_moves > 100,
        "the run must exercise both levels: faults from the pool and the file, write-back \
         from pool to file, same-filled and incompressible pages, sampling, compaction: {snap:?}"
    );
    assert!(
        snap.peak_dram_bytes <= QUOTA + 2 * (1 << 20),
        "DRAM stayed within the quota plus slack: {snap:?}"
    );
    // With the program's threads gone (audit pauses the evictor), the books must balance.
    engine.audit().expect("page table books balance");

    if !forking {
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
    // Fork: both stay tiered; the child sees memory as it was at the fork; neither sees the
    // other's writes.
    let l0 = world.blocks[0].layout.read().unwrap();
    let v0 = world.blocks[0].versions[0].load(Ordering::Acquire);
    let plan = engine.fork_prepare();
    assert!(
        matches!(plan, ForkPlan::Tiered { .. }),
        "fork events are available here (root, handler threads)"
    );
    // SAFETY: the child only reads and writes memory, runs its engine, and calls _exit.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        engine.fork_child(plan);
        let mut bad = world.verify_all("child after fork");
        World::fill(&l0, 0, 0xDEAD);
        if !world.check(&l0, 0, 0xDEAD, "child own write") {
            bad += 1;
        }
        // SAFETY: leaving the child without running the parent's destructors.
        unsafe { libc::_exit(if bad == 0 { 0 } else { 1 }) };
    }
    engine.fork_parent(plan);
    let mut status = 0;
    // SAFETY: waiting for our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "child saw wrong data"
    );
    assert!(
        world.check(&l0, 0, v0, "parent after child wrote"),
        "child's write leaked into the parent"
    );
    drop(l0);
    assert_eq!(world.verify_all("parent after fork"), 0);
    let _ = std::fs::remove_dir_all(&dir);
}
