//! The engine's counters: relaxed atomics in one place, updated from the fault path (so no
//! locks, no allocation), read into a serializable [`Snapshot`]. Names follow the metric
//! naming of the whole project (`memtide_<subsystem>_<what>`, units in the name, as the
//! Prometheus metrics of `run --metrics` and the host daemon). Entry points: [`Counters`],
//! [`LatencyHistogram`], [`Snapshot`].

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use serde::{Deserialize, Serialize};

/// Latency histogram with log-linear buckets (8 per power of two), lock-free.
pub struct LatencyHistogram {
    buckets: [AtomicU64; Self::BUCKETS],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        LatencyHistogram {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            count: AtomicU64::new(0),
            sum_ns: AtomicU64::new(0),
        }
    }
}

impl LatencyHistogram {
    const SUB: u32 = 8;
    const BUCKETS: usize = 60 * Self::SUB as usize;

    fn index(ns: u64) -> usize {
        if ns < Self::SUB as u64 {
            return ns as usize;
        }
        let exp = 63 - ns.leading_zeros();
        let sub = (ns >> (exp - 3)) & (Self::SUB as u64 - 1);
        ((exp - 2) * Self::SUB + sub as u32) as usize
    }

    /// Lower bound in nanoseconds of bucket `i` (inverse of `index`).
    fn lower(i: usize) -> u64 {
        if i < Self::SUB as usize {
            return i as u64;
        }
        let exp = i as u32 / Self::SUB + 2;
        let sub = i as u64 % Self::SUB as u64;
        (1u64 << exp) + (sub << (exp - 3))
    }

    fn clear(&self) {
        for b in &self.buckets {
            b.store(0, Relaxed);
        }
        self.count.store(0, Relaxed);
        self.sum_ns.store(0, Relaxed);
    }

    pub fn record(&self, ns: u64) {
        self.buckets[Self::index(ns).min(Self::BUCKETS - 1)].fetch_add(1, Relaxed);
        self.count.fetch_add(1, Relaxed);
        self.sum_ns.fetch_add(ns, Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.count.load(Relaxed)
    }

    /// The value at quantile `q` (0..=1) in microseconds, to bucket resolution (12.5%); 0 when
    /// empty.
    pub fn quantile_us(&self, q: f64) -> f64 {
        let total = self.count();
        if total == 0 {
            return 0.0;
        }
        let rank = ((total as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, b) in self.buckets.iter().enumerate() {
            seen += b.load(Relaxed);
            if seen >= rank {
                // Midpoint of the bucket.
                let lo = Self::lower(i);
                let hi = Self::lower(i + 1);
                return (lo + hi) as f64 / 2.0 / 1000.0;
            }
        }
        0.0
    }

    /// Cumulative counts at the upper bounds `le_us` (microseconds, ascending), as a
    /// Prometheus histogram has them; a bucket straddling a bound counts below it when its
    /// lower edge is below the bound (to bucket resolution, 12.5%).
    pub fn cumulative(&self, le_us: &[f64]) -> Vec<(f64, u64)> {
        let mut out = Vec::with_capacity(le_us.len());
        let mut seen = 0u64;
        let mut i = 0;
        for &le in le_us {
            let le_ns = (le * 1000.0) as u64;
            while i < Self::BUCKETS && Self::lower(i) < le_ns {
                seen += self.buckets[i].load(Relaxed);
                i += 1;
            }
            out.push((le, seen));
        }
        out
    }

    /// Sum of all values recorded, in microseconds.
    pub fn sum_us(&self) -> f64 {
        self.sum_ns.load(Relaxed) as f64 / 1000.0
    }

    pub fn mean_us(&self) -> f64 {
        let n = self.count();
        if n == 0 {
            0.0
        } else {
            self.sum_ns.load(Relaxed) as f64 / n as f64 / 1000.0
        }
    }
}

/// Everything the engine counts.
#[derive(Default)]
pub struct Counters {
    /// First touches served with zeros (pages).
    pub faults_zero: AtomicU64,
    /// Faults served from a level below DRAM (the file or the compressed pool).
    pub faults_tier: AtomicU64,
    /// Of those, faults served from the compressed pool (a decompression, no I/O).
    pub faults_compressed: AtomicU64,
    /// Pages stored in the compressed pool as they left DRAM, pages kept as their one
    /// repeated word, and pages that compressed too little and went to the file.
    pub compressed_stores: AtomicU64,
    pub compressed_same: AtomicU64,
    pub compressed_rejected: AtomicU64,
    /// Pages sent to the file without a try, while the pool kept refusing the pages it tried
    /// (it then tries one in sixteen).
    pub compressed_skipped: AtomicU64,
    /// Pool objects written back to the file (decompressed) to make room in the pool.
    pub compressed_spills: AtomicU64,
    /// Pool copies of pages that are in DRAM again, dropped to give the pool's DRAM back.
    pub compressed_drops: AtomicU64,
    /// Compactions of the pool, and the objects they moved out of its sparsest chunks.
    pub compressed_compactions: AtomicU64,
    pub compressed_moves: AtomicU64,
    /// Faults on an inactive page still in DRAM (promoted back without I/O).
    pub faults_inactive: AtomicU64,
    /// Of those, pages copied back rather than moved (see `Config::copy_inactive_hits`).
    pub faults_inactive_copied: AtomicU64,
    /// Faults that waited for another thread's move of the same page.
    pub faults_wait: AtomicU64,
    /// Pages the kernel moved out of DRAM although it reported the move as failed (found by
    /// reading the page tables after a failed move).
    pub moves_underreported: AtomicU64,
    /// Pages brought in by read-ahead beside a faulting page.
    pub readahead_pages: AtomicU64,
    /// Of those, pages read as the next page of a fault that started no run, while objects
    /// span page pairs.
    pub readahead_pairs: AtomicU64,
    /// Tier faults at a page whose slot follows the slot the previous tier read ended at
    /// (one slot gap allowed), and of those, faults whose page does not follow that read's
    /// last page in the address space: what read-ahead by eviction order (tier slots are
    /// allocated in eviction order) could have saved beyond read-ahead by address.
    pub faults_tier_slot_follows: AtomicU64,
    pub faults_tier_slot_follows_only: AtomicU64,
    /// Pages promoted to DRAM (tier-1 reads and inactive hits).
    pub promotions: AtomicU64,
    /// Pages demoted to tier 1 (written or dropped clean).
    pub demotions: AtomicU64,
    /// Demotions that needed no write: a valid tier-1 copy existed.
    pub demotions_clean: AtomicU64,
    /// Demotions of all-zero pages: dropped, no tier space used.
    pub demotions_zero: AtomicU64,
    /// Tier copies of pages also in DRAM dropped to keep tier 1 within its limit.
    pub tier_copies_dropped: AtomicU64,
    /// Tier copies of pages only in tier 1 moved below a lowered limit, so the file could be
    /// cut.
    pub tier_copies_moved: AtomicU64,
    /// Pages unmapped into the inactive list.
    pub deactivations: AtomicU64,
    /// Of those, pages a fault unmapped for the evictor (`Engine::stage_for_fault`).
    pub deactivations_in_faults: AtomicU64,
    /// Pages a fault staging for the evictor found gone and left to it (`evict::Orphans`).
    pub fault_stage_orphans: AtomicU64,
    /// Pages the sweep found written since it last passed (kept mapped: no hint fault).
    pub pages_seen_written: AtomicU64,
    /// Inactive pages put back in place without a touch (to make room in the inactive list
    /// when there is no pressure).
    pub reactivations: AtomicU64,
    pub tier_read_bytes: AtomicU64,
    pub tier_write_bytes: AtomicU64,
    pub tier_write_ops: AtomicU64,
    pub tier_errors: AtomicU64,
    /// Tier reads whose pages did not match the checksum taken when they were written.
    pub tier_read_mismatches: AtomicU64,
    /// Times a faulting thread waited for eviction to make room.
    pub quota_waits: AtomicU64,
    /// Time faulting threads spent waiting for eviction to make room (ns).
    pub quota_wait_ns: AtomicU64,
    /// Pages admitted above the quota because eviction could not make room.
    pub quota_overruns: AtomicU64,
    /// Forks after which both processes stay tiered.
    pub forks: AtomicU64,
    pub epochs: AtomicU64,
    pub scan_cpu_ns: AtomicU64,
    pub evict_cpu_ns: AtomicU64,
    pub peak_resident_pages: AtomicU64,
    /// The most anonymous memory and page tables the process held when a snapshot was taken
    /// (see [`Snapshot::process_peak_anon_bytes`]).
    pub peak_process_anon_bytes: AtomicU64,
    /// The most of it outside managed DRAM at one snapshot (see
    /// [`Snapshot::process_peak_unmanaged_bytes`]).
    pub peak_process_unmanaged_bytes: AtomicU64,
    pub active_pages: AtomicU64,
    /// Pages of memory currently allocated to the program in managed regions (reservations
    /// not yet committed included).
    pub managed_pages: AtomicU64,
    /// Pages holding data the program discarded (`madvise(MADV_DONTNEED)`, a guest's free
    /// page reports through QEMU): dropped from DRAM or tier 1 without a write.
    pub discarded_pages: AtomicU64,
    pub peak_managed_pages: AtomicU64,
    pub tier_read_latency: LatencyHistogram,
    pub fault_tier_latency: LatencyHistogram,
    /// Faults served from the compressed pool, from the fault to the page mapped.
    pub fault_compressed_latency: LatencyHistogram,
}

impl Counters {
    /// In a forked child: what happened in the parent before the fork is the parent's to
    /// count, so every count of events starts again at zero (what the child holds — managed
    /// pages, peaks — stays: it holds it too).
    pub fn forked(&self) {
        for c in [
            &self.faults_zero,
            &self.faults_tier,
            &self.faults_compressed,
            &self.compressed_stores,
            &self.compressed_same,
            &self.compressed_rejected,
            &self.compressed_skipped,
            &self.compressed_spills,
            &self.compressed_drops,
            &self.compressed_compactions,
            &self.compressed_moves,
            &self.faults_inactive,
            &self.faults_inactive_copied,
            &self.faults_wait,
            &self.moves_underreported,
            &self.readahead_pages,
            &self.readahead_pairs,
            &self.faults_tier_slot_follows,
            &self.faults_tier_slot_follows_only,
            &self.promotions,
            &self.demotions,
            &self.demotions_clean,
            &self.demotions_zero,
            &self.tier_copies_dropped,
            &self.tier_copies_moved,
            &self.deactivations,
            &self.deactivations_in_faults,
            &self.fault_stage_orphans,
            &self.pages_seen_written,
            &self.reactivations,
            &self.tier_read_bytes,
            &self.tier_write_bytes,
            &self.tier_write_ops,
            &self.tier_errors,
            &self.tier_read_mismatches,
            &self.quota_waits,
            &self.quota_wait_ns,
            &self.quota_overruns,
            &self.forks,
            &self.epochs,
            &self.scan_cpu_ns,
            &self.evict_cpu_ns,
            &self.discarded_pages,
        ] {
            c.store(0, Relaxed);
        }
        for h in [
            &self.tier_read_latency,
            &self.fault_tier_latency,
            &self.fault_compressed_latency,
        ] {
            h.clear();
        }
    }

    pub fn bump(c: &AtomicU64) {
        c.fetch_add(1, Relaxed);
    }

    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Relaxed);
    }

    pub fn peak(c: &AtomicU64, v: u64) {
        c.fetch_max(v, Relaxed);
    }
}

/// Upper bounds of the tier-read latency histogram exported (microseconds): around the
/// operator guidance's 200 and 400 µs lines.
pub const TIER_READ_BUCKETS_US: [f64; 11] = [
    25.0, 50.0, 100.0, 150.0, 200.0, 300.0, 400.0, 800.0, 1600.0, 5000.0, 20000.0,
];

/// A point-in-time copy of the counters, as written to `--stats` files and printed at exit.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Snapshot {
    pub pid: u32,
    pub elapsed_seconds: f64,
    pub quota_bytes: u64,
    pub dram_bytes: u64,
    pub peak_dram_bytes: u64,
    pub inactive_bytes: u64,
    pub tier_bytes: u64,
    /// Tier-1 slots in use by this process and the processes it forked or was forked with
    /// (they share one file; a slot two of them hold counts once).
    #[serde(default)]
    pub tier_family_bytes: u64,
    pub tier_file_bytes: u64,
    /// The most tier 1 may hold now (its size; a host daemon may change it).
    #[serde(default)]
    pub tier_limit_bytes: u64,
    pub managed_bytes: u64,
    pub peak_managed_bytes: u64,
    pub active_bytes: u64,
    pub process_rss_bytes: u64,
    /// The process's peak resident size so far (VmHWM).
    #[serde(default)]
    pub process_peak_rss_bytes: u64,
    /// The most anonymous resident memory plus page tables (RssAnon + RssShmem + VmPTE) seen
    /// at any snapshot so far: what a memory cgroup charges this process for, unlike VmHWM,
    /// which also counts the pages of its program and libraries that the page cache already
    /// held (0 in statistics from before this field).
    #[serde(default)]
    pub process_peak_anon_bytes: u64,
    /// The most of that anonymous memory and page tables outside managed DRAM, the two taken
    /// at the same snapshot: memtide's own state and what it does not manage. (The anonymous
    /// peak less the DRAM peak would mix a sampled figure with an exact one, taken at
    /// different times; it can come out at 0.) 0 in statistics from before this field.
    #[serde(default)]
    pub process_peak_unmanaged_bytes: u64,
    #[serde(default)]
    pub discarded_bytes: u64,
    pub faults_zero: u64,
    pub faults_tier: u64,
    /// Of `faults_tier`, those served from the compressed pool.
    #[serde(default)]
    pub faults_compressed: u64,
    pub faults_inactive: u64,
    /// Of `faults_inactive`, pages copied back rather than moved.
    #[serde(default)]
    pub faults_inactive_copied: u64,
    pub faults_wait: u64,
    pub moves_underreported: u64,
    pub readahead_pages: u64,
    #[serde(default)]
    pub readahead_pairs: u64,
    #[serde(default)]
    pub faults_tier_slot_follows: u64,
    #[serde(default)]
    pub faults_tier_slot_follows_only: u64,
    pub promotions: u64,
    pub demotions: u64,
    pub demotions_clean: u64,
    pub demotions_zero: u64,
    /// Tier copies of pages also in DRAM dropped to keep tier 1 within its limit.
    #[serde(default)]
    pub tier_copies_dropped: u64,
    /// Tier copies of pages only in tier 1 moved below a lowered limit, so the file could be
    /// cut.
    #[serde(default)]
    pub tier_copies_moved: u64,
    pub deactivations: u64,
    /// Of those, pages a fault unmapped for the evictor while the program waited (no TLB
    /// flush on another CPU).
    #[serde(default)]
    pub deactivations_in_faults: u64,
    /// Pages a fault staging for the evictor found gone (zapped behind memtide's back) and
    /// left to the evictor.
    #[serde(default)]
    pub fault_stage_orphans: u64,
    /// Pages the CLOCK sweep found written since it last passed them, and kept mapped
    /// (where the kernel tracks writes: see `Uffd::tracks_writes`).
    #[serde(default)]
    pub pages_seen_written: u64,
    #[serde(default)]
    pub reactivations: u64,
    /// `--record`: events written, and events lost because the recording fell behind.
    #[serde(default)]
    pub recorded_events: u64,
    #[serde(default)]
    pub recorded_dropped: u64,
    pub tier_read_bytes: u64,
    pub tier_write_bytes: u64,
    pub tier_write_ops: u64,
    pub tier_errors: u64,
    #[serde(default)]
    pub tier_read_mismatches: u64,
    /// Tier reads whose completion the waiting thread (a handler thread, or the faulting one
    /// with `--faults signal`) saw by polling, and reads it slept for (see
    /// `Config::poll_reads`).
    #[serde(default)]
    pub tier_reads_polled: u64,
    #[serde(default)]
    pub tier_reads_slept: u64,
    /// Times a handler thread stopped waiting on the userfaultfd because the program's threads
    /// no longer faulted on its CPU, and times one was made to wait there again
    /// (`Config::follow_threads`).
    #[serde(default)]
    pub handlers_disarmed: u64,
    #[serde(default)]
    pub handlers_armed: u64,
    /// Faults whose thread's CPU a handler took to be its own without reading it: the
    /// thread faulted back to back there.
    #[serde(default)]
    pub handler_cpu_reads_skipped: u64,
    pub tier_read_latency_p50_us: f64,
    pub tier_read_latency_p99_us: f64,
    pub fault_tier_latency_p50_us: f64,
    pub fault_tier_latency_p99_us: f64,
    /// The compressed level: its compressor (`lz4`, or `off`), the DRAM its pool takes (part
    /// of `dram_bytes`) and may take, the pages it holds and their compressed bytes, and what
    /// it did (see [`Counters`]). All 0 in statistics from before the level.
    #[serde(default)]
    pub compress: String,
    #[serde(default)]
    pub compressed_pool_bytes: u64,
    #[serde(default)]
    pub compressed_capacity_bytes: u64,
    #[serde(default)]
    pub compressed_pages: u64,
    #[serde(default)]
    pub compressed_data_bytes: u64,
    #[serde(default)]
    pub compressed_stores: u64,
    #[serde(default)]
    pub compressed_same: u64,
    #[serde(default)]
    pub compressed_rejected: u64,
    /// Pages sent to the file untried while the pages tried kept being refused.
    #[serde(default)]
    pub compressed_skipped: u64,
    #[serde(default)]
    pub compressed_spills: u64,
    #[serde(default)]
    pub compressed_drops: u64,
    /// The pool's holes (free objects in chunks in use), its compactions and the objects they
    /// moved.
    #[serde(default)]
    pub compressed_hole_bytes: u64,
    #[serde(default)]
    pub compressed_compactions: u64,
    #[serde(default)]
    pub compressed_moves: u64,
    /// The pool sizing itself: faults on objects stored within the last step of DRAM, file
    /// faults on pages written back within the last step of pool, and its moves.
    #[serde(default)]
    pub compressed_young_hits: u64,
    #[serde(default)]
    pub compressed_ghost_hits: u64,
    #[serde(default)]
    pub compressed_grows: u64,
    #[serde(default)]
    pub compressed_shrinks: u64,
    /// Whether the pool sizes itself (`--compressed-sizing adaptive`).
    #[serde(default)]
    pub compressed_adaptive: bool,
    #[serde(default)]
    pub fault_compressed_latency_p50_us: f64,
    #[serde(default)]
    pub fault_compressed_latency_p99_us: f64,
    /// Tier-1 reads by latency: cumulative counts at upper bounds in microseconds
    /// ([`TIER_READ_BUCKETS_US`]).
    #[serde(default)]
    pub tier_read_latency_buckets: Vec<(f64, u64)>,
    #[serde(default)]
    pub tier_read_latency_sum_us: f64,
    #[serde(default)]
    pub tier_reads: u64,
    pub quota_waits: u64,
    #[serde(default)]
    pub quota_wait_seconds: f64,
    pub quota_overruns: u64,
    /// Forks after which both processes stay tiered (the child's own engine started).
    #[serde(default)]
    pub forks: u64,
    /// The process this one was forked from, when its engine came with the fork (0: started
    /// its own).
    #[serde(default)]
    pub forked_from: u32,
    /// What the scheduler says of the handler threads, summed: times given a CPU, time spent
    /// runnable waiting for one (after a wake-up: a fault, an I/O completion), time on one.
    /// The wait per run is what a fault pays before its handler runs (0 in statistics from
    /// before these fields, and under SIGBUS delivery).
    #[serde(default)]
    pub handler_runs: u64,
    #[serde(default)]
    pub handler_wait_seconds: f64,
    #[serde(default)]
    pub handler_cpu_seconds: f64,
    /// The same for the evictor thread.
    #[serde(default)]
    pub evictor_runs: u64,
    #[serde(default)]
    pub evictor_wait_seconds: f64,
    pub epochs: u64,
    pub scan_cpu_seconds: f64,
    pub evict_cpu_seconds: f64,
    pub tier: String,
    /// How faults were delivered: `threads` or `signal`.
    #[serde(default)]
    pub faults: String,
    pub warnings: Vec<String>,
}

impl Snapshot {
    /// Mean time a handler thread waited for a CPU each time it was woken, in microseconds.
    pub fn handler_wait_per_run_us(&self) -> f64 {
        if self.handler_runs == 0 {
            return 0.0;
        }
        self.handler_wait_seconds * 1e6 / self.handler_runs as f64
    }

    /// Pages in the compressed pool per byte of pool DRAM, as a ratio (uncompressed bytes
    /// over the pool's DRAM); 0 while the pool is empty.
    pub fn compression_ratio(&self) -> f64 {
        if self.compressed_pool_bytes == 0 {
            return 0.0;
        }
        (self.compressed_pages * 4096) as f64 / self.compressed_pool_bytes as f64
    }

    /// The program's bytes memtide holds — managed pages in DRAM and in tier 1 — as a
    /// fraction of the process's resident size plus its tier-1 bytes: how much of the program
    /// memtide actually tiers. (Reserved address space that holds nothing does not count.)
    pub fn coverage(&self) -> f64 {
        let whole = self.process_rss_bytes + self.tier_bytes;
        if whole == 0 {
            return 0.0;
        }
        let held = (self.dram_bytes + self.tier_bytes).min(self.managed_bytes);
        held.min(whole) as f64 / whole as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_quantiles_within_bucket_resolution() {
        let h = LatencyHistogram::default();
        for us in 1..=100u64 {
            h.record(us * 1000);
        }
        let p50 = h.quantile_us(0.5);
        let p99 = h.quantile_us(0.99);
        assert!((p50 - 50.0).abs() / 50.0 < 0.13, "p50 {p50}");
        assert!((p99 - 99.0).abs() / 99.0 < 0.13, "p99 {p99}");
        assert!((h.mean_us() - 50.5).abs() < 0.01);
    }

    #[test]
    fn cumulative_counts_at_bounds() {
        let h = LatencyHistogram::default();
        for us in [10u64, 30, 30, 120, 450, 9000] {
            h.record(us * 1000);
        }
        let c = h.cumulative(&[25.0, 50.0, 100.0, 200.0, 400.0, 800.0, 20000.0]);
        let counts: Vec<u64> = c.iter().map(|&(_, n)| n).collect();
        assert_eq!(counts, vec![1, 3, 3, 4, 4, 5, 6]);
        assert!((h.sum_us() - 9640.0).abs() < 1e-6);
    }

    #[test]
    fn bucket_bounds_are_monotonic_and_inverse() {
        for i in 0..LatencyHistogram::BUCKETS - 1 {
            assert!(LatencyHistogram::lower(i) < LatencyHistogram::lower(i + 1));
            assert_eq!(LatencyHistogram::index(LatencyHistogram::lower(i)), i);
        }
    }
}
