//! End to end: programs whose memory the kernel reads and writes on their behalf, with most of
//! that memory evicted or never touched — each once failed under memtide with EFAULT ("Bad
//! address"), and each must now do what it does natively: python filling a buffer with
//! getrandom(2), GNU sort reading its input through stdio into a managed buffer, and fio
//! doing io_uring I/O from a managed buffer pool larger than the DRAM budget, verified.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{memtide, output_within, require, stderr, Scratch};

fn tiered(dram: &str, tier: &std::path::Path, program: &[&str]) -> std::process::Output {
    output_within(
        memtide()
            .args(["run", "--dram", dram, "--tier"])
            .arg(tier)
            .arg("--")
            .args(program),
        Duration::from_secs(300),
    )
}

#[test]
fn getrandom_fills_a_buffer_four_times_the_budget() {
    require("python3");
    let s = Scratch::new("getrandom");
    let o = tiered(
        "64MiB",
        s.path(),
        &[
            "python3",
            "-c",
            "import os\nb = os.urandom(300 << 20)\nprint(len(b), sum(1 for i in range(0, len(b), 4096) if b[i:i+64] != bytes(64)))",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        format!("{} {}", 300 << 20, 300 << 8),
        "every page holds random bytes"
    );
}

#[test]
fn sort_reads_its_input_into_managed_memory() {
    let s = Scratch::new("sort");
    let input = s.path().join("lines.txt");
    let mut text = String::new();
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    for _ in 0..600_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        text.push_str(&format!("{x:016x} {}\n", x % 1000));
    }
    std::fs::write(&input, text).unwrap();
    let native = Command::new("sort")
        .args(["-S", "256M"])
        .arg(&input)
        .output()
        .unwrap();
    assert!(native.status.success());
    let o = tiered(
        "16MiB",
        s.path(),
        &["sort", "-S", "256M", input.to_str().unwrap()],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        o.stdout == native.stdout,
        "the same sorted output as natively"
    );
}

#[test]
fn fio_io_uring_from_a_managed_buffer_pool_verifies() {
    require("fio");
    let s = Scratch::new("fio");
    let job = s.path().join("job.fio");
    // 64 buffers of 1 MiB (64 MiB of managed memory, twice the budget), written through
    // io_uring and read back and verified (crc32c). `thread`: fio's job runs as a thread of
    // the process that allocated the buffers.
    std::fs::write(
        &job,
        format!(
            "[global]\nthread=1\nioengine=io_uring\niomem=malloc\ndirect=1\nbs=1M\niodepth=64\n\
             size=256M\nfilename={}\nverify=crc32c\ndo_verify=1\nverify_state_save=0\n[write-verify]\nrw=write\n",
            s.path().join("data").display()
        ),
    )
    .unwrap();
    let o = tiered("32MiB", s.path(), &["fio", job.to_str().unwrap()]);
    let out = String::from_utf8_lossy(&o.stdout);
    let err = stderr(&o);
    assert!(o.status.success(), "{out}{err}");
    assert!(out.contains("err= 0"), "{out}");
    assert!(
        !out.contains("Bad address") && !err.contains("Bad address"),
        "{out}{err}"
    );
    assert!(
        err.contains("from tier 1") && !err.contains(" 0 from tier 1"),
        "the buffers went through tier 1: {err}"
    );
}
