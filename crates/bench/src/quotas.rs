//! `memtide bench --experiments quotas`: four tenants with different active sets share
//! --host-dram, each serving a paced load. Side by side, --reps times: an equal static split
//! (each `memtide run --dram host/4`) and the host daemon's activeness quotas (`memtide host`,
//! each tenant guaranteed host/16). The busiest tenant joins 10 s after the others, so the
//! run also shows how long its quota takes to follow. Reported: each tenant's throughput and
//! the total, the ratio of the totals, whether any quota ever fell below its minimum or the
//! quotas above the budget (the daemon's status, sampled twice a second), and the time the late
//! tenant's quota took to reach 90% of where it settled. Entry point: [`quotas`].

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use memtide_engine::size::format as bytes;

use crate::lab::Common;
use crate::report::median;
use crate::tenants::TenantArgs;

/// The tenants: name, share of the footprint that is hot, seconds after the start it joins.
const TENANTS: [(&str, f64, u64); 4] = [
    ("busy", 0.80, 10),
    ("medium", 0.40, 0),
    ("light", 0.10, 0),
    ("idle", 0.05, 0),
];
/// Accesses per second each tenant serves (paced: the host is limited by memory, not CPU).
const RATE: u64 = 150_000;
const WARMUP: u64 = 15;

/// One tenant's run: its measured throughput.
fn spawn_tenant(
    exe: &Path,
    placement: &[String],
    a: &Common,
    x: &TenantArgs,
    t: usize,
) -> Result<Child> {
    let (name, hot, join) = TENANTS[t];
    // Every measured phase ends together: the late tenant measures 10 s less.
    let seconds = 30 - join;
    let mut cmd = Command::new(exe);
    cmd.arg("run")
        .args(placement)
        .arg("--tier")
        .arg(&a.tier)
        .args(["-q", "--name", name, "--"])
        .arg(exe)
        .args(["workload", "--footprint", &x.tenant_footprint.to_string()])
        .args(["--hot", &format!("{}%", hot * 100.0), "--hot-share", "100%"])
        .args(["--rate", &RATE.to_string(), "--warmup", &WARMUP.to_string()])
        .args([
            "--seconds",
            &seconds.to_string(),
            "--seed",
            &(7 + t).to_string(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd.spawn()
        .with_context(|| format!("cannot start tenant {name}"))
}

/// The throughput a tenant's workload reported, checking that it kept its data.
fn throughput(child: Child, name: &str) -> Result<f64> {
    let o = child.wait_with_output()?;
    let out = String::from_utf8_lossy(&o.stdout);
    if !o.status.success() {
        bail!(
            "tenant {name} failed: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        );
    }
    let result = out
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["event"] == "result")
        .with_context(|| format!("tenant {name} printed no result"))?;
    if result["mismatches"].as_u64() != Some(0) {
        bail!("tenant {name} read back wrong data: {result}");
    }
    Ok(result["throughput"].as_f64().unwrap_or(0.0))
}

/// Starts the tenants on their schedule and returns their throughputs.
fn run_tenants(
    exe: &Path,
    a: &Common,
    x: &TenantArgs,
    placement: impl Fn(usize) -> Vec<String>,
) -> Result<Vec<f64>> {
    let start = Instant::now();
    let mut order: Vec<usize> = (0..TENANTS.len()).collect();
    order.sort_by_key(|&t| TENANTS[t].2);
    let mut children: Vec<(usize, Child)> = Vec::new();
    for t in order {
        let at = Duration::from_secs(TENANTS[t].2);
        if let Some(wait) = at.checked_sub(start.elapsed()) {
            std::thread::sleep(wait);
        }
        children.push((t, spawn_tenant(exe, &placement(t), a, x, t)?));
    }
    let mut out = vec![0.0; TENANTS.len()];
    for (t, c) in children {
        out[t] = throughput(c, TENANTS[t].0)?;
    }
    Ok(out)
}

/// What the status samples showed during an activeness run.
#[derive(Default)]
struct Watch {
    samples: u64,
    over_budget: u64,
    below_min: u64,
    /// (seconds since the start, the late tenant's quota)
    late_quota: Vec<(f64, u64)>,
}

pub fn quotas(a: &Common, x: &TenantArgs) -> Result<serde_json::Value> {
    let exe = std::env::current_exe().context("cannot locate the memtide binary")?;
    let budget = x.host_dram;
    let share = budget / TENANTS.len() as u64;
    let min = budget / 16;
    println!(
        "quotas: {} tenants of {} each share {} ({}/{}/{}/{} of each hot, {} accesses/s each; `{}` joins after 10 s), {} rep(s)",
        TENANTS.len(),
        bytes(x.tenant_footprint),
        bytes(budget),
        TENANTS[0].1 * 100.0,
        TENANTS[1].1 * 100.0,
        TENANTS[2].1 * 100.0,
        TENANTS[3].1 * 100.0,
        RATE,
        TENANTS[0].0,
        a.reps()
    );
    let dir = std::env::temp_dir().join(format!("memtide-bench-quotas-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let socket = dir.join("host.sock");
    let mut statics: Vec<Vec<f64>> = Vec::new();
    let mut actives: Vec<Vec<f64>> = Vec::new();
    let mut follow: Vec<f64> = Vec::new();
    let (mut samples, mut over, mut below) = (0u64, 0u64, 0u64);
    for rep in 0..a.reps() {
        let s = run_tenants(&exe, a, x, |_| vec!["--dram".into(), share.to_string()])?;
        println!(
            "  rep {}: static 1/{}     {}",
            rep + 1,
            TENANTS.len(),
            row(&s)
        );
        statics.push(s);
        let (q, watch) = with_daemon(&exe, a, x, &socket, budget, min)?;
        println!("  rep {}: activeness     {}", rep + 1, row(&q));
        actives.push(q);
        samples += watch.samples;
        over += watch.over_budget;
        below += watch.below_min;
        if let Some(s) = settle_time(&watch.late_quota) {
            follow.push(s);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let per = |runs: &[Vec<f64>], t: usize| median(runs.iter().map(|r| r[t]).collect());
    let total = |runs: &[Vec<f64>]| median(runs.iter().map(|r| r.iter().sum()).collect());
    let st: Vec<f64> = (0..TENANTS.len()).map(|t| per(&statics, t)).collect();
    let ac: Vec<f64> = (0..TENANTS.len()).map(|t| per(&actives, t)).collect();
    let (ts, ta) = (total(&statics), total(&actives));
    println!(
        "\n  {:<18} {}",
        "medians (k acc/s)",
        TENANTS
            .iter()
            .map(|t| format!("{:>9}", t.0))
            .chain(std::iter::once(format!("{:>9}", "total")))
            .collect::<String>()
    );
    println!(
        "  {:<18} {}",
        format!("static 1/{}", TENANTS.len()),
        row(&st)
    );
    println!("  {:<18} {}", "activeness", row(&ac));
    println!(
        "  activeness / static: {:.2}x total throughput; quotas within the budget in {}/{} samples, below a minimum in {}; `{}`'s quota reached 90% of where it settled {} after it joined",
        ta / ts,
        samples - over,
        samples,
        below,
        TENANTS[0].0,
        if follow.is_empty() {
            "never".into()
        } else {
            format!("{:.1} s (median)", median(follow.clone()))
        }
    );
    Ok(serde_json::json!({
        "budget_bytes": budget,
        "tenant_footprint": x.tenant_footprint,
        "tenants": TENANTS.iter().map(|t| serde_json::json!({"name": t.0, "hot": t.1, "joins_after_seconds": t.2})).collect::<Vec<_>>(),
        "rate": RATE,
        "static": statics,
        "activeness": actives,
        "ratio": ta / ts,
        "samples": samples,
        "over_budget": over,
        "below_min": below,
        "follow_seconds": follow,
    }))
}

fn row(v: &[f64]) -> String {
    v.iter()
        .chain(std::iter::once(&v.iter().sum::<f64>()))
        .map(|x| format!("{:>9.1}", x / 1000.0))
        .collect()
}

/// Seconds from the late tenant's first quota until it first reached 90% of where it settled:
/// its quota 20 s after it joined (mid-way through its measured phase, before anyone leaves).
fn settle_time(q: &[(f64, u64)]) -> Option<f64> {
    let first = q.first()?.0;
    let settled = q.iter().find(|&&(t, _)| t >= first + 20.0)?.1 as f64;
    q.iter()
        .find(|&&(_, v)| v as f64 >= 0.9 * settled)
        .map(|&(t, _)| t - first)
}

/// One activeness run: a daemon, the tenants as its guests, and a thread sampling its status.
fn with_daemon(
    exe: &Path,
    a: &Common,
    x: &TenantArgs,
    socket: &Path,
    budget: u64,
    min: u64,
) -> Result<(Vec<f64>, Watch)> {
    // Tier for everything the tenants hold, as each has in the static split: the comparison
    // is about DRAM.
    let tier = x.tenant_footprint * TENANTS.len() as u64;
    let mut daemon = Command::new(exe)
        .args(["host", "--dram", &budget.to_string(), "--tier"])
        .arg(&a.tier)
        .args(["--tier-size", &tier.to_string()])
        .arg("--socket")
        .arg(socket)
        .args(["--metrics", "off"])
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot start memtide host")?;
    let mut err = BufReader::new(daemon.stderr.take().expect("piped"));
    let mut line = String::new();
    err.read_line(&mut line)?;
    if !line.contains("sharing") {
        let _ = daemon.kill();
        bail!("memtide host did not start: {line}");
    }
    std::thread::spawn(move || for _ in err.lines() {});
    let watch = Arc::new(Mutex::new(Watch::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (watch, stop) = (watch.clone(), stop.clone());
        let (exe, socket): (PathBuf, PathBuf) = (exe.to_path_buf(), socket.to_path_buf());
        let start = Instant::now();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(500));
                let Ok(o) = Command::new(&exe)
                    .args(["status", "--json", "--socket"])
                    .arg(&socket)
                    .output()
                else {
                    continue;
                };
                let Ok(s) = serde_json::from_slice::<serde_json::Value>(&o.stdout) else {
                    continue;
                };
                let Some(tenants) = s["tenants"].as_array() else {
                    continue;
                };
                let mut w = watch.lock().unwrap_or_else(|e| e.into_inner());
                w.samples += 1;
                let q = |t: &serde_json::Value, k: &str| t[k].as_u64().unwrap_or(0);
                let sum: u64 = tenants.iter().map(|t| q(t, "quota_bytes")).sum();
                if sum > budget {
                    w.over_budget += 1;
                }
                if tenants
                    .iter()
                    .any(|t| q(t, "quota_bytes") < q(t, "min_bytes"))
                {
                    w.below_min += 1;
                }
                if let Some(t) = tenants.iter().find(|t| t["name"] == TENANTS[0].0) {
                    w.late_quota
                        .push((start.elapsed().as_secs_f64(), q(t, "quota_bytes")));
                }
            }
        })
    };
    let result = run_tenants(exe, a, x, |_| {
        vec![
            format!("--host={}", socket.display()),
            "--dram".into(),
            min.to_string(),
        ]
    });
    stop.store(true, Ordering::Release);
    let _ = sampler.join();
    let _ = daemon.kill();
    let _ = daemon.wait();
    let watch = std::mem::take(&mut *watch.lock().unwrap_or_else(|e| e.into_inner()));
    Ok((result?, watch))
}
