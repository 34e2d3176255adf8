//! Value parsers shared by the subcommands' flags (sizes, percentages), so every flag reports
//! a bad value the same way.

/// Parses a byte size such as `512MiB` or `4GiB`.
pub fn size(s: &str) -> Result<u64, String> {
    memtide_engine::size::parse(s).map_err(|e| e.to_string())
}

/// Parses a positive byte size.
pub fn nonzero_size(s: &str) -> Result<u64, String> {
    match size(s)? {
        0 => Err("must be more than 0".into()),
        n => Ok(n),
    }
}

/// Parses a percentage `0 < p <= 100`, written `25%` or `25`.
pub fn percent(s: &str) -> Result<f64, String> {
    let t = s.trim().trim_end_matches('%');
    match t.parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 100.0 => Ok(v),
        _ => Err(format!("`{s}` is not a percentage between 0 and 100")),
    }
}

/// Parses a DRAM budget as a percentage of a footprint, `0 < p <= 1000`: above 100 the budget
/// exceeds the footprint (no pressure).
pub fn budget_percent(s: &str) -> Result<f64, String> {
    let t = s.trim().trim_end_matches('%');
    match t.parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 1000.0 => Ok(v),
        _ => Err(format!(
            "`{s}` is not a budget: give a percentage of the footprint, more than 0 and at most 1000"
        )),
    }
}

/// Parses a fraction `0 <= f <= 1`, written as a percentage (`20%`) or a fraction (`0.2`).
pub fn fraction(s: &str) -> Result<f64, String> {
    let t = s.trim();
    let v = if let Some(p) = t.strip_suffix('%') {
        p.trim().parse::<f64>().map(|v| v / 100.0)
    } else {
        t.parse::<f64>()
    };
    match v {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        _ => Err(format!("`{s}` is not a fraction: write 20% or 0.2")),
    }
}

/// Parses a duration in seconds, `10`, `2.5s` or `500ms`.
pub fn seconds(s: &str) -> Result<f64, String> {
    let t = s.trim();
    let v = if let Some(ms) = t.strip_suffix("ms") {
        ms.trim().parse::<f64>().map(|v| v / 1000.0)
    } else {
        t.trim_end_matches('s').trim().parse::<f64>()
    };
    match v {
        Ok(v) if v > 0.0 && v.is_finite() => Ok(v),
        _ => Err(format!("`{s}` is not a duration: write 10s or 500ms")),
    }
}

/// Parses a latency in nanoseconds: `90us`, `100ns`, `1.5ms`, `80µs`.
pub fn latency_ns(s: &str) -> Result<f64, String> {
    let t = s.trim();
    let (num, mult) = if let Some(n) = t.strip_suffix("ns") {
        (n, 1.0)
    } else if let Some(n) = t.strip_suffix("us").or_else(|| t.strip_suffix("µs")) {
        (n, 1e3)
    } else if let Some(n) = t.strip_suffix("ms") {
        (n, 1e6)
    } else {
        return Err(format!("`{s}` is not a latency: write 90us, 100ns or 1ms"));
    };
    match num.trim().parse::<f64>() {
        Ok(v) if v >= 0.0 && v.is_finite() => Ok(v * mult),
        _ => Err(format!("`{s}` is not a latency: write 90us, 100ns or 1ms")),
    }
}

/// Parses a duration that may be zero.
pub fn seconds_or_zero(s: &str) -> Result<f64, String> {
    if s.trim().trim_end_matches('s').trim().parse::<f64>() == Ok(0.0) {
        return Ok(0.0);
    }
    seconds(s)
}

/// Parses a rate per second: `5M`, `5M/s`, `200K/s`, `1e6`.
pub fn rate(s: &str) -> Result<f64, String> {
    let t = s.trim().trim_end_matches("/s");
    let (num, mult) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 1e3),
        Some('M' | 'm') => (&t[..t.len() - 1], 1e6),
        Some('G' | 'g') => (&t[..t.len() - 1], 1e9),
        _ => (t, 1.0),
    };
    match num.trim().parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() => Ok(v * mult),
        _ => Err(format!("`{s}` is not a rate: write 5M/s")),
    }
}

/// Fault delivery: `threads` or `signal`.
pub fn delivery(s: &str) -> Result<memtide_engine::Delivery, String> {
    memtide_engine::Delivery::from_name(s)
        .ok_or_else(|| format!("`{s}` is not a way to deliver faults: write threads or signal"))
}

pub fn eviction_policy(s: &str) -> Result<memtide_engine::EvictionPolicy, String> {
    memtide_engine::EvictionPolicy::from_name(s)
        .ok_or_else(|| format!("`{s}` is not an eviction policy: write sweep or placement"))
}

pub fn compress(s: &str) -> Result<memtide_engine::Compress, String> {
    memtide_engine::Compress::from_name(s)
        .ok_or_else(|| format!("`{s}` is not a compressor memtide has: write lz4, zstd or off"))
}

/// How the compressed pool is sized (`--compressed-sizing`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolSizing {
    Fixed,
    Adaptive,
}

pub fn pool_sizing(s: &str) -> Result<PoolSizing, String> {
    match s {
        "fixed" => Ok(PoolSizing::Fixed),
        "adaptive" => Ok(PoolSizing::Adaptive),
        _ => Err(format!("`{s}`: write fixed or adaptive")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parsers() {
        assert_eq!(nonzero_size("1GiB"), Ok(1 << 30));
        assert!(nonzero_size("0").is_err());
        assert!(nonzero_size("lots").is_err());
        assert_eq!(percent("25%"), Ok(25.0));
        assert!(percent("0").is_err());
        assert_eq!(budget_percent("125%"), Ok(125.0));
        assert!(budget_percent("0").is_err() && budget_percent("2000").is_err());
        assert_eq!(fraction("20%"), Ok(0.2));
        assert_eq!(fraction("0.9"), Ok(0.9));
        assert!(fraction("120%").is_err());
        assert_eq!(seconds("500ms"), Ok(0.5));
        assert_eq!(seconds("2s"), Ok(2.0));
        assert!(seconds("-1").is_err());
    }
}
