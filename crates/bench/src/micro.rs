//! The microbenchmark (`--experiments micro`): the built-in workload under every configuration
//! side by side — all-DRAM, memtide at each DRAM budget, Linux swap and zswap at the same
//! budgets — with interleaved repetitions, medians and ratios; plus the first-touch fill and
//! the tier-1 fault latency against a raw O_DIRECT read of the same device. Entry points:
//! [`MicroArgs`], [`run`].

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use memtide_engine::size::format as bytes;
use serde::Serialize;

use crate::demo::{run_workload, Outcome, Placement};
use crate::device::{Pattern, ProbeFile};
use crate::lab::{beyond_quota, budget_bytes, config_width, swap_peer, Common, Configs, SameDram};
use crate::report::{median, step_label};
use crate::system::{interrupted, Pool, Pools};
use crate::workload::{Contents, WorkloadArgs};

/// The microbenchmark's flags.
#[derive(Args, Debug)]
pub struct MicroArgs {
    /// What the workload's pages hold, named by what lz4 makes of it: `zero-heavy` (all but
    /// 16 bytes a page zero, as a fresh allocation), `random` (incompressible), `2x` (half
    /// random, half zero), `3x` (a third random), `text` (English words, about 1.6:1). Every byte is
    /// checked at the end of every run.
    #[arg(long, value_enum, default_value = "zero-heavy")]
    pub contents: Contents,
    /// Workloads: `green` (10% of pages take all accesses but 1 in 100,000, which go
    /// anywhere: the active set is at most half of every budget down to 20%), `skewed` (10% of
    /// pages take 99% and the other 1% go anywhere: every page is touched every few seconds,
    /// so the active set is the whole footprint), `red` (80% of pages take 99%: the active
    /// set is larger than DRAM), `hotcold` (a scattered 20% of pages take 90%: at 50% the hot
    /// set fits and what placement keeps decides the misses; not in the default set) and
    /// `uniform`.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "green,skewed,red,uniform"
    )]
    pub workloads: Vec<String>,
    /// Worker threads of the workload; every count is run.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub threads: Vec<usize>,
}

impl MicroArgs {
    /// Refuses workloads and thread counts it cannot run.
    pub fn check(&self) -> Result<()> {
        for w in &self.workloads {
            if workload_shape(w).is_none() {
                bail!("unknown workload `{w}`: choose green, skewed, red, hotcold, uniform");
            }
        }
        if self.threads.is_empty() || self.threads.iter().any(|&t| t == 0 || t > 64) {
            bail!("--threads: give thread counts from 1 to 64");
        }
        Ok(())
    }
}

/// A workload of the microbenchmark: which share of pages gets which share of accesses.
pub fn workload_shape(name: &str) -> Option<(f64, f64)> {
    match name {
        "green" => Some((0.10, 0.99999)),
        "skewed" => Some((0.10, 0.99)),
        "red" => Some((0.80, 0.99)),
        "hotcold" => Some((0.20, 0.90)),
        "uniform" => Some((1.0, 1.0)),
        _ => None,
    }
}

#[derive(Serialize, Clone, Default)]
struct RunRecord {
    workload: String,
    threads: usize,
    config: String,
    rep: usize,
    throughput: f64,
    fill_seconds: f64,
    slow_fraction: f64,
    /// p50 of the sampled slow accesses: a fault as the program waits for it.
    slow_p50_us: f64,
    peak_rss: u64,
    tier_fault_p50_us: Option<f64>,
    tier_read_p50_us: Option<f64>,
    peak_dram: Option<u64>,
    /// zram configurations: the most DRAM its compressed pool took.
    #[serde(skip_serializing_if = "Option::is_none")]
    pool_peak: Option<u64>,
    verified_pages: u64,
    /// Linux swap's cgroup limit: the budget plus what memtide's runs kept unmanaged.
    #[serde(skip_serializing_if = "Option::is_none")]
    cgroup_limit: Option<u64>,
    /// Why the run ended without a result (Linux configurations only).
    #[serde(skip_serializing_if = "Option::is_none")]
    failed: Option<String>,
}

#[derive(Serialize)]
struct Row {
    workload: String,
    threads: usize,
    config: String,
    /// DRAM budget as a fraction of the footprint (1 for all-DRAM).
    budget: f64,
    throughput_median: f64,
    vs_dram: f64,
    vs_swap: Option<f64>,
    fill_median_seconds: f64,
    slow_fraction_median: f64,
    slow_p50_median_us: f64,
}

/// p50 of random 4 KiB O_DIRECT reads at queue depth 1 on a file in `dir`, in µs (the
/// probe's measurement, shorter).
pub(crate) fn raw_read_p50_us(dir: &Path) -> Result<f64> {
    let file = ProbeFile::create(dir, 256 << 20, false)?;
    let d = std::time::Duration::from_secs(600);
    file.run(Pattern::SequentialWrite, 4, 1 << 20, d, &|_| {})?;
    let run = file.run(
        Pattern::RandomRead,
        1,
        4096,
        std::time::Duration::from_secs(3),
        &|_| {},
    )?;
    Ok(median(
        run.latencies_ns.iter().map(|&ns| ns as f64 / 1e3).collect(),
    ))
}

/// The microbenchmark: the built-in workload under every configuration.
pub fn run(
    a: &Common,
    m: &MicroArgs,
    configs: &Configs,
    pools: &mut Pools,
    raw_p50: Option<f64>,
) -> Result<serde_json::Value> {
    let mut same_dram = SameDram::new(a, configs);
    let configs = &configs.0;
    let total_runs = a.reps() * m.workloads.len() * m.threads.len() * configs.len();
    let mut records: Vec<RunRecord> = Vec::new();
    let started = Instant::now();
    for rep in 0..a.reps() {
        for wname in &m.workloads {
            let (hot, hot_share) = workload_shape(wname).expect("checked");
            for &threads in &m.threads {
                let w = WorkloadArgs {
                    footprint: a.footprint,
                    hot,
                    hot_share,
                    writes: 0.2,
                    seconds: a.seconds,
                    warmup: a.warmup,
                    threads,
                    rate: 0.0,
                    scan: false,
                    contents: m.contents,
                    seed: 42 + rep as u64,
                };
                for (name, budget, place, pool) in configs {
                    let budget = *budget;
                    if interrupted() {
                        bail!("interrupted; settings restored");
                    }
                    let budget_b = budget_bytes(a.footprint, budget * 100.0);
                    pools.select(*pool, budget_b, m.contents.lz4_ratio())?;
                    let label = format!(
                        "{} {wname} {threads}t {name}",
                        step_label(records.len(), total_runs, started)
                    );
                    let cgroup_limit =
                        same_dram.before(name, budget, place, *pool, pools.cap(*pool, budget_b))?;
                    let o: Outcome = match run_workload(&label, &w, place) {
                        Ok(o) => o,
                        // Linux may kill a workload in its cgroup (out of memory with the
                        // swap device busy or zswap's pool charged to the cgroup): that is a
                        // result; a memtide run failing is not.
                        Err(e) if matches!(place, Placement::Cgroup { .. }) => {
                            eprintln!("{label}: failed: {e:#}");
                            records.push(RunRecord {
                                workload: wname.clone(),
                                threads,
                                config: name.clone(),
                                rep,
                                cgroup_limit,
                                failed: Some(format!("{e:#}")),
                                ..RunRecord::default()
                            });
                            continue;
                        }
                        Err(e) => return Err(e),
                    };
                    if o.result.mismatches > 0 {
                        bail!(
                            "{label}: {} pages read back wrong — a correctness failure, not a benchmark result",
                            o.result.mismatches
                        );
                    }
                    eprintln!(
                        "{label}: {:.0} k accesses/s, {:.2}% slow, fill {:.2} s, {} pages verified ({:.0} s)",
                        o.result.throughput / 1e3,
                        o.result.slow_fraction * 100.0,
                        o.result.fill_seconds,
                        o.result.verified_pages,
                        o.wall_seconds
                    );
                    records.push(RunRecord {
                        workload: wname.clone(),
                        threads,
                        config: name.clone(),
                        rep,
                        throughput: o.result.throughput,
                        fill_seconds: o.result.fill_seconds,
                        slow_fraction: o.result.slow_fraction,
                        slow_p50_us: o.result.slow_p50_us,
                        peak_rss: o.peak_rss,
                        tier_fault_p50_us: o.memtide.as_ref().map(|s| s.fault_tier_latency_p50_us),
                        tier_read_p50_us: o.memtide.as_ref().map(|s| s.tier_read_latency_p50_us),
                        peak_dram: o.memtide.as_ref().map(|s| s.peak_dram_bytes),
                        pool_peak: pools.zram_peak(),
                        verified_pages: o.result.verified_pages,
                        cgroup_limit,
                        failed: None,
                    });
                    if let Some(s) = &o.memtide {
                        same_dram.saw(budget, beyond_quota(s, o.peak_rss));
                    }
                }
            }
        }
    }

    // Medians and ratios.
    let med = |w: &str, t: usize, c: &str, f: &dyn Fn(&RunRecord) -> f64| {
        median(
            records
                .iter()
                .filter(|r| r.workload == w && r.threads == t && r.config == c)
                .filter(|r| r.failed.is_none())
                .map(f)
                .collect(),
        )
    };
    let cw = config_width(configs.iter().map(|c| c.0.as_str()));
    let mut rows = Vec::new();
    println!();
    println!(
        "{:<8} {:>3} {:<cw$} {:>12} {:>9} {:>9} {:>9} {:>8} {:>10}",
        "workload",
        "thr",
        "config",
        "accesses/s",
        "vs DRAM",
        "vs swap",
        "miss",
        "fill s",
        "miss µs"
    );
    for w in &m.workloads {
        for &t in &m.threads {
            let dram = med(w, t, "all-DRAM", &|r| r.throughput);
            for (c, budget, _, _) in configs {
                let tp = med(w, t, c, &|r| r.throughput);
                let vs_swap = swap_peer(c, *budget)
                    .map(|swap| tp / med(w, t, &swap, &|r| r.throughput))
                    .filter(|v| v.is_finite());
                let row = Row {
                    workload: w.clone(),
                    threads: t,
                    config: c.clone(),
                    budget: *budget,
                    throughput_median: tp,
                    vs_dram: tp / dram,
                    vs_swap,
                    fill_median_seconds: med(w, t, c, &|r| r.fill_seconds),
                    slow_fraction_median: med(w, t, c, &|r| r.slow_fraction),
                    slow_p50_median_us: med(w, t, c, &|r| r.slow_p50_us),
                };
                let failed = records
                    .iter()
                    .filter(|r| &r.workload == w && r.threads == t && &r.config == c)
                    .filter(|r| r.failed.is_some())
                    .count();
                if tp.is_nan() {
                    println!(
                        "{:<8} {:>3} {:<cw$} {:>12} (every run was killed: {failed} of {})",
                        w,
                        t,
                        c,
                        "failed",
                        a.reps()
                    );
                    rows.push(row);
                    continue;
                }
                println!(
                    "{:<8} {:>3} {:<cw$} {:>12.0} {:>8.3}x {:>9} {:>8.3}% {:>8.2} {:>10}{}",
                    row.workload,
                    row.threads,
                    row.config,
                    row.throughput_median,
                    row.vs_dram,
                    row.vs_swap.map_or("-".into(), |v| format!("{v:.2}x")),
                    row.slow_fraction_median * 100.0,
                    row.fill_median_seconds,
                    if row.slow_p50_median_us > 0.0 {
                        format!("{:.0}", row.slow_p50_median_us)
                    } else {
                        "-".into()
                    },
                    if failed > 0 {
                        format!("  ({failed} of {} runs killed)", a.reps())
                    } else {
                        String::new()
                    }
                );
                rows.push(row);
            }
        }
    }
    println!(
        "(miss: accesses served from tier 1 or swap, i.e. slower than 20 µs; sampled 1 in 64; miss µs: their p50 as the program waits for them)"
    );
    same_dram.print();
    // memtide against the compressed peers at the same budget, and what zram's pool took.
    for w in &m.workloads {
        for &t in &m.threads {
            for (c, budget, _, _) in configs.iter().filter(|c| c.0.starts_with("memtide ")) {
                let tp = med(w, t, c, &|r| r.throughput);
                if !tp.is_finite() {
                    // Every run of this configuration failed: the table says so.
                    continue;
                }
                let peers: Vec<(String, f64)> = ["zswap", "zram"]
                    .iter()
                    .map(|peer| format!("{peer} {:.0}%", budget * 100.0))
                    .filter(|peer| configs.iter().any(|c| &c.0 == peer))
                    .map(|peer| {
                        let p = med(w, t, &peer, &|r| r.throughput);
                        (peer, p)
                    })
                    .collect();
                // A peer every run of which failed (a median of none) has no ratio to give.
                let (ran, none): (Vec<_>, Vec<_>) = peers.into_iter().partition(|(_, p)| *p > 0.0);
                let vs: Vec<String> = ran
                    .iter()
                    .map(|(peer, p)| format!("{:.2}x {peer}", tp / p))
                    .collect();
                let none: Vec<&str> = none.iter().map(|(peer, _)| peer.as_str()).collect();
                if !vs.is_empty() {
                    println!("({w} {t} thr: {c} runs at {})", vs.join(", "));
                }
                if !none.is_empty() {
                    println!(
                        "({w} {t} thr: no ratio of {c} to {}: no result)",
                        none.join(", ")
                    );
                }
            }
        }
    }
    for (c, budget, _, pool) in configs.iter().filter(|c| c.3 == Pool::Zram) {
        let peak = records
            .iter()
            .filter(|r| &r.config == c)
            .filter_map(|r| r.pool_peak)
            .max();
        if let Some(peak) = peak {
            println!(
                "({c}: its pool took up to {} of DRAM; its share of the budget is {})",
                bytes(peak),
                bytes(pools.cap(*pool, budget_bytes(a.footprint, budget * 100.0)))
            );
        }
    }
    if a.faults.contains(&memtide_engine::Delivery::Signal) {
        println!("(sig: memtide with faults delivered as SIGBUS in the faulting thread, --faults signal; the others use handler threads)");
    }
    // One plot per workload: throughput against all-DRAM per budget, per family and threads.
    for w in &m.workloads {
        let mut series = Vec::new();
        for family in ["memtide", "Linux swap", "zswap", "zram"] {
            for &t in &m.threads {
                let points: Vec<(f64, f64)> = rows
                    .iter()
                    .filter(|r| &r.workload == w && r.threads == t && r.config.starts_with(family))
                    .map(|r| (r.budget, r.vs_dram))
                    .collect();
                if !points.is_empty() {
                    series.push(crate::plot::Series {
                        name: format!("{family}, {t} thr"),
                        points,
                    });
                }
            }
        }
        let path = PathBuf::from(format!("{}-{w}.svg", a.plot.display()));
        crate::plot::Chart::ratio_vs_budget(
            format!(
                "memtide bench: {w} workload over {}, throughput vs all-DRAM",
                bytes(a.footprint)
            ),
            "DRAM budget, fraction of the footprint",
            "throughput / all-DRAM",
            series,
        )
        .write(&path)?;
    }
    let fault_p50 = median(
        records
            .iter()
            .filter(|r| r.workload == m.workloads[0] && r.threads == m.threads[0])
            .filter_map(|r| r.tier_fault_p50_us)
            .collect(),
    );
    let fill_dram = median(
        records
            .iter()
            .filter(|r| r.config == "all-DRAM")
            .map(|r| r.fill_seconds)
            .collect(),
    );
    let fill_mt = median(
        records
            .iter()
            .filter(|r| r.config.starts_with("memtide"))
            .map(|r| r.fill_seconds)
            .collect(),
    );
    println!();
    println!(
        "first-touch fill of {}: all-DRAM {fill_dram:.2} s, memtide {fill_mt:.2} s ({:.2}x)",
        bytes(a.footprint),
        fill_mt / fill_dram
    );
    match raw_p50 {
        _ if fault_p50.is_nan() || fault_p50 <= 0.0 => println!("no tier-1 faults in these runs"),
        Some(raw) => println!(
            "tier-1 fault p50 {fault_p50:.0} µs vs raw O_DIRECT 4 KiB read p50 {raw:.0} µs on the same device (+{:.0} µs)",
            fault_p50 - raw
        ),
        None => println!("tier-1 fault p50 {fault_p50:.0} µs (raw device read not measured)"),
    }
    Ok(serde_json::json!({
        "threads": m.threads,
        "workloads": m.workloads,
        "contents": m.contents.name(),
        "pool_share": a.pool_share,
        "memtide_pool_share": a.compressed_max,
        "seconds": a.seconds,
        "warmup": a.warmup,
        "rows": rows,
        "runs": records,
        "fill_dram_seconds": fill_dram,
        "fill_memtide_seconds": fill_mt,
        "tier_fault_p50_us": fault_p50,
        "raw_read_p50_us": raw_p50,
    }))
}
