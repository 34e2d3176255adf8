//! The corpus: memtide's policy against the published online policies on a fixed set of
//! workload families, each at several DRAM sizes and over several seeds. Each row compares
//! memtide's misses at the same DRAM (`placement-exact`) and as the engine runs it (`placement`,
//! with its headroom below the quota) with the best online policy's, says whether a loss is
//! beyond the noise across seeds, and estimates the time; every online policy is also held
//! against the best of the other five. `memtide sim --corpus` prints it. Entry point: [`run`].

use crate::{simulate, Job, Latency, Outcome, Source, Spec};

/// The families replayed: kind and parameters, without size.
pub const FAMILIES: [&str; 12] = [
    "zipf:skew=0.6",
    "zipf:skew=0.8",
    "zipf:skew=0.99",
    "zipf:skew=1.2",
    "hotcold:hot=20%,share=90%",
    "hotcold:hot=5%,share=95%",
    "hotcold:hot=50%,share=80%",
    "active:active=20%,cold=0.5%",
    "active:active=50%,cold=2%,skew=0",
    "phases:hot=10%,share=90%,phases=4",
    "scan:hot=20%,share=90%",
    "uniform",
];

/// The online policies memtide's is measured against: each sees every access.
pub const ONLINE: [&str; 6] = ["lru", "clock", "arc", "2q", "s3fifo", "sieve"];

/// How big each family is, how many seeds, how many threads replay.
#[derive(Clone, Debug)]
pub struct Params {
    pub footprint: String,
    pub accesses: String,
    pub warmup: String,
    pub seeds: u64,
    pub threads: usize,
}

/// One workload at one DRAM size.
#[derive(Clone, Debug)]
pub struct Row {
    /// The workload's description (as `Spec` prints it).
    pub label: String,
    pub dram_fraction: f64,
    /// Every policy's outcome, summed over the seeds.
    pub outcomes: Vec<Outcome>,
    /// The online policy that missed least.
    pub best: Outcome,
    /// memtide's own outcome at the same DRAM (`placement-exact`).
    pub memtide: Outcome,
    /// memtide's misses against the best's, at the same DRAM and as the engine runs it.
    pub memtide_vs_best: f64,
    pub engine_vs_best: f64,
    /// Estimated time against the best policy's, hint faults included.
    pub time_vs_best: f64,
    /// memtide's misses less the best policy's, seed by seed.
    pub excess_by_seed: Vec<f64>,
    /// Twice the standard error of that excess, as a share of the best's misses per seed.
    pub noise: f64,
    /// With several seeds: whether the mean excess is beyond twice its standard error.
    pub beyond_noise: bool,
}

/// One policy's misses against a best, row after row: how many rows at or below it, the
/// geometric mean of the ratios and the worst.
#[derive(Clone, Copy, Debug, Default)]
pub struct Tally {
    pub at_or_below: usize,
    log_sum: f64,
    pub worst: f64,
    rows: usize,
}

impl Tally {
    /// Adds a row where the policy missed `own` times and the best `best` times; returns the
    /// ratio.
    pub fn add(&mut self, own: u64, best: u64) -> f64 {
        let r = vs(own, best);
        self.at_or_below += usize::from(own <= best);
        self.log_sum += r.ln();
        self.worst = self.worst.max(r);
        self.rows += 1;
        r
    }

    pub fn geometric_mean(&self) -> f64 {
        (self.log_sum / self.rows.max(1) as f64).exp()
    }
}

/// What the whole corpus came to.
#[derive(Clone, Debug, Default)]
pub struct Summary {
    pub rows: usize,
    /// memtide at the same DRAM, and as the engine runs it, against the best online policy.
    pub memtide: Tally,
    pub engine: Tally,
    /// Each online policy (in [`ONLINE`] order) against the best of the other five.
    pub peers: [Tally; ONLINE.len()],
    /// Rows where memtide's loss is beyond the noise across seeds.
    pub losses_beyond_noise: usize,
    time_log_sum: f64,
}

impl Summary {
    /// Geometric mean of the estimated time against the best policy's.
    pub fn time_geometric_mean(&self) -> f64 {
        (self.time_log_sum / self.rows.max(1) as f64).exp()
    }
}

/// The mean of `xs` and its standard error (0 for fewer than two values).
pub fn mean_and_standard_error(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n.max(1.0);
    if xs.len() < 2 {
        return (mean, 0.0);
    }
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, (var / n).sqrt())
}

/// Misses `m` against `best`'s, as a ratio (1 when both are 0).
pub fn vs(m: u64, best: u64) -> f64 {
    match (m, best) {
        (0, _) => 1.0,
        (m, 0) => m as f64,
        (m, b) => m as f64 / b as f64,
    }
}

/// Replays every family at every size `sizes` gives for its page count, calling `on_row` as
/// each row is done; `size` parses the sizes in the specs.
pub fn run(
    p: &Params,
    lat: &Latency,
    size: impl Fn(&str) -> Option<u64>,
    sizes: impl Fn(u64) -> Result<Vec<u64>, String>,
    mut on_row: impl FnMut(&Row),
) -> Result<Summary, String> {
    let mut sum = Summary::default();
    for family in FAMILIES {
        let (kind, rest) = family.split_once(':').unwrap_or((family, ""));
        let spec = format!(
            "{kind}:footprint={},accesses={},warmup={}{}{rest}",
            p.footprint,
            p.accesses,
            p.warmup,
            if rest.is_empty() { "" } else { "," }
        );
        let s = Spec::parse(&spec, 4096, &size).map_err(|e| format!("--corpus-*: {e}"))?;
        let label = s.to_string();
        let pages = Source::Spec(s.clone()).pages();
        let drams = sizes(pages)?;
        let jobs: Vec<Job> = drams
            .iter()
            .flat_map(|&d| {
                ["placement-exact", "placement"]
                    .into_iter()
                    .chain(ONLINE)
                    .map(move |p| Job::new(p, d))
            })
            .collect();
        // The same family with each seed (1 is the default); outcomes are summed over them.
        let mut by_seed = Vec::new();
        for seed in 1..=p.seeds {
            let src = Source::Spec(Spec { seed, ..s.clone() });
            by_seed.push(
                simulate(&src, &jobs, lat, p.threads, &|_, _| {}).map_err(|e| e.to_string())?,
            );
        }
        for &d in &drams {
            let row = row(&label, pages, d, &by_seed, p.seeds, lat, &mut sum);
            on_row(&row);
        }
    }
    Ok(sum)
}

/// The row of `label` at `d` pages of DRAM from each seed's outcomes, tallied into `sum`.
fn row(
    label: &str,
    pages: u64,
    d: u64,
    by_seed: &[Vec<Outcome>],
    seeds: u64,
    lat: &Latency,
    sum: &mut Summary,
) -> Row {
    // Each seed's outcomes at this size, and their sums.
    let per_seed: Vec<Vec<Outcome>> = by_seed
        .iter()
        .map(|out| {
            out.iter()
                .filter(|o| o.dram_pages == d.min(pages))
                .cloned()
                .collect()
        })
        .collect();
    let mut at = per_seed[0].clone();
    for out in &per_seed[1..] {
        for (s, o) in at.iter_mut().zip(out) {
            s.add(o);
        }
    }
    let find = |name: &str| at.iter().find(|o| o.policy == name).expect("memtide ran");
    let (mt, engine) = (find("placement-exact"), find("placement"));
    let best = at
        .iter()
        .filter(|o| !o.policy.starts_with("placement"))
        .min_by_key(|o| o.misses)
        .expect("online policies ran");
    // With several seeds: memtide's misses less the best policy's, seed by seed, and whether
    // their mean exceeds twice its standard error (a loss beyond the noise).
    let diffs: Vec<f64> = per_seed
        .iter()
        .map(|out| {
            let m = |name: &str| {
                out.iter()
                    .find(|o| o.policy == name)
                    .map_or(0, |o| o.misses) as f64
            };
            m("placement-exact") - m(&best.policy)
        })
        .collect();
    let (mean, se) = mean_and_standard_error(&diffs);
    let beyond_noise = seeds > 1 && mean > 2.0 * se;
    if beyond_noise {
        sum.losses_beyond_noise += 1;
    }
    let memtide_vs_best = sum.memtide.add(mt.misses, best.misses);
    let engine_vs_best = sum.engine.add(engine.misses, best.misses);
    for (tally, name) in sum.peers.iter_mut().zip(ONLINE) {
        let others = at
            .iter()
            .filter(|o| !o.policy.starts_with("placement") && o.policy != name)
            .map(|o| o.misses)
            .min()
            .expect("other online policies ran");
        tally.add(find(name).misses, others);
    }
    let time_vs_best = mt.slowdown(lat) / best.slowdown(lat);
    sum.time_log_sum += time_vs_best.ln();
    sum.rows += 1;
    Row {
        label: label.to_string(),
        dram_fraction: d as f64 / pages as f64,
        best: best.clone(),
        memtide: mt.clone(),
        memtide_vs_best,
        engine_vs_best,
        time_vs_best,
        noise: 2.0 * se / (best.misses as f64 / seeds as f64).max(1.0),
        beyond_noise,
        excess_by_seed: diffs,
        outcomes: at.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tally_counts_rows_at_or_below_and_the_worst() {
        let mut t = Tally::default();
        assert_eq!(t.add(90, 100), 0.9);
        assert_eq!(t.add(200, 100), 2.0);
        assert_eq!(t.add(0, 0), 1.0);
        assert_eq!(t.at_or_below, 2);
        assert_eq!(t.worst, 2.0);
        assert!((t.geometric_mean() - (0.9f64 * 2.0).powf(1.0 / 3.0)).abs() < 1e-12);
    }

    #[test]
    fn the_standard_error_of_a_mean() {
        assert_eq!(mean_and_standard_error(&[3.0]), (3.0, 0.0));
        let (m, se) = mean_and_standard_error(&[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(m, 2.5);
        assert!((se - (1.666_666_666_666_666_7f64 / 4.0).sqrt()).abs() < 1e-12);
    }
}
