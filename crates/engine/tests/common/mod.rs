//! Shared by the engine's tests: an engine over a scratch tier directory, and running one test
//! in a child process (for scenarios that end the process when they fail: a fatal stop, a
//! deadlock).

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use memtide_engine::{Config, Engine};

pub const PAGE: usize = 4096;

/// Page `i`'s stamp, for the tests that check each page by one word (pairs, readahead).
pub fn stamp(i: usize) -> u64 {
    (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1
}

/// Writes page `i`'s stamp into its last word (where a value that starts on the page before
/// ends) in the managed block at `base`.
pub fn write_stamp(base: usize, i: usize) {
    // SAFETY: the caller's block is managed memory it owns.
    unsafe { ((base + i * PAGE + PAGE - 8) as *mut u64).write_volatile(stamp(i)) };
}

/// Reads page `i`'s last word in the managed block at `base`.
pub fn read_stamp(base: usize, i: usize) -> u64 {
    // SAFETY: as in write_stamp.
    unsafe { ((base + i * PAGE + PAGE - 8) as *const u64).read_volatile() }
}

/// Page `i`'s stamp after `round` rewrites (see [`Rewrites`]).
pub fn round_stamp(i: usize, round: u32) -> u64 {
    ((i as u64) << 32 | round as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1
}

/// The pages of a managed block, each stamped at both ends with its number and how many times
/// it was rewritten, so that a page that lost a write or came back as another page's bytes
/// reads wrong.
pub struct Rewrites {
    base: usize,
    round: Vec<u32>,
}

impl Rewrites {
    /// Stamps each of the `pages` pages of the managed block at `base` (round 0).
    pub fn new(base: usize, pages: usize) -> Rewrites {
        let r = Rewrites {
            base,
            round: vec![0; pages],
        };
        for i in 0..pages {
            r.write(i);
        }
        r
    }

    fn at(&self, i: usize, end: usize) -> *mut u64 {
        (self.base + i * PAGE + end * (PAGE - 8)) as *mut u64
    }

    fn write(&self, i: usize) {
        for end in 0..2 {
            // SAFETY: the caller's block is managed memory it owns.
            unsafe {
                self.at(i, end)
                    .write_volatile(round_stamp(i, self.round[i]))
            };
        }
    }

    /// Stamps of page `i` that read wrong (0 to 2).
    fn wrong(&self, i: usize) -> usize {
        let want = round_stamp(i, self.round[i]);
        // SAFETY: as in write.
        (0..2)
            .filter(|&end| unsafe { self.at(i, end).read_volatile() } != want)
            .count()
    }

    /// Checks page `i`'s stamps and rewrites it with the next round's: how many read wrong.
    pub fn step(&mut self, i: usize) -> usize {
        let wrong = self.wrong(i);
        self.round[i] += 1;
        self.write(i);
        wrong
    }

    /// Checks every page's stamps: how many read wrong.
    pub fn check_all(&self) -> usize {
        (0..self.round.len()).map(|i| self.wrong(i)).sum()
    }
}

/// A tier directory removed when the test ends.
pub struct Scratch(pub PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A scratch directory for tier files, named after the test.
pub fn scratch(name: &str) -> Scratch {
    let dir = std::env::temp_dir().join(format!("memtide-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    Scratch(dir)
}

/// The configuration the tests use: `quota` bytes of DRAM, a 1 GiB arena, 50 ms epochs.
pub fn config(dir: &Scratch, quota: u64) -> Config {
    let mut cfg = Config::new(quota, &dir.0);
    cfg.arena_bytes = 1 << 30;
    cfg.epoch_ms = 50;
    cfg.policy = policy();
    cfg
}

/// The eviction policy the tests run: `MEMTIDE_TEST_POLICY` (sweep or placement), else the
/// engine's default.
pub fn policy() -> memtide_engine::EvictionPolicy {
    std::env::var("MEMTIDE_TEST_POLICY")
        .ok()
        .map(|n| memtide_engine::EvictionPolicy::from_name(&n).expect("sweep or placement"))
        .unwrap_or_default()
}

/// An engine with `quota` bytes of DRAM (see [`config`]).
pub fn engine(name: &str, quota: u64) -> (&'static Engine, Scratch) {
    let dir = scratch(name);
    let e = start(&config(&dir, quota));
    (e, dir)
}

/// An engine with `quota` bytes of DRAM and no compressed pool: every page that leaves DRAM
/// goes to the file, for tests of the file's own paths (read-ahead, slots, device faults) on
/// pages that would otherwise compress.
pub fn file_only(name: &str, quota: u64) -> (&'static Engine, Scratch) {
    let dir = scratch(name);
    let mut cfg = config(&dir, quota);
    cfg.compress = memtide_engine::Compress::Off;
    let e = start(&cfg);
    (e, dir)
}

pub fn start(cfg: &Config) -> &'static Engine {
    Engine::start(cfg).expect("engine starts (needs userfaultfd: run as root)")
}

/// Whether this process is the child [`in_child`] started.
pub fn is_child(marker: &str) -> bool {
    std::env::var_os(marker).is_some()
}

/// Runs the test `test` of this binary alone in a child process with `marker` set in its
/// environment, and returns what it printed. A child still running after `timeout` is killed
/// (its output then ends with a line saying so).
pub fn in_child(test: &str, marker: &str, timeout: Duration) -> Output {
    in_child_with(test, marker, timeout, &[])
}

/// [`in_child`], with more variables in the child's environment.
pub fn in_child_with(
    test: &str,
    marker: &str,
    timeout: Duration,
    env: &[(&str, String)],
) -> Output {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(marker, "1")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > timeout {
            let _ = child.kill();
            let mut out = child.wait_with_output().unwrap();
            out.stderr
                .extend_from_slice(format!("\n(killed after {timeout:?})\n").as_bytes());
            return out;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// Ends the test process, saying `what` hung, unless dropped within `limit`: a thread left
/// asleep in a fault (a lost wake) would otherwise hang the suite instead of failing it.
pub struct Watchdog(std::sync::mpsc::Sender<()>);

pub fn watchdog(what: &'static str, limit: Duration) -> Watchdog {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        // Dropping the watchdog disconnects the channel: only a timeout means a hang.
        if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(limit) {
            eprintln!("{what} did not finish within {limit:?}: a thread is stuck");
            std::process::exit(101);
        }
    });
    Watchdog(tx)
}

/// A small deterministic generator (xorshift): the same sequence on every run.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A number below `n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}
