//! Prometheus metrics: the host and every tenant, named as all of memtide's metrics are
//! (`memtide_<subsystem>_<what>`, units in the name; counters get `_total` from the encoder),
//! encoded by `prometheus-client` from a [`HostStatus`] taken at scrape time; and the small HTTP
//! server that serves them (`/metrics`, the status as JSON at `/api/status`, and from a daemon
//! the dashboard at `/` over the last hour at `/api/history`). Entry points: [`encode`],
//! [`serve_http`].

use std::borrow::Cow;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::protocol::{HostStatus, TenantReport, TenantStatus};

/// The text a scrape gets for `status`.
pub fn encode(status: &HostStatus) -> String {
    let mut reg = Registry::default();
    reg.register_collector(Box::new(Status(status.clone())));
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, &reg);
    out
}

#[derive(Debug)]
struct Status(HostStatus);

type Labels = Vec<(Cow<'static, str>, String)>;

fn labels(t: &TenantStatus) -> Labels {
    vec![
        ("tenant".into(), t.name.clone()),
        ("id".into(), t.tenant.to_string()),
        ("pid".into(), t.pid.to_string()),
    ]
}

/// A histogram whose buckets were counted elsewhere (by the engine).
#[derive(Debug)]
struct ConstHistogram<'a> {
    sum: f64,
    count: u64,
    /// Counts per bucket, not cumulative: the encoder adds them up into `le` buckets.
    buckets: &'a [(f64, u64)],
}

impl EncodeMetric for ConstHistogram<'_> {
    fn encode(&self, mut e: MetricEncoder) -> Result<(), std::fmt::Error> {
        e.encode_histogram::<NoLabelSet>(self.sum, self.count, self.buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// A gauge: one value per label set; a single row without labels is the host's own.
fn gauge(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: &[(Labels, i64)],
) -> Result<(), std::fmt::Error> {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
    match rows {
        [(l, v)] if l.is_empty() => ConstGauge::new(*v).encode(m)?,
        _ => {
            for (l, v) in rows {
                ConstGauge::new(*v).encode(m.encode_family(l)?)?;
            }
        }
    }
    Ok(())
}

fn counter(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: &[(Labels, u64)],
) -> Result<(), std::fmt::Error> {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (l, v) in rows {
        ConstCounter::new(*v).encode(m.encode_family(l)?)?;
    }
    Ok(())
}

fn health_value(colour: &str) -> i64 {
    match colour {
        "red" => 2,
        "yellow" => 1,
        _ => 0,
    }
}

impl Collector for Status {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = &self.0;
        let host: Labels = Vec::new();
        let h = |v: u64| vec![(host.clone(), v as i64)];
        gauge(
            &mut enc,
            "memtide_host_dram_budget_bytes",
            "DRAM the host daemon shares among tenants.",
            &h(s.budget_bytes),
        )?;
        gauge(
            &mut enc,
            "memtide_host_tier_capacity_bytes",
            "Tier-1 capacity of the host.",
            &h(s.tier_capacity_bytes),
        )?;
        gauge(
            &mut enc,
            "memtide_host_quota_bytes",
            "Sum of the tenants' DRAM quotas.",
            &h(s.quota_bytes),
        )?;
        gauge(
            &mut enc,
            "memtide_host_dram_bytes",
            "Managed memory in DRAM, all tenants.",
            &h(s.dram_bytes),
        )?;
        gauge(
            &mut enc,
            "memtide_host_tier_bytes",
            "Managed memory in tier 1, all tenants.",
            &h(s.tier_bytes),
        )?;
        gauge(
            &mut enc,
            "memtide_host_active_bytes",
            "Estimated active memory, all tenants.",
            &h(s.active_bytes),
        )?;
        gauge(
            &mut enc,
            "memtide_host_tenants",
            "Tenants registered.",
            &h(s.tenants.len() as u64),
        )?;
        gauge(
            &mut enc,
            "memtide_host_active_health",
            "Active memory against the budget: 0 green (<50%), 1 yellow (50-75%), 2 red (>75%).",
            &[(host.clone(), health_value(&s.active_health))],
        )?;
        gauge(
            &mut enc,
            "memtide_host_tier_read_latency_health",
            "Worst tenant's tier-1 read p99: 0 green (<200us), 1 yellow (200-400us), 2 red (>400us).",
            &[(host.clone(), health_value(&s.latency_health))],
        )?;

        let per = |f: &dyn Fn(&TenantStatus) -> i64| -> Vec<(Labels, i64)> {
            s.tenants.iter().map(|t| (labels(t), f(t))).collect()
        };
        let per_c = |f: &dyn Fn(&TenantReport) -> u64| -> Vec<(Labels, u64)> {
            s.tenants
                .iter()
                .map(|t| (labels(t), f(&t.report)))
                .collect()
        };
        gauge(
            &mut enc,
            "memtide_tenant_quota_bytes",
            "The tenant's DRAM quota.",
            &per(&|t| t.quota_bytes as i64),
        )?;
        gauge(
            &mut enc,
            "memtide_tenant_min_bytes",
            "The tenant's guaranteed DRAM.",
            &per(&|t| t.min_bytes as i64),
        )?;
        gauge(
            &mut enc,
            "memtide_tenant_dram_bytes",
            "The tenant's managed memory in DRAM.",
            &per(&|t| t.report.dram_bytes as i64),
        )?;
        {
            let mut m = enc.encode_descriptor(
                "memtide_tenant_tier_bytes",
                "The tenant's managed memory below DRAM, by level: compressed (pages in the compressed pool, uncompressed size) and file (tier 1).",
                None,
                MetricType::Gauge,
            )?;
            for t in &s.tenants {
                for (level, v) in [
                    ("compressed", t.report.compressed_bytes),
                    ("file", t.report.tier_bytes),
                ] {
                    let mut l = labels(t);
                    l.push(("level".into(), level.into()));
                    ConstGauge::new(v as i64).encode(m.encode_family(&l)?)?;
                }
            }
        }
        gauge(
            &mut enc,
            "memtide_tenant_compressed_pool_bytes",
            "DRAM the tenant's compressed pool takes (part of its DRAM).",
            &per(&|t| t.report.compressed_pool_bytes as i64),
        )?;
        gauge(
            &mut enc,
            "memtide_tenant_tier_limit_bytes",
            "The most the tenant's tier 1 may hold now (its share of the host's tier capacity).",
            &per(&|t| t.tier_share_bytes as i64),
        )?;
        gauge(
            &mut enc,
            "memtide_tenant_tier_file_bytes",
            "How long the tenant's tier files are (above its limit until what lay above a lowered limit has moved below it).",
            &per(&|t| t.report.tier_file_bytes as i64),
        )?;
        gauge(
            &mut enc,
            "memtide_tenant_active_bytes",
            "The tenant's estimated active memory (pages touched within a second, sampled).",
            &per(&|t| t.report.active_bytes as i64),
        )?;
        gauge(
            &mut enc,
            "memtide_tenant_pinned",
            "1 if the tenant is never tiered.",
            &per(&|t| t.pinned as u64 as i64),
        )?;
        gauge(
            &mut enc,
            "memtide_tenant_health",
            "The tenant's colour: 0 green, 1 yellow, 2 red (active memory against its quota, tier read p99).",
            &per(&|t| health_value(&t.health)),
        )?;
        {
            let mut m = enc.encode_descriptor(
                "memtide_tenant_faults",
                "Faults by kind: zero (first touch), compressed (decompressed from the pool), tier (read from tier 1), inactive (hint fault, no I/O), wait (waited for a page in flight).",
                None,
                MetricType::Counter,
            )?;
            for t in &s.tenants {
                for (kind, v) in [
                    ("zero", t.report.faults_zero),
                    ("compressed", t.report.faults_compressed),
                    (
                        "tier",
                        t.report.faults_tier - t.report.faults_compressed.min(t.report.faults_tier),
                    ),
                    ("inactive", t.report.faults_inactive),
                    ("wait", t.report.faults_wait),
                ] {
                    let mut l = labels(t);
                    l.push(("kind".into(), kind.into()));
                    ConstCounter::new(v).encode(m.encode_family(&l)?)?;
                }
            }
        }
        counter(
            &mut enc,
            "memtide_tenant_promotions",
            "Pages brought back into DRAM.",
            &per_c(&|r| r.promotions),
        )?;
        counter(
            &mut enc,
            "memtide_tenant_demotions",
            "Pages moved out of DRAM to tier 1.",
            &per_c(&|r| r.demotions),
        )?;
        counter(
            &mut enc,
            "memtide_tenant_tier_read_bytes",
            "Bytes read from tier 1.",
            &per_c(&|r| r.tier_read_bytes),
        )?;
        counter(
            &mut enc,
            "memtide_tenant_tier_write_bytes",
            "Bytes written to tier 1.",
            &per_c(&|r| r.tier_write_bytes),
        )?;
        {
            let mut m = enc.encode_descriptor(
                "memtide_tenant_tier_read_latency_seconds",
                "Tier-1 read latency.",
                None,
                MetricType::Histogram,
            )?;
            for t in &s.tenants {
                // The engine's counts are cumulative; the encoder wants them per bucket.
                let mut below = 0u64;
                let buckets: Vec<(f64, u64)> = t
                    .report
                    .tier_read_latency_buckets
                    .iter()
                    .map(|&(le_us, n)| (le_us / 1e6, n))
                    .chain(std::iter::once((f64::INFINITY, t.report.tier_reads)))
                    .map(|(le, cumulative)| {
                        let n = cumulative.saturating_sub(below);
                        below = below.max(cumulative);
                        (le, n)
                    })
                    .collect();
                ConstHistogram {
                    sum: t.report.tier_read_latency_sum_us / 1e6,
                    count: t.report.tier_reads,
                    buckets: &buckets,
                }
                .encode(m.encode_family(&labels(t))?)?;
            }
        }
        Ok(())
    }
}

/// The dashboard page: no assets from anywhere else, so it works without a network.
pub const DASHBOARD: &str = include_str!("dashboard.html");

/// What the HTTP server serves: the status (for `/metrics` and `/api/status`) and, from a
/// daemon, the last hour (`/api/history`, drawn by the dashboard at `/`).
pub struct Routes {
    pub status: Box<dyn Fn() -> HostStatus + Send + Sync>,
    pub history: Option<Box<dyn Fn() -> String + Send + Sync>>,
}

/// Requests served at once; a connection beyond them is closed unanswered.
const MAX_CLIENTS: usize = 32;

/// The most a request's line and headers may take.
const MAX_HEAD: usize = 8 << 10;

/// The most time a client has to send its request, and then to take the answer: a client that
/// stops reading (or writes a byte a second) loses its connection instead of holding a thread.
const CLIENT_TIME: Duration = Duration::from_secs(5);

/// Serves `routes` on `addr`, on a thread of its own. Returns the address bound (port 0 picks
/// one). Every request is answered once and the connection closed (`Connection: close`);
/// requests whose `Host` is not an IP address or `localhost` are refused, so a web page
/// cannot read the daemon through a name it rebinds to this machine.
pub fn serve_http(addr: SocketAddr, routes: Routes) -> Result<SocketAddr> {
    let listener =
        TcpListener::bind(addr).with_context(|| format!("cannot serve metrics on {addr}"))?;
    let bound = listener
        .local_addr()
        .context("the metrics server has no address")?;
    let routes = Arc::new(routes);
    let busy = Arc::new(AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("memtide-http".into())
        .spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else {
                    // Out of descriptors: wait for connections to close.
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                };
                if busy.fetch_add(1, Ordering::AcqRel) >= MAX_CLIENTS {
                    busy.fetch_sub(1, Ordering::AcqRel);
                    continue;
                }
                let (routes, slot) = (routes.clone(), Slot(busy.clone()));
                // The slot is given back when the thread ends, however it ends (or when it
                // could not start).
                let _ = std::thread::Builder::new()
                    .name("memtide-http-client".into())
                    .spawn(move || {
                        let _slot = slot;
                        answer(conn, &routes);
                    });
            }
        })?;
    Ok(bound)
}

/// One of the [`MAX_CLIENTS`] places, given back when dropped.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A request as far as the server needs it.
struct Head {
    method: String,
    path: String,
    host: Option<String>,
}

/// Reads a request's line and headers within [`CLIENT_TIME`] and [`MAX_HEAD`].
fn read_head(conn: &mut TcpStream) -> Option<Head> {
    let deadline = Instant::now() + CLIENT_TIME;
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") && !buf.windows(2).any(|w| w == b"\n\n") {
        let left = deadline.checked_duration_since(Instant::now())?;
        conn.set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .ok()?;
        let n = conn.read(&mut chunk).ok()?;
        if n == 0 || buf.len() + n > MAX_HEAD {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let text = String::from_utf8_lossy(&buf);
    let mut lines = text.lines();
    let mut first = lines.next()?.split_whitespace();
    let (method, target) = (first.next()?.to_string(), first.next()?);
    let host = lines
        .take_while(|l| !l.is_empty())
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("host"))
        .map(|(_, v)| v.trim().to_string());
    Some(Head {
        method,
        path: target.split('?').next().unwrap_or("").to_string(),
        host,
    })
}

/// Whether a `Host` header names this machine without a name anyone can point elsewhere: an
/// IP address or `localhost`, with or without a port. A request without one (HTTP/1.0) is let
/// through: browsers always send it.
pub fn host_allowed(host: Option<&str>) -> bool {
    let Some(h) = host else {
        return true;
    };
    let name = if let Some(rest) = h.strip_prefix('[') {
        match rest.split_once(']') {
            Some((v6, port))
                if port.is_empty()
                    || port
                        .strip_prefix(':')
                        .is_some_and(|p| p.parse::<u16>().is_ok()) =>
            {
                return v6.parse::<std::net::Ipv6Addr>().is_ok();
            }
            _ => return false,
        }
    } else {
        match h.rsplit_once(':') {
            Some((name, port)) if port.parse::<u16>().is_ok() => name,
            Some(_) => return false,
            None => h,
        }
    };
    name.eq_ignore_ascii_case("localhost") || name.parse::<std::net::Ipv4Addr>().is_ok()
}

fn answer(mut conn: TcpStream, routes: &Routes) {
    let Some(head) = read_head(&mut conn) else {
        return;
    };
    let (body, ctype, code) = if head.method != "GET" && head.method != "HEAD" {
        ("only GET and HEAD\n".to_string(), "text/plain", 405)
    } else if !host_allowed(head.host.as_deref()) {
        (
            "ask by IP address or localhost\n".to_string(),
            "text/plain",
            403,
        )
    } else {
        match (head.path.as_str(), &routes.history) {
            ("/metrics", _) => (
                encode(&(routes.status)()),
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                200,
            ),
            ("/api/status", _) => (
                serde_json::to_string(&(routes.status)()).unwrap_or_default(),
                "application/json",
                200,
            ),
            ("/api/history", Some(h)) => (h(), "application/json", 200),
            ("/", Some(_)) => (DASHBOARD.to_string(), "text/html; charset=utf-8", 200),
            _ => ("not found\n".to_string(), "text/plain", 404),
        }
    };
    let reason = match code {
        200 => "OK",
        403 => "Forbidden",
        404 => "Not Found",
        _ => "Method Not Allowed",
    };
    let mut out = format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if head.method != "HEAD" {
        out.extend_from_slice(body.as_bytes());
    }
    let deadline = Instant::now() + CLIENT_TIME;
    let mut sent = 0;
    while sent < out.len() {
        let Some(left) = deadline.checked_duration_since(Instant::now()) else {
            return;
        };
        if conn
            .set_write_timeout(Some(left.max(Duration::from_millis(1))))
            .is_err()
        {
            return;
        }
        match conn.write(&out[sent..(sent + (64 << 10)).min(out.len())]) {
            Ok(0) | Err(_) => return,
            Ok(n) => sent += n,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_follow_the_naming_contract() {
        let mut t = TenantStatus {
            tenant: 1,
            name: "redis".into(),
            pid: 42,
            quota_bytes: 1 << 30,
            health: "red".into(),
            ..TenantStatus::default()
        };
        t.report.faults_tier = 17 + 5;
        t.report.faults_compressed = 5;
        t.report.tier_bytes = 4096;
        t.report.compressed_bytes = 8192;
        t.report.compressed_pool_bytes = 3000;
        t.report.tier_reads = 3;
        t.report.tier_read_latency_sum_us = 300.0;
        t.report.tier_read_latency_buckets = vec![(100.0, 2), (200.0, 3)];
        let s = HostStatus {
            budget_bytes: 8 << 30,
            active_health: "green".into(),
            latency_health: "green".into(),
            tenants: vec![t],
            ..HostStatus::default()
        };
        let text = encode(&s);
        for want in [
            "memtide_host_dram_budget_bytes 8589934592",
            "memtide_tenant_quota_bytes{tenant=\"redis\",id=\"1\",pid=\"42\"} 1073741824",
            "memtide_tenant_faults_total{tenant=\"redis\",id=\"1\",pid=\"42\",kind=\"tier\"} 17",
            "memtide_tenant_faults_total{tenant=\"redis\",id=\"1\",pid=\"42\",kind=\"compressed\"} 5",
            "memtide_tenant_tier_bytes{tenant=\"redis\",id=\"1\",pid=\"42\",level=\"file\"} 4096",
            "memtide_tenant_tier_bytes{tenant=\"redis\",id=\"1\",pid=\"42\",level=\"compressed\"} 8192",
            "memtide_tenant_compressed_pool_bytes{tenant=\"redis\",id=\"1\",pid=\"42\"} 3000",
            "memtide_tenant_health{tenant=\"redis\",id=\"1\",pid=\"42\"} 2",
            "memtide_tenant_tier_read_latency_seconds_bucket{le=\"0.0001\",tenant=\"redis\",id=\"1\",pid=\"42\"} 2",
            "memtide_tenant_tier_read_latency_seconds_bucket{le=\"0.0002\",tenant=\"redis\",id=\"1\",pid=\"42\"} 3",
            "memtide_tenant_tier_read_latency_seconds_bucket{le=\"+Inf\",tenant=\"redis\",id=\"1\",pid=\"42\"} 3",
            "memtide_tenant_tier_read_latency_seconds_count{tenant=\"redis\",id=\"1\",pid=\"42\"} 3",
        ] {
            assert!(text.contains(want), "missing {want:?} in:\n{text}");
        }
        assert!(text.ends_with("# EOF\n"));
    }

    /// Sends one request on a new connection; returns the whole answer.
    fn get(addr: SocketAddr, path: &str, host: &str) -> String {
        let mut c = TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        write!(c, "GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n").unwrap();
        let mut out = String::new();
        c.read_to_string(&mut out).unwrap();
        out
    }

    #[test]
    fn a_client_that_stops_reading_holds_no_one_else() {
        // A status whose metrics take several MiB: more than the sockets between hold.
        let big = HostStatus {
            tenants: (0..5000)
                .map(|i| TenantStatus {
                    tenant: i,
                    name: format!("tenant-{i}"),
                    ..TenantStatus::default()
                })
                .collect(),
            ..HostStatus::default()
        };
        let whole = encode(&big).len();
        let addr = serve_http(
            "127.0.0.1:0".parse().unwrap(),
            Routes {
                status: Box::new(move || big.clone()),
                history: None,
            },
        )
        .unwrap();
        let mut slow = TcpStream::connect(addr).unwrap();
        write!(slow, "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").unwrap();
        // A client that asks nothing at all either.
        let _mute = TcpStream::connect(addr).unwrap();
        std::thread::sleep(Duration::from_millis(500));
        let t0 = Instant::now();
        let other = get(addr, "/nothing-here", "127.0.0.1");
        assert!(other.starts_with("HTTP/1.1 404"), "{other}");
        let full = get(addr, "/metrics", &addr.to_string());
        assert!(full.starts_with("HTTP/1.1 200"));
        assert!(full.ends_with("# EOF\n"), "a reading client gets it all");
        assert!(t0.elapsed() < CLIENT_TIME, "served in {:?}", t0.elapsed());
        let refused = get(addr, "/metrics", "rebound.example:9464");
        assert!(refused.starts_with("HTTP/1.1 403"), "{refused}");
        // The one that stopped reading is cut off after its time.
        std::thread::sleep(CLIENT_TIME + Duration::from_secs(1));
        slow.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut got = Vec::new();
        let _ = slow.read_to_end(&mut got);
        assert!(
            got.len() < whole,
            "the slow client got all {} bytes",
            got.len()
        );
    }

    #[test]
    fn only_ip_addresses_and_localhost_are_hosts() {
        for ok in [
            None,
            Some("127.0.0.1:9464"),
            Some("127.0.0.1"),
            Some("localhost:9464"),
            Some("LOCALHOST"),
            Some("[::1]:9464"),
            Some("[::1]"),
            Some("10.1.2.3:80"),
        ] {
            assert!(host_allowed(ok), "{ok:?} refused");
        }
        for bad in [
            Some("attacker.example:9464"),
            Some("attacker.example"),
            Some("localhost.attacker.example"),
            Some("127.0.0.1.nip.io:9464"),
            Some("[::1]x"),
            Some("[::1]x9464"),
            Some("[::1]:"),
            Some("127.0.0.1:port"),
            Some(""),
        ] {
            assert!(!host_allowed(bad), "{bad:?} allowed");
        }
    }
}
