//! Programs that fork stay tiered, within one quota: children that overwrite their own parts
//! of a region while the parent rewrites all of it (C), a python `multiprocessing` pool with
//! the fork start method, and a child killed with SIGKILL in the middle of its faults, whose
//! tier slots all come back. The process tree's DRAM is sampled as the machine holds it (the
//! sum of its processes' `Pss_Anon`, so a page shared copy-on-write counts once).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{memtide, natively, require, stderr, tree_pss_anon_bytes, Scratch};

const MIB: u64 = 1 << 20;

/// Builds `programs/fork.c` into `dir`.
fn fork_program(dir: &Path) -> PathBuf {
    require("gcc");
    let exe = dir.join("fork");
    let b = Command::new("gcc")
        .args(["-O2", "-o"])
        .arg(&exe)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/programs/fork.c"
        ))
        .output()
        .unwrap();
    assert!(b.status.success(), "gcc: {}", stderr(&b));
    exe
}

/// Runs `cmd` to its end within `limit`, sampling its process tree's DRAM every 50 ms: its
/// output and the largest sample.
fn run_sampling(cmd: &mut Command, limit: Duration) -> (std::process::Output, u64) {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    // The pipes are read at the end: the programs here write little.
    let start = Instant::now();
    let mut peak = 0;
    while child.try_wait().unwrap().is_none() {
        peak = peak.max(tree_pss_anon_bytes(pid));
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    (child.wait_with_output().unwrap(), peak)
}

fn stats(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Eight children of a process holding 512 MiB under a 64 MiB quota each overwrite an eighth
/// and check the rest is as at the fork, while the parent rewrites everything: every process
/// sees its own writes and the bytes of the fork, never another's; every child reads from the
/// tier on its own; the nine processes stay within the one quota.
#[test]
fn forked_children_see_their_own_writes_and_the_bytes_of_the_fork() {
    let s = Scratch::new("fork-children");
    let exe = fork_program(s.path());
    let st = s.path().join("stats.json");
    let (out, peak) = run_sampling(
        memtide()
            .args(["run", "--dram", "64MiB", "--tier"])
            .arg(s.path())
            .arg("--stats")
            .arg(&st)
            .arg("--")
            .arg(&exe)
            .args(["children", "512", "8"]),
        Duration::from_secs(300),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "children failed 0, parent's wrong words 0\n"
    );
    let v = stats(&st);
    let main = v["main_pid"].as_u64().unwrap();
    let procs = v["processes"].as_array().unwrap();
    let kids: Vec<_> = procs
        .iter()
        .filter(|p| p["forked_from"].as_u64() == Some(main))
        .collect();
    assert_eq!(kids.len(), 8, "eight children ran their engine: {v}");
    for k in &kids {
        assert!(
            k["faults_tier"].as_u64().unwrap() > 1000,
            "each child read what it inherited from the tier itself: {k}"
        );
    }
    eprintln!(
        "nine processes: the tree's DRAM peaked at {} MiB",
        peak / MIB
    );
    // Each process also holds its engine's books and the program's own small memory (44 MiB
    // beyond the quota for the nine and the launcher, measured), but never a quota of its own:
    // nine quotas would be 576 MiB.
    assert!(
        peak <= 64 * MIB + 9 * 8 * MIB,
        "the tree held {} MiB at a sample",
        peak / MIB
    );
}

/// python's `multiprocessing` with the fork start method: four workers each checksum all of a
/// 1 GiB bytearray made before the fork, under a 256 MiB quota: the results are the native
/// run's, and the tree stays within the quota.
#[test]
fn a_multiprocessing_pool_reads_what_its_parent_made() {
    require("python3");
    let s = Scratch::new("fork-multiprocessing");
    let script = s.path().join("pool.py");
    std::fs::write(
        &script,
        r#"
import multiprocessing as mp, zlib
data = bytearray(range(256)) * (4 << 20)  # 1 GiB
for i in range(0, len(data), 4096):
    data[i] = (i >> 12) % 251
def work(k):
    m = memoryview(data)
    c = 0
    for i in range(0, len(m), 1 << 24):
        c = zlib.crc32(m[i:i + (1 << 24)], c)
    return k, c
if __name__ == "__main__":
    with mp.get_context("fork").Pool(4) as p:
        print(sorted(p.map(work, range(4))))
"#,
    )
    .unwrap();
    let native = natively(Command::new("python3").arg(&script));
    let st = s.path().join("stats.json");
    let (out, peak) = run_sampling(
        memtide()
            .args(["run", "--dram", "256MiB", "--tier"])
            .arg(s.path())
            .arg("--stats")
            .arg(&st)
            .args(["--", "python3"])
            .arg(&script),
        Duration::from_secs(600),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout), native);
    let v = stats(&st);
    let main = v["main_pid"].as_u64().unwrap();
    let workers = v["processes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["forked_from"].as_u64() == Some(main))
        .count();
    assert!(workers >= 4, "the pool's workers ran their engines: {v}");
    eprintln!("the pool: the tree's DRAM peaked at {} MiB", peak / MIB);
    // Five python processes (the parent and four workers) hold their interpreters and engines'
    // books beside the quota (66 MiB in all, measured), and the launcher its own.
    assert!(
        peak <= 256 * MIB + 6 * 16 * MIB,
        "the tree held {} MiB at a sample",
        peak / MIB
    );
}

/// A child killed with SIGKILL while it faults pages in and dirties them leaves no tier slot
/// behind: once the parent's engine has found it dead, the slots in use are the parent's own.
#[test]
fn a_child_killed_mid_fault_leaves_no_slot_behind() {
    let s = Scratch::new("fork-kill");
    let exe = fork_program(s.path());
    let out = common::output_within(
        memtide()
            .args([
                "run",
                "--dram",
                "32MiB",
                "--stats-interval",
                "100ms",
                "--tier",
            ])
            .arg(s.path())
            .arg("--")
            .arg(&exe)
            .args(["kill", "256"]),
        Duration::from_secs(120),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    eprint!("{text}");
    assert!(out.status.success(), "{text}{}", stderr(&out));
    // Before the kill the child held slots of its own (the pages it dirtied and evicted).
    let before: Vec<u64> = text
        .lines()
        .next()
        .unwrap()
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    assert!(before[0] > before[1], "the child held slots: {text}");
    assert!(text.contains("all the parent's; wrong words 0"), "{text}");
}

/// A child forked from a thread other than the main one ends when that thread's function
/// returns, as natively (its engine's threads do not keep it alive: CPython's test_threading
/// waited for such a child for good), and so does a program whose main thread leaves with
/// `pthread_exit` before its worker ends.
#[test]
fn a_process_ends_with_its_last_program_thread() {
    require("python3");
    let s = Scratch::new("fork-thread");
    let script = s.path().join("thread_fork.py");
    std::fs::write(
        &script,
        r#"
import os, threading, sys
b = bytearray(32 << 20)
for i in range(0, len(b), 4096):
    b[i] = 1
def func():
    pid = os.fork()
    if pid == 0:
        print("child", sum(b[::4096]), threading.main_thread().ident == threading.get_ident())
        sys.stdout.flush()
    else:
        _, st = os.waitpid(pid, 0)
        print("parent: the child exited with", os.waitstatus_to_exitcode(st))
th = threading.Thread(target=func)
th.start()
th.join()
"#,
    )
    .unwrap();
    let native = natively(Command::new("python3").arg(&script));
    let out = common::output_within(
        memtide()
            .args(["run", "-q", "--dram", "8MiB", "--tier"])
            .arg(s.path())
            .args(["--", "python3"])
            .arg(&script),
        Duration::from_secs(60),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout), native);

    require("gcc");
    let c = s.path().join("pexit.c");
    std::fs::write(
        &c,
        "#include <pthread.h>\n#include <stdio.h>\n#include <stdlib.h>\n#include <unistd.h>\n\
         static void *work(void *a) { char *p = malloc(64 << 20);\n\
         for (int i = 0; i < (64 << 20); i += 4096) p[i] = 1;\n\
         usleep(100000); printf(\"worker done\\n\"); fflush(stdout); return a; }\n\
         int main(void) { pthread_t t; pthread_create(&t, 0, work, 0);\n\
         printf(\"main leaves\\n\"); fflush(stdout); pthread_exit(0); }\n",
    )
    .unwrap();
    let exe = s.path().join("pexit");
    let b = Command::new("gcc")
        .args(["-O1", "-pthread", "-o"])
        .arg(&exe)
        .arg(&c)
        .output()
        .unwrap();
    assert!(b.status.success(), "gcc: {}", stderr(&b));
    let out = common::output_within(
        memtide()
            .args(["run", "-q", "--dram", "16MiB", "--tier"])
            .arg(s.path())
            .arg("--")
            .arg(&exe),
        Duration::from_secs(60),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "main leaves\nworker done\n"
    );
}
