//! Reading the per-process stats files the preload library writes, and printing the summary a
//! user sees when a program run under memtide exits. Entry points: [`collect`], [`print`].

use std::collections::BTreeMap;
use std::path::Path;

use memtide_engine::{size::format as bytes, Snapshot};
use memtide_policy::{Health, HealthThresholds};

/// The latest snapshot of each process, and the one at which it managed the most memory
/// (exit snapshots are taken after the program freed its memory; coverage is judged at peak).
#[derive(Default)]
pub struct Collected {
    pub latest: BTreeMap<u32, Snapshot>,
    pub at_peak: BTreeMap<u32, Snapshot>,
}

impl Collected {
    /// Reads every `memtide-<pid>.json` in `dir`.
    pub fn update(&mut self, dir: &Path) {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return;
        };
        for ent in rd.flatten() {
            let name = ent.file_name();
            let name = name.to_string_lossy();
            if !(name.starts_with("memtide-") && name.ends_with(".json")) {
                continue;
            }
            let Ok(text) = std::fs::read_to_string(ent.path()) else {
                continue;
            };
            let Ok(s) = serde_json::from_str::<Snapshot>(&text) else {
                continue;
            };
            let best = self.at_peak.entry(s.pid).or_insert_with(|| s.clone());
            if s.managed_bytes > best.managed_bytes {
                *best = s.clone();
            }
            self.latest.insert(s.pid, s);
        }
    }

    /// The process that managed the most memory (the program itself, usually).
    pub fn main(&self) -> Option<(&Snapshot, &Snapshot)> {
        let pid = self
            .at_peak
            .values()
            .max_by_key(|s| s.peak_managed_bytes)?
            .pid;
        Some((self.latest.get(&pid)?, self.at_peak.get(&pid)?))
    }
}

pub fn collect(dir: &Path) -> Collected {
    let mut c = Collected::default();
    c.update(dir);
    c
}

/// Share of the program's memory that memtide manages, judged at peak: managed bytes over
/// managed bytes plus resident memory memtide does not manage.
pub fn coverage(peak: &Snapshot) -> f64 {
    let unmanaged = peak.process_rss_bytes.saturating_sub(peak.dram_bytes);
    let whole = peak.managed_bytes + unmanaged;
    if whole == 0 {
        0.0
    } else {
        peak.managed_bytes as f64 / whole as f64
    }
}

/// Prints the summary of a run to stderr.
pub fn print(program: &str, status: &str, c: &Collected) {
    let Some((s, peak)) = c.main() else {
        eprintln!(
            "memtide: {program} {status}; it allocated no managed memory (no allocation reached the size threshold), so nothing was tiered"
        );
        return;
    };
    let t = HealthThresholds::default();
    eprintln!(
        "memtide: {program} {status} after {:.1} s",
        s.elapsed_seconds
    );
    eprintln!(
        "  DRAM     quota {}, peak {}, now {} (inactive {})",
        bytes(s.quota_bytes),
        bytes(s.peak_dram_bytes),
        bytes(s.dram_bytes),
        bytes(s.inactive_bytes)
    );
    let cov = coverage(peak);
    eprintln!(
        "  managed  peak {} — {:.0}% of the program's memory{}",
        bytes(s.peak_managed_bytes),
        cov * 100.0,
        if cov < 0.5 {
            " (little: most of this program's memory is in allocations below the threshold or in mappings memtide does not manage)"
        } else {
            ""
        }
    );
    eprintln!(
        "  tier 1   {} in use, file {}; read {}, written {} in {} writes{}",
        bytes(s.tier_bytes),
        bytes(s.tier_file_bytes),
        bytes(s.tier_read_bytes),
        bytes(s.tier_write_bytes),
        s.tier_write_ops,
        if s.tier_errors > 0 {
            format!(", {} I/O errors", s.tier_errors)
        } else {
            String::new()
        }
    );
    eprintln!("           {}", s.tier);
    let lat = if s.faults_tier > 0 {
        format!(
            " (fault p50 {:.0} µs, p99 {:.0} µs; device read p50 {:.0} µs, p99 {:.0} µs: {})",
            s.fault_tier_latency_p50_us,
            s.fault_tier_latency_p99_us,
            s.tier_read_latency_p50_us,
            s.tier_read_latency_p99_us,
            Health::of_latency(s.tier_read_latency_p50_us, &t).as_str()
        )
    } else {
        String::new()
    };
    eprintln!(
        "  faults   {} first-touch pages, {} from tier 1{lat}, {} inactive hits (no I/O), {} waited on a page in flight",
        s.faults_zero, s.faults_tier, s.faults_inactive, s.faults_wait
    );
    eprintln!(
        "  moves    {} promotions ({} read ahead), {} demotions ({} clean, {} zero: no write)",
        s.promotions, s.readahead_pages, s.demotions, s.demotions_clean, s.demotions_zero
    );
    eprintln!(
        "  active   {} at last epoch ({}), {} epochs; evictor CPU {:.2} s, scan CPU {:.2} s",
        bytes(peak.active_bytes.max(s.active_bytes)),
        Health::of_active(peak.active_bytes.max(s.active_bytes), s.quota_bytes, &t).as_str(),
        s.epochs,
        s.evict_cpu_seconds,
        s.scan_cpu_seconds
    );
    if s.quota_waits > 0 || s.quota_overruns > 0 {
        eprintln!(
            "  quota    {} waits for eviction, {} pages admitted above the quota",
            s.quota_waits, s.quota_overruns
        );
    }
    for w in &s.warnings {
        eprintln!("  warning  {w}");
    }
    if c.latest.len() > 1 {
        eprintln!(
            "  ({} processes ran with memtide; figures above are for pid {})",
            c.latest.len(),
            s.pid
        );
    }
}
