//! `memtide host`: owns the host's DRAM budget and tier capacity. Tenants (`memtide run
//! --host`) register over a Unix socket, report their figures every second and get their DRAM
//! quota and tier share back; every epoch the budget is split again by activeness and the tier
//! capacity by what each tenant holds beyond its quota (`memtide_policy::share`). A connection
//! that closes releases its tenant's shares at once. Entry point: [`serve`].
//!
//! # Who may do what
//!
//! The socket is mode 0660 (owner: the daemon's user; group: `--group`). The daemon asks the
//! kernel who connected (`SO_PEERCRED`): root and the daemon's own user are admins and may read
//! and change any tenant; anyone else may register one tenant on its connection and read and
//! change only that one.

use std::collections::BTreeMap;
use std::io::{BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use memtide_engine::size::format as bytes;
use memtide_policy::share::{self, Demand, ShareRules, TierDemand};
use memtide_policy::{Health, HealthThresholds, PAGE_SIZE};

use crate::history::History;
use crate::protocol::{
    self, Change, HostStatus, Registration, Request, Response, TenantReport, TenantStatus,
};

/// The smallest quota a tiered tenant can run with (the engine's own minimum).
pub const MIN_QUOTA: u64 = 64 << 10;

/// What the daemon is asked to do.
#[derive(Clone, Debug)]
pub struct HostConfig {
    pub budget_bytes: u64,
    pub tier_dir: PathBuf,
    pub tier_capacity_bytes: u64,
    pub socket: PathBuf,
    /// Group allowed to connect (besides the daemon's user).
    pub group: Option<u32>,
    pub epoch: Duration,
    pub rules: ShareRules,
    /// Every tenant encrypts its tier pages.
    pub encrypt_tier: bool,
}

struct Tenant {
    name: String,
    pid: u32,
    uid: u32,
    pinned: bool,
    min: u64,
    max: Option<u64>,
    quota: u64,
    /// Its share of the tier capacity.
    tier: u64,
    joined: Instant,
    report: TenantReport,
    /// The report before, and when each came (for rates).
    previous: Option<(Instant, TenantReport)>,
    reported: Instant,
    health: Health,
}

impl Tenant {
    fn demand(&self) -> Demand {
        let pages = |b: u64| b / PAGE_SIZE as u64;
        Demand {
            min: pages(self.min),
            max: self.max.map_or(u64::MAX, pages),
            pinned: self.pinned,
            held: pages(self.report.dram_bytes + self.report.tier_bytes)
                .max(pages(self.report.managed_bytes)),
            active: pages(self.report.active_bytes),
        }
    }

    /// What it needs of the tier, at the DRAM quota it has.
    fn tier_demand(&self) -> TierDemand {
        let pages = |b: u64| b / PAGE_SIZE as u64;
        let r = &self.report;
        TierDemand {
            pinned: self.pinned,
            may_hold: if self.previous.is_none() {
                pages(self.tier)
            } else {
                pages(r.tier_bytes.max(r.tier_limit_bytes))
            },
            only_in_tier: pages(
                r.tier_bytes
                    .min(r.managed_bytes.saturating_sub(r.dram_bytes)),
            ),
            beyond_quota: self.demand().held.saturating_sub(pages(self.quota)),
        }
    }

    fn active_pct(&self) -> f64 {
        if self.quota == 0 {
            return 0.0;
        }
        self.report.active_bytes as f64 * 100.0 / self.quota as f64
    }

    /// Tier-read latency at quantile `q` over the last report interval.
    fn recent_us(&self, q: f64) -> Option<f64> {
        protocol::window_quantile_us(&self.report, self.previous.as_ref().map(|(_, r)| r), q)
    }

    /// Active memory against the quota, and the tier-read p99 of the last interval.
    fn colour(&self, t: &HealthThresholds) -> Health {
        if self.pinned {
            return Health::Green;
        }
        let a = Health::of_active(self.report.active_bytes, self.quota, t);
        let l = self
            .recent_us(0.99)
            .map_or(Health::Green, |us| Health::of_latency(us, t));
        a.max(l)
    }
}

/// The daemon's state.
pub struct Host {
    cfg: HostConfig,
    tenants: BTreeMap<u64, Tenant>,
    next_id: u64,
    started: Instant,
    health: (Health, Health),
    thresholds: HealthThresholds,
    history: History,
}

fn log(msg: impl AsRef<str>) {
    eprintln!("memtide host: {}", msg.as_ref());
}

impl Host {
    pub fn new(cfg: HostConfig) -> Host {
        Host {
            cfg,
            tenants: BTreeMap::new(),
            next_id: 1,
            started: Instant::now(),
            health: (Health::Green, Health::Green),
            thresholds: HealthThresholds::default(),
            history: History::default(),
        }
    }

    fn guaranteed(&self, except: Option<u64>) -> u64 {
        self.tenants
            .iter()
            .filter(|(&id, _)| Some(id) != except)
            .map(|(_, t)| t.min)
            .sum()
    }

    /// Whether a tenant (`except`: the one being changed, if any) may have these terms: a
    /// tiered tenant's minimum is one the engine can run with, the maximum is not below it,
    /// and the minimums of all tenants fit the budget.
    fn check_terms(
        &self,
        except: Option<u64>,
        pinned: bool,
        min: u64,
        max: Option<u64>,
    ) -> Result<(), String> {
        if !pinned && min < MIN_QUOTA {
            return Err(format!(
                "a tiered tenant's minimum must be at least {}",
                bytes(MIN_QUOTA)
            ));
        }
        if let Some(m) = max.filter(|&m| m < min) {
            return Err(format!(
                "maximum {} is below the minimum {}",
                bytes(m),
                bytes(min)
            ));
        }
        let taken = self.guaranteed(except);
        if taken + min > self.cfg.budget_bytes {
            return Err(format!(
                "cannot guarantee {}: {} of the host's {} is already guaranteed to other tenants",
                bytes(min),
                bytes(taken),
                bytes(self.cfg.budget_bytes)
            ));
        }
        Ok(())
    }

    fn register(&mut self, r: Registration, uid: u32) -> Result<u64, String> {
        if r.name.is_empty() || r.name.len() > 200 {
            return Err("a tenant's name must be 1 to 200 bytes".into());
        }
        self.check_terms(None, r.pinned, r.min_bytes, r.max_bytes)?;
        let id = self.next_id;
        self.next_id += 1;
        let now = Instant::now();
        log(format!(
            "tenant {id} ({}, pid {}, uid {uid}) joined: minimum {}{}{}",
            r.name,
            r.pid,
            bytes(r.min_bytes),
            r.max_bytes
                .map(|m| format!(", maximum {}", bytes(m)))
                .unwrap_or_default(),
            if r.pinned {
                ", pinned (not tiered)"
            } else {
                ""
            }
        ));
        self.tenants.insert(
            id,
            Tenant {
                name: r.name,
                pid: r.pid,
                uid,
                pinned: r.pinned,
                min: r.min_bytes,
                max: r.max_bytes,
                quota: r.min_bytes,
                tier: 0,
                joined: now,
                report: TenantReport::default(),
                previous: None,
                reported: now,
                health: Health::Green,
            },
        );
        self.rebalance();
        Ok(id)
    }

    fn leave(&mut self, id: u64) {
        if let Some(t) = self.tenants.remove(&id) {
            log(format!(
                "tenant {id} ({}) left after {:.0} s; its {} quota goes back to the host",
                t.name,
                t.joined.elapsed().as_secs_f64(),
                bytes(t.quota)
            ));
            self.rebalance();
        }
    }

    /// Takes a tenant's figures; returns its quota and tier share.
    fn report(&mut self, id: u64, r: TenantReport) -> (u64, u64) {
        let Some(t) = self.tenants.get_mut(&id) else {
            return (0, 0);
        };
        let now = Instant::now();
        if r.pid != 0 {
            t.pid = r.pid;
        }
        let old = std::mem::replace(&mut t.report, r);
        t.previous = Some((t.reported, old));
        t.reported = now;
        (t.quota, t.tier)
    }

    fn change(&mut self, id: u64, c: &Change) -> Result<(), String> {
        let t = self
            .tenants
            .get(&id)
            .ok_or_else(|| format!("no tenant {id}"))?;
        let min = c.min_bytes.unwrap_or(t.min);
        let max = match c.max_bytes {
            Some(0) => None,
            Some(m) => Some(m),
            None => t.max,
        };
        self.check_terms(Some(id), t.pinned, min, max)?;
        let t = self.tenants.get_mut(&id).expect("looked up above");
        t.min = min;
        t.max = max;
        log(format!(
            "tenant {id} ({}) now has minimum {}{}",
            t.name,
            bytes(min),
            max.map(|m| format!(", maximum {}", bytes(m)))
                .unwrap_or_default()
        ));
        self.rebalance();
        Ok(())
    }

    /// Splits the budget and the tier capacity again (each epoch, and when a tenant joins,
    /// leaves or changes).
    pub fn rebalance(&mut self) {
        let ids: Vec<u64> = self.tenants.keys().copied().collect();
        let demands: Vec<Demand> = ids.iter().map(|id| self.tenants[id].demand()).collect();
        let current: Vec<u64> = ids
            .iter()
            .map(|id| self.tenants[id].quota / PAGE_SIZE as u64)
            .collect();
        let budget = self.cfg.budget_bytes / PAGE_SIZE as u64;
        let quotas = share::split(budget, &demands, &current, &self.cfg.rules);
        for (id, q) in ids.iter().zip(quotas) {
            let t = self.tenants.get_mut(id).expect("tenant listed");
            let q = (q * PAGE_SIZE as u64).max(if t.pinned { 0 } else { MIN_QUOTA });
            t.quota = q;
        }
        let tier: Vec<TierDemand> = ids
            .iter()
            .map(|id| self.tenants[id].tier_demand())
            .collect();
        let shares = share::split_tier(self.cfg.tier_capacity_bytes / PAGE_SIZE as u64, &tier);
        for (id, s) in ids.iter().zip(shares) {
            self.tenants.get_mut(id).expect("tenant listed").tier = s * PAGE_SIZE as u64;
        }
    }

    /// Logs every tenant (and the host, as `s` shows it) whose colour changed, with the
    /// numbers behind it.
    fn health_events(&mut self, s: &HostStatus) {
        let th = self.thresholds;
        for (id, t) in self.tenants.iter_mut() {
            let now = t.colour(&th);
            if now != t.health {
                log(format!(
                    "tenant {id} ({}) turned {}: active {} of its {} quota ({:.0}%), tier read p99 {:.0} µs over the last interval",
                    t.name,
                    now.as_str(),
                    bytes(t.report.active_bytes),
                    bytes(t.quota),
                    t.active_pct(),
                    t.recent_us(0.99).unwrap_or(0.0)
                ));
                t.health = now;
            }
        }
        let now = (colour(&s.active_health), colour(&s.latency_health));
        if now != self.health {
            log(format!(
                "host active memory is {} ({} of the {} budget), tier read latency {} (p99 {:.0} µs)",
                now.0.as_str(),
                bytes(s.active_bytes),
                bytes(s.budget_bytes),
                now.1.as_str(),
                s.tier_read_latency_p99_us
            ));
            self.health = now;
        }
    }

    /// Ends an epoch: splits the budget again, logs changes of colour, keeps a sample.
    pub fn epoch(&mut self) {
        self.rebalance();
        let s = self.status(None);
        self.health_events(&s);
        self.history
            .record(self.started.elapsed().as_secs_f64(), &s);
    }

    /// The last hour's samples as JSON (for the dashboard).
    pub fn history_json(&self) -> String {
        serde_json::to_string(&self.history.points().collect::<Vec<_>>()).unwrap_or_default()
    }

    /// The host and the tenants `only` allows (all when `None`).
    pub fn status(&self, only: Option<u64>) -> HostStatus {
        let th = &self.thresholds;
        let mut s = HostStatus {
            budget_bytes: self.cfg.budget_bytes,
            tier_dir: self.cfg.tier_dir.display().to_string(),
            tier_capacity_bytes: self.cfg.tier_capacity_bytes,
            uptime_seconds: self.started.elapsed().as_secs_f64(),
            ..HostStatus::default()
        };
        for (&id, t) in &self.tenants {
            s.quota_bytes += t.quota;
            s.dram_bytes += t.report.dram_bytes;
            s.tier_bytes += t.report.tier_bytes;
            s.active_bytes += t.report.active_bytes;
            let (p50, p99) = (
                t.recent_us(0.5).unwrap_or(0.0),
                t.recent_us(0.99).unwrap_or(0.0),
            );
            s.tier_read_latency_p50_us = s.tier_read_latency_p50_us.max(p50);
            s.tier_read_latency_p99_us = s.tier_read_latency_p99_us.max(p99);
            if only.is_some_and(|o| o != id) {
                continue;
            }
            let rate = |f: fn(&TenantReport) -> u64| match &t.previous {
                Some((at, old)) => {
                    let dt = t.reported.duration_since(*at).as_secs_f64();
                    if dt > 0.0 {
                        f(&t.report).saturating_sub(f(old)) as f64 / dt
                    } else {
                        0.0
                    }
                }
                None => 0.0,
            };
            s.tenants.push(TenantStatus {
                tenant: id,
                name: t.name.clone(),
                pid: t.pid,
                uid: t.uid,
                pinned: t.pinned,
                min_bytes: t.min,
                max_bytes: t.max,
                quota_bytes: t.quota,
                tier_share_bytes: t.tier,
                active_pct: t.active_pct(),
                health: t.colour(th).as_str().into(),
                faults_per_second: rate(|r| r.faults_zero + r.faults_tier + r.faults_inactive),
                tier_faults_per_second: rate(|r| r.faults_tier),
                promotions_per_second: rate(|r| r.promotions),
                recent_read_p50_us: p50,
                recent_read_p99_us: p99,
                seconds: t.joined.elapsed().as_secs_f64(),
                report: t.report.clone(),
            });
        }
        s.active_health = Health::of_active(s.active_bytes, s.budget_bytes, th)
            .as_str()
            .into();
        s.latency_health = Health::of_latency(s.tier_read_latency_p99_us, th)
            .as_str()
            .into();
        s
    }
}

fn colour(s: &str) -> Health {
    match s {
        "red" => Health::Red,
        "yellow" => Health::Yellow,
        _ => Health::Green,
    }
}

/// The daemon's shared state.
#[derive(Clone)]
pub struct Shared(Arc<Mutex<Host>>);

impl Shared {
    pub fn new(host: Host) -> Shared {
        Shared(Arc::new(Mutex::new(host)))
    }

    /// The state. A panic in one connection's thread cannot leave it half-changed in a way
    /// that matters (every change is one field at a time), so a poisoned lock is taken as is.
    pub fn lock(&self) -> MutexGuard<'_, Host> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Creates the socket (replacing a stale one, refusing if a daemon answers there), mode 0660.
pub fn bind(cfg: &HostConfig) -> Result<UnixListener> {
    let path = &cfg.socket;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            bail!(
                "another memtide host daemon is listening at {}",
                path.display()
            );
        }
        std::fs::remove_file(path)
            .with_context(|| format!("cannot remove the stale socket {}", path.display()))?;
    }
    let l =
        UnixListener::bind(path).with_context(|| format!("cannot listen at {}", path.display()))?;
    if let Some(gid) = cfg.group {
        std::os::unix::fs::chown(path, None, Some(gid))
            .with_context(|| format!("cannot give {} to group {gid}", path.display()))?;
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
        .with_context(|| format!("cannot set the mode of {}", path.display()))?;
    Ok(l)
}

/// Accepts tenants and clients until the process ends; a thread splits the budget every epoch.
pub fn serve(listener: UnixListener, host: Shared) -> Result<()> {
    let epoch = host.lock().cfg.epoch;
    {
        let host = host.clone();
        std::thread::Builder::new()
            .name("memtide-epoch".into())
            .spawn(move || loop {
                std::thread::sleep(epoch);
                host.lock().epoch();
            })?;
    }
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        let host = host.clone();
        let _ = std::thread::Builder::new()
            .name("memtide-conn".into())
            .spawn(move || connection(conn, host));
    }
    Ok(())
}

/// Serves one connection until it closes; its tenant, if any, leaves with it.
fn connection(conn: UnixStream, host: Shared) {
    let Ok((_, uid, _)) = memtide_engine::sys::peer_credentials(&conn) else {
        return;
    };
    let admin = uid == 0 || uid == memtide_engine::sys::effective_uid();
    let Ok(mut writer) = conn.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(conn);
    let mut mine: Option<u64> = None;
    loop {
        let resp = match protocol::read_line(&mut reader) {
            Err(_) | Ok(None) => break,
            Ok(Some(Err(e))) => Response::Error {
                message: e.to_string(),
            },
            Ok(Some(Ok(line))) => match protocol::decode(&line) {
                Err(e) => Response::Error {
                    message: e.to_string(),
                },
                Ok(req) => answer(&host, req, admin, uid, &mut mine),
            },
        };
        if writer
            .write_all(protocol::encode(&resp).as_bytes())
            .is_err()
        {
            break;
        }
    }
    if let Some(id) = mine {
        host.lock().leave(id);
    }
}

fn answer(host: &Shared, req: Request, admin: bool, uid: u32, mine: &mut Option<u64>) -> Response {
    let err = |m: String| Response::Error { message: m };
    let mut h = host.lock();
    match req {
        Request::Register(r) => {
            if mine.is_some() {
                return err("this connection already registered a tenant".into());
            }
            match h.register(r, uid) {
                Ok(id) => {
                    *mine = Some(id);
                    Response::Registered {
                        tenant: id,
                        quota_bytes: h.tenants[&id].quota,
                        tier_dir: h.cfg.tier_dir.display().to_string(),
                        tier_bytes: h.tenants[&id].tier,
                        tier_capacity_bytes: h.cfg.tier_capacity_bytes,
                        encrypt_tier: h.cfg.encrypt_tier,
                    }
                }
                Err(m) => err(m),
            }
        }
        Request::Report(r) => match *mine {
            Some(id) => {
                let (quota_bytes, tier_bytes) = h.report(id, r);
                Response::Quota {
                    quota_bytes,
                    tier_bytes: Some(tier_bytes),
                }
            }
            None => err("register first".into()),
        },
        Request::Status => {
            if admin {
                Response::Status(h.status(None))
            } else {
                // Someone else's tenant sees only itself (no tenant: the host totals alone).
                Response::Status(h.status(Some(mine.unwrap_or(0))))
            }
        }
        Request::Set(c) => {
            let target = match (c.tenant, *mine) {
                (Some(t), _) if admin => t,
                (Some(t), Some(m)) if t == m => t,
                (None, Some(m)) => m,
                (Some(t), _) => return err(format!("not allowed to change tenant {t}")),
                (None, None) => return err("which tenant? (this connection has none)".into()),
            };
            match h.change(target, &c) {
                Ok(()) => Response::Done,
                Err(m) => err(m),
            }
        }
    }
}
