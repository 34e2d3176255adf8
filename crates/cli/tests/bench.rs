//! `memtide bench`, one short run of each experiment: every configuration (all-DRAM, memtide,
//! Linux swap, zswap and zram where the kernel has them) at every workload, thread count, tenant and guest count
//! appears in the report, every finished run verified its data, the plots are written, and
//! every system setting the bench changed is back as it was.

mod common;

use common::{memtide, stderr, Scratch};

/// The benches change system-wide settings (zswap, swap files): one at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs `memtide bench ARGS` with its tier, JSON report and plots in `s`; returns its output
/// and the report.
fn run_bench(s: &Scratch, args: &[&str]) -> (String, serde_json::Value) {
    let json = s.path().join("bench.json");
    let o = memtide()
        .arg("bench")
        .args(args)
        .arg("--tier")
        .arg(s.path())
        .arg("--json")
        .arg(&json)
        .arg("--plot")
        .arg(s.path().join("plot"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let v = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    (String::from_utf8_lossy(&o.stdout).into_owned(), v)
}

fn swaps() -> String {
    std::fs::read_to_string("/proc/swaps").unwrap_or_default()
}

/// Whether the kernel has a zram device the bench may use (present, not set up).
fn zram_free() -> bool {
    std::fs::read_to_string("/sys/block/zram0/initstate").is_ok_and(|s| s.trim() == "0")
}

/// The settings of the compressed pools a bench may change.
fn pool_settings() -> Vec<Option<String>> {
    [
        "/sys/module/zswap/parameters/max_pool_percent",
        "/sys/block/zram0/initstate",
        "/sys/block/zram0/comp_algorithm",
        "/sys/block/zram0/disksize",
    ]
    .iter()
    .map(|f| std::fs::read_to_string(f).ok())
    .collect()
}

#[test]
fn short_microbenchmark_reports_every_configuration() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let s = Scratch::new("bench");
    let zswap = std::fs::read_to_string("/sys/module/zswap/parameters/enabled").ok();
    let swaps_before = swaps();
    let pools_before = pool_settings();
    let (_, v) = run_bench(
        &s,
        &[
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
            "--contents",
            "2x",
        ],
    );
    let v = &v["micro"];
    let mut configs = vec!["all-DRAM", "memtide 50%", "Linux swap 50%"];
    if zswap.is_some() {
        configs.push("zswap 50%");
    }
    if zram_free() {
        configs.push("zram 50%");
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
                    // Against Linux swap, unless Linux killed its run (a result, reported so).
                    let swap_killed = v["runs"].as_array().unwrap().iter().any(|r| {
                        r["workload"] == w
                            && r["threads"] == t
                            && r["config"] == "Linux swap 50%"
                            && r.get("failed").is_some()
                    });
                    assert!(row["vs_swap"].as_f64().is_some() || swap_killed, "{row}");
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
    assert_restored(&zswap, pools_before, &swaps_before, s.path());
}

/// Every setting a bench changed is back: zswap and zram as they were, no swap file left on, no file
/// left in the tier directory, no cgroup left behind.
fn assert_restored(
    zswap: &Option<String>,
    pools_before: Vec<Option<String>>,
    swaps_before: &str,
    tier: &std::path::Path,
) {
    assert_eq!(
        &std::fs::read_to_string("/sys/module/zswap/parameters/enabled").ok(),
        zswap
    );
    // zswap's pool cap as it was; zram, found unused, reset to how it was found.
    assert_eq!(
        pool_settings(),
        pools_before,
        "the compressed pools' settings are back"
    );
    assert_eq!(swaps(), swaps_before);
    let left: Vec<_> = std::fs::read_dir(tier)
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
    let (_, v) = run_bench(
        &s,
        &[
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
            "--no-zram",
            "--values",
            "json",
        ],
    );
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
        // Device reads per request: none to count with everything in DRAM; a count for
        // memtide (its tier faults) and for Linux (its cgroup's major faults).
        assert!(rows[0]["device_faults_per_op"].is_null(), "{}", rows[0]);
        assert!(mt["device_faults_per_op"].as_f64().unwrap() >= 0.0, "{mt}");
        if rows[2]["ops_per_sec"].as_f64().is_some() {
            assert!(
                rows[2]["device_faults_per_op"].as_f64().unwrap() >= 0.0,
                "{}",
                rows[2]
            );
        }
        for run in sec["runs"].as_array().unwrap() {
            if run.get("failed").is_none() {
                assert!(run["gets_verified"].as_u64().unwrap() > 100, "{run}");
            }
        }
        // memtide kept the server within its budget (plus the documented slack).
        let peak = sec["runs"][1]["peak_dram"].as_u64().unwrap();
        assert!(peak <= (32 << 20) + (1 << 20), "peak DRAM {peak}");
        // Linux swap had the same DRAM: its cgroup's limit is the budget plus what memtide
        // kept resident beyond its quota (rounded up to a MiB).
        let unmanaged = sec["runs"][1]["unmanaged"].as_u64().unwrap();
        assert!(unmanaged > 0, "{}", sec["runs"][1]);
        let limit = sec["runs"][2]["cgroup_limit"].as_u64().unwrap();
        assert_eq!(limit, (32 << 20) + unmanaged.next_multiple_of(1 << 20));
        assert!(s.path().join(format!("plot-{server}.svg")).exists());
    }
}

#[test]
fn short_density_and_noisy_neighbour_runs_report_every_tenant() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let s = Scratch::new("benchtenants");
    let zswap = std::fs::read_to_string("/sys/module/zswap/parameters/enabled").ok();
    let swaps_before = swaps();
    let pools_before = pool_settings();
    let (out, v) = run_bench(
        &s,
        &[
            "--experiments",
            "density,noisy",
            "--tenant-footprint",
            "32MiB",
            "--host-dram",
            "64MiB",
            "--tenants",
            "1,3",
            "--tenant-rate",
            "50K/s",
            "--neighbour-footprint",
            "128MiB",
            "--seconds",
            "1",
            "--warmup",
            "0.5",
            "--reps",
            "1",
        ],
    );
    assert!(out.contains("all-DRAM fits 2 tenants"), "{out}");

    let d = &v["density"];
    assert_eq!(d["all_dram_fits"], 2);
    let rows = d["rows"].as_array().unwrap();
    let shape: Vec<(u64, &str)> = rows
        .iter()
        .map(|r| {
            (
                r["tenants"].as_u64().unwrap(),
                r["config"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        shape,
        [
            (1, "all-DRAM"),
            (1, "memtide"),
            (1, "Linux swap"),
            (3, "all-DRAM"),
            (3, "memtide"),
            (3, "Linux swap")
        ]
    );
    // The DRAM is split evenly (whole MiB), and paced tenants never beat their load.
    let mt3 = rows
        .iter()
        .find(|r| r["tenants"] == 3 && r["config"] == "memtide")
        .unwrap();
    assert_eq!(mt3["dram_each"].as_u64(), Some(21 << 20));
    for r in rows {
        let tp = r["median_throughput"].as_f64().unwrap();
        assert!(tp > 0.0 && tp <= 50_000.0 * 1.1, "{r}");
    }
    for run in d["runs"].as_array().unwrap() {
        let tenants = run["runs"].as_array().unwrap();
        assert_eq!(
            tenants.len() as u64,
            run["tenants"].as_u64().unwrap(),
            "{run}"
        );
        for t in tenants {
            if t.get("failed").is_none() {
                assert_eq!(t["verified_pages"].as_u64(), Some(8192), "{run}");
            } else {
                assert_eq!(
                    run["config"], "Linux swap",
                    "memtide tenants never fail: {run}"
                );
            }
        }
    }
    let names: Vec<&str> = d["density"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["config"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["memtide", "Linux swap"]);
    let svg = std::fs::read_to_string(s.path().join("plot-density.svg")).unwrap();
    assert!(svg.contains("memtide") && svg.contains("Linux swap"));

    let n = &v["noisy"];
    let configs: Vec<&str> = n["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["config"].as_str().unwrap())
        .collect();
    assert_eq!(configs, ["all-DRAM", "memtide 50%", "Linux swap 50%"]);
    for run in n["runs"].as_array().unwrap() {
        let beside = run["beside_neighbour"].as_bool().unwrap();
        assert_eq!(run["neighbour"].is_object(), beside, "{run}");
        if run["config"] == "memtide" {
            assert_eq!(run["sensitive"]["verified_pages"].as_u64(), Some(8192));
            if beside {
                // The streamer swept its whole footprint through 16 MiB of DRAM, intact.
                assert_eq!(run["neighbour"]["verified_pages"].as_u64(), Some(32768));
                assert!(run["neighbour"]["throughput"].as_f64().unwrap() > 0.0);
            }
        }
    }
    assert_restored(&zswap, pools_before, &swaps_before, s.path());
}

#[test]
fn short_vm_density_run_reports_every_guest() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    common::require("qemu-system-x86_64");
    let guest = common::guest();
    let s = Scratch::new("benchvms");
    let zswap = std::fs::read_to_string("/sys/module/zswap/parameters/enabled").ok();
    let swaps_before = swaps();
    let pools_before = pool_settings();
    let (out, v) = run_bench(
        &s,
        &[
            "--experiments",
            "vms",
            "--guest",
            guest.to_str().unwrap(),
            "--vm-dram",
            "1GiB",
            "--guests",
            "1,2",
            "--guest-rate",
            "100K/s",
            "--guest-warmup",
            "2",
            "--guest-seconds",
            "2",
            "--reps",
            "1",
            "--policy",
            "sweep,placement",
            "--faults",
            "threads,signal",
            "--guest-contents",
            "2x",
        ],
    );
    assert!(out.contains("all-DRAM fits 1 guest of 1.00 GiB"), "{out}");
    let d = &v["vms"];
    assert_eq!(d["all_dram_fits"], 1);
    let rows = d["rows"].as_array().unwrap();
    let shape: Vec<(u64, &str)> = rows
        .iter()
        .map(|r| (r["guests"].as_u64().unwrap(), r["config"].as_str().unwrap()))
        .collect();
    // Every policy and delivery asked for (SIGBUS delivery only under TCG, as here).
    assert_eq!(d["accel"], "Tcg");
    let mut configs = vec![
        "all-DRAM",
        "memtide",
        "memtide sig",
        "memtide placement",
        "memtide sig placement",
        "Linux swap",
    ];
    let zram = zram_free();
    if zram {
        configs.push("zram");
    }
    assert_eq!(d["guest_contents"], "2x");
    let want: Vec<(u64, &str)> = [1, 2]
        .iter()
        .flat_map(|&n| configs.iter().map(move |&c| (n, c)))
        .collect();
    assert_eq!(shape, want);
    for r in rows {
        let c = r["config"].as_str().unwrap();
        if c.starts_with("memtide") && r["guests"] == 2 {
            // Each memtide configuration says what its faults cost and how many there were.
            let p50 = r["tier_fault_p50_us"].as_f64().unwrap();
            let p99 = r["tier_fault_p99_us"].as_f64().unwrap();
            assert!(p50 > 0.0 && p99 >= p50, "{r}");
            assert!(r["device_faults"].as_f64().unwrap() > 0.0, "{r}");
            assert!(r["hint_faults"].as_f64().is_some(), "{r}");
            // With handler threads, what the scheduler made them wait; in-thread, no handlers.
            let wait = r.get("handler_wait_us").and_then(|w| w.as_f64());
            if c.contains("sig") {
                assert_eq!(wait, None, "{r}");
            } else {
                assert!(wait.is_some_and(|w| w >= 0.0), "{r}");
            }
        } else if !c.starts_with("memtide") {
            assert!(r.get("tier_fault_p50_us").is_none(), "{r}");
        }
    }
    assert!(out.contains("tier fault p50/99"), "{out}");
    const MIB: u64 = 1 << 20;
    for run in d["runs"].as_array().unwrap() {
        let guests = run["runs"].as_array().unwrap();
        let n = run["guests"].as_u64().unwrap();
        assert_eq!(guests.len() as u64, n, "{run}");
        // The host DRAM is split evenly, in whole MiB.
        assert_eq!(run["share"].as_u64(), Some(1024 / n * MIB), "{run}");
        for g in guests {
            if g.get("failed").is_some() {
                assert!(
                    run["config"] == "Linux swap" || run["config"] == "zram",
                    "only Linux kills guests: {run}"
                );
                continue;
            }
            // Every guest reported its rate, and a paced guest never beats its load.
            let rate = g["achieved"].as_f64().unwrap();
            if !run["config"].as_str().unwrap().starts_with("memtide") {
                // The kernel's faults in the measured seconds were counted from /proc.
                let m = &g["measured"];
                assert!(m["device_faults_per_s"].as_f64().unwrap() >= 0.0, "{run}");
            }
            assert!(rate > 0.0 && rate <= 100_000.0 * 1.02, "{run}");
            if run["config"].as_str().unwrap().starts_with("memtide") {
                let share = run["share"].as_u64().unwrap();
                // memtide held guest RAM to the share less QEMU's own memory: QEMU stayed
                // within the share (with 32 MiB of slack for its own memory's variation).
                let rss = g["peak_rss"].as_u64().unwrap();
                assert!(rss <= share + 32 * MIB, "peak RSS {} MiB: {run}", rss / MIB);
                if n == 2 {
                    // 768 MiB filled in 480 MiB of guest RAM, of which the compressed pool
                    // takes a sixteenth: pages went to tier 1 and back.
                    assert!(
                        g["tier_write_bytes"].as_u64().unwrap() >= 128 * MIB,
                        "{run}"
                    );
                    assert!(g["device_faults"].as_u64().unwrap() > 0, "{run}");
                }
            }
        }
    }
    // zram's pool took pages (half of each is zero) from guests whose cgroups hold half
    // their share; the other configurations' runs say nothing of it.
    for run in d["runs"].as_array().unwrap() {
        let peak = run.get("pool_peak").and_then(|p| p.as_u64());
        if run["config"] == "zram" {
            assert!(peak.is_some_and(|p| p > 0), "{run}");
        } else {
            assert_eq!(peak, None, "{run}");
        }
    }
    let names: Vec<&str> = d["density"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["config"].as_str().unwrap())
        .collect();
    assert_eq!(names, configs[1..]);
    let svg = std::fs::read_to_string(s.path().join("plot-vms.svg")).unwrap();
    for c in &configs[1..] {
        assert!(svg.contains(c), "{c} not in the plot");
    }
    assert_restored(&zswap, pools_before, &swaps_before, s.path());
}
