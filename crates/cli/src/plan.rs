//! `memtide plan`: sizes hosts for a mix of tenants. Each tenant's profile (footprint, active
//! memory, skew — or a recorded trace) is replayed under memtide's policy at DRAM fractions from
//! 5% to 95%; the resulting loss curves, the host (TOML) and the prices go to
//! [`memtide_sim::plan::plan`], whose answer is printed and written as JSON and SVG. Entry
//! point: [`plan`].

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::Args;
use memtide_engine::size;
use memtide_sim::plan::{Binding, Host, Point, Prices, Tenant};
use memtide_sim::workload::{Kind, Spec};
use memtide_sim::{simulate, Job, Latency, Source};
use serde::Deserialize;

use memtide_launch::opts;

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// The host and the tenant mix, as TOML: a [host] table (dram, and optionally tier,
    /// tier_iops, cost) and one [[tenant]] table per kind of tenant (name, footprint, active,
    /// and optionally skew, cold, writes, count, rate; or trace = "file.mtt"). The file
    /// examples/tenants.toml explains every key.
    #[arg(long)]
    pub tenants: PathBuf,
    /// Price of DRAM, per GiB (e.g. 3.0/GiB, or 3000/TiB).
    #[arg(long, value_parser = price, allow_hyphen_values = true)]
    pub dram_cost: f64,
    /// Price of tier-1 capacity, per GiB.
    #[arg(long, value_parser = price, allow_hyphen_values = true)]
    pub tier_cost: f64,
    /// Largest throughput loss against all-DRAM any tenant may have.
    #[arg(long, value_parser = opts::percent, default_value = "5%")]
    pub max_loss: f64,
    /// Tier latency and read rate from a `memtide probe --json` result.
    #[arg(long)]
    pub probe: Option<PathBuf>,
    /// Cost of a tier-1 miss (fault + read + map), when there is no --probe.
    #[arg(long, value_parser = opts::latency_ns, default_value = "80us")]
    pub tier_latency: f64,
    /// Cost of a miss served from the compressed pool, for tenants that give a `ratio`.
    #[arg(long, value_parser = opts::latency_ns, default_value = "15us")]
    pub compressed_latency: f64,
    /// Also write the plan as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Where to draw each tenant's loss vs DRAM curve, as SVG.
    #[arg(long, default_value = "memtide-plan.svg")]
    pub plot: PathBuf,
}

/// Parses a price per GiB: `3.0`, `3.0/GiB`, `3000/TiB`, `0.003/MiB`.
fn price(s: &str) -> Result<f64, String> {
    let t = s.trim();
    let (num, per) = match t.split_once('/') {
        Some((n, unit)) => {
            let per = match unit.trim().to_ascii_lowercase().as_str() {
                "gib" | "gb" => 1.0,
                "tib" | "tb" => 1024.0,
                "mib" | "mb" => 1.0 / 1024.0,
                _ => return Err(format!("`{s}`: write a price per GiB, like 3.0/GiB")),
            };
            (n.trim(), per)
        }
        None => (t, 1.0),
    };
    match num.parse::<f64>() {
        Ok(v) if v < 0.0 => Err(format!("`{s}`: a price cannot be negative")),
        Ok(v) if v.is_finite() => Ok(v / per),
        _ => Err(format!("`{s}` is not a price: write 3.0/GiB")),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    host: HostToml,
    #[serde(rename = "tenant", default)]
    tenants: Vec<TenantToml>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HostToml {
    dram: String,
    tier: Option<String>,
    tier_iops: Option<f64>,
    cost: Option<f64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantToml {
    name: String,
    footprint: Option<String>,
    active: Option<String>,
    skew: Option<f64>,
    cold: Option<String>,
    writes: Option<String>,
    count: Option<u64>,
    rate: Option<String>,
    trace: Option<PathBuf>,
    /// Pages memtide's compressed pool holds per page of its DRAM for this tenant (about 1.8
    /// for pages lz4 halves; a run's `--stats` give compressed_pages over the pool's pages).
    /// Given, the plan also tries pools of a sixteenth, an eighth, a quarter and half of the
    /// DRAM, and keeps the split that loses least.
    ratio: Option<f64>,
}

/// Pages a synthetic profile is replayed at: curves depend on fractions, not on absolute
/// size, so a 64 GiB tenant is replayed as a 1 GiB one with the same shape.
const SIM_PAGES: u64 = 1 << 18;
/// Accesses per simulated page, counted, after as many not counted (DRAM settles after the
/// fill: the active set comes back from tier 1 once).
const ACCESSES_PER_PAGE: u64 = 16;
const WARMUP_PER_PAGE: u64 = 16;

fn parse_size(what: &str, tenant: &str, v: &str) -> Result<u64> {
    size::parse(v).map_err(|e| anyhow::anyhow!("tenant `{tenant}`: {what}: {e}"))
}

fn fraction(what: &str, tenant: &str, v: &str) -> Result<f64> {
    opts::fraction(v).map_err(|e| anyhow::anyhow!("tenant `{tenant}`: {what}: {e}"))
}

fn parse_rate(tenant: &str, v: &str) -> Result<f64> {
    opts::rate(v).map_err(|e| anyhow::anyhow!("tenant `{tenant}`: rate: {e}"))
}

/// A tenant's profile to replay, and what the plan needs to know of it.
struct Profile {
    tenant: Tenant,
    source: Source,
    pages: u64,
    /// The tenant's compression ratio in the pool, if it gave one.
    ratio: Option<f64>,
}

/// The pool shares a tenant with a `ratio` is replayed at (0: the file alone).
const POOL_SHARES: [f64; 5] = [0.0, 1.0 / 16.0, 1.0 / 8.0, 1.0 / 4.0, 1.0 / 2.0];

/// Page accesses per second of a tenant at full speed, unless it says: one per microsecond of
/// its own work.
const DEFAULT_RATE: f64 = 1e6;

fn profile(t: &TenantToml, base: &Path) -> Result<Profile> {
    let name = &t.name;
    let count = t.count.unwrap_or(1);
    if count == 0 {
        bail!("tenant `{name}`: count must be at least 1");
    }
    let rate = match &t.rate {
        Some(r) => parse_rate(name, r)?,
        None => DEFAULT_RATE,
    };
    if let Some(r) = t.ratio {
        if !(1.0..=64.0).contains(&r) {
            bail!("tenant `{name}`: ratio {r}: give pages per page of pool, from 1 to 64");
        }
    }
    if let Some(trace) = &t.trace {
        if t.skew.is_some() || t.cold.is_some() {
            bail!("tenant `{name}`: a trace tenant takes no skew or cold (the trace has them)");
        }
        let path = base.join(trace);
        let data = std::fs::read(&path)
            .with_context(|| format!("tenant `{name}`: cannot read trace {}", path.display()))?;
        let tr = memtide_sim::import::load(&path, data, None)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        let pages: u64 = tr.tenant_pages.iter().sum();
        if pages == 0 {
            bail!("tenant `{name}`: the trace touches no pages");
        }
        let footprint = match &t.footprint {
            Some(f) => parse_size("footprint", name, f)?,
            None => pages * 4096,
        };
        let active = match &t.active {
            Some(a) => parse_size("active", name, a)?,
            None => footprint,
        };
        return Ok(Profile {
            tenant: Tenant {
                name: name.clone(),
                footprint_bytes: footprint,
                active_bytes: active.min(footprint),
                count,
                rate,
                curve: Vec::new(),
            },
            source: Source::Trace(tr),
            pages,
            ratio: t.ratio,
        });
    }
    let footprint = parse_size(
        "footprint",
        name,
        t.footprint.as_deref().ok_or_else(|| {
            anyhow::anyhow!("tenant `{name}`: give footprint (and active), or a trace")
        })?,
    )?;
    if footprint < 4096 {
        bail!("tenant `{name}`: footprint must be at least one page");
    }
    let active = parse_size(
        "active",
        name,
        t.active
            .as_deref()
            .ok_or_else(|| anyhow::anyhow!("tenant `{name}`: give active (memory it touches)"))?,
    )?;
    if active == 0 || active > footprint {
        bail!("tenant `{name}`: active must be more than 0 and at most the footprint");
    }
    let skew = t.skew.unwrap_or(0.0);
    if !(0.0..=4.0).contains(&skew) {
        bail!("tenant `{name}`: skew must be between 0 (uniform) and 4");
    }
    let cold = match &t.cold {
        Some(c) => fraction("cold", name, c)?,
        None => 0.001,
    };
    let writes = match &t.writes {
        Some(w) => fraction("writes", name, w)?,
        None => 0.2,
    };
    let pages = (footprint / 4096).min(SIM_PAGES);
    let spec = Spec {
        kind: Kind::Active {
            active: active as f64 / footprint as f64,
            skew,
            cold,
        },
        pages,
        accesses: pages * ACCESSES_PER_PAGE,
        writes,
        seed: 1,
        fill: true,
        warmup: pages * WARMUP_PER_PAGE,
    };
    Ok(Profile {
        tenant: Tenant {
            name: name.clone(),
            footprint_bytes: footprint,
            active_bytes: active,
            count,
            rate,
            curve: Vec::new(),
        },
        source: Source::Spec(spec),
        pages,
        ratio: t.ratio,
    })
}

fn load(path: &Path) -> Result<(Host, Vec<TenantToml>)> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let f: File = toml::from_str(&text).map_err(|e| {
        let msg = e.message().to_string();
        anyhow::anyhow!("{}: {msg}", path.display())
    })?;
    let dram = size::parse(&f.host.dram).map_err(|e| anyhow::anyhow!("[host] dram: {e}"))?;
    if dram == 0 {
        bail!("[host] dram must be more than 0");
    }
    let tier = f
        .host
        .tier
        .as_deref()
        .map(|t| size::parse(t).map_err(|e| anyhow::anyhow!("[host] tier: {e}")))
        .transpose()?;
    if let Some(i) = f.host.tier_iops {
        if !(i > 0.0 && i.is_finite()) {
            bail!("[host] tier_iops must be a positive number");
        }
    }
    if f.host.cost.is_some_and(|c| c < 0.0 || !c.is_finite()) {
        bail!("[host] cost cannot be negative");
    }
    if f.tenants.is_empty() {
        bail!("{}: no [[tenant]] tables", path.display());
    }
    Ok((
        Host {
            dram_bytes: dram,
            tier_bytes: tier,
            tier_iops: f.host.tier_iops,
            cost: f.host.cost.unwrap_or(0.0),
        },
        f.tenants,
    ))
}

fn copies(n: u64) -> String {
    format!("{n} {}", if n == 1 { "copy" } else { "copies" })
}

fn binding_words(b: Binding) -> &'static str {
    match b {
        Binding::Dram => "DRAM: each copy needs that much DRAM for its hot pages to stay within the loss budget",
        Binding::ActiveMemory => "the operator guidance: one more copy would put active memory above 75% of DRAM (red)",
        Binding::TierBandwidth => "tier-1 bandwidth: one more copy would need more random reads per second than the tier serves",
        Binding::TierCapacity => "tier-1 capacity: one more copy's cold pages would not fit on the tier",
    }
}

pub fn plan(a: PlanArgs) -> Result<ExitCode> {
    let (mut host, specs) = load(&a.tenants)?;
    let mut tier_ns = a.tier_latency;
    let mut latency_from = format!("{:.0} µs (--tier-latency)", tier_ns / 1e3);
    if let Some(p) = &a.probe {
        let r = memtide_bench::probe::ProbeReport::load(p)?;
        tier_ns = r.tier_latency_us * 1e3;
        latency_from = format!(
            "{:.0} µs ({} read p50 {:.0} µs + fault handling)",
            r.tier_latency_us,
            p.display(),
            r.read_qd1.p50_us
        );
        if host.tier_iops.is_none() {
            host.tier_iops = Some(r.read_iops_qd32);
        }
    }
    let base = a.tenants.parent().unwrap_or(Path::new("."));
    let mut profiles: Vec<Profile> = specs
        .iter()
        .map(|t| profile(t, base))
        .collect::<Result<_>>()?;
    let max_loss = a.max_loss / 100.0;
    eprintln!(
        "memtide plan: {} kinds of tenant, loss budget {:.1}%, DRAM {:.2}/GiB, tier {:.2}/GiB, tier latency {latency_from}",
        profiles.len(),
        a.max_loss,
        a.dram_cost,
        a.tier_cost
    );
    // Replay every profile at 5%..95% DRAM under memtide's policy, all cores.
    let fractions: Vec<f64> = (1..=19).map(|i| i as f64 * 0.05).collect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let tty = std::io::stderr().is_terminal();
    let total = profiles.len() * fractions.len();
    for (k, p) in profiles.iter_mut().enumerate() {
        // An access costs the tenant's own time per access at full speed; a miss adds the
        // tier latency, a soft fault memtide's few microseconds.
        let lat = Latency {
            dram_ns: 1e9 / p.tenant.rate,
            tier_ns,
            soft_ns: 6_000.0,
            compressed_ns: a.compressed_latency,
        };
        // With a ratio, every fraction at every pool share; the curve keeps the best split.
        let shares: &[f64] = if p.ratio.is_some() {
            &POOL_SHARES
        } else {
            &POOL_SHARES[..1]
        };
        let (pages, ratio) = (p.pages, p.ratio.unwrap_or(1.0));
        let jobs: Vec<Job> = fractions
            .iter()
            .flat_map(|f| {
                let dram = ((pages as f64 * f).round() as u64).max(1);
                shares.iter().map(move |&s| Job {
                    pool_pages: (dram as f64 * s) as u64,
                    pool_share: s,
                    ratio,
                    ..Job::new("placement", dram)
                })
            })
            .collect();
        let out = simulate(&p.source, &jobs, &lat, threads, &|done, _| {
            if tty {
                let d = k * fractions.len() + done / shares.len();
                eprint!(
                    "\r{} {d}/{total} replays",
                    memtide_bench::report::bar(d, total)
                );
                let _ = std::io::stderr().flush();
            }
        })?;
        p.tenant.curve = out
            .chunks(shares.len())
            .zip(&fractions)
            .map(|(split, &f)| {
                let o = split
                    .iter()
                    .min_by(|x, y| x.slowdown(&lat).total_cmp(&y.slowdown(&lat)))
                    .expect("one replay per share");
                Point {
                    fraction: f,
                    pool_share: o.pool_pages as f64 / o.dram_pages.max(1) as f64,
                    miss_ratio: o.file_misses() as f64 / o.accesses.max(1) as f64,
                    write_ratio: o.writebacks as f64 / o.accesses.max(1) as f64,
                    slowdown: o.slowdown(&lat),
                }
            })
            .collect();
        p.tenant.curve.push(Point {
            fraction: 1.0,
            pool_share: 0.0,
            miss_ratio: 0.0,
            write_ratio: 0.0,
            slowdown: 1.0,
        });
    }
    if tty {
        eprintln!();
    }
    let tenants: Vec<Tenant> = profiles.into_iter().map(|p| p.tenant).collect();
    let prices = Prices {
        dram_per_gib: a.dram_cost,
        tier_per_gib: a.tier_cost,
    };
    let plan = memtide_sim::plan::plan(&tenants, &host, &prices, max_loss);
    let best = &plan.options[plan.best];

    // With a tenant's ratio: how much of its DRAM the plan gives the compressed pool.
    let leveled = specs.iter().any(|t| t.ratio.is_some());
    println!(
        "{:<14} {:>6} {:>10} {:>10} {:>12}{} {:>9} {:>9} {:>12}",
        "tenant",
        "copies",
        "footprint",
        "active",
        "DRAM each",
        if leveled {
            format!(" {:>12}", "of it pool")
        } else {
            String::new()
        },
        "in DRAM",
        "loss",
        "tier reads"
    );
    for (t, &f) in tenants.iter().zip(&best.fractions) {
        let pt = t
            .curve
            .iter()
            .find(|p| p.fraction == f)
            .copied()
            .unwrap_or(t.curve[0]);
        let dram_each = (t.footprint_bytes as f64 * f) as u64;
        println!(
            "{:<14} {:>6} {:>10} {:>10} {:>12}{} {:>8.0}% {:>8.1}% {:>10.1}K/s",
            t.name,
            t.count,
            size::format(t.footprint_bytes),
            size::format(t.active_bytes),
            size::format(dram_each),
            match (leveled, pt.pool_share > 0.0) {
                (false, _) => String::new(),
                (true, false) => format!(" {:>12}", "-"),
                (true, true) => format!(
                    " {:>12}",
                    size::format((dram_each as f64 * pt.pool_share) as u64)
                ),
            },
            f * 100.0,
            pt.loss() * 100.0,
            pt.miss_ratio * t.rate / pt.slowdown / 1e3
        );
    }
    println!();
    println!(
        "Per host ({} DRAM{}{}{}):",
        size::format(host.dram_bytes),
        host.tier_bytes
            .map_or(String::new(), |t| format!(", {} tier", size::format(t))),
        host.tier_iops
            .map_or(String::new(), |i| format!(", tier {:.0}K reads/s", i / 1e3)),
        if host.cost > 0.0 {
            format!(", host {:.0}", host.cost)
        } else {
            String::new()
        }
    );
    println!("  all in DRAM: {} of the mix", copies(plan.all_dram_copies));
    let density = if plan.all_dram_copies > 0 {
        format!(
            " — {:.2}x the all-DRAM density",
            best.copies as f64 / plan.all_dram_copies as f64
        )
    } else {
        String::new()
    };
    println!(
        "  with memtide: {}, worst loss {:.1}%{density}",
        copies(best.copies),
        best.loss * 100.0
    );
    println!("  binding constraint: {}", binding_words(best.binding));
    println!(
        "  active memory at that packing: {:.0}% of DRAM — {} (guidance: green under 50%, yellow 50–75%, red over 75%)",
        best.active_share * 100.0,
        best.health.as_str()
    );
    let ratio = best.tier_per_copy as f64 / best.dram_per_copy.max(1) as f64;
    println!(
        "  DRAM:tier per copy {} : {} (1:{ratio:.1}), tier-1 traffic {:.1}K reads/s and {:.1}K writes/s per copy",
        size::format(best.dram_per_copy),
        size::format(best.tier_per_copy),
        best.reads_per_copy / 1e3,
        best.writes_per_copy / 1e3
    );
    println!();
    println!("Cost per copy of the mix (host, its DRAM, and the tier the copies use):");
    println!(
        "  {:<22} {:>11} {:>8} {:>8} {:>14}  binding",
        "split", "DRAM", "copies", "loss", "cost per copy"
    );
    for (i, o) in plan.options.iter().enumerate() {
        let split: Vec<String> = o
            .fractions
            .iter()
            .map(|f| format!("{:.0}%", f * 100.0))
            .collect();
        println!(
            "  {:<22} {:>11} {:>8} {:>7.1}% {:>14.2}  {:?}{}",
            split.join("/"),
            size::format(o.dram_per_copy),
            o.copies,
            o.loss * 100.0,
            o.cost_per_copy,
            o.binding,
            if i == plan.best { "   <- cheapest" } else { "" }
        );
    }
    println!(
        "  {:<22} {:>11} {:>8} {:>7.1}% {:>14.2}",
        "all in DRAM",
        size::format(
            tenants
                .iter()
                .map(|t| t.footprint_bytes * t.count)
                .sum::<u64>()
        ),
        plan.all_dram_copies,
        0.0,
        plan.all_dram_cost_per_copy
    );
    if plan.saving.is_finite() {
        println!(
            "TCO saving vs all-DRAM: {:.0}% per copy of the mix",
            plan.saving * 100.0
        );
    } else {
        println!("All-DRAM cannot hold one copy of the mix on this host.");
    }

    let series = tenants
        .iter()
        .map(|t| memtide_bench::plot::Series {
            name: t.name.clone(),
            points: t.curve.iter().map(|p| (p.fraction, p.loss())).collect(),
        })
        .collect();
    memtide_bench::plot::Chart::loss_vs_dram(
        "Estimated loss vs DRAM per tenant (memtide policy)".into(),
        "DRAM, fraction of the tenant's footprint",
        series,
    )
    .write(&a.plot)?;
    if let Some(p) = &a.json {
        let json = serde_json::json!({
            "host": host,
            "prices": prices,
            "tier_latency_ns": tier_ns,
            "tenants": tenants,
            "plan": plan,
        });
        memtide_bench::report::write_json(p, &json)?;
    }
    Ok(ExitCode::SUCCESS)
}
