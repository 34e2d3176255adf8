//! `memtide demo`, README's first command, in a short run: both configurations ran, every page
//! of both verified, memtide stayed within its DRAM budget and put the rest below DRAM: in its
//! compressed pool and in tier 1.

mod common;

use common::{memtide, stderr, Scratch};

/// The figure in the demo table's row `name`, memtide's column.
fn row<'a>(out: &'a str, name: &str) -> &'a str {
    out.lines()
        .find(|l| l.starts_with(name))
        .unwrap_or_else(|| panic!("no row `{name}` in:\n{out}"))
}

/// The size written just before `word` (`16.00 MiB managed`), in MiB.
fn mib_before(line: &str, word: &str) -> f64 {
    let w: Vec<&str> = line.split_whitespace().collect();
    let i = w
        .iter()
        .position(|&x| x == word)
        .unwrap_or_else(|| panic!("no `{word}` in `{line}`"));
    let scale = match w[i - 1] {
        "KiB" => 1.0 / 1024.0,
        "MiB" => 1.0,
        "GiB" => 1024.0,
        unit => panic!("unit {unit} in `{line}`"),
    };
    w[i - 2].parse::<f64>().unwrap() * scale
}

#[test]
fn short_demo_tiers_and_verifies_every_page() {
    let s = Scratch::new("demo");
    let o = memtide()
        .args([
            "demo",
            "--footprint",
            "64MiB",
            "--dram",
            "16MiB",
            "--seconds",
            "0.5",
            "--warmup",
            "0.5",
            "--tier",
        ])
        .arg(s.path())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    // 64 MiB = 16384 pages, verified in both runs.
    assert_eq!(
        row(&out, "pages verified").matches("16384 ok").count(),
        2,
        "{out}"
    );
    // memtide kept at most its budget (plus the documented 1 MiB slack), the compressed pool
    // within it, and the rest below DRAM: pages that compress 2:1 fill the pool (a sixteenth
    // of the budget) with about twice its size; the rest went to tier 1.
    let managed = mib_before(row(&out, "DRAM used (peak)"), "managed");
    assert!(managed <= 17.0, "managed DRAM peak {managed} MiB:\n{out}");
    let pooled = mib_before(row(&out, "compressed pool holds"), "of");
    let in_dram = row(&out, "compressed pool holds")
        .split_once(" in ")
        .map(|(_, d)| d)
        .unwrap_or_else(|| panic!("no pool DRAM in:\n{out}"));
    let pool_dram = mib_before(in_dram, "of");
    assert!(
        pool_dram <= 1.0 && pooled >= 1.5 * pool_dram && pooled > 1.0,
        "pool holds {pooled} MiB in {pool_dram} MiB:\n{out}"
    );
    let tier = mib_before(&format!("{} end", row(&out, "tier 1 holds")), "end");
    assert!(
        pooled + tier >= 64.0 - 17.0,
        "pool {pooled} MiB + tier 1 {tier} MiB:\n{out}"
    );
    assert!(out.contains("memtide kept"), "{out}");
}
