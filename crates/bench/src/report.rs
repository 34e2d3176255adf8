//! Small pieces every report shares: medians, the progress bar, JSON files.

use std::path::Path;

use anyhow::{Context, Result};

/// Median of the finite values (NaN when there are none).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// A 30-character bar for `done` of `total`.
pub fn bar(done: usize, total: usize) -> String {
    let w = 30;
    let filled = (done * w / total.max(1)).min(w);
    format!("[{}{}]", "#".repeat(filled), " ".repeat(w - filled))
}

/// `[k/total, about N min left]`: where a long series of runs is, the estimate from the runs
/// done so far.
pub fn step_label(done: usize, total: usize, started: std::time::Instant) -> String {
    if done == 0 {
        return format!("[1/{total}]");
    }
    let left = started.elapsed().as_secs_f64() / done as f64 * (total - done) as f64;
    format!("[{}/{total}, about {:.0} min left]", done + 1, left / 60.0)
}

/// Writes `value` as pretty JSON to `path`.
pub fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    std::fs::write(path, serde_json::to_vec_pretty(value)?)
        .with_context(|| format!("cannot write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_skips_failed_runs_and_averages_the_middle_pair() {
        assert_eq!(median(vec![3.0, f64::NAN, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(vec![f64::NAN]).is_nan());
        assert_eq!(
            bar(15, 30),
            format!("[{}{}]", "#".repeat(15), " ".repeat(15))
        );
    }
}
