//! `kill -9`, as a user or an out-of-memory killer would: of a program under memtide, of
//! `memtide run` itself, and of `memtide bench`. Nothing may be left behind: no tier file (it
//! is unlinked as soon as it is created), no statistics directory, no program running on
//! unwatched, and no swap file, cgroup, zswap setting or workload process of a bench.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::{memtide, Scratch};

/// Allocates 256 MiB (four times the DRAM it gets), writes it, says its pid and waits.
const SCRIPT: &str = "import os, time
b = bytearray(256 << 20)
for i in range(0, len(b), 4096):
    b[i] = 1
print(os.getpid(), flush=True)
time.sleep(300)
";

/// Starts the script under `memtide run` with its tier in `dir`; returns memtide and the
/// program's pid once the program has written its memory.
fn start_program(dir: &Path) -> (Child, i32) {
    let mut m = memtide()
        .args(["run", "--dram", "64MiB", "--tier"])
        .arg(dir)
        .args(["--", "python3", "-c", SCRIPT])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(m.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    let pid: i32 = line.trim().parse().expect("the program says its pid");
    (m, pid)
}

/// The program holds a tier file, already unlinked: tiering happened and nothing shows.
fn holds_unlinked_tier_file(pid: i32) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .any(|t| {
            let t = t.to_string_lossy();
            t.contains(".tier") && t.ends_with("(deleted)")
        })
}

fn empty(dir: &Path) -> bool {
    std::fs::read_dir(dir).unwrap().next().is_none()
}

/// Whether process `pid` is gone (or a zombie nobody has reaped yet).
fn gone(pid: i32) -> bool {
    match memtide_engine::sys::stat_fields(&format!("/proc/{pid}/stat")) {
        None => true,
        Some(f) => f.first().is_some_and(|s| s == "Z"),
    }
}

fn wait_until(what: &str, timeout: Duration, mut ok: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !ok() {
        assert!(t0.elapsed() < timeout, "{what} within {timeout:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn kill9(pid: i32) {
    // SAFETY: kill has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
}

fn stats_dirs_of(pid: u32) -> Vec<String> {
    std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!("memtide-stats-{pid}-")))
        .collect()
}

#[test]
fn killing_the_program_leaves_nothing_behind() {
    common::require("python3");
    let s = Scratch::new("kill-program");
    let (m, pid) = start_program(s.path());
    assert!(holds_unlinked_tier_file(pid), "the program has a tier file");
    assert!(empty(s.path()), "the tier file is not in the directory");
    let mid = m.id();
    kill9(pid);
    let out = m.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(137), "memtide passes the kill on");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("was killed by signal 9"), "{err}");
    assert!(empty(s.path()));
    assert!(stats_dirs_of(mid).is_empty(), "{:?}", stats_dirs_of(mid));
}

#[test]
fn killing_memtide_stops_the_program_and_leaves_nothing_behind() {
    common::require("python3");
    let s = Scratch::new("kill-memtide");
    let (mut m, pid) = start_program(s.path());
    assert!(holds_unlinked_tier_file(pid), "the program has a tier file");
    let mid = m.id();
    kill9(mid as i32);
    m.wait().unwrap();
    wait_until(
        "the program stops with memtide",
        Duration::from_secs(20),
        || gone(pid),
    );
    assert!(empty(s.path()));
    // memtide could not remove its statistics directory; the next run does.
    assert_eq!(stats_dirs_of(mid).len(), 1);
    let o = memtide()
        .args(["run", "--dram", "64MiB", "--tier"])
        .arg(s.path())
        .args(["--", "true"])
        .output()
        .unwrap();
    assert!(o.status.success());
    assert!(stats_dirs_of(mid).is_empty(), "{:?}", stats_dirs_of(mid));
}

fn swaps() -> String {
    std::fs::read_to_string("/proc/swaps").unwrap_or_default()
}

/// The cgroups a bench with this pid made, under either hierarchy.
fn bench_cgroups(pid: u32) -> Vec<std::path::PathBuf> {
    ["/sys/fs/cgroup", "/sys/fs/cgroup/memory"]
        .iter()
        .filter_map(|root| std::fs::read_dir(root).ok())
        .flat_map(|rd| rd.flatten())
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(&format!("memtide-bench-{pid}-"))
        })
        .map(|e| e.path())
        .collect()
}

#[test]
fn killing_the_bench_puts_back_swap_cgroups_and_zswap() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(euid, 0, "this test needs root (swapon, cgroups)");
    let s = Scratch::new("kill-bench");
    let zswap = std::fs::read_to_string("/sys/module/zswap/parameters/enabled").ok();
    let swaps_before = swaps();
    let mut b = memtide()
        .args([
            "bench",
            "--footprint",
            "64MiB",
            "--budgets",
            "50",
            "--workloads",
            "red",
            "--threads",
            "1",
            "--seconds",
            "10",
            "--warmup",
            "0",
            "--reps",
            "1",
            "--no-zswap",
            "--tier",
        ])
        .arg(s.path())
        .arg("--plot")
        .arg(s.path().join("plot"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let bid = b.id();
    // Wait for the Linux-swap run: a workload inside the bench's cgroup.
    let mut inside = Vec::new();
    wait_until(
        "a run in the bench's cgroup",
        Duration::from_secs(120),
        || {
            inside = bench_cgroups(bid)
                .iter()
                .flat_map(|c| {
                    std::fs::read_to_string(c.join("cgroup.procs"))
                        .unwrap_or_default()
                        .lines()
                        .map(str::to_owned)
                        .collect::<Vec<_>>()
                })
                .filter_map(|p| p.trim().parse::<i32>().ok())
                .collect();
            !inside.is_empty()
        },
    );
    assert!(
        swaps().contains(&format!("memtide-bench-{bid}.swap")),
        "{}",
        swaps()
    );
    let children = children_of(bid);
    assert!(
        !children.is_empty(),
        "the bench runs its workload in a child"
    );
    kill9(bid as i32);
    b.wait().unwrap();
    wait_until(
        "swap, cgroups and runs put back",
        Duration::from_secs(60),
        || {
            swaps() == swaps_before
                && bench_cgroups(bid).is_empty()
                && inside.iter().chain(&children).all(|&p| gone(p))
        },
    );
    assert!(!s.path().join(format!("memtide-bench-{bid}.swap")).exists());
    assert_eq!(
        std::fs::read_to_string("/sys/module/zswap/parameters/enabled").ok(),
        zswap
    );
}

/// The children of every thread of process `pid`.
fn children_of(pid: u32) -> Vec<i32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|c| {
            c.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<i32>>()
        })
        .collect()
}
