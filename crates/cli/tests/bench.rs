//! `memtide bench`, one short run of the microbenchmark: every configuration (all-DRAM, memtide,
//! Linux swap, zswap where the kernel has it) at every workload and thread count appears in the
//! report, every finished run verified its data, the plots are written, and every system
//! setting the bench changed is back as it was.

mod common;

use common::{memtide, stderr, Scratch};

/// The benches change system-wide settings (zswap, swap files): one at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn swaps() -> String {
    std::fs::read_to_string("/proc/swaps").unwrap_or_default()
}

#[test]
fn short_microbenchmark_reports_every_configuration() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let s = Scratch::new("bench");
    let json = s.path().join("bench.json");
    let zswap = std::fs::read_to_string("/sys/module/zswap/parameters/enabled").ok();
    let swaps_before = swaps();
    let o = memtide()
        .args([
            "bench",
            "--footprint",
            "128MiB",
            "--budgets",
            "50",
            "--workloads",
            "green,uniform",
            "--threads",
            "1,2",
            "--seconds",
            "0.5",
            "--warmup",
            "0.5",
            "--reps",
            "1",
            "--tier",
        ])
        .arg(s.path())
        .arg("--json")
        .arg(&json)
        .arg("--plot")
        .arg(s.path().join("plot"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let v = &v["micro"];
    let mut configs = vec!["all-DRAM", "memtide 50%", "Linux swap 50%"];
    if zswap.is_some() {
        configs.push("zswap 50%");
    }
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2 * 2 * configs.len(), "{rows:?}");
    for w in ["green", "uniform"] {
        for t in [1, 2] {
            for c in &configs {
                let row = rows
                    .iter()
                    .find(|r| r["workload"] == w && r["threads"] == t && r["config"] == *c)
                    .unwrap_or_else(|| panic!("no row for {w} {t} {c}"));
                if *c == "all-DRAM" {
                    assert_eq!(row["vs_dram"].as_f64(), Some(1.0));
                }
                if *c == "memtide 50%" {
                    assert!(row["throughput_median"].as_f64().unwrap() > 0.0);
                    assert!(row["vs_swap"].as_f64().is_some(), "{row}");
                }
            }
        }
    }
    for run in v["runs"].as_array().unwrap() {
        if run.get("failed").is_none() {
            assert!(run["verified_pages"].as_u64().unwrap() > 0, "{run}");
        } else {
            assert!(
                !run["config"].as_str().unwrap().starts_with("memtide"),
                "memtide runs never fail: {run}"
            );
        }
    }
    for w in ["green", "uniform"] {
        let svg = std::fs::read_to_string(s.path().join(format!("plot-{w}.svg"))).unwrap();
        assert!(svg.contains("memtide, 1 thr") && svg.contains("Linux swap, 2 thr"));
    }
    // Settings restored: zswap as it was, no swap file left on, no file left in the tier.
    assert_eq!(
        std::fs::read_to_string("/sys/module/zswap/parameters/enabled").ok(),
        zswap
    );
    assert_eq!(swaps(), swaps_before);
    let left: Vec<_> = std::fs::read_dir(s.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| !n.ends_with(".json") && !n.ends_with(".svg"))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    for root in ["/sys/fs/cgroup", "/sys/fs/cgroup/memory"] {
        if let Ok(d) = std::fs::read_dir(root) {
            let ours: Vec<_> = d
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .filter(|n| n.starts_with("memtide-bench-"))
                .collect();
            assert!(ours.is_empty(), "cgroups left behind in {root}: {ours:?}");
        }
    }
}

#[test]
fn short_memcached_and_redis_runs_verify_every_get() {
    common::require("memcached");
    common::require("redis-server");
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let s = Scratch::new("benchkv");
    let json = s.path().join("kv.json");
    let o = memtide()
        .args([
            "bench",
            "--experiments",
            "memcached,redis",
            "--footprint",
            "64MiB",
            "--budgets",
            "50",
            "--skews",
            "0.99",
            "--seconds",
            "0.5",
            "--warmup",
            "0.5",
            "--reps",
            "1",
            "--no-zswap",
            "--tier",
        ])
        .arg(s.path())
        .arg("--json")
        .arg(&json)
        .arg("--plot")
        .arg(s.path().join("plot"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    for server in ["memcached", "redis"] {
        let sec = &v[server];
        let rows = sec["rows"].as_array().unwrap();
        let configs: Vec<&str> = rows.iter().map(|r| r["config"].as_str().unwrap()).collect();
        assert_eq!(
            configs,
            ["all-DRAM", "memtide 50%", "Linux swap 50%"],
            "{server}"
        );
        let mt = &rows[1];
        assert!(mt["ops_per_sec"].as_f64().unwrap() > 0.0, "{mt}");
        assert!(mt["p99_us"].as_f64().unwrap() >= mt["p50_us"].as_f64().unwrap());
        for run in sec["runs"].as_array().unwrap() {
            if run.get("failed").is_none() {
                assert!(run["gets_verified"].as_u64().unwrap() > 100, "{run}");
            }
        }
        // memtide kept the server within its budget (plus the documented slack).
        let peak = sec["runs"][1]["peak_dram"].as_u64().unwrap();
        assert!(peak <= (32 << 20) + (1 << 20), "peak DRAM {peak}");
        assert!(s.path().join(format!("plot-{server}.svg")).exists());
    }
}
