//! Capacity planning: from each tenant's loss-vs-DRAM curve (replays of its profile under
//! memtide's policy), a host's DRAM, tier capacity and tier read rate, and the prices of DRAM and
//! tier, finds how many copies of a tenant mix fit per host within a loss budget, at which
//! DRAM:tier split that costs least, and what limits the packing. Pure arithmetic; the replays
//! happen in the caller. Entry point: [`plan`].

use memtide_policy::health::{Health, HealthThresholds};
use serde::Serialize;

/// One point of a tenant's curve: its profile replayed with `fraction` of its memory in DRAM.
#[derive(Clone, Copy, Debug, Serialize, PartialEq)]
pub struct Point {
    pub fraction: f64,
    /// Of that DRAM, the share the compressed pool takes (the split that lost least; 0: none).
    pub pool_share: f64,
    /// Tier-1 reads per access.
    pub miss_ratio: f64,
    /// Tier-1 writes per access.
    pub write_ratio: f64,
    /// Estimated run time relative to all-DRAM.
    pub slowdown: f64,
}

impl Point {
    /// Throughput lost relative to all-DRAM.
    pub fn loss(&self) -> f64 {
        1.0 - 1.0 / self.slowdown
    }
}

/// A kind of tenant in the mix.
#[derive(Clone, Debug, Serialize)]
pub struct Tenant {
    pub name: String,
    pub footprint_bytes: u64,
    pub active_bytes: u64,
    /// Copies of this tenant in one copy of the mix.
    pub count: u64,
    /// Memory accesses per second at full (all-DRAM) speed.
    pub rate: f64,
    /// Points by increasing fraction; the last one is all-DRAM (fraction 1).
    pub curve: Vec<Point>,
}

impl Tenant {
    /// Index of the smallest fraction whose loss is within `max_loss`.
    fn cheapest(&self, max_loss: f64) -> usize {
        self.curve
            .iter()
            .position(|p| p.loss() <= max_loss)
            .unwrap_or(self.curve.len() - 1)
    }
}

/// The host the tenants are packed onto.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Host {
    pub dram_bytes: u64,
    /// Tier-1 capacity; `None` when it is not a constraint.
    pub tier_bytes: Option<u64>,
    /// 4 KiB random reads per second tier 1 sustains; `None` when not known.
    pub tier_iops: Option<f64>,
    /// Cost of the host apart from its memory.
    pub cost: f64,
}

/// Prices per GiB.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Prices {
    pub dram_per_gib: f64,
    pub tier_per_gib: f64,
}

/// What stops one more copy of the mix from fitting.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Binding {
    /// The DRAM each copy needs to stay within the loss budget.
    Dram,
    /// The operator guidance: active memory above 75% of DRAM is red.
    ActiveMemory,
    /// Tier-1 reads per second.
    TierBandwidth,
    /// Tier-1 capacity.
    TierCapacity,
}

/// One way to split the mix's memory between DRAM and tier 1.
#[derive(Clone, Debug, Serialize)]
pub struct Split {
    /// Fraction of each tenant's memory in DRAM (in mix order).
    pub fractions: Vec<f64>,
    /// Worst loss of any tenant.
    pub loss: f64,
    pub dram_per_copy: u64,
    pub tier_per_copy: u64,
    pub active_per_copy: u64,
    /// Tier-1 reads and writes per second per copy.
    pub reads_per_copy: f64,
    pub writes_per_copy: f64,
    /// Copies per host, and what limits them.
    pub copies: u64,
    pub binding: Binding,
    /// Active memory over host DRAM at `copies` copies, and its colour.
    pub active_share: f64,
    #[serde(serialize_with = "health_name")]
    pub health: Health,
    /// Host cost (host + its DRAM + the tier the copies use) divided by copies.
    pub cost_per_copy: f64,
}

/// The plan.
#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    pub max_loss: f64,
    /// Splits from the least DRAM within the budget upwards; `best` indexes the cheapest.
    pub options: Vec<Split>,
    pub best: usize,
    /// All in DRAM: copies per host and cost per copy.
    pub all_dram_copies: u64,
    pub all_dram_cost_per_copy: f64,
    /// 1 - best cost per copy / all-DRAM cost per copy.
    pub saving: f64,
}

const GIB: f64 = (1u64 << 30) as f64;

fn health_name<S: serde::Serializer>(h: &Health, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(h.as_str())
}

/// Plans the mix `tenants` on `host` within `max_loss` (a fraction of throughput).
pub fn plan(tenants: &[Tenant], host: &Host, prices: &Prices, max_loss: f64) -> Plan {
    let start: Vec<usize> = tenants.iter().map(|t| t.cheapest(max_loss)).collect();
    // Shift every tenant up its curve together, one step at a time, until all are in DRAM:
    // more DRAM per copy costs more, but lowers tier traffic, which may be what binds.
    let steps = tenants
        .iter()
        .zip(&start)
        .map(|(t, &s)| t.curve.len() - 1 - s)
        .max()
        .unwrap_or(0);
    let mut options: Vec<Split> = (0..=steps)
        .map(|k| {
            let idx: Vec<usize> = tenants
                .iter()
                .zip(&start)
                .map(|(t, &s)| (s + k).min(t.curve.len() - 1))
                .collect();
            option(tenants, &idx, host, prices)
        })
        .collect();
    // The same split can come out twice when every tenant hit the top of its curve.
    options.dedup_by(|a, b| a.fractions == b.fractions);
    let best = (0..options.len())
        .min_by(|&a, &b| {
            let (x, y) = (&options[a], &options[b]);
            if x.copies == 0 || y.copies == 0 {
                return y.copies.cmp(&x.copies);
            }
            x.cost_per_copy
                .total_cmp(&y.cost_per_copy)
                .then(y.copies.cmp(&x.copies))
        })
        .unwrap_or(0);
    let full_dram: u64 = tenants.iter().map(|t| t.footprint_bytes * t.count).sum();
    let all_dram_copies = host.dram_bytes.checked_div(full_dram).unwrap_or(0);
    let host_total = host.cost + host.dram_bytes as f64 / GIB * prices.dram_per_gib;
    let all_dram_cost_per_copy = if all_dram_copies == 0 {
        f64::INFINITY
    } else {
        host_total / all_dram_copies as f64
    };
    let saving = 1.0 - options[best].cost_per_copy / all_dram_cost_per_copy;
    Plan {
        max_loss,
        options,
        best,
        all_dram_copies,
        all_dram_cost_per_copy,
        saving,
    }
}

fn option(tenants: &[Tenant], idx: &[usize], host: &Host, prices: &Prices) -> Split {
    let mut dram = 0u64;
    let mut tier = 0u64;
    let mut active = 0u64;
    let mut reads = 0.0;
    let mut writes = 0.0;
    let mut loss: f64 = 0.0;
    let mut fractions = Vec::new();
    for (t, &i) in tenants.iter().zip(idx) {
        let p = t.curve[i];
        let d = (t.footprint_bytes as f64 * p.fraction).ceil() as u64;
        dram += d * t.count;
        tier += (t.footprint_bytes - d.min(t.footprint_bytes)) * t.count;
        active += t.active_bytes * t.count;
        // A slowed-down tenant makes proportionally fewer accesses per second.
        let rate = t.rate / p.slowdown * t.count as f64;
        reads += p.miss_ratio * rate;
        writes += p.write_ratio * rate;
        loss = loss.max(p.loss());
        fractions.push(p.fraction);
    }
    let guidance = HealthThresholds::default();
    let limits = [
        (Binding::Dram, host.dram_bytes.checked_div(dram)),
        // The guidance is about tiered memory: with nothing in tier 1 it does not apply.
        (
            Binding::ActiveMemory,
            (tier > 0 && active > 0).then(|| {
                (host.dram_bytes as f64 * guidance.active_red_pct / 100.0 / active as f64).floor()
                    as u64
            }),
        ),
        (
            Binding::TierBandwidth,
            host.tier_iops
                .filter(|_| reads > 0.0)
                .map(|iops| (iops / reads).floor() as u64),
        ),
        (
            Binding::TierCapacity,
            host.tier_bytes.and_then(|cap| cap.checked_div(tier)),
        ),
    ];
    let (binding, copies) = limits
        .iter()
        .filter_map(|&(b, n)| n.map(|n| (b, n)))
        .min_by_key(|&(_, n)| n)
        .unwrap_or((Binding::Dram, 0));
    let active_share = (copies * active) as f64 / host.dram_bytes.max(1) as f64;
    let host_total = host.cost
        + host.dram_bytes as f64 / GIB * prices.dram_per_gib
        + (copies * tier) as f64 / GIB * prices.tier_per_gib;
    Split {
        fractions,
        loss,
        dram_per_copy: dram,
        tier_per_copy: tier,
        active_per_copy: active,
        reads_per_copy: reads,
        writes_per_copy: writes,
        copies,
        binding,
        active_share,
        health: Health::of_active(copies * active, host.dram_bytes, &guidance),
        cost_per_copy: if copies == 0 {
            f64::INFINITY
        } else {
            host_total / copies as f64
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenant(name: &str, footprint_gib: u64, active_gib: u64, losses: &[(f64, f64)]) -> Tenant {
        Tenant {
            name: name.into(),
            footprint_bytes: footprint_gib << 30,
            active_bytes: active_gib << 30,
            count: 1,
            rate: 1e7,
            curve: losses
                .iter()
                .map(|&(fraction, miss_ratio)| Point {
                    fraction,
                    pool_share: 0.0,
                    miss_ratio,
                    write_ratio: 0.0,
                    // 100 ns per access, 80 µs per miss.
                    slowdown: 1.0 + miss_ratio * 800.0,
                })
                .collect(),
        }
    }

    fn host(dram_gib: u64) -> Host {
        Host {
            dram_bytes: dram_gib << 30,
            tier_bytes: None,
            tier_iops: None,
            cost: 0.0,
        }
    }

    const PRICES: Prices = Prices {
        dram_per_gib: 3.0,
        tier_per_gib: 0.1,
    };

    #[test]
    fn dram_binds_when_the_budget_needs_much_dram() {
        // 64 GiB tenant, 8 GiB active: within 5% loss at 50% DRAM (miss ratio 5e-5 → 4%).
        let t = tenant(
            "web",
            64,
            8,
            &[(0.25, 1e-3), (0.5, 5e-5), (0.75, 1e-5), (1.0, 0.0)],
        );
        let p = plan(&[t], &host(256), &PRICES, 0.05);
        let b = &p.options[p.best];
        assert_eq!(b.fractions, vec![0.5]);
        assert_eq!(b.dram_per_copy, 32 << 30);
        assert_eq!(b.copies, 8);
        assert_eq!(b.binding, Binding::Dram);
        assert_eq!(p.all_dram_copies, 4);
        assert!(p.saving > 0.4, "{p:?}");
    }

    #[test]
    fn active_memory_guidance_binds_before_dram_runs_out() {
        // Needs only 10% DRAM, but half its memory is active: the red line (75% of DRAM
        // active) limits copies before DRAM does.
        let t = tenant("cache", 64, 32, &[(0.1, 1e-5), (1.0, 0.0)]);
        let p = plan(&[t], &host(256), &PRICES, 0.05);
        let b = &p.options[p.best];
        assert_eq!(b.binding, Binding::ActiveMemory);
        assert_eq!(b.copies, 6); // 6 x 32 = 192 GiB = 75% of 256
        assert!(b.active_share <= 0.75);
    }

    #[test]
    fn tier_bandwidth_can_make_more_dram_cheaper() {
        // At 25% DRAM each copy reads 1e-3 x 1e7 / 1.8 = 5.6 K/s; the tier serves 20 K/s, so
        // only 3 copies fit; at 50% DRAM reads drop 20x and DRAM binds at 8 copies, cheaper
        // per copy.
        let t = tenant("db", 64, 4, &[(0.25, 1e-3), (0.5, 5e-5), (1.0, 0.0)]);
        let mut h = host(256);
        h.tier_iops = Some(20_000.0);
        h.cost = 1000.0;
        let p = plan(&[t], &h, &PRICES, 0.9);
        assert_eq!(p.options[0].binding, Binding::TierBandwidth);
        assert_eq!(p.options[0].copies, 3);
        let b = &p.options[p.best];
        assert_eq!(b.fractions, vec![0.5]);
        assert_eq!(b.copies, 8);
        assert!(b.cost_per_copy < p.options[0].cost_per_copy);
    }

    #[test]
    fn a_budget_no_split_meets_falls_back_to_all_dram() {
        let t = tenant("x", 16, 16, &[(0.5, 1.0), (1.0, 0.0)]);
        let p = plan(&[t], &host(64), &PRICES, 0.01);
        assert_eq!(p.options[p.best].fractions, vec![1.0]);
        assert_eq!(p.options[p.best].copies, p.all_dram_copies);
        assert_eq!(p.saving, 0.0);
    }
}
