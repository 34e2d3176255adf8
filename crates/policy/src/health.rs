//! Health colours from the published operator guidance for memory tiering.
//!
//! Active memory under 50% of DRAM is green, 50–75% yellow, over 75% red; tier-1 read latency
//! under 200 µs green, 200–400 µs yellow, over 400 µs red. Entry point: [`Health::of_active`].

/// A traffic-light verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Health {
    Green,
    Yellow,
    Red,
}

impl Health {
    /// Lower-case name, as printed and exported.
    pub fn as_str(self) -> &'static str {
        match self {
            Health::Green => "green",
            Health::Yellow => "yellow",
            Health::Red => "red",
        }
    }

    /// Verdict for active memory as a fraction of the DRAM quota.
    pub fn of_active(active_bytes: u64, dram_bytes: u64, t: &HealthThresholds) -> Health {
        if dram_bytes == 0 {
            return Health::Red;
        }
        let pct = active_bytes as f64 * 100.0 / dram_bytes as f64;
        classify(pct, t.active_yellow_pct, t.active_red_pct)
    }

    /// Verdict for a tier-1 read latency in microseconds.
    pub fn of_latency(latency_us: f64, t: &HealthThresholds) -> Health {
        classify(latency_us, t.latency_yellow_us, t.latency_red_us)
    }
}

fn classify(value: f64, yellow: f64, red: f64) -> Health {
    if value > red {
        Health::Red
    } else if value >= yellow {
        Health::Yellow
    } else {
        Health::Green
    }
}

/// The thresholds; [`Default`] gives the published ones.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HealthThresholds {
    pub active_yellow_pct: f64,
    pub active_red_pct: f64,
    pub latency_yellow_us: f64,
    pub latency_red_us: f64,
}

impl Default for HealthThresholds {
    fn default() -> Self {
        HealthThresholds {
            active_yellow_pct: 50.0,
            active_red_pct: 75.0,
            latency_yellow_us: 200.0,
            latency_red_us: 400.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn published_boundaries() {
        let t = HealthThresholds::default();
        assert_eq!(Health::of_active(49, 100, &t), Health::Green);
        assert_eq!(Health::of_active(50, 100, &t), Health::Yellow);
        assert_eq!(Health::of_active(75, 100, &t), Health::Yellow);
        assert_eq!(Health::of_active(76, 100, &t), Health::Red);
        assert_eq!(Health::of_latency(199.0, &t), Health::Green);
        assert_eq!(Health::of_latency(300.0, &t), Health::Yellow);
        assert_eq!(Health::of_latency(401.0, &t), Health::Red);
        assert_eq!(Health::of_active(1, 0, &t), Health::Red);
    }
}
