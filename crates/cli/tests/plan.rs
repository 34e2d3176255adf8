//! `memtide plan` end to end on the example tenants file: the plan fits at least as many copies
//! as all-DRAM within the loss budget, names a binding constraint, and checks the guidance; bad
//! files and prices are one-line errors.

mod common;

use std::path::PathBuf;

use common::{fails_with, memtide, stderr, Scratch};

fn example() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/tenants.toml")
}

#[test]
fn example_plan_is_consistent() {
    let s = Scratch::new("plan");
    let json = s.path().join("plan.json");
    let svg = s.path().join("plan.svg");
    let o = memtide()
        .args(["plan", "--tenants"])
        .arg(example())
        .args([
            "--dram-cost",
            "3.0/GiB",
            "--tier-cost",
            "0.1/GiB",
            "--max-loss",
            "5%",
            "--json",
        ])
        .arg(&json)
        .arg("--plot")
        .arg(&svg)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("binding constraint:"), "{out}");
    assert!(out.contains("guidance: green under 50%"), "{out}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let plan = &v["plan"];
    let best = &plan["options"][plan["best"].as_u64().unwrap() as usize];
    assert!(best["loss"].as_f64().unwrap() <= 0.05, "{best}");
    assert!(best["copies"].as_u64().unwrap() >= plan["all_dram_copies"].as_u64().unwrap());
    assert!(["dram", "active_memory", "tier_bandwidth", "tier_capacity"]
        .contains(&best["binding"].as_str().unwrap()));
    assert_ne!(best["health"], "red", "the plan never packs into red");
    let saving = plan["saving"].as_f64().unwrap();
    assert!((0.0..1.0).contains(&saving), "{saving}");
    // Each tenant's curve: 19 replays and all-DRAM; more DRAM never costs much more loss,
    // and the least DRAM loses the most.
    for t in v["tenants"].as_array().unwrap() {
        let loss: Vec<f64> = t["curve"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| 1.0 - 1.0 / p["slowdown"].as_f64().unwrap())
            .collect();
        assert_eq!(loss.len(), 20);
        assert_eq!(*loss.last().unwrap(), 0.0);
        assert!(loss[0] > loss[loss.len() / 2], "{loss:?}");
    }
    assert_eq!(
        std::fs::read_to_string(&svg)
            .unwrap()
            .matches("<polyline")
            .count(),
        2
    );
    // The example's cache gives a ratio, so each of its points is the best of five splits, the
    // file alone among them: never more loss than the same tenant without a ratio.
    assert!(out.contains("of it pool"), "{out}");
    let without = s.path().join("noratio.toml");
    let text = std::fs::read_to_string(example()).unwrap();
    std::fs::write(
        &without,
        text.lines()
            .filter(|l| !l.starts_with("ratio"))
            .collect::<Vec<_>>()
            .join("\n"),
    )
    .unwrap();
    let json2 = s.path().join("noratio.json");
    let o = memtide()
        .args(["plan", "--tenants"])
        .arg(&without)
        .args(["--dram-cost", "3.0/GiB", "--tier-cost", "0.1/GiB", "--json"])
        .arg(&json2)
        .arg("--plot")
        .arg(s.path().join("noratio.svg"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!String::from_utf8_lossy(&o.stdout).contains("of it pool"));
    let v2: serde_json::Value = serde_json::from_slice(&std::fs::read(&json2).unwrap()).unwrap();
    let curve = |v: &serde_json::Value| -> Vec<(f64, f64)> {
        let t = v["tenants"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == "cache")
            .unwrap();
        t["curve"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                (
                    p["slowdown"].as_f64().unwrap(),
                    p["pool_share"].as_f64().unwrap(),
                )
            })
            .collect()
    };
    let (with, plain) = (curve(&v), curve(&v2));
    let shares = [0.0, 1.0 / 16.0, 1.0 / 8.0, 1.0 / 4.0, 1.0 / 2.0];
    for (w, p) in with.iter().zip(&plain) {
        assert!(w.0 <= p.0, "with a pool {} against {}", w.0, p.0);
        assert!(shares.iter().any(|s| (w.1 - s).abs() < 1e-3), "{}", w.1);
        assert_eq!(p.1, 0.0);
    }
}

#[test]
fn bad_input_is_one_line() {
    let s = Scratch::new("planbad");
    let ex = example();
    let ex = ex.to_str().unwrap();
    let costs = ["--dram-cost", "3/GiB", "--tier-cost", "0.1/GiB"];
    let with = |file: &str, extra: &[&str], needle: &str| {
        let mut args = vec!["plan", "--tenants", file];
        args.extend_from_slice(extra);
        fails_with(&args, needle);
    };
    with(
        ex,
        &["--dram-cost", "-3/GiB", "--tier-cost", "0.1"],
        "cannot be negative",
    );
    with(
        ex,
        &["--dram-cost", "3/GiB", "--tier-cost", "cheap"],
        "not a price",
    );
    with("/nonexistent/t.toml", &costs, "cannot read");
    let write = |name: &str, text: &str| -> String {
        let p = s.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_string()
    };
    let f = write(
        "nohost.toml",
        "[[tenant]]\nname='a'\nfootprint='1GiB'\nactive='1GiB'\n",
    );
    with(&f, &costs, "missing field `host`");
    let f = write(
        "big.toml",
        "[host]\ndram='64GiB'\n[[tenant]]\nname='a'\nfootprint='1GiB'\nactive='2GiB'\n",
    );
    with(&f, &costs, "at most the footprint");
    let f = write(
        "typo.toml",
        "[host]\ndram='64GiB'\n[[tenant]]\nname='a'\nfootprint='1GiB'\nactiv='1GiB'\n",
    );
    with(&f, &costs, "unknown field `activ`");
    let f = write(
        "ratio.toml",
        "[host]\ndram='64GiB'\n[[tenant]]\nname='a'\nfootprint='1GiB'\nactive='1GiB'\nratio=0.5\n",
    );
    with(&f, &costs, "from 1 to 64");
    let f = write(
        "size.toml",
        "[host]\ndram='lots'\n[[tenant]]\nname='a'\nfootprint='1GiB'\nactive='1GiB'\n",
    );
    with(&f, &costs, "[host] dram");
}
