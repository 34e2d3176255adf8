//! A fault waits for its tier read by polling the read's completion before sleeping, where
//! the device answers fast (its usual read well under the poll's limit, as these machines'
//! disks do): the reads are counted as polled, and every page read back holds its stamp. With
//! polling off, the same reads are all waited for by sleeping.

use memtide_engine::{Compress, Engine};

mod common;

use common::{config, read_stamp, scratch, stamp, start, write_stamp, Rng, PAGE};

/// 8 MiB of DRAM under a block of 32 MiB: most random reads go to the file.
const QUOTA: u64 = 8 << 20;
const PAGES: usize = 8 << 10;
const READS: usize = 4000;
/// A device whose mean read is under this is fast enough to poll (half the poll's limit,
/// 150 µs, with a margin).
const FAST_US: f64 = 60.0;

struct Outcome {
    polled: u64,
    slept: u64,
    tier_faults: u64,
    /// The mean device read while the reads ran: what the engine's average of recent reads,
    /// which decides whether to poll, follows.
    read_mean_us: f64,
    wrong: usize,
}

fn run(name: &str, poll_reads: bool) -> Outcome {
    let dir = scratch(name);
    let mut cfg = config(&dir, QUOTA);
    cfg.compress = Compress::Off;
    cfg.poll_reads = poll_reads;
    let e: &Engine = start(&cfg);
    let base = e.alloc(PAGES * PAGE, PAGE).unwrap();
    for i in 0..PAGES {
        write_stamp(base, i);
    }
    let s0 = e.snapshot();
    let mut rng = Rng(0xFEED);
    let mut wrong = 0;
    for _ in 0..READS {
        let i = rng.below(PAGES);
        wrong += (read_stamp(base, i) != stamp(i)) as usize;
    }
    let s1 = e.snapshot();
    let reads =
        |s: &memtide_engine::Snapshot| s.tier_read_latency_buckets.last().map_or(0, |b| b.1);
    let n = (reads(&s1) - reads(&s0)).max(1);
    Outcome {
        polled: s1.tier_reads_polled - s0.tier_reads_polled,
        slept: s1.tier_reads_slept - s0.tier_reads_slept,
        tier_faults: s1.faults_tier - s0.faults_tier,
        read_mean_us: (s1.tier_read_latency_sum_us - s0.tier_read_latency_sum_us) / n as f64,
        wrong,
    }
}

#[test]
fn a_fast_device_s_reads_are_polled_and_read_back_right() {
    let off = run("polled-off", false);
    let on = run("polled-on", true);
    for (what, o) in [("polling off", &off), ("polling on", &on)] {
        eprintln!(
            "{what}: {} tier faults, {} reads polled, {} slept for, device read mean {:.0} µs",
            o.tier_faults, o.polled, o.slept, o.read_mean_us
        );
        assert_eq!(o.wrong, 0, "{what}: every page read back its stamp");
        assert!(
            o.tier_faults > READS as u64 / 2,
            "{what}: the reads came from the file"
        );
    }
    assert_eq!(off.polled, 0, "nothing is polled with polling off");
    assert!(
        off.slept >= off.tier_faults / 2,
        "with polling off the reads are slept for"
    );
    if on.read_mean_us >= FAST_US {
        eprintln!(
            "not asserted: this device's reads (mean {:.0} µs) are too slow to poll",
            on.read_mean_us
        );
        return;
    }
    assert!(
        on.polled * 2 > on.polled + on.slept,
        "most reads of a fast device are polled: {} of {}",
        on.polled,
        on.polled + on.slept
    );
}
