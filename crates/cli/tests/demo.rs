//! `memtide demo`, README's first command, in a short run: both configurations ran, every page
//! of both verified, memtide stayed within its DRAM budget and put the rest in tier 1.

mod common;

use common::{memtide, stderr, Scratch};

/// The figure in the demo table's row `name`, memtide's column.
fn row<'a>(out: &'a str, name: &str) -> &'a str {
    out.lines()
        .find(|l| l.starts_with(name))
        .unwrap_or_else(|| panic!("no row `{name}` in:\n{out}"))
}

/// The size in MiB written just before `word` (`16.00 MiB managed`).
fn mib_before(line: &str, word: &str) -> f64 {
    let w: Vec<&str> = line.split_whitespace().collect();
    let i = w
        .iter()
        .position(|&x| x == word)
        .unwrap_or_else(|| panic!("no `{word}` in `{line}`"));
    assert_eq!(w[i - 1], "MiB", "`{line}`");
    w[i - 2].parse().unwrap()
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
    // memtide kept at most its budget (plus the documented 1 MiB slack) and the rest in tier 1.
    let managed = mib_before(row(&out, "DRAM used (peak)"), "managed");
    assert!(managed <= 17.0, "managed DRAM peak {managed} MiB:\n{out}");
    let tier = mib_before(&format!("{} end", row(&out, "tier 1 holds")), "end");
    assert!(tier >= 64.0 - 17.0, "tier 1 holds {tier} MiB:\n{out}");
    assert!(out.contains("memtide kept"), "{out}");
}
