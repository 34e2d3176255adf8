//! `memtide sim`: replays a synthetic access profile under several DRAM sizes and policies on
//! all cores, prints misses (and their ratio to Belady's optimum) and an estimated slowdown, and
//! writes JSON for scripts. Entry point: [`sim`].

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::Args;
use memtide_engine::size;
use memtide_sim::trace::{Record, Writer};
use memtide_sim::{simulate, Job, Latency, Source, Spec, Trace, ALL_POLICIES, KNOWN_POLICIES};

use memtide_bench::opts;

#[derive(Args, Debug)]
pub struct SimArgs {
    /// The access profile: KIND:key=value,... with KIND uniform, zipf (skew), hotcold (hot,
    /// share), scan (hot, share), phases (hot, share, phases), tiles (n tenants of `footprint`
    /// each, `active` fraction used, `noisy` of them streaming), active (active, skew, cold:
    /// one tenant's profile); keys footprint, accesses, warmup (accesses not counted), writes,
    /// seed, fill. Example: zipf:footprint=64GiB,skew=0.99,accesses=200M
    #[arg(long, required_unless_present = "trace", conflicts_with = "trace")]
    pub workload: Option<String>,
    /// Replay a recorded trace (.mtt) instead of a synthetic workload.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Write the synthetic workload's accesses as a trace (.mtt) to this file.
    #[arg(long, requires = "workload")]
    pub save_trace: Option<PathBuf>,
    /// DRAM sizes to try: percentages of the footprint or sizes, comma-separated (25%,50%,4GiB).
    #[arg(long, value_delimiter = ',', default_value = "25%,50%,75%")]
    pub dram: Vec<String>,
    /// Policies, comma-separated, or `all`: memtide, lru, clock, lfu, opt; and memory-mode, a
    /// direct-mapped DRAM cache in front of the slow tier (not in `all`).
    #[arg(long, value_delimiter = ',', default_value = "all")]
    pub policy: Vec<String>,
    /// Cost of an access from DRAM, including the program's own work per access.
    #[arg(long, value_parser = opts::latency_ns, default_value = "100ns")]
    pub dram_latency: f64,
    /// Cost of a tier-1 miss (fault + read + map).
    #[arg(long, value_parser = opts::latency_ns, default_value = "80us")]
    pub tier_latency: f64,
    /// Accesses per second the program makes at full (all-DRAM) speed, for the tier-1
    /// bandwidth columns (default: one per --dram-latency).
    #[arg(long, value_parser = opts::rate)]
    pub rate: Option<f64>,
    /// Cost of a soft fault on memtide's inactive list.
    #[arg(long, value_parser = opts::latency_ns, default_value = "6us")]
    pub soft_latency: f64,
    /// Take the tier latency from a `memtide probe --json` result (its read p50 plus memtide's
    /// fault handling) instead of --tier-latency.
    #[arg(long)]
    pub probe: Option<PathBuf>,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Where a sweep (two or more DRAM sizes) draws loss vs DRAM per policy, as SVG.
    #[arg(long, default_value = "memtide-sim.svg")]
    pub plot: PathBuf,
}

fn parse_dram(s: &str, pages: u64) -> Result<u64> {
    let t = s.trim();
    let bytes = if let Some(p) = t.strip_suffix('%') {
        let pct: f64 = p
            .trim()
            .parse()
            .ok()
            .filter(|v: &f64| *v > 0.0 && v.is_finite())
            .with_context(|| format!("--dram {s}: not a percentage"))?;
        if pct > 100.0 {
            bail!("--dram {s} is larger than the footprint");
        }
        return Ok(((pages as f64 * pct / 100.0) as u64).max(1));
    } else {
        size::parse(t).map_err(|e| anyhow::anyhow!("--dram: {e}"))?
    };
    let p = bytes / 4096;
    if p == 0 {
        bail!("--dram {s} is less than one page");
    }
    if p > pages {
        bail!(
            "--dram {s} is larger than the footprint ({})",
            size::format(pages * 4096)
        );
    }
    Ok(p)
}

pub fn sim(a: SimArgs) -> Result<ExitCode> {
    let (spec, label) = match (&a.workload, &a.trace) {
        (Some(w), _) => {
            let s = Spec::parse(w, 4096, |v| size::parse(v).ok())
                .map_err(|e| anyhow::anyhow!("--workload: {e}"))?;
            let label = s.to_string();
            (Source::Spec(s), label)
        }
        (None, Some(p)) => {
            let data =
                std::fs::read(p).with_context(|| format!("cannot read trace {}", p.display()))?;
            let t = Trace::parse(data).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
            let label = format!(
                "trace {}: {} records, {} tenants, {} pages",
                p.display(),
                t.records,
                t.tenant_pages.len(),
                t.tenant_pages.iter().sum::<u64>()
            );
            (Source::Trace(t), label)
        }
        (None, None) => bail!("give --workload or --trace"),
    };
    let pages = spec.pages();
    if pages == 0 {
        bail!("the trace touches no pages");
    }
    if pages > u32::MAX as u64 {
        bail!("the footprint is larger than 16 TiB, the simulator's limit");
    }
    if let (Some(path), Source::Spec(s)) = (&a.save_trace, &spec) {
        let f = std::fs::File::create(path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        let mut w = Writer::new(std::io::BufWriter::new(f), 4096)?;
        for (i, (page, write)) in s.generator().enumerate() {
            w.record(Record {
                time_ns: i as u64 * 100,
                tenant: 0,
                page,
                write,
            })?;
        }
        w.finish()?;
    }
    let sizes: Vec<u64> = a
        .dram
        .iter()
        .map(|d| parse_dram(d, pages))
        .collect::<Result<_>>()?;
    let mut policies: Vec<String> = Vec::new();
    for p in &a.policy {
        if p == "all" {
            policies.extend(ALL_POLICIES.iter().map(|s| s.to_string()));
        } else if KNOWN_POLICIES.contains(&p.as_str()) {
            policies.push(p.clone());
        } else {
            bail!("--policy: unknown policy `{p}`: choose from memtide, lru, clock, lfu, opt, memory-mode, all");
        }
    }
    policies.dedup();
    let tier_ns = match &a.probe {
        Some(p) => {
            let r = memtide_bench::probe::ProbeReport::load(p)?;
            eprintln!(
                "tier latency {:.0} µs from {} ({} read p50 {:.0} µs + fault handling)",
                r.tier_latency_us,
                p.display(),
                r.path,
                r.read_qd1.p50_us
            );
            r.tier_latency_us * 1e3
        }
        None => a.tier_latency,
    };
    let lat = Latency {
        dram_ns: a.dram_latency.max(1e-3),
        tier_ns,
        soft_ns: a.soft_latency,
    };
    let jobs: Vec<Job> = sizes
        .iter()
        .flat_map(|&d| {
            policies.iter().map(move |p| Job {
                policy: p.clone(),
                dram_pages: d,
            })
        })
        .collect();
    eprintln!("memtide sim: {label}");
    let tty = std::io::stderr().is_terminal();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let start = std::time::Instant::now();
    let out = simulate(&spec, &jobs, &lat, threads, &|done, total| {
        if tty {
            eprint!(
                "\r{} {done}/{total} replays",
                memtide_bench::report::bar(done, total)
            );
            let _ = std::io::stderr().flush();
        }
    })?;
    let secs = start.elapsed().as_secs_f64();
    if tty {
        eprintln!();
    }
    // Tier-1 traffic: misses read a page, write-backs write one, at the access rate the
    // program keeps once slowed down.
    let full_rate = a.rate.unwrap_or(1e9 / lat.dram_ns);
    let bandwidth = |events: u64, o: &memtide_sim::Outcome| -> f64 {
        let rate = full_rate / o.slowdown(&lat);
        events as f64 / o.accesses.max(1) as f64 * rate * 4096.0 / 1e6
    };
    println!(
        "{:<10} {:<8} {:>12} {:>9} {:>8} {:>11} {:>11} {:>9} {:>7} {:>9} {:>9}",
        "DRAM",
        "policy",
        "misses",
        "miss %",
        "vs OPT",
        "soft faults",
        "writebacks",
        "slowdown",
        "loss",
        "read MB/s",
        "write MB/s"
    );
    let mut rows = Vec::new();
    for &d in &sizes {
        let opt = out
            .iter()
            .find(|o| o.policy == "opt" && o.dram_pages == d.min(pages))
            .map(|o| o.misses);
        for o in out.iter().filter(|o| o.dram_pages == d.min(pages)) {
            let vs_opt = opt.map(|m| match (m, o.misses) {
                (0, 0) => 1.0,
                (0, _) => f64::INFINITY,
                (m, x) => x as f64 / m as f64,
            });
            let slow = o.slowdown(&lat);
            println!(
                "{:<10} {:<8} {:>12} {:>8.3}% {:>8} {:>11} {:>11} {:>8.2}x {:>6.1}% {:>9.1} {:>10.1}",
                size::format(d * 4096),
                o.policy,
                o.misses,
                o.miss_ratio() * 100.0,
                vs_opt.map_or("-".into(), |v| format!("{v:.2}x")),
                o.soft_faults,
                o.writebacks,
                slow,
                (1.0 - 1.0 / slow) * 100.0,
                bandwidth(o.misses, o),
                bandwidth(o.writebacks, o)
            );
            if o.tenant_accesses.len() > 1 {
                let per: Vec<String> = (0..o.tenant_accesses.len())
                    .map(|t| format!("t{t} {:.2}x", o.tenant_slowdown(t, &lat)))
                    .collect();
                println!("{:<10} {:<8}   per tenant: {}", "", "", per.join("  "));
            }
            rows.push(serde_json::json!({
                "dram_bytes": d * 4096,
                "dram_fraction": d as f64 / pages as f64,
                "outcome": o,
                "misses_vs_opt": vs_opt,
                "slowdown": slow,
                "tier_read_mb_per_sec": bandwidth(o.misses, o),
                "tier_write_mb_per_sec": bandwidth(o.writebacks, o),
            }));
        }
    }
    if sizes.len() >= 2 {
        let series = policies
            .iter()
            .map(|p| {
                let mut points: Vec<(f64, f64)> = out
                    .iter()
                    .filter(|o| &o.policy == p)
                    .map(|o| {
                        let slow = o.slowdown(&lat);
                        (o.dram_pages as f64 / pages as f64, 1.0 - 1.0 / slow)
                    })
                    .collect();
                points.sort_by(|a, b| a.0.total_cmp(&b.0));
                memtide_bench::plot::Series {
                    name: p.clone(),
                    points,
                }
            })
            .collect();
        memtide_bench::plot::Chart::loss_vs_dram(
            format!("Estimated loss vs DRAM — {label}"),
            "DRAM, fraction of the footprint",
            series,
        )
        .write(&a.plot)?;
    }
    // Bytes of state per page, the most any size needed, per policy.
    let state: Vec<String> = policies
        .iter()
        .filter_map(|p| {
            let b = out
                .iter()
                .filter(|o| &o.policy == p)
                .map(|o| o.state_bytes)
                .max()?;
            (b > 0).then(|| format!("{p} {:.1}", b as f64 / pages as f64))
        })
        .collect();
    if !state.is_empty() {
        eprintln!("simulator state, bytes per page: {}", state.join(", "));
    }
    // Every replay also replays the fill pass and the warm-up, uncounted.
    let uncounted = match &spec {
        Source::Spec(s) => (if s.fill { s.pages } else { 0 }) + s.warmup,
        Source::Trace(_) => 0,
    };
    let total: u64 = out.iter().map(|o| o.accesses + uncounted).sum();
    eprintln!(
        "{} replays, {:.0} M simulated accesses in {secs:.1} s ({:.1} M/s on {threads} threads)",
        out.len(),
        total as f64 / 1e6,
        total as f64 / secs / 1e6
    );
    if let Some(p) = &a.json {
        let json = serde_json::json!({
            "workload": label,
            "pages": pages,
            "latency": lat,
            "rate": full_rate,
            "results": rows,
        });
        memtide_bench::report::write_json(p, &json)?;
    }
    Ok(ExitCode::SUCCESS)
}
