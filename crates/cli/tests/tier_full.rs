//! When tier 1 fills up, memtide stops evicting, keeps the data in DRAM, warns once and counts
//! it — the program runs on with correct data.

mod common;

use common::{main_stats, memtide, require, stderr, Scratch};

#[test]
fn full_tier_keeps_data_in_dram_and_says_so() {
    require("python3");
    let s = Scratch::new("tierfull");
    let stats = s.path().join("stats.json");
    // 96 MiB of data, 16 MiB of DRAM, room for only 32 MiB in tier 1.
    let o = memtide()
        .args(["run", "--dram", "16MiB", "--tier-size", "32MiB", "--tier"])
        .arg(s.path())
        .arg("--stats")
        .arg(&stats)
        .args([
            "--",
            "python3",
            "-c",
            "b = bytearray(range(256)) * (384 * 1024)\nprint(sum(b[::4096]), b[-1], len(b))",
        ])
        .output()
        .unwrap();
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    let want: u64 = (0..96u64 << 20).step_by(4096).map(|i| i % 256).sum();
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        format!("{want} 255 {}", 96 << 20)
    );
    assert_eq!(
        err.matches("tier 1 is full").count(),
        2,
        "warned once, and listed in the summary: {err}"
    );
    let st = main_stats(&stats);
    assert!(st["quota_overruns"].as_u64().unwrap() > 0, "{st}");
    assert!(st["tier_bytes"].as_u64().unwrap() <= 32 << 20, "{st}");
}
