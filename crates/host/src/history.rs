//! The last hour of the host, for the dashboard: one sample per epoch of the host and of every
//! tenant, oldest dropped first. Entry point: [`History`].

use std::collections::VecDeque;

use serde::Serialize;

use crate::protocol::HostStatus;

/// How far back the history goes.
pub const KEEP_SECONDS: f64 = 3600.0;

/// One tenant at one moment.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct TenantPoint {
    pub tenant: u64,
    pub name: String,
    pub quota_bytes: u64,
    pub dram_bytes: u64,
    pub active_bytes: u64,
    /// Tier-read p99 over the last report interval (0 without reads).
    pub read_p99_us: f64,
    /// Tier bandwidth since the sample before, bytes per second.
    pub read_bytes_per_second: f64,
    pub write_bytes_per_second: f64,
    /// The levels below DRAM: the compressed pool's DRAM (part of `dram_bytes`), the pages it
    /// holds (uncompressed bytes), and the file's bytes.
    pub pool_bytes: u64,
    pub compressed_bytes: u64,
    pub file_bytes: u64,
    /// Faults served from each level since the sample before, per second.
    pub compressed_faults_per_second: f64,
    pub file_faults_per_second: f64,
    pub health: String,
}

/// The host at one moment.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Point {
    /// Seconds since the daemon started.
    pub t: f64,
    pub budget_bytes: u64,
    pub quota_bytes: u64,
    pub dram_bytes: u64,
    pub active_bytes: u64,
    pub read_p99_us: f64,
    pub active_health: String,
    pub latency_health: String,
    pub tenants: Vec<TenantPoint>,
}

/// Samples of the last [`KEEP_SECONDS`].
#[derive(Default)]
pub struct History {
    points: VecDeque<Point>,
    /// Each tenant's counters at the sample before (for rates).
    last: Vec<Counts>,
}

/// A tenant's counters at a sample.
#[derive(Clone, Copy)]
struct Counts {
    tenant: u64,
    t: f64,
    read_bytes: u64,
    write_bytes: u64,
    faults_tier: u64,
    faults_compressed: u64,
}

impl History {
    /// Adds a sample of `s` taken `t` seconds after the daemon started.
    pub fn record(&mut self, t: f64, s: &HostStatus) {
        let mut tenants = Vec::with_capacity(s.tenants.len());
        let mut last = Vec::with_capacity(s.tenants.len());
        for ts in &s.tenants {
            let now = Counts {
                tenant: ts.tenant,
                t,
                read_bytes: ts.report.tier_read_bytes,
                write_bytes: ts.report.tier_write_bytes,
                faults_tier: ts.report.faults_tier,
                faults_compressed: ts.report.faults_compressed,
            };
            let before = self.last.iter().find(|l| l.tenant == ts.tenant && t > l.t);
            let rate = |of: fn(&Counts) -> u64| {
                before.map_or(0.0, |b| of(&now).saturating_sub(of(b)) as f64 / (t - b.t))
            };
            let (rate_r, rate_w) = (rate(|c| c.read_bytes), rate(|c| c.write_bytes));
            let compressed = rate(|c| c.faults_compressed);
            // faults_tier counts both levels.
            let file = (rate(|c| c.faults_tier) - compressed).max(0.0);
            last.push(now);
            tenants.push(TenantPoint {
                tenant: ts.tenant,
                name: ts.name.clone(),
                quota_bytes: ts.quota_bytes,
                dram_bytes: ts.report.dram_bytes,
                active_bytes: ts.report.active_bytes,
                read_p99_us: ts.recent_read_p99_us,
                read_bytes_per_second: rate_r,
                write_bytes_per_second: rate_w,
                pool_bytes: ts.report.compressed_pool_bytes,
                compressed_bytes: ts.report.compressed_bytes,
                file_bytes: ts.report.tier_bytes,
                compressed_faults_per_second: compressed,
                file_faults_per_second: file,
                health: ts.health.clone(),
            });
        }
        self.last = last;
        self.points.push_back(Point {
            t,
            budget_bytes: s.budget_bytes,
            quota_bytes: s.quota_bytes,
            dram_bytes: s.dram_bytes,
            active_bytes: s.active_bytes,
            read_p99_us: s.tier_read_latency_p99_us,
            active_health: s.active_health.clone(),
            latency_health: s.latency_health.clone(),
            tenants,
        });
        while self.points.front().is_some_and(|p| t - p.t > KEEP_SECONDS) {
            self.points.pop_front();
        }
    }

    /// The samples, oldest first.
    pub fn points(&self) -> impl Iterator<Item = &Point> {
        self.points.iter()
    }

    pub fn len(&self) -> usize {
        self.points.len()
    }

    pub fn is_empty(&self) -> bool {
        self.points.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::TenantStatus;

    fn status(read: u64) -> HostStatus {
        let mut t = TenantStatus {
            tenant: 1,
            name: "a".into(),
            ..TenantStatus::default()
        };
        t.report.tier_read_bytes = read;
        // Faults from below DRAM: 3 per byte read, 1 of them from the pool.
        t.report.faults_tier = 3 * read;
        t.report.faults_compressed = read;
        t.report.compressed_pool_bytes = 1 << 20;
        HostStatus {
            tenants: vec![t],
            ..HostStatus::default()
        }
    }

    #[test]
    fn keeps_an_hour_and_computes_bandwidth() {
        let mut h = History::default();
        h.record(0.0, &status(0));
        h.record(2.0, &status(4096));
        let p: Vec<&Point> = h.points().collect();
        assert_eq!(p[1].tenants[0].read_bytes_per_second, 2048.0);
        assert_eq!(p[1].tenants[0].compressed_faults_per_second, 2048.0);
        assert_eq!(p[1].tenants[0].file_faults_per_second, 4096.0);
        assert_eq!(p[1].tenants[0].pool_bytes, 1 << 20);
        assert_eq!(p[0].tenants[0].file_faults_per_second, 0.0);
        h.record(KEEP_SECONDS + 1.0, &status(4096));
        assert_eq!(h.len(), 2, "the sample from t=0 is over an hour old");
        assert_eq!(h.points().next().unwrap().t, 2.0);
    }
}
