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
        "size.toml",
        "[host]\ndram='lots'\n[[tenant]]\nname='a'\nfootprint='1GiB'\nactive='1GiB'\n",
    );
    with(&f, &costs, "[host] dram");
}
