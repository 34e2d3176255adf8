//! `memtide bench`'s experiments with several tenants on one host, each tenant a copy of the
//! built-in workload in its own process:
//!
//! - **density**: how many tenants fit in a fixed amount of DRAM while each keeps 90% (95%) of
//!   its all-DRAM throughput. Every tenant serves a fixed load (paced accesses, so that N
//!   tenants on a small machine are limited by memory, not by CPU); under memtide and Linux
//!   swap the DRAM is split evenly; all-DRAM fits only as many tenants as the DRAM holds, and
//!   is also run at every N as the reference for the same CPU sharing.
//! - **noisy neighbour**: a tenant running as fast as it can beside one that streams over a
//!   large cold footprint, each with its own DRAM budget; the first tenant's loss alone and
//!   beside the streamer, under each placement.
//!
//! Entry points: [`density`], [`noisy`].

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Result};
use memtide_engine::size::format as bytes;
use serde::Serialize;

use crate::demo::{run_workload_showing, Outcome, Placement};
use crate::lab::Common;
use crate::micro::workload_shape;
use crate::opts;
use crate::report::{median, step_label};
use crate::system::{interrupted, TenantCgroups};
use crate::workload::WorkloadArgs;

/// The multi-tenant experiments' flags (`density`, `noisy`, `quotas`).
#[derive(clap::Args, Debug)]
pub struct TenantArgs {
    /// Density: the DRAM the tenants share (split evenly among them under memtide and Linux
    /// swap; all-DRAM fits as many tenants as this holds). Quotas: the host daemon's budget
    /// (and four times each tenant's static share).
    #[arg(long, value_parser = opts::nonzero_size, default_value = "512MiB")]
    pub host_dram: u64,
    /// Density and quotas: memory each tenant touches; noisy: the sensitive tenant's.
    #[arg(long, value_parser = opts::nonzero_size, default_value = "256MiB")]
    pub tenant_footprint: u64,
    /// Density: the numbers of tenants to try.
    #[arg(long, value_delimiter = ',', default_value = "2,4,8,12,16,18,20")]
    pub tenants: Vec<usize>,
    /// Density: the load each tenant serves, in accesses/s (the green workload, paced).
    #[arg(long, value_parser = opts::rate, default_value = "100K/s")]
    pub tenant_rate: f64,
    /// Noisy: memory the streaming neighbour sweeps over.
    #[arg(long, value_parser = opts::nonzero_size, default_value = "2GiB")]
    pub neighbour_footprint: u64,
    /// Noisy: each tenant's DRAM budget, as a percentage of the sensitive tenant's footprint.
    #[arg(long, value_parser = opts::percent, default_value = "50")]
    pub tenant_dram: f64,
}

/// What the multi-tenant experiments run on.
pub struct Host<'a> {
    pub tier: &'a Path,
    pub preload: &'a Path,
    /// Per-tenant memory cgroups for Linux swap (`None`: `--no-swap`).
    pub cgroups: Option<&'a TenantCgroups>,
}

/// How the tenants of one run are placed.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Family {
    Dram,
    Memtide,
    Swap,
    /// Linux swap with a zram device in front (the vms experiment only).
    Zram,
}

impl Family {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Family::Dram => "all-DRAM",
            Family::Memtide => "memtide",
            Family::Swap => "Linux swap",
            Family::Zram => "zram",
        }
    }

    pub(crate) fn all(host: &Host) -> Vec<Family> {
        let mut v = vec![Family::Dram, Family::Memtide];
        if host.cgroups.is_some() {
            v.push(Family::Swap);
        }
        v
    }
}

/// One tenant's result in one run (`None` throughput: Linux killed it).
#[derive(Serialize, Clone, Debug)]
struct TenantRun {
    throughput: Option<f64>,
    slow_fraction: f64,
    p99_us: f64,
    verified_pages: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    failed: Option<String>,
}

/// Runs the tenants side by side, tenant `i` with `dram[i]` of DRAM (`None`: unlimited), and
/// returns their results in order. A memtide tenant that fails, or any tenant that reads back
/// wrong data, fails the experiment; a tenant Linux kills in its cgroup is a result.
fn run_together(
    family: Family,
    host: &Host,
    tenants: &[(WorkloadArgs, Option<u64>)],
) -> Result<Vec<TenantRun>> {
    let mut procs: Vec<Option<PathBuf>> = Vec::new();
    for (i, (_, dram)) in tenants.iter().enumerate() {
        procs.push(match (family, dram, host.cgroups) {
            (Family::Swap, Some(d), Some(cg)) => Some(cg.limit(i, *d)?),
            _ => None,
        });
    }
    let places: Vec<Placement> = tenants
        .iter()
        .zip(&procs)
        .map(|((_, dram), procs)| match (family, dram, procs) {
            (Family::Memtide, Some(d), _) => Placement::Memtide {
                dram: *d,
                tier: host.tier,
                preload: host.preload,
                faults: memtide_engine::Delivery::Threads,
                policy: memtide_engine::EvictionPolicy::default(),
                compress: memtide_engine::Compress::default(),
                pool_share: None,
            },
            (Family::Swap, Some(_), Some(p)) => Placement::Cgroup { procs: p },
            _ => Placement::Dram,
        })
        .collect();
    let outcomes: Vec<Result<Outcome>> = std::thread::scope(|s| {
        let handles: Vec<_> = tenants
            .iter()
            .zip(&places)
            .enumerate()
            .map(|(i, ((w, _), place))| {
                s.spawn(move || run_workload_showing(&format!("tenant {i}"), w, place, false))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("tenant thread"))
            .collect()
    });
    let mut runs = Vec::new();
    for (i, o) in outcomes.into_iter().enumerate() {
        match o {
            Ok(o) => runs.push(TenantRun {
                throughput: Some(o.result.throughput),
                slow_fraction: o.result.slow_fraction,
                p99_us: o.result.p99_us,
                verified_pages: o.result.verified_pages,
                failed: None,
            }),
            Err(e) if family == Family::Swap && !format!("{e:#}").contains("MISMATCH") => runs
                .push(TenantRun {
                    throughput: None,
                    slow_fraction: f64::NAN,
                    p99_us: f64::NAN,
                    verified_pages: 0,
                    failed: Some(format!("{e:#}")),
                }),
            Err(e) => bail!("{} tenant {i}: {e:#}", family.name()),
        }
    }
    Ok(runs)
}

/// One tenant of the green workload over `--tenant-footprint`, one thread, at `rate`
/// accesses/s (0: as fast as it can).
fn green_tenant(a: &Common, x: &TenantArgs, rate: f64, seed: u64) -> WorkloadArgs {
    let (hot, hot_share) = workload_shape("green").expect("known");
    WorkloadArgs {
        footprint: x.tenant_footprint,
        hot,
        hot_share,
        writes: 0.2,
        seconds: a.seconds,
        warmup: a.warmup,
        threads: 1,
        rate,
        scan: false,
        contents: crate::workload::Contents::default(),
        seed: 42 + seed,
    }
}

#[derive(Serialize)]
struct DensityRun {
    tenants: usize,
    config: String,
    rep: usize,
    dram_each: Option<u64>,
    runs: Vec<TenantRun>,
}

#[derive(Serialize)]
struct DensityRow {
    tenants: usize,
    config: String,
    dram_each: Option<u64>,
    /// Medians over the repetitions of: the slowest tenant's throughput, and the median
    /// tenant's, both against all-DRAM with as many tenants.
    worst_vs_dram: f64,
    median_vs_dram: f64,
    /// Median over the repetitions of the tenants' median throughput, accesses/s.
    median_throughput: f64,
    slow_fraction: f64,
    p99_us: f64,
    killed: usize,
}

#[derive(Serialize)]
pub(crate) struct Density {
    config: String,
    /// Most tenants (of those tried) at which the slowest tenant kept 90% / 95% of all-DRAM
    /// (median over the repetitions) and no tenant was killed, as at every smaller count.
    at_10_percent_loss: Option<usize>,
    at_5_percent_loss: Option<usize>,
}

/// One count and placement of a density experiment: the slowest tenant against all-DRAM
/// (median over the repetitions) and how many tenant runs Linux killed.
pub(crate) struct Fit {
    pub n: usize,
    pub config: String,
    pub worst_vs_dram: f64,
    pub killed: usize,
}

/// Says how many tenants (`what`: "tenants", "guests") each of `configs` (all but all-DRAM) fits
/// within 10% and 5% loss — the most at which the slowest kept the bar and none was killed,
/// at every smaller count too — against the `fits` all-DRAM holds, and plots the slowest
/// tenant per count to `plot`.
pub(crate) fn report_fits(
    what: &str,
    fits: usize,
    counts: &[usize],
    configs: &[String],
    rows: &[Fit],
    title: String,
    plot: &Path,
) -> Result<Vec<Density>> {
    let most_within = |config: &str, bar: f64| -> Option<usize> {
        let mut best = None;
        for &n in counts {
            let Some(r) = rows.iter().find(|r| r.n == n && r.config == config) else {
                break;
            };
            // A tenant killed in any repetition did not fit, whatever the median says.
            if r.worst_vs_dram >= bar && r.killed == 0 {
                best = Some(n);
            } else {
                break;
            }
        }
        best
    };
    let largest = counts.iter().copied().max().unwrap_or(0);
    let say = |n: Option<usize>| match n {
        None => "none of the counts tried".to_string(),
        Some(n) if fits > 0 => format!(
            "{n} {what} ({:.1}x all-DRAM){}",
            n as f64 / fits as f64,
            if n == largest {
                format!(", the most tried: try more with --{what}")
            } else {
                String::new()
            }
        ),
        Some(n) => format!("{n} {what} (all-DRAM fits none)"),
    };
    let mut densities = Vec::new();
    for c in configs {
        let d = Density {
            config: c.clone(),
            at_10_percent_loss: most_within(c, 0.90),
            at_5_percent_loss: most_within(c, 0.95),
        };
        println!(
            "{}: at most 10% loss {}; at most 5% loss {}.",
            d.config,
            say(d.at_10_percent_loss),
            say(d.at_5_percent_loss)
        );
        densities.push(d);
    }
    crate::plot::Chart {
        title,
        x_label: what.into(),
        y_label: format!("slowest of the {what}: throughput / all-DRAM"),
        x_range: None,
        y_range: Some((0.0, 1.1)),
        x_percent: false,
        y_percent: false,
        series: configs
            .iter()
            .map(|c| crate::plot::Series {
                name: c.clone(),
                points: rows
                    .iter()
                    .filter(|r| &r.config == c)
                    .map(|r| (r.n as f64, r.worst_vs_dram))
                    .collect(),
            })
            .collect(),
    }
    .write(plot)?;
    Ok(densities)
}

/// The density experiment.
pub fn density(a: &Common, x: &TenantArgs, host: &Host) -> Result<serde_json::Value> {
    let fits = (x.host_dram / x.tenant_footprint) as usize;
    eprintln!(
        "density: tenants of {} (green workload, {:.0} k accesses/s each) sharing {} of DRAM; all-DRAM fits {fits}",
        bytes(x.tenant_footprint),
        x.tenant_rate / 1e3,
        bytes(x.host_dram)
    );
    let families = Family::all(host);
    let total = a.reps() * x.tenants.len() * families.len();
    let started = Instant::now();
    let mut records: Vec<DensityRun> = Vec::new();
    for rep in 0..a.reps() {
        for &n in &x.tenants {
            for &family in &families {
                if interrupted() {
                    bail!("interrupted; settings restored");
                }
                let each = (family != Family::Dram)
                    .then(|| (x.host_dram / n as u64) / (1 << 20) * (1 << 20));
                let tenants: Vec<(WorkloadArgs, Option<u64>)> = (0..n)
                    .map(|i| {
                        (
                            green_tenant(a, x, x.tenant_rate, (rep * 1000 + i) as u64),
                            each,
                        )
                    })
                    .collect();
                let label = format!(
                    "{} density {n} tenants {}{}",
                    step_label(records.len(), total, started),
                    family.name(),
                    each.map_or(String::new(), |d| format!(", {} each", bytes(d)))
                );
                eprintln!("{label}: running");
                let runs = run_together(family, host, &tenants)?;
                let tp: Vec<f64> = runs.iter().map(|r| r.throughput.unwrap_or(0.0)).collect();
                let killed = runs.iter().filter(|r| r.failed.is_some()).count();
                eprintln!(
                    "{label}: slowest tenant {:.0} k/s, median {:.0} k/s{}, {} pages verified",
                    tp.iter().copied().fold(f64::INFINITY, f64::min) / 1e3,
                    median(tp.clone()) / 1e3,
                    if killed > 0 {
                        format!(", {killed} killed")
                    } else {
                        String::new()
                    },
                    runs.iter().map(|r| r.verified_pages).sum::<u64>()
                );
                records.push(DensityRun {
                    tenants: n,
                    config: family.name().into(),
                    rep,
                    dram_each: each,
                    runs,
                });
            }
        }
    }

    // Per N and configuration: medians over the repetitions.
    let of = |n: usize, f: Family| {
        records
            .iter()
            .filter(move |r| r.tenants == n && r.config == f.name())
    };
    let worst = |r: &DensityRun| {
        r.runs
            .iter()
            .map(|t| t.throughput.unwrap_or(0.0))
            .fold(f64::INFINITY, f64::min)
    };
    let mid = |r: &DensityRun| median(r.runs.iter().map(|t| t.throughput.unwrap_or(0.0)).collect());
    let mut rows = Vec::new();
    println!();
    println!(
        "{:>7} {:<11} {:>10} {:>13} {:>13} {:>12} {:>8} {:>9}",
        "tenants",
        "config",
        "DRAM each",
        "slowest/DRAM",
        "median/DRAM",
        "median k/s",
        "miss",
        "p99 µs"
    );
    for &n in &x.tenants {
        let reference = median(of(n, Family::Dram).map(mid).collect());
        for &f in &families {
            let row = DensityRow {
                tenants: n,
                config: f.name().into(),
                dram_each: of(n, f).next().and_then(|r| r.dram_each),
                worst_vs_dram: median(of(n, f).map(worst).collect()) / reference,
                median_vs_dram: median(of(n, f).map(mid).collect()) / reference,
                median_throughput: median(of(n, f).map(mid).collect()),
                slow_fraction: median(
                    of(n, f)
                        .flat_map(|r| r.runs.iter().map(|t| t.slow_fraction))
                        .collect(),
                ),
                p99_us: median(
                    of(n, f)
                        .flat_map(|r| r.runs.iter().map(|t| t.p99_us))
                        .collect(),
                ),
                killed: of(n, f)
                    .map(|r| r.runs.iter().filter(|t| t.failed.is_some()).count())
                    .sum(),
            };
            println!(
                "{:>7} {:<11} {:>10} {:>12.3}x {:>12.3}x {:>12.0} {:>7.3}% {:>9.1}{}",
                n,
                row.config,
                row.dram_each.map_or("unlimited".into(), bytes),
                row.worst_vs_dram,
                row.median_vs_dram,
                row.median_throughput / 1e3,
                row.slow_fraction * 100.0,
                row.p99_us,
                match (f, row.killed) {
                    (Family::Dram, _) if n > fits => "  (would not fit: reference only)".into(),
                    (_, 0) => String::new(),
                    (_, k) => format!("  ({k} tenant runs killed)"),
                }
            );
            rows.push(row);
        }
    }
    println!();
    println!(
        "all-DRAM fits {fits} tenant{} of {} in {}.",
        if fits == 1 { "" } else { "s" },
        bytes(x.tenant_footprint),
        bytes(x.host_dram)
    );
    let fit_rows: Vec<Fit> = rows
        .iter()
        .map(|r| Fit {
            n: r.tenants,
            config: r.config.clone(),
            worst_vs_dram: r.worst_vs_dram,
            killed: r.killed,
        })
        .collect();
    let densities = report_fits(
        "tenants",
        fits,
        &x.tenants,
        &families
            .iter()
            .filter(|&&f| f != Family::Dram)
            .map(|f| f.name().to_string())
            .collect::<Vec<_>>(),
        &fit_rows,
        format!(
            "memtide bench: density, tenants of {} sharing {} of DRAM",
            bytes(x.tenant_footprint),
            bytes(x.host_dram)
        ),
        &PathBuf::from(format!("{}-density.svg", a.plot.display())),
    )?;
    Ok(serde_json::json!({
        "host_dram": x.host_dram,
        "tenant_footprint": x.tenant_footprint,
        "tenant_rate": x.tenant_rate,
        "all_dram_fits": fits,
        "rows": rows,
        "density": densities,
        "runs": records,
    }))
}

#[derive(Serialize)]
struct NoisyRun {
    config: String,
    beside_neighbour: bool,
    rep: usize,
    sensitive: TenantRun,
    neighbour: Option<TenantRun>,
}

#[derive(Serialize)]
struct NoisyRow {
    config: String,
    alone: f64,
    beside: f64,
    /// The sensitive tenant's throughput beside the streamer against all-DRAM alone.
    beside_vs_dram_alone: f64,
    /// The same against all-DRAM beside the streamer (what is left once CPU and cache
    /// sharing, which all-DRAM suffers too, are taken out).
    beside_vs_dram_beside: f64,
    /// The same tenant beside the streamer against alone, in this placement.
    neighbour_effect: f64,
    p99_alone_us: f64,
    p99_beside_us: f64,
    slow_beside: f64,
    neighbour_throughput: f64,
}

/// The noisy-neighbour experiment.
pub fn noisy(a: &Common, x: &TenantArgs, host: &Host) -> Result<serde_json::Value> {
    let budget =
        ((x.tenant_footprint as f64 * x.tenant_dram / 100.0) as u64).next_multiple_of(1 << 20);
    eprintln!(
        "noisy neighbour: a tenant of {} (green workload, as fast as it can) beside one streaming over {}, each with {} of DRAM",
        bytes(x.tenant_footprint),
        bytes(x.neighbour_footprint),
        bytes(budget)
    );
    let sensitive = |rep: usize| green_tenant(a, x, 0.0, rep as u64);
    // The streamer starts its sweep during the sensitive tenant's warm-up and keeps going
    // past its end.
    let streamer = WorkloadArgs {
        footprint: x.neighbour_footprint,
        hot: 1.0,
        hot_share: 1.0,
        writes: 0.2,
        seconds: a.seconds + 2.0,
        warmup: a.warmup,
        threads: 1,
        rate: 0.0,
        scan: true,
        contents: crate::workload::Contents::default(),
        seed: 7,
    };
    let families = Family::all(host);
    let total = a.reps() * families.len() * 2;
    let started = Instant::now();
    let mut records: Vec<NoisyRun> = Vec::new();
    for rep in 0..a.reps() {
        for &family in &families {
            for beside in [false, true] {
                if interrupted() {
                    bail!("interrupted; settings restored");
                }
                let dram = (family != Family::Dram).then_some(budget);
                let mut tenants = vec![(sensitive(rep), dram)];
                if beside {
                    tenants.push((streamer.clone(), dram));
                }
                let label = format!(
                    "{} noisy {} {}",
                    step_label(records.len(), total, started),
                    family.name(),
                    if beside {
                        "beside the streamer"
                    } else {
                        "alone"
                    }
                );
                eprintln!("{label}: running");
                let mut runs = run_together(family, host, &tenants)?.into_iter();
                let s = runs.next().expect("sensitive tenant");
                let n = runs.next();
                eprintln!(
                    "{label}: {:.0} k accesses/s, p99 {:.1} µs{}",
                    s.throughput.unwrap_or(0.0) / 1e3,
                    s.p99_us,
                    n.as_ref().map_or(String::new(), |n| format!(
                        "; streamer {:.0} k/s",
                        n.throughput.unwrap_or(0.0) / 1e3
                    ))
                );
                records.push(NoisyRun {
                    config: family.name().into(),
                    beside_neighbour: beside,
                    rep,
                    sensitive: s,
                    neighbour: n,
                });
            }
        }
    }
    let med = |f: Family, beside: bool, g: &dyn Fn(&NoisyRun) -> f64| {
        median(
            records
                .iter()
                .filter(|r| r.config == f.name() && r.beside_neighbour == beside)
                .map(g)
                .collect(),
        )
    };
    let tp = |r: &NoisyRun| r.sensitive.throughput.unwrap_or(0.0);
    let dram_alone = med(Family::Dram, false, &tp);
    let dram_beside = med(Family::Dram, true, &tp);
    println!();
    println!(
        "{:<16} {:>10} {:>11} {:>13} {:>13} {:>10} {:>16} {:>8} {:>13}",
        "config",
        "alone k/s",
        "beside k/s",
        "vs DRAM alone",
        "vs DRAM besd",
        "neighbour",
        "p99 µs alone/bes",
        "miss",
        "streamer k/s"
    );
    let mut rows = Vec::new();
    for &f in &families {
        let name = match f {
            Family::Dram => f.name().to_string(),
            _ => format!("{} {:.0}%", f.name(), x.tenant_dram),
        };
        let (alone, beside) = (med(f, false, &tp), med(f, true, &tp));
        let row = NoisyRow {
            config: name,
            alone,
            beside,
            beside_vs_dram_alone: beside / dram_alone,
            beside_vs_dram_beside: beside / dram_beside,
            neighbour_effect: beside / alone,
            p99_alone_us: med(f, false, &|r| r.sensitive.p99_us),
            p99_beside_us: med(f, true, &|r| r.sensitive.p99_us),
            slow_beside: med(f, true, &|r| r.sensitive.slow_fraction),
            neighbour_throughput: med(f, true, &|r| {
                r.neighbour
                    .as_ref()
                    .and_then(|n| n.throughput)
                    .unwrap_or(0.0)
            }),
        };
        println!(
            "{:<16} {:>10.0} {:>11.0} {:>12.3}x {:>12.3}x {:>9.3}x {:>7.1} / {:>6.1} {:>7.3}% {:>13.0}",
            row.config,
            row.alone / 1e3,
            row.beside / 1e3,
            row.beside_vs_dram_alone,
            row.beside_vs_dram_beside,
            row.neighbour_effect,
            row.p99_alone_us,
            row.p99_beside_us,
            row.slow_beside * 100.0,
            row.neighbour_throughput / 1e3
        );
        rows.push(row);
    }
    println!("(beside the streamer: against all-DRAM alone and all-DRAM beside the streamer; neighbour: beside / alone in the same placement)");
    Ok(serde_json::json!({
        "tenant_footprint": x.tenant_footprint,
        "neighbour_footprint": x.neighbour_footprint,
        "dram_each": budget,
        "rows": rows,
        "runs": records,
    }))
}
