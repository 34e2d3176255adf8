//! `--compressed-sizing adaptive`: the compressed pool sizes itself by what it saves. On a
//! workload whose cold pages are read again soon after the pool writes them back (a small hot
//! set, half the accesses spread over a footprint four times the quota, pages that lz4 halves),
//! with faults served in the faulting thread (so that a pool fault costs a few microseconds
//! against a file fault's tens), a step more pool saves far more than it costs: the pool
//! grows, within its bounds, and every byte still reads back. Fixed sizing (the default)
//! never moves.

mod common;

use common::{main_stats, memtide, Scratch};

/// Runs the workload under `sizing`; returns the main process's statistics.
fn run(dir: &Scratch, sizing: &str) -> serde_json::Value {
    let stats = dir.path().join(format!("{sizing}.json"));
    let o = memtide()
        .args(["run", "--dram", "64MiB", "--faults", "signal", "--tier"])
        .arg(dir.path())
        .args(["--compressed-sizing", sizing, "--stats"])
        .arg(&stats)
        .args(["-q", "--"])
        .arg(env!("CARGO_BIN_EXE_memtide"))
        .args(["workload", "--footprint", "256MiB", "--hot", "5%"])
        .args(["--hot-share", "50%", "--contents", "2x"])
        .args(["--seconds", "10", "--warmup", "2"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", common::stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("\"mismatches\":0"), "{out}");
    main_stats(&stats)
}

#[test]
fn an_adaptive_pool_grows_while_it_saves_and_a_fixed_one_stays() {
    let dir = Scratch::new("poolsizing");
    let n = |s: &serde_json::Value, k: &str| s[k].as_u64().unwrap();
    let mib = 1u64 << 20;

    let s = run(&dir, "adaptive");
    assert_eq!(s["compressed_adaptive"], true);
    // File faults on pages the pool wrote back lately (what a step more would serve) and
    // pool faults on pages that left DRAM lately (what a step less DRAM costs) are counted.
    assert!(n(&s, "compressed_ghost_hits") > 1000, "{s}");
    assert!(n(&s, "compressed_young_hits") > 0, "{s}");
    // It started at a sixteenth of the quota (4 MiB) and grew in steps of a thirty-second
    // (2 MiB), never past half the quota.
    let cap = n(&s, "compressed_capacity_bytes");
    assert!(n(&s, "compressed_grows") >= 2, "{s}");
    assert!(cap >= 4 * mib + 2 * mib && cap <= 32 * mib, "{cap}");
    assert!(n(&s, "compressed_pool_bytes") <= 32 * mib);

    let f = run(&dir, "fixed");
    assert_eq!(f["compressed_adaptive"], false);
    assert_eq!(n(&f, "compressed_grows") + n(&f, "compressed_shrinks"), 0);
    assert_eq!(n(&f, "compressed_capacity_bytes"), 4 * mib);
}
