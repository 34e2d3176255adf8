//! `memtide run --record`: the trace holds every page the engine brought into DRAM, and
//! replayed in the simulator at the same DRAM under the engine's policy (sweep) it misses
//! within 25% of the tier faults the engine counted.

mod common;

use common::{main_stats, memtide, Scratch};

/// Replays `trace` at `dram` under the engine's policy (sweep); returns the outcome.
fn replay(dir: &Scratch, trace: &std::path::Path, dram: &str) -> serde_json::Value {
    let json = dir.path().join("sim.json");
    let o = memtide()
        .args(["sim", "--trace"])
        .arg(trace)
        .args(["--dram", dram, "--policy", "sweep", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", common::stderr(&o));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    v["results"][0]["outcome"].clone()
}

#[test]
fn a_recorded_run_replays_to_the_engines_tier_faults() {
    let dir = Scratch::new("record");
    let trace = dir.path().join("run.mtt");
    let stats = dir.path().join("run.json");
    // The simulator models DRAM and one level below it: the engine runs without its
    // compressed pool, which would take part of the 128 MiB from the pages.
    let o = memtide()
        .args(["run", "--dram", "128MiB", "--compress", "off", "--tier"])
        .arg(dir.path())
        .arg("--record")
        .arg(&trace)
        .arg("--stats")
        .arg(&stats)
        .args(["-q", "--"])
        .arg(env!("CARGO_BIN_EXE_memtide"))
        .args([
            "workload",
            "--footprint",
            "512MiB",
            "--hot",
            "20%",
            "--hot-share",
            "90%",
        ])
        .args(["--seconds", "6"])
        .output()
        .unwrap();
    let err = common::stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("recorded"), "{err}");
    let st = main_stats(&stats);
    let n = |k: &str| st[k].as_u64().unwrap();
    assert_eq!(n("recorded_dropped"), 0, "the recording fell behind");
    // Every page brought in: zero fills, tier faults, hint faults.
    assert_eq!(
        n("recorded_events"),
        n("faults_zero") + n("faults_tier") + n("faults_inactive")
    );
    let engine_tier = n("faults_tier");
    assert!(
        engine_tier > 10_000,
        "too few tier faults to compare: {engine_tier}"
    );

    let out = &replay(&dir, &trace, "128MiB");
    assert_eq!(
        out["accesses"].as_u64().unwrap(),
        n("recorded_events"),
        "the trace holds what was recorded"
    );
    let sim_tier = out["misses"].as_u64().unwrap();
    let off = (sim_tier as f64 - engine_tier as f64).abs() / engine_tier as f64;
    eprintln!(
        "engine {engine_tier} tier faults, replay {sim_tier} misses ({:.1}% off)",
        off * 100.0
    );
    // Unloaded, the two agree within a few percent. The trace holds the faults but not when
    // the engine's sampler deactivated pages, which the simulator's sweep decides by itself:
    // on a loaded machine the two drift apart (CI once saw 19.5%).
    assert!(
        off <= 0.25,
        "replay {sim_tier} misses vs the engine's {engine_tier} tier faults"
    );
}

#[test]
fn a_recorded_run_says_which_level_served_each_fault() {
    let dir = Scratch::new("recordlevels");
    let trace = dir.path().join("run.mtt");
    let stats = dir.path().join("run.json");
    // Pages half random, half zero: the pool takes them, and its oldest go on to the file.
    let o = memtide()
        .args(["run", "--dram", "64MiB", "--tier"])
        .arg(dir.path())
        .arg("--record")
        .arg(&trace)
        .arg("--stats")
        .arg(&stats)
        .args(["-q", "--"])
        .arg(env!("CARGO_BIN_EXE_memtide"))
        .args(["workload", "--footprint", "256MiB", "--contents", "2x"])
        .args(["--seconds", "3", "--warmup", "1"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", common::stderr(&o));
    let st = main_stats(&stats);
    let n = |k: &str| st[k].as_u64().unwrap();
    assert_eq!(n("recorded_dropped"), 0, "the recording fell behind");
    let t = memtide_sim::Trace::parse(std::fs::read(&trace).unwrap()).unwrap();
    let [unknown, dram, pool, file] = t.levels.expect("a recorded trace has levels");
    assert_eq!(unknown, 0);
    assert_eq!(pool, n("faults_compressed"));
    assert_eq!(file, n("faults_tier") - n("faults_compressed"));
    assert_eq!(dram, n("faults_zero") + n("faults_inactive"));
    // Both levels served faults (a loaded machine runs fewer in the 3 s: 500 from the pool).
    assert!(pool > 100 && file > 1000, "pool {pool}, file {file}");
    // `memtide sim` tells them.
    let o = memtide()
        .args(["sim", "--trace"])
        .arg(&trace)
        .args(["--dram", "64MiB", "--policy", "sweep"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", common::stderr(&o));
    let err = common::stderr(&o);
    assert!(
        err.contains(&format!(
            "{pool} from the compressed pool, {file} from the file"
        )),
        "{err}"
    );
    // The trace keeps what the pool measured: the pages it held per page of its DRAM, as the
    // run ended, and its median fault; a replay with a pool models it with those.
    let figures = t.pool.expect("a recording with a pool keeps its figures");
    let held = (n("compressed_pages") * 4096) as f64 / n("compressed_pool_bytes") as f64;
    assert!(
        (figures.ratio - held).abs() < 1e-9,
        "{figures:?}, the run's stats say {held}"
    );
    assert!(figures.ratio > 1.3, "2:1 pages, held at {}", figures.ratio);
    let p50_ns = st["fault_compressed_latency_p50_us"].as_f64().unwrap() * 1e3;
    assert!((figures.fault_ns - p50_ns).abs() < 1e-6, "{figures:?}");
    // `memtide sim` of the trace with a pool of a quarter (and `extra`): what it says.
    let sim_with_pool = |extra: &[&str]| {
        let o = memtide()
            .args(["sim", "--trace"])
            .arg(&trace)
            .args([
                "--dram",
                "64MiB",
                "--policy",
                "sweep",
                "--compressed",
                "25%",
            ])
            .args(extra)
            .output()
            .unwrap();
        let err = common::stderr(&o);
        assert!(o.status.success(), "{err}");
        err
    };
    let err = sim_with_pool(&[]);
    assert!(
        err.contains(&format!(
            "as the recording measured, the pool holds {:.2} pages per page of DRAM (--ratio sets another); a pool miss costs {:.1} µs",
            figures.ratio,
            figures.fault_ns / 1e3
        )),
        "{err}"
    );
    // A figure given on the command line is used instead, and not said to be the recording's.
    let err = sim_with_pool(&["--ratio", "1.5"]);
    assert!(
        err.contains("as the recording measured, a pool miss costs")
            && !err.contains("pages per page of DRAM (--ratio"),
        "{err}"
    );
}

#[test]
fn record_needs_a_writable_file() {
    common::fails_with(
        &[
            "run",
            "--dram",
            "64MiB",
            "--record",
            "/nonexistent/dir/run.mtt",
            "--",
            "true",
        ],
        "cannot write --record file",
    );
}

/// A python program that frees and reallocates: a page first touched again after a free is a
/// new page to the replay, not a miss.
const PYTHON: &str = r#"
import random
r = random.Random(1)
for rnd in range(2):
    b = bytearray(96 << 20)
    for i in range(0, len(b), 4096):
        b[i] = 1
    hot = [r.randrange(0, len(b) // 4096) for _ in range(5000)]
    for _ in range(20):
        for p in hot:
            b[p * 4096 + 1] = (b[p * 4096 + 1] + 1) & 255
    for _ in range(8000):
        b[r.randrange(0, len(b))] ^= 1
    del b
print("done")
"#;

#[test]
fn python_replays_too() {
    common::require("python3");
    let dir = Scratch::new("record-python");
    let trace = dir.path().join("py.mtt");
    let stats = dir.path().join("py.json");
    let o = memtide()
        .args(["run", "--dram", "32MiB", "--tier"])
        .arg(dir.path())
        .arg("--record")
        .arg(&trace)
        .arg("--stats")
        .arg(&stats)
        .args(["-q", "--", "python3", "-c", PYTHON])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", common::stderr(&o));
    let st = main_stats(&stats);
    let engine_tier = st["faults_tier"].as_u64().unwrap();
    assert!(engine_tier > 5_000, "too few tier faults: {engine_tier}");
    let sim_tier = replay(&dir, &trace, "32MiB")["misses"].as_u64().unwrap();
    let off = (sim_tier as f64 - engine_tier as f64).abs() / engine_tier as f64;
    eprintln!(
        "python: engine {engine_tier} tier faults, replay {sim_tier} ({:.1}% off)",
        off * 100.0
    );
    assert!(off <= 0.10, "replay {sim_tier} vs engine {engine_tier}");
}
