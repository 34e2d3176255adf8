//! End to end: python3 fills a 2 GiB bytearray with a seeded pattern and hashes it, under
//! memtide with 512 MiB of DRAM; the hash must equal that of an untiered run, and the stats
//! must show the memory really went through tier 1.

mod common;

use std::time::Duration;

use common::{main_stats, memtide, natively, output_within, require, stderr, Scratch};
use memtide_engine::size;

const SCRIPT: &str = r#"
import hashlib, sys
n = int(sys.argv[1])
b = bytearray(n)
pat = hashlib.sha256(b"memtide").digest() * 2048
for off in range(0, n, len(pat)):
    b[off:off + len(pat)] = pat[:min(len(pat), n - off)]
for i in range(0, n, 4096):
    b[i] = (i // 4096) % 251
# Touch it again out of order, so pages come back from tier 1 in another order.
for i in range(n - 4096, 0, -4096 * 97):
    b[i + 1] = (b[i] + 1) % 256
print(hashlib.sha256(b).hexdigest())
"#;

#[test]
fn python_bytearray_matches_untiered_run() {
    require("python3");
    let s = Scratch::new("python");
    let script = s.path().join("big.py");
    std::fs::write(&script, SCRIPT).unwrap();
    let n = (2u64 << 30).to_string();
    let native = natively(std::process::Command::new("python3").arg(&script).arg(&n));
    let stats = s.path().join("stats.json");
    // About 20 s here; a hang fails the test after 5 minutes instead of holding up CI.
    let tiered = output_within(
        memtide()
            .args(["run", "--dram", "512MiB", "--tier"])
            .arg(s.path())
            .arg("--stats")
            .arg(&stats)
            .args(["--", "python3"])
            .arg(&script)
            .arg(&n),
        Duration::from_secs(300),
    );
    assert!(tiered.status.success(), "{}", stderr(&tiered));
    assert_eq!(
        String::from_utf8_lossy(&tiered.stdout),
        native,
        "same bytes with and without memtide"
    );
    let st = main_stats(&stats);
    assert!(
        st["peak_managed_bytes"].as_u64().unwrap() >= 2 << 30,
        "{st}"
    );
    assert!(
        st["demotions"].as_u64().unwrap() > 100_000,
        "data went to tier 1: {st}"
    );
    assert!(
        st["faults_tier"].as_u64().unwrap() > 1000,
        "data came back from tier 1: {st}"
    );
    assert!(
        st["peak_dram_bytes"].as_u64().unwrap() <= (512 << 20) + (2 << 20),
        "DRAM stayed within the budget plus slack: {st}"
    );
    // The anonymous peak, which the bench gives Linux swap's cgroup: at least the managed
    // pages in DRAM (anonymous), at most the resident peak plus page tables (2 GiB mapped
    // needs 4 MiB of them).
    let anon = st["process_peak_anon_bytes"].as_u64().unwrap();
    assert!(
        anon >= st["peak_dram_bytes"].as_u64().unwrap()
            && anon <= st["process_peak_rss_bytes"].as_u64().unwrap() + (8 << 20),
        "anonymous peak between the DRAM peak and the resident peak: {st}"
    );
    let err = stderr(&tiered);
    assert!(
        err.contains("tier 1") && err.contains("promotions"),
        "summary printed: {err}"
    );
    // What it held outside managed DRAM, both taken at one snapshot: the interpreter's own
    // memory and memtide's state, some, and within the anonymous peak.
    let unmanaged = st["process_peak_unmanaged_bytes"].as_u64().unwrap();
    assert!(
        unmanaged > 0 && unmanaged <= anon,
        "memory outside managed DRAM: {st}"
    );
    // The summary says how much DRAM the process held beyond the managed pages.
    assert!(
        err.contains(&format!(
            "  process  {} anonymous + page tables at peak (a memory cgroup's charge): {} more than managed DRAM",
            size::format(anon),
            size::format(unmanaged)
        )),
        "summary names the anonymous peak: {err}"
    );
    // The tier file is gone.
    let left: Vec<_> = std::fs::read_dir(s.path())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tier"))
        .collect();
    assert!(left.is_empty(), "tier file left behind: {left:?}");
}
