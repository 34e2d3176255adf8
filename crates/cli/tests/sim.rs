//! `memtide sim` end to end: bad specs and sizes are one-line errors; a real replay writes JSON
//! in which Belady's OPT misses least and every policy saw the same accesses.

mod common;

use common::{fails_with, memtide, stderr, Scratch};

#[test]
fn bad_input_is_one_line() {
    fails_with(
        &["sim", "--workload", "zipfy:skew=1"],
        "unknown workload kind",
    );
    fails_with(&["sim", "--workload", "zipf:skew=-2"], "bad value");
    fails_with(
        &[
            "sim",
            "--workload",
            "uniform:footprint=1GiB",
            "--dram",
            "2GiB",
        ],
        "larger than the footprint",
    );
    fails_with(
        &["sim", "--workload", "uniform", "--dram", "150%"],
        "larger than the footprint",
    );
    fails_with(
        &["sim", "--workload", "uniform", "--policy", "fifo"],
        "unknown policy",
    );
}

#[test]
fn replay_writes_json_with_opt_lowest() {
    let s = Scratch::new("sim");
    let json = s.path().join("sim.json");
    let o = memtide()
        .args([
            "sim",
            "--workload",
            "hotcold:footprint=256MiB,hot=10%,share=95%,accesses=2M",
            "--dram",
            "25%,50%",
            "--policy",
            "all",
            "--json",
        ])
        .arg(&json)
        .arg("--plot")
        .arg(s.path().join("sim.svg"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    // The sweep's plot: one line per policy.
    let svg = std::fs::read_to_string(s.path().join("sim.svg")).unwrap();
    assert_eq!(svg.matches("<polyline").count(), 5, "{svg}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let rows = v["results"].as_array().unwrap();
    assert_eq!(rows.len(), 10);
    for frac in [0.25, 0.5] {
        let at: Vec<_> = rows
            .iter()
            .filter(|r| (r["dram_fraction"].as_f64().unwrap() - frac).abs() < 1e-6)
            .collect();
        let misses = |p: &str| {
            at.iter().find(|r| r["outcome"]["policy"] == p).unwrap()["outcome"]["misses"]
                .as_u64()
                .unwrap()
        };
        for p in ["memtide", "lru", "clock", "lfu"] {
            assert!(misses("opt") <= misses(p), "{p} at {frac}");
            assert!(misses(p) > 0, "{p} at {frac} should miss");
        }
        for r in &at {
            assert_eq!(r["outcome"]["accesses"].as_u64(), Some(2_000_000));
            // Tier-1 read bandwidth: a page per miss at the (slowed) access rate.
            let o = &r["outcome"];
            let misses = o["misses"].as_f64().unwrap();
            let want = misses / 2e6 * 1e7 / r["slowdown"].as_f64().unwrap() * 4096.0 / 1e6;
            let got = r["tier_read_mb_per_sec"].as_f64().unwrap();
            assert!((got - want).abs() <= want * 1e-9 + 1e-9, "{got} vs {want}");
        }
    }
}

#[test]
fn saved_trace_replays_the_same_and_damage_is_reported() {
    let s = Scratch::new("simtrace");
    let trace = s.path().join("w.mtt");
    let spec = "zipf:footprint=64MiB,skew=0.9,accesses=300K,fill=no";
    let run = |args: &[&str], json: &std::path::Path| -> serde_json::Value {
        let o = memtide()
            .args(["sim", "--dram", "25%", "--policy", "lru,memtide"])
            .arg("--plot")
            .arg(s.path().join("unused.svg"))
            .args(args)
            .arg("--json")
            .arg(json)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_slice(&std::fs::read(json).unwrap()).unwrap()
    };
    let a = run(
        &["--workload", spec, "--save-trace", trace.to_str().unwrap()],
        &s.path().join("a.json"),
    );
    let b = run(
        &["--trace", trace.to_str().unwrap()],
        &s.path().join("b.json"),
    );
    for i in 0..2 {
        assert_eq!(
            a["results"][i]["outcome"]["misses"],
            b["results"][i]["outcome"]["misses"]
        );
        assert!(a["results"][i]["outcome"]["misses"].as_u64().unwrap() > 0);
    }
    let bytes = std::fs::read(&trace).unwrap();
    std::fs::write(&trace, &bytes[..bytes.len() / 2]).unwrap();
    fails_with(&["sim", "--trace", trace.to_str().unwrap()], "truncated");
    let mut bad = bytes.clone();
    bad[100] ^= 0x10;
    std::fs::write(&trace, &bad).unwrap();
    fails_with(&["sim", "--trace", trace.to_str().unwrap()], "corrupted");
}
