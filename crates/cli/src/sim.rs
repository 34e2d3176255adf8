//! `memtide sim`: replays a synthetic access profile under several DRAM sizes and policies on
//! all cores, prints misses (and their ratio to Belady's optimum) and an estimated slowdown, and
//! writes JSON for scripts. Entry point: [`sim`].

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::Args;
use memtide_engine::size;
use memtide_sim::import::{self, Format};
use memtide_sim::trace::{Record, Writer};
use memtide_sim::{corpus, simulate, Job, Latency, Source, Spec, ALL_POLICIES, KNOWN_POLICIES};

use memtide_launch::opts;

#[derive(Args, Debug)]
pub struct SimArgs {
    /// The access profile: KIND:key=value,... with KIND uniform, zipf (skew), hotcold (hot,
    /// share), scan (hot, share), phases (hot, share, phases), tiles (n tenants of `footprint`
    /// each, `active` fraction used, `noisy` of them streaming), active (active, skew, cold:
    /// one tenant's profile); keys footprint, accesses, warmup (accesses not counted), writes,
    /// seed, fill. Example: zipf:footprint=64GiB,skew=0.99,accesses=200M
    #[arg(
        long,
        required_unless_present_any = ["trace", "corpus"],
        conflicts_with_all = ["trace", "corpus"]
    )]
    pub workload: Option<String>,
    /// Compare memtide's policy with the online policies (lru, clock, arc, 2q, s3fifo, sieve)
    /// on the built-in corpus: zipf at four skews, three hot/cold splits, two active-memory
    /// profiles, a moving hot set, a hot set with a scan, uniform; each at every --dram
    /// (default here 10%,25%,50%,75%), after a warm-up. Prints memtide's misses against the
    /// best online policy's on every row, at the same DRAM (placement-exact), and as the engine
    /// runs it, with its headroom below the quota (placement).
    #[arg(long, conflicts_with = "trace")]
    pub corpus: bool,
    /// With --corpus: each workload's footprint (default 1GiB), counted accesses (default 5M)
    /// and uncounted warm-up (default 5M).
    #[arg(long)]
    pub corpus_footprint: Option<String>,
    #[arg(long)]
    pub corpus_accesses: Option<String>,
    #[arg(long)]
    pub corpus_warmup: Option<String>,
    /// With --corpus: replay every family with seeds 1..=N (default 1) and compare misses
    /// summed over them; each row then says whether memtide's excess over the best policy is
    /// beyond twice its standard error across the seeds (the `2se` column), and so more than
    /// the noise of one run.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1000))]
    pub corpus_seeds: Option<u64>,
    /// Replay a recorded trace instead of a synthetic workload: memtide's .mtt, libCacheSim's
    /// oracleGeneral (uncompressed), or CSV (see --trace-format).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// The trace's format: auto (the .mtt header, a .csv name, or oracleGeneral in the name),
    /// mtt, oracle-general, or csv: one access per line, `id` or `time,id,...`, or a header
    /// naming an obj_id, id, key, page or addr column (addr: a byte address) and optionally an
    /// op column marking writes. Each distinct object is one page; sizes are ignored.
    #[arg(long, value_parser = trace_format)]
    pub trace_format: Option<TraceFormat>,
    /// Write the synthetic workload's accesses as a trace (.mtt) to this file.
    #[arg(long)]
    pub save_trace: Option<PathBuf>,
    /// DRAM sizes to try: percentages of the footprint or sizes, comma-separated (25%,50%,4GiB).
    #[arg(long, value_delimiter = ',')]
    pub dram: Vec<String>,
    /// Policies, comma-separated, or `all`: placement (memtide's placement queues, seeing only
    /// the faults the engine sees), lru, clock, arc, 2q, s3fifo, sieve (each sees every access),
    /// lfu (exact), gclock (LFU with aging), opt (Belady, offline); not in `all`: memory-mode (a
    /// direct-mapped DRAM cache in front of the slow tier), placement-exact (placement with
    /// exactly --dram pages in use, as the others have; placement keeps the engine's 1-2 MiB of
    /// headroom below the quota) and sweep (the engine's default, its CLOCK sweep over page
    /// histories). placement and sweep model the engine, so they run from 64 KiB of DRAM up, as
    /// the engine does. Older names: memtide (placement), memtide-exact, memtide-v1 (sweep).
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
    /// Model memtide's compressed level: the share of each --dram its pool takes (6.25%, a
    /// sixteenth, is the engine's default; 0 for none), comma-separated to compare splits.
    /// Pages leaving DRAM go into the pool, which holds --ratio pages per page of its DRAM,
    /// and on to the file when it is full, oldest first; a miss on a page still in the pool
    /// costs --compressed-latency instead of --tier-latency. (opt and memory-mode keep no pool.)
    #[arg(long, value_delimiter = ',', value_parser = share)]
    pub compressed: Vec<f64>,
    /// How the modelled pool is sized, as `memtide run --compressed-sizing`: `fixed` (each
    /// --compressed share, all along) or `adaptive` (from a sixteenth of --dram, once per 2 s
    /// of the replay's estimated time a thirty-second up or two down, by the engine's own
    /// rule, up to the --compressed share, default half, at most three quarters: the table's
    /// pool column shows where it ended). Adaptive replays the engine's policies only: placement,
    /// placement-exact, sweep.
    #[arg(long, value_parser = opts::pool_sizing, default_value = "fixed", value_name = "HOW")]
    pub compressed_sizing: opts::PoolSizing,
    /// With --compressed: pages the pool holds per page of its DRAM (the engine's `--stats`
    /// show it as compressed_pages over compressed_pool_bytes; about 1.8 for pages that lz4
    /// halves, 1 for incompressible ones).
    /// [default: what the recording's pool held, for a trace of `memtide run --record`; else 2]
    #[arg(long, value_parser = ratio)]
    pub ratio: Option<f64>,
    /// With --compressed: cost of a miss served from the pool (fault, decompression, map).
    /// [default: the recording's median pool fault, for a trace of `memtide run --record`;
    /// else 15us]
    #[arg(long, value_parser = opts::latency_ns)]
    pub compressed_latency: Option<f64>,
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
    /// Where a sweep (two or more DRAM sizes) draws loss vs DRAM per policy, as SVG (default
    /// memtide-sim.svg).
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

/// A `--compressed` share: a percentage (6.25%) or a fraction (0.0625) of --dram, below 100%.
fn share(s: &str) -> Result<f64, String> {
    let t = s.trim();
    let v = match t.strip_suffix('%') {
        Some(p) => p.trim().parse::<f64>().map(|v| v / 100.0),
        None => t.parse::<f64>(),
    }
    .map_err(|_| format!("`{s}`: give a share of --dram, as 6.25% or 0.0625"))?;
    if !(0.0..1.0).contains(&v) {
        return Err(format!(
            "`{s}`: the pool's share of --dram must be at least 0 and below 100%"
        ));
    }
    Ok(v)
}

fn ratio(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if (1.0..=64.0).contains(&v) => Ok(v),
        _ => Err(format!("`{s}`: give pages per page of pool, from 1 to 64")),
    }
}

/// A `--trace-format`: a format, or none to tell it from the file.
#[derive(Clone, Copy, Debug)]
pub struct TraceFormat(Option<Format>);

fn trace_format(s: &str) -> Result<TraceFormat, String> {
    Format::parse(s)
        .map(TraceFormat)
        .ok_or_else(|| format!("`{s}`: choose auto, mtt, oracle-general or csv"))
}

/// The latency model: the options, with the tier's latency from a probe result if given.
fn latency(a: &SimArgs) -> Result<Latency> {
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
    Ok(Latency {
        dram_ns: a.dram_latency.max(1e-3),
        tier_ns,
        soft_ns: a.soft_latency,
        compressed_ns: a.compressed_latency.unwrap_or(15_000.0),
    })
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

pub fn sim(mut a: SimArgs) -> Result<ExitCode> {
    // Options that belong to another one. (clap's `requires` is not checked when the option
    // required conflicts with one given, as --workload, --trace and --corpus all do: so here.)
    if a.trace_format.is_some() && a.trace.is_none() {
        bail!("--trace-format describes a --trace file; a --workload has no format");
    }
    if a.save_trace.is_some() && a.workload.is_none() {
        bail!("--save-trace writes the accesses of a --workload");
    }
    let corpus_sizes = [&a.corpus_footprint, &a.corpus_accesses, &a.corpus_warmup];
    if !a.corpus && (corpus_sizes.iter().any(|o| o.is_some()) || a.corpus_seeds.is_some()) {
        bail!(
            "--corpus-footprint, --corpus-accesses, --corpus-warmup and --corpus-seeds shape --corpus"
        );
    }
    if a.corpus {
        // The corpus compares every online policy on its rows and draws nothing.
        if a.plot.is_some() {
            bail!("--plot draws a sweep of a --workload or --trace; --corpus has no plot (--json writes its rows)");
        }
        if a.policy != ["all"] {
            bail!("--policy chooses what a --workload or --trace replays; --corpus always compares memtide with every online policy");
        }
        if !a.compressed.is_empty() || a.ratio.is_some() || a.compressed_latency.is_some() {
            bail!("--compressed, --ratio and --compressed-latency model a pool for a --workload or --trace; --corpus compares policies without one");
        }
        return corpus(&a);
    }
    if a.dram.is_empty() {
        a.dram = vec!["25%".into(), "50%".into(), "75%".into()];
    }
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
            let t = import::load(p, data, a.trace_format.and_then(|f| f.0))
                .map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
            let mut label = format!(
                "trace {}: {} records, {} tenants, {} pages",
                p.display(),
                t.records,
                t.tenant_pages.len(),
                t.tenant_pages.iter().sum::<u64>()
            );
            if let Some([_, dram, pool, file]) = t.levels {
                label += &format!(
                    "; as recorded, {dram} first touches and hint faults, {pool} from the compressed pool, {file} from the file"
                );
            }
            if let Some(p) = t.pool {
                label += &format!(
                    "; its pool held {:.2} pages per page of DRAM, a pool fault took {:.1} µs (p50)",
                    p.ratio,
                    p.fault_ns / 1e3
                );
            }
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
        let p = &memtide_sim::policy_name(p).to_string();
        if p == "all" {
            policies.extend(ALL_POLICIES.iter().map(|s| s.to_string()));
        } else if KNOWN_POLICIES.contains(&p.as_str()) {
            policies.push(p.clone());
        } else {
            bail!(
                "--policy: unknown policy `{p}`: choose from {}, all",
                KNOWN_POLICIES.join(", ")
            );
        }
    }
    // Once each, in the order given (an older name and its new one are the same policy).
    let mut seen = std::collections::HashSet::new();
    policies.retain(|p| seen.insert(p.clone()));
    let mut lat = latency(&a)?;
    // A recording's pool measured its own ratio and fault time: the defaults for its replay.
    let recorded = match &spec {
        Source::Trace(t) => t.pool,
        Source::Spec(_) => None,
    };
    let recorded_ratio = recorded.filter(|_| a.ratio.is_none()).map(|p| p.ratio);
    let recorded_ns = recorded
        .filter(|p| a.compressed_latency.is_none() && p.fault_ns > 0.0)
        .map(|p| p.fault_ns);
    if let Some(ns) = recorded_ns {
        lat.compressed_ns = ns;
    }
    // `placement` and `sweep` model the engine, which takes no quota under 64 KiB.
    let engine_modelled = |p: &str| p == "placement" || p == "sweep";
    for &d in &sizes {
        if d < ENGINE_MIN_PAGES && policies.iter().any(|p| engine_modelled(p)) {
            eprintln!(
                "memtide sim: placement and sweep are not simulated at {}: the engine's DRAM quota is at least 64 KiB ({ENGINE_MIN_PAGES} pages); placement-exact is",
                size::format(d * 4096)
            );
        }
    }
    let adaptive = a.compressed_sizing == opts::PoolSizing::Adaptive;
    let shares: Vec<f64> = match (a.compressed.is_empty(), adaptive) {
        (true, false) => vec![0.0],
        // A pool that sizes itself grows to half of --dram unless told otherwise.
        (true, true) => vec![0.5],
        (false, _) => a.compressed.clone(),
    };
    if adaptive {
        if shares.contains(&0.0) {
            bail!("--compressed-sizing adaptive sizes a pool: give --compressed shares above 0 (the most it may take)");
        }
        let others: Vec<&str> = policies
            .iter()
            .map(String::as_str)
            .filter(|p| !memtide_sim::SIZABLE_POLICIES.contains(p))
            .collect();
        if !others.is_empty() {
            bail!(
                "--compressed-sizing adaptive replays the engine's policies only: give --policy {} (not {})",
                memtide_sim::SIZABLE_POLICIES.join(","),
                others.join(", ")
            );
        }
    }
    let leveled = shares.iter().any(|&s| s > 0.0);
    if !leveled && (a.ratio.is_some() || a.compressed_latency.is_some()) {
        bail!("--ratio and --compressed-latency describe the pool of --compressed");
    }
    let ratio = a.ratio.or(recorded_ratio).unwrap_or(2.0);
    if leveled {
        let mut taken = Vec::new();
        if let Some(r) = recorded_ratio {
            taken.push(format!(
                "the pool holds {r:.2} pages per page of DRAM (--ratio sets another)"
            ));
        }
        if let Some(ns) = recorded_ns {
            taken.push(format!(
                "a pool miss costs {:.1} µs, the engine's own time in the fault without its wake-ups (--compressed-latency sets another)",
                ns / 1e3
            ));
        }
        if !taken.is_empty() {
            eprintln!(
                "memtide sim: as the recording measured, {}",
                taken.join("; ")
            );
        }
    }
    let jobs: Vec<Job> = sizes
        .iter()
        .flat_map(|&d| {
            let shares = shares.clone();
            policies
                .iter()
                .filter(move |p| d >= ENGINE_MIN_PAGES || !engine_modelled(p))
                .flat_map(move |p| {
                    // opt and memory-mode keep no pool: once each.
                    let kept = if p != "opt" && p != "memory-mode" {
                        shares.clone()
                    } else {
                        vec![0.0]
                    };
                    kept.into_iter().map(move |s| Job {
                        pool_pages: (d.min(pages) as f64 * s) as u64,
                        pool_share: s,
                        ratio,
                        adaptive,
                        ..Job::new(p.clone(), d)
                    })
                })
        })
        .collect();
    if jobs.is_empty() {
        bail!("nothing to simulate: give --dram 64KiB or more for placement and sweep");
    }
    eprintln!("memtide sim: {label}");
    let tty = std::io::stderr().is_terminal();
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(jobs.len())
        .max(1);
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
    // The policy column fits the longest name (placement-exact).
    let pw = out
        .iter()
        .map(|o| o.policy.len())
        .max()
        .unwrap_or(0)
        .max(10);
    // With --compressed: the pool's share of DRAM and the misses it served.
    let pool_share = |o: &memtide_sim::Outcome| {
        if o.pool_pages == 0 {
            "-".to_string()
        } else {
            format!(
                "{:.1}%",
                o.pool_pages as f64 * 100.0 / o.dram_pages.max(1) as f64
            )
        }
    };
    let pool_head = if leveled {
        format!(" {:>6} {:>12}", "pool", "from pool")
    } else {
        String::new()
    };
    let pool_row = |o: &memtide_sim::Outcome, share: String| {
        if leveled {
            format!(" {share:>6} {:>12}", o.compressed_hits)
        } else {
            String::new()
        }
    };
    println!(
        "{:<10} {:<pw$}{pool_head} {:>12} {:>9} {:>10} {:>8} {:>11} {:>11} {:>9} {:>7} {:>9} {:>9}",
        "DRAM",
        "policy",
        "misses",
        "miss %",
        "+1st tch %",
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
                "{:<10} {:<pw$}{} {:>12} {:>8.3}% {:>9.3}% {:>8} {:>11} {:>11} {:>8.2}x {:>6.1}% {:>9.1} {:>10.1}",
                size::format(d * 4096),
                o.policy,
                pool_row(o, pool_share(o)),
                o.misses,
                o.miss_ratio() * 100.0,
                o.miss_ratio_with_first_touches() * 100.0,
                vs_opt.map_or("-".into(), |v| format!("{v:.2}x")),
                o.soft_faults,
                o.writebacks,
                slow,
                (1.0 - 1.0 / slow) * 100.0,
                bandwidth(o.file_misses(), o),
                bandwidth(o.writebacks, o)
            );
            if adaptive && o.pool_share > 0.0 {
                println!(
                    "{:<10} {:<pw$}   pool sized itself: {} steps up, {} down, at most {:.1}% of DRAM",
                    "",
                    "",
                    o.pool_grows,
                    o.pool_shrinks,
                    memtide_sim::adaptive_pool_most(
                        o.dram_pages,
                        (o.dram_pages as f64 * o.pool_share) as u64
                    ) as f64
                        * 100.0
                        / o.dram_pages.max(1) as f64
                );
            }
            if o.tenant_accesses.len() > 1 {
                let per: Vec<String> = (0..o.tenant_accesses.len())
                    .map(|t| format!("t{t} {:.2}x", o.tenant_slowdown(t, &lat)))
                    .collect();
                println!("{:<10} {:<pw$}   per tenant: {}", "", "", per.join("  "));
            }
            rows.push(serde_json::json!({
                "dram_bytes": d * 4096,
                "dram_fraction": d as f64 / pages as f64,
                "outcome": o,
                "miss_ratio": o.miss_ratio(),
                "miss_ratio_with_first_touches": o.miss_ratio_with_first_touches(),
                "misses_vs_opt": vs_opt,
                "slowdown": slow,
                "tier_read_mb_per_sec": bandwidth(o.file_misses(), o),
                "tier_write_mb_per_sec": bandwidth(o.writebacks, o),
            }));
        }
    }
    if sizes.len() >= 2 {
        // One line per policy, and per pool share when several are compared.
        let mut lines: Vec<(String, f64)> = Vec::new();
        for o in &out {
            if !lines
                .iter()
                .any(|(p, s)| *p == o.policy && *s == o.pool_share)
            {
                lines.push((o.policy.clone(), o.pool_share));
            }
        }
        let series = lines
            .iter()
            .map(|(p, share)| {
                let mut points: Vec<(f64, f64)> = out
                    .iter()
                    .filter(|o| &o.policy == p && o.pool_share == *share)
                    .map(|o| {
                        let slow = o.slowdown(&lat);
                        (o.dram_pages as f64 / pages as f64, 1.0 - 1.0 / slow)
                    })
                    .collect();
                points.sort_by(|a, b| a.0.total_cmp(&b.0));
                memtide_bench::plot::Series {
                    name: if leveled {
                        format!("{p}, pool {:.1}%", share * 100.0)
                    } else {
                        p.clone()
                    },
                    points,
                }
            })
            .collect();
        memtide_bench::plot::Chart::loss_vs_dram(
            format!("Estimated loss vs DRAM — {label}"),
            "DRAM, fraction of the footprint",
            series,
        )
        .write(a.plot.as_deref().unwrap_or(Path::new("memtide-sim.svg")))?;
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
        "{} replay{}, {:.0} M simulated accesses in {secs:.1} s ({:.1} M/s on {threads} thread{})",
        out.len(),
        if out.len() == 1 { "" } else { "s" },
        total as f64 / 1e6,
        total as f64 / secs / 1e6,
        if threads == 1 { "" } else { "s" }
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

/// The engine's smallest DRAM quota, in pages (64 KiB).
const ENGINE_MIN_PAGES: u64 = 16;

/// A corpus row's workload without its size (the same on every row): the text before
/// ", N pages", cut to the column's width.
fn short_label(label: &str) -> String {
    let end = label
        .match_indices(", ")
        .find(|(at, _)| {
            let rest = &label[at + 2..];
            let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
            digits > 0 && rest[digits..].starts_with(" pages")
        })
        .map_or(label.len(), |(at, _)| at);
    label[..end].chars().take(44).collect()
}

fn corpus(a: &SimArgs) -> Result<ExitCode> {
    let drams: Vec<String> = if a.dram.is_empty() {
        ["10%", "25%", "50%", "75%"].map(String::from).to_vec()
    } else {
        a.dram.clone()
    };
    let lat = latency(a)?;
    let seeds = a.corpus_seeds.unwrap_or(1);
    let params = corpus::Params {
        footprint: a.corpus_footprint.clone().unwrap_or("1GiB".into()),
        accesses: a.corpus_accesses.clone().unwrap_or("5M".into()),
        warmup: a.corpus_warmup.clone().unwrap_or("5M".into()),
        seeds,
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    println!(
        "{:<44} {:>5} {:>8} {:>9} {:>9} {:>8} {:>8} {:>7} {:>7}{}",
        "workload",
        "DRAM",
        "best",
        "best %",
        "memtide %",
        "ratio",
        "soft/acc",
        "time",
        "engine",
        if seeds > 1 { "     2se" } else { "" }
    );
    let start = std::time::Instant::now();
    let mut rows = Vec::new();
    let sizes = |pages: u64| -> Result<Vec<u64>, String> {
        drams
            .iter()
            .map(|d| parse_dram(d, pages).map_err(|e| e.to_string()))
            .collect()
    };
    let sum = corpus::run(
        &params,
        &lat,
        |v| size::parse(v).ok(),
        sizes,
        |r| {
            let soft = r.memtide.soft_faults as f64 / r.memtide.accesses.max(1) as f64;
            println!(
                "{:<44} {:>5} {:>8} {:>8.3}% {:>8.3}% {:>7.3}x {:>7.1}% {:>6.3}x {:>6.3}x{}",
                short_label(&r.label),
                format!("{:.0}%", r.dram_fraction * 100.0),
                r.best.policy,
                r.best.miss_ratio() * 100.0,
                r.memtide.miss_ratio() * 100.0,
                r.memtide_vs_best,
                soft * 100.0,
                r.time_vs_best,
                r.engine_vs_best,
                match (seeds > 1, r.beyond_noise) {
                    (false, _) => String::new(),
                    (true, sig) => format!(" {:>6.3}{}", r.noise, if sig { "!" } else { "" }),
                }
            );
            rows.push(serde_json::json!({
                "workload": r.label,
                "dram_fraction": r.dram_fraction,
                "outcomes": r.outcomes,
                "best_online": r.best.policy,
                "memtide_vs_best": r.memtide_vs_best,
                "memtide_time_vs_best": r.time_vs_best,
                "engine_vs_best": r.engine_vs_best,
                "seeds": seeds,
                "memtide_excess_by_seed": r.excess_by_seed,
                "loss_beyond_noise": r.beyond_noise,
            }));
        },
    )
    .map_err(|e| anyhow::anyhow!(e))?;
    let (memtide, engine_tally, peers) = (sum.memtide, sum.engine, sum.peers);
    let significant_losses = sum.losses_beyond_noise;
    let n = rows.len();
    println!(
        "\nmemtide at or below the best online policy on {} of {n} rows; worst {:.3}x, \
         geometric mean {:.3}x ({:.0} s)",
        memtide.at_or_below,
        memtide.worst,
        memtide.geometric_mean(),
        start.elapsed().as_secs_f64()
    );
    println!(
        "as the engine runs it (evicting from 1-2 write-back batches below the quota: `engine`), \
         at or below on {} of {n}; geometric mean {:.3}x",
        engine_tally.at_or_below,
        engine_tally.geometric_mean()
    );
    println!(
        "estimated time (misses at {:.0} µs, hint faults at {:.0} µs, accesses at {:.0} ns): \
         geometric mean {:.3}x the best policy's",
        lat.tier_ns / 1e3,
        lat.soft_ns / 1e3,
        lat.dram_ns,
        sum.time_geometric_mean()
    );
    if seeds > 1 {
        println!(
            "misses summed over seeds 1..={seeds}; memtide's excess over the best policy is beyond \
             twice its standard error across the seeds (`!`) on {significant_losses} of {n} rows"
        );
    }
    println!("each online policy against the best of the other five, for comparison:");
    for (name, t) in corpus::ONLINE.iter().zip(&peers) {
        println!(
            "  {name:<7} at or below on {:>2} of {n}; worst {:.3}x, geometric mean {:.3}x",
            t.at_or_below,
            t.worst,
            t.geometric_mean()
        );
    }
    println!(
        "memtide sees what the engine sees (first touches, misses, hint faults on pages it \
         staged: soft/acc); the others see every access; memtide % and ratio are at the same \
         DRAM as the others (placement-exact)"
    );
    if let Some(p) = &a.json {
        let peers: Vec<_> = corpus::ONLINE
            .iter()
            .zip(&peers)
            .map(|(name, t)| {
                serde_json::json!({
                    "policy": name,
                    "rows_at_or_below_the_others": t.at_or_below,
                    "geometric_mean_vs_the_others": t.geometric_mean(),
                    "worst_vs_the_others": t.worst,
                })
            })
            .collect();
        memtide_bench::report::write_json(
            p,
            &serde_json::json!({ "rows": rows, "online_vs_the_others": peers }),
        )?;
    }
    Ok(ExitCode::SUCCESS)
}
