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
            if held(&s) > held(best) {
                *best = s.clone();
            }
            self.latest.insert(s.pid, s);
        }
    }

    /// The process that managed the most memory of those that started an engine of their own
    /// (the program itself, usually; a forked child shares its parent's books up to the fork,
    /// so it is never preferred to it).
    pub fn main(&self) -> Option<(&Snapshot, &Snapshot)> {
        let pid = self
            .at_peak
            .values()
            .max_by_key(|s| (s.forked_from == 0, s.peak_managed_bytes))?
            .pid;
        Some((self.latest.get(&pid)?, self.at_peak.get(&pid)?))
    }
}

pub fn collect(dir: &Path) -> Collected {
    let mut c = Collected::default();
    c.update(dir);
    c
}

/// Share of the program's memory that memtide manages, judged at peak: the program's bytes
/// memtide holds (managed pages in DRAM and tier 1; reserved address space holding nothing
/// does not count) over those plus resident memory memtide does not manage.
pub fn coverage(peak: &Snapshot) -> f64 {
    let held = held(peak);
    let unmanaged = peak.process_rss_bytes.saturating_sub(peak.dram_bytes);
    let whole = held + unmanaged;
    if whole == 0 {
        0.0
    } else {
        held as f64 / whole as f64
    }
}

/// The program's bytes memtide holds: managed pages in DRAM, in the compressed pool (counted
/// uncompressed, in place of the pool's DRAM) or in tier 1 (a clean page is in two places; the
/// allocated pages bound it).
pub fn held(s: &Snapshot) -> u64 {
    let pages = s.dram_bytes.saturating_sub(s.compressed_pool_bytes);
    (pages + s.compressed_pages * 4096 + s.tier_bytes).min(s.managed_bytes)
}

/// Prints the summary of a run to stderr.
pub fn print(program: &str, status: &str, c: &Collected) {
    let Some((s, peak)) = c.main() else {
        let why =
            unmanageable(program).unwrap_or("no allocation reached the size threshold".into());
        eprintln!(
            "memtide: {program} {status}; it allocated no managed memory ({why}), so nothing was tiered"
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
    // What a memory cgroup would charge the program: DRAM beyond the quota is memtide's own
    // per-page state and the program's memory memtide does not manage. (Stats files from
    // before the engine measured it have 0.)
    if s.process_peak_anon_bytes > 0 {
        eprintln!(
            "  process  {} anonymous + page tables at peak (a memory cgroup's charge): {} more than managed DRAM (memtide's page state, unmanaged memory)",
            bytes(s.process_peak_anon_bytes),
            bytes(beyond_quota(s, 0))
        );
    }
    let cov = coverage(peak);
    eprintln!(
        "  managed  {} held at peak ({} of address space) — {:.0}% of the program's memory{}",
        bytes(held(peak)),
        bytes(s.peak_managed_bytes),
        cov * 100.0,
        if cov < 0.5 {
            match unmanageable(program) {
                Some(why) => format!(" (little: {why})"),
                None => " (little: most of this program's memory is in allocations below the threshold or in mappings memtide does not manage)".into(),
            }
        } else {
            String::new()
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
    if s.compress.is_empty() || s.compress == "off" {
        eprintln!("  pool     off (--compress off): pages leave DRAM for tier 1 only");
    } else {
        eprintln!(
            "  pool     {}: {} of pages in {} of DRAM ({}), up to {}{}; {} pages stored, {} same-filled (one word each), {} compressed too little (to tier 1){}; {} written back to tier 1, {} copies dropped; {} in holes, {} objects moved by {} compactions",
            s.compress,
            bytes(s.compressed_pages * 4096),
            bytes(s.compressed_pool_bytes),
            if s.compressed_pool_bytes > 0 {
                format!("{:.1}:1", s.compression_ratio())
            } else {
                "empty".into()
            },
            bytes(s.compressed_capacity_bytes),
            if s.compressed_adaptive {
                format!(
                    " (sized by what it saves: {} steps up, {} down)",
                    s.compressed_grows, s.compressed_shrinks
                )
            } else {
                " (fixed)".into()
            },
            s.compressed_stores,
            s.compressed_same,
            s.compressed_rejected,
            if s.compressed_skipped > 0 {
                format!(
                    ", {} sent there untried (the pool had refused a run of the pages it tried)",
                    s.compressed_skipped
                )
            } else {
                String::new()
            },
            s.compressed_spills,
            s.compressed_drops,
            bytes(s.compressed_hole_bytes),
            s.compressed_moves,
            s.compressed_compactions
        );
    }
    let lat = if s.faults_tier > 0 {
        let waited = s.tier_reads_polled + s.tier_reads_slept;
        let polled = if waited > 0 {
            format!(
                "; {:.0}% of reads polled",
                100.0 * s.tier_reads_polled as f64 / waited as f64
            )
        } else {
            String::new()
        };
        format!(
            " (fault p50 {:.0} µs, p99 {:.0} µs; device read p50 {:.0} µs, p99 {:.0} µs: {}{polled})",
            s.fault_tier_latency_p50_us,
            s.fault_tier_latency_p99_us,
            s.tier_read_latency_p50_us,
            s.tier_read_latency_p99_us,
            Health::of_latency(s.tier_read_latency_p50_us, &t).as_str()
        )
    } else {
        String::new()
    };
    let pool = if s.faults_compressed > 0 {
        format!(
            " (p50 {:.0} µs, p99 {:.0} µs)",
            s.fault_compressed_latency_p50_us, s.fault_compressed_latency_p99_us
        )
    } else {
        String::new()
    };
    eprintln!(
        "  faults   {} first-touch pages, {} from the pool{pool}, {} from tier 1{lat}, {} inactive hits (no I/O; {} copied back), {} waited on a page in flight",
        s.faults_zero,
        s.faults_compressed,
        s.faults_tier - s.faults_compressed.min(s.faults_tier),
        s.faults_inactive,
        s.faults_inactive_copied,
        s.faults_wait
    );
    eprintln!(
        "  moves    {} promotions ({} read ahead{}), {} demotions ({} clean, {} zero: no write){}",
        s.promotions,
        s.readahead_pages,
        if s.readahead_pairs > 0 {
            format!(", {} of them as the next page of a pair", s.readahead_pairs)
        } else {
            String::new()
        },
        s.demotions,
        s.demotions_clean,
        s.demotions_zero,
        if s.discarded_bytes > 0 {
            format!(
                "; {} the program discarded, dropped without a write",
                bytes(s.discarded_bytes)
            )
        } else {
            String::new()
        }
    );
    if s.pages_seen_written > 0 || s.deactivations_in_faults > 0 {
        eprintln!(
            "  sweep    {} pages unmapped into the inactive list ({} by faults, for the evictor), {} kept in DRAM for being written since the last pass (no fault)",
            s.deactivations, s.deactivations_in_faults, s.pages_seen_written
        );
    }
    eprintln!(
        "  active   {} touched within a second, sampled ({}), {} epochs; evictor CPU {:.2} s, scan CPU {:.2} s",
        bytes(peak.active_bytes.max(s.active_bytes)),
        Health::of_active(peak.active_bytes.max(s.active_bytes), s.quota_bytes, &t).as_str(),
        s.epochs,
        s.evict_cpu_seconds,
        s.scan_cpu_seconds
    );
    if s.quota_waits > 0 || s.quota_overruns > 0 {
        eprintln!(
            "  quota    {} waits for eviction ({:.2} s in all), {} pages admitted above the quota",
            s.quota_waits, s.quota_wait_seconds, s.quota_overruns
        );
    }
    for w in &s.warnings {
        eprintln!("  warning  {w}");
    }
    if c.latest.len() > 1 {
        print_processes(c, s.pid);
    }
}

/// Most processes listed one by one (the rest are counted in the totals).
const LISTED: usize = 8;

/// One line per process that ran with memtide, and their totals: processes forked with their
/// engine share the program's quota (the figures above are the main process's).
fn print_processes(c: &Collected, main: u32) {
    let forked = c.latest.values().filter(|s| s.forked_from != 0).count();
    eprintln!(
        "  processes {} ran with memtide{}; figures above are for pid {main}",
        c.latest.len(),
        if forked > 0 {
            format!(" ({forked} forked with their engine, within the one quota)")
        } else {
            String::new()
        }
    );
    for (pid, s) in c.latest.iter().take(LISTED) {
        let peak = c.at_peak.get(pid).unwrap_or(s);
        eprintln!(
            "           pid {pid}{}: DRAM peak {}, {} faults from the pool and tier 1, {} read and {} written to tier 1",
            if s.forked_from != 0 {
                format!(" (forked from {})", s.forked_from)
            } else {
                String::new()
            },
            bytes(peak.peak_dram_bytes.max(s.peak_dram_bytes)),
            s.faults_tier,
            bytes(s.tier_read_bytes),
            bytes(s.tier_write_bytes)
        );
    }
    if c.latest.len() > LISTED {
        eprintln!("           and {} more", c.latest.len() - LISTED);
    }
    let sum = |f: fn(&Snapshot) -> u64| c.latest.values().map(f).sum::<u64>();
    eprintln!(
        "           total: {} faults from the pool and tier 1, {} read and {} written to tier 1",
        sum(|s| s.faults_tier),
        bytes(sum(|s| s.tier_read_bytes)),
        bytes(sum(|s| s.tier_write_bytes))
    );
}

/// Why memtide cannot manage a program's memory, when its executable says so: a statically
/// linked program cannot load the preload library, and the Go runtime maps its memory with
/// raw system calls. `None` when neither is known to apply.
pub fn unmanageable(program: &str) -> Option<String> {
    let path = find_program(program)?;
    let bytes = std::fs::read(&path).ok()?;
    if bytes.windows(GO_BUILDINFO.len()).any(|w| w == GO_BUILDINFO) {
        return Some(
            "it is a Go program: the Go runtime maps its memory with raw system calls, which memtide cannot interpose"
                .into(),
        );
    }
    if !has_interpreter(&bytes)? {
        return Some(
            "it is statically linked: memtide's preload library cannot load into it".into(),
        );
    }
    None
}

/// The header of the build information every Go binary since Go 1.18 carries.
const GO_BUILDINFO: &[u8] = b"\xff Go buildinf:";

fn find_program(program: &str) -> Option<std::path::PathBuf> {
    if program.contains('/') {
        return Some(program.into());
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

/// Whether a 64-bit ELF executable names a program interpreter (is dynamically linked);
/// `None` if it is not one.
fn has_interpreter(elf: &[u8]) -> Option<bool> {
    const PT_INTERP: u32 = 3;
    if elf.len() < 64 || &elf[..4] != b"\x7fELF" || elf[4] != 2 {
        return None;
    }
    let u16_at = |o: usize| Some(u16::from_le_bytes(elf.get(o..o + 2)?.try_into().ok()?));
    let phoff = u64::from_le_bytes(elf.get(0x20..0x28)?.try_into().ok()?) as usize;
    let phentsize = u16_at(0x36)? as usize;
    let phnum = u16_at(0x38)? as usize;
    let mut found = false;
    for k in 0..phnum {
        let at = phoff + k * phentsize;
        let kind = u32::from_le_bytes(elf.get(at..at + 4)?.try_into().ok()?);
        found |= kind == PT_INTERP;
    }
    Some(found)
}

/// What a memtide run kept in DRAM beyond its managed pages, as a memory cgroup would count it
/// for Linux swap: the most anonymous memory and page tables it held outside managed DRAM at
/// one snapshot. The program's and libraries' file pages are left out: the page cache already
/// held them, so the swap run's cgroup is not charged for them (VmHWM counts them: 10 MiB for
/// redis). Statistics from before that figure existed fall back to the peak anonymous memory,
/// or to `peak_rss` (VmHWM), less the peak managed DRAM.
pub fn beyond_quota(s: &memtide_engine::Snapshot, peak_rss: u64) -> u64 {
    if s.process_peak_unmanaged_bytes > 0 {
        return s.process_peak_unmanaged_bytes;
    }
    let resident = match s.process_peak_anon_bytes {
        0 => peak_rss,
        anon => anon,
    };
    resident.saturating_sub(s.peak_dram_bytes)
}
