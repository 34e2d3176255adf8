//! Handler threads follow the program's threads: while a program thread faults on one CPU
//! only, the handler on the other CPU stops waiting on the userfaultfd (each fault would wake
//! it for nothing), and it waits there again as soon as a fault comes from a thread on its
//! CPU. A thread faulting back to back on one CPU is taken to be there without reading its
//! CPU each time. Every page read back holds its stamp throughout. With following off, no
//! handler ever stands aside.

use memtide_engine::threads::{
    allowed_cpus, gettid, note_program_thread, pin_to_cpu, program_thread_cpu,
};
use memtide_engine::{Compress, Engine};

mod common;

use common::{config, read_stamp, scratch, stamp, start, write_stamp, Rng, PAGE};

/// 8 MiB of DRAM under a block of 32 MiB: most random reads are tier faults.
const QUOTA: u64 = 8 << 20;
const PAGES: usize = 8 << 10;
/// Random reads on each CPU: far more tier faults than a handler needs to see before it
/// stands aside (64).
const READS: usize = 3000;

struct Outcome {
    /// Handlers disarmed and armed after the reads on the first CPU, and after those on the
    /// second.
    first: (u64, u64),
    second: (u64, u64),
    tier_faults: u64,
    /// Faults whose thread's CPU the serving handler took to be its own without reading it.
    cpu_reads_skipped: u64,
    wrong: usize,
}

fn run(name: &str, follow: bool, cpus: (usize, usize)) -> Outcome {
    let dir = scratch(name);
    let mut cfg = config(&dir, QUOTA);
    cfg.compress = Compress::Off;
    cfg.follow_threads = follow;
    let e: &Engine = start(&cfg);
    pin_to_cpu(cpus.0).expect("pin to the first CPU");
    assert_eq!(
        program_thread_cpu(gettid()),
        Some(cpus.0 as u32),
        "the thread's CPU is read from its rseq area"
    );
    let base = e.alloc(PAGES * PAGE, PAGE).unwrap();
    for i in 0..PAGES {
        write_stamp(base, i);
    }
    let mut rng = Rng(0xF0110);
    let mut wrong = 0;
    let s0 = e.snapshot();
    for _ in 0..READS {
        let i = rng.below(PAGES);
        wrong += (read_stamp(base, i) != stamp(i)) as usize;
    }
    let s1 = e.snapshot();
    pin_to_cpu(cpus.1).expect("pin to the second CPU");
    for _ in 0..READS {
        let i = rng.below(PAGES);
        wrong += (read_stamp(base, i) != stamp(i)) as usize;
    }
    let s2 = e.snapshot();
    for i in 0..PAGES {
        wrong += (read_stamp(base, i) != stamp(i)) as usize;
    }
    let o = Outcome {
        first: (s1.handlers_disarmed, s1.handlers_armed),
        second: (s2.handlers_disarmed, s2.handlers_armed),
        tier_faults: s2.faults_tier - s0.faults_tier,
        cpu_reads_skipped: s2.handler_cpu_reads_skipped - s0.handler_cpu_reads_skipped,
        wrong,
    };
    eprintln!(
        "follow {follow}: {} tier faults; after CPU {}: {} disarmed, {} armed; after CPU {}: \
         {} disarmed, {} armed; {} CPU reads skipped; {} pages read back wrong",
        o.tier_faults,
        cpus.0,
        o.first.0,
        o.first.1,
        cpus.1,
        o.second.0,
        o.second.1,
        o.cpu_reads_skipped,
        o.wrong
    );
    o
}

#[test]
fn handlers_stand_aside_while_the_program_faults_elsewhere() {
    let cpus = allowed_cpus().expect("sched_getaffinity");
    if cpus.len() < 2 {
        eprintln!("one CPU: every fault is served on it, there is nothing to follow");
        return;
    }
    // This thread is the program's: its faults say which CPU they come from.
    note_program_thread();
    if program_thread_cpu(gettid()).is_none() {
        eprintln!(
            "no rseq area to read a thread's CPU from (glibc before 2.35, rseq turned off, \
             not x86-64): handlers cannot follow threads here"
        );
        return;
    }
    let pair = (cpus[0], cpus[1]);

    let on = run("follow-on", true, pair);
    assert_eq!(on.wrong, 0, "every page reads back its stamp");
    assert!(
        on.tier_faults > READS as u64,
        "the reads were tier faults: {}",
        on.tier_faults
    );
    assert!(
        on.first.0 >= 1,
        "faults from one CPU only: the other CPU's handler stands aside"
    );
    assert!(
        on.second.1 >= 1,
        "a fault from the second CPU arms its handler again"
    );
    assert!(
        on.second.0 > on.first.0,
        "and the first CPU's handler stands aside in turn"
    );
    assert!(
        on.cpu_reads_skipped > 0,
        "a thread faulting back to back on one CPU is taken to be there without a read"
    );

    let off = run("follow-off", false, pair);
    assert_eq!(off.wrong, 0, "every page reads back its stamp");
    assert_eq!(
        (off.second.0, off.second.1),
        (0, 0),
        "with following off every handler waits on the userfaultfd"
    );
    assert_eq!(off.cpu_reads_skipped, 0, "and no thread's CPU is read");
}
