//! The engine: one arena of managed memory registered with userfaultfd, its page table, and
//! the stages of a page's life, a file each: the fault path (`fault.rs`, run by a handler
//! thread per CPU (`handlers.rs`), or in the faulting thread from SIGBUS), eviction and
//! write-back (`evict.rs`, the evictor thread; its choices come from the policy, through the
//! interface in `policy.rs`: the CLOCK sweep in `evict.rs`, placement in `place.rs`), and the program's own memory calls
//! (`region.rs`: free, discard, mremap, mprotect, pins, fork), and the sampled estimate of
//! active memory (`active.rs`, run by the evictor). Small shared pieces have files of their
//! own: the staging ring (`ring.rs`), the levels below DRAM (`compressed.rs`: the compressed
//! pool; `store.rs`: tier 1, the file, with its slots and state), the DRAM quota (`quota.rs`, changeable at run time) and
//! the fatal stop (`fatal.rs`). This file holds the engine object, its start and its reports. Entry
//! points: [`Engine::start`], [`Engine::alloc`], [`Engine::handle_fault`].
//!
//! # How a page moves
//!
//! ```text
//!  Unpopulated --first touch (zero-fill, 16-page chunks)--> Mapped
//!  Mapped --evictor: UFFDIO_MOVE to a staging slot--> Staged      (the inactive list)
//!  Staged --program touches it: UFFDIO_COPY back (the slot dead until the tail), or
//!         UFFDIO_MOVE back--> Mapped                           (a hint fault: it is hot)
//!  Staged --evictor: compress into the pool, or write to tier 1 (or drop if clean/zero)
//!         --> Evicted (or Unpopulated)
//!  Evicted --program touches it: decompress from the pool or read tier 1, UFFDIO_COPY
//!         --> Mapped (copy kept: clean; a pool copy only until the evictor drops it)
//!  Evicted in the pool --evictor, pool full: decompress, write to tier 1--> Evicted in tier 1
//! ```
//!
//! The levels below DRAM (`compressed.rs`: the pool; `store.rs`: the file) and where a page's
//! copy is ([`TierCopy`]) are described in those files.
//!
//! # Invariants
//!
//! - No write is lost: a page leaves the program's view only by `UFFDIO_MOVE`, which unmaps
//!   and moves it atomically; its DRAM is released (staging zapped) only after its bytes are in
//!   tier 1 (the write returned) or are known to equal the tier copy or to be all zero.
//! - The fault path takes no locks and allocates nothing (with SIGBUS delivery it runs in a
//!   signal handler); it waits only on page words and on the quota, each with a timeout, and
//!   the evictor, which it waits for, never waits for a quota.
//! - Whoever maps a page for a fault wakes the threads waiting on it (UFFDIO_COPY and
//!   UFFDIO_MOVE wake their destination); a handler that finds the page already mapped wakes
//!   the faulting thread itself.
//! - The quota's `resident` counts pages holding DRAM (mapped, staged, writing, or in
//!   flight); a faulting thread reserves quota before it claims a page. The quota bounds
//!   those pages plus the compressed pool's (`Quota::held`).

mod active;
mod compressed;
mod evict;
mod fatal;
mod fault;
mod fork;
mod group;
mod handlers;
mod place;
mod policy;
mod quota;
mod record;
mod region;
mod ring;
mod store;

use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use memtide_policy::ahead::ZERO_CHUNK;
use memtide_policy::{Watermarks, PAGE_SIZE};

use crate::arena::RangeAlloc;
use crate::inject::Inject;
use crate::pages::{PageTable, State, TierCopy};
pub use crate::signal::Fault;
use crate::signal::FaultHandler;
use crate::stats::{Counters, Snapshot};
use crate::sys::{self, Mapping};
use crate::threads::SchedStat;
use crate::tier::{self, Codec, Encrypted, Faulty, FileTier, SlotMap, TierFaults, TierOpenError};
use crate::uffd::{Delivery, MoveReport, OpenError, Uffd};
pub use compressed::Compress;
pub use policy::EvictionPolicy;

use compressed::Compressed;
use fault::BouncePool;
use place::Arrivals;
use quota::{Doorbell, Quota};
pub use record::Event;
use record::Recorder;
use ring::StagingRing;
use store::Store;

pub use fork::ForkPlan;
pub use region::Pinned;

/// What the engine is asked to do.
#[derive(Clone, Debug)]
pub struct Config {
    /// DRAM quota for managed memory, in bytes.
    pub dram_bytes: u64,
    /// Directory to create the tier file in, or the file to create.
    pub tier_path: PathBuf,
    /// Most bytes tier 1 may hold (default: the arena's size).
    pub tier_bytes: Option<u64>,
    /// The most the tier size may be raised to at run time ([`Engine::set_tier_bytes`]; a host
    /// daemon's share of its tier capacity). Default: `tier_bytes`, fixed.
    pub tier_max_bytes: Option<u64>,
    /// Virtual size of the arena: the most managed memory the program can have at once.
    pub arena_bytes: u64,
    /// Length of an activeness epoch.
    pub epoch_ms: u64,
    /// How faults reach the engine: handler threads (the default: kernel accesses to managed
    /// memory wait for the page), or SIGBUS in the faulting thread.
    pub faults: Delivery,
    /// Record every page brought into DRAM (first touches, tier faults, hint faults) to this
    /// raw file (see `record.rs`; `memtide run --record` turns it into a trace).
    pub record: Option<PathBuf>,
    /// Encrypt pages before they leave DRAM (AES-256-GCM, a key that lives only in memory).
    pub encrypt_tier: bool,
    /// Which pages leave DRAM: the CLOCK sweep (the default) or the placement queues.
    pub policy: EvictionPolicy,
    /// Let the CLOCK sweep see which mapped pages were written (where the kernel can tell:
    /// asynchronous userfaultfd write-protection, Linux 6.7), so that a page the program
    /// writes keeps its place without being unmapped to prove it. On by default;
    /// `MEMTIDE_TRACK_WRITES=0` turns it off.
    pub track_writes: bool,
    /// Let faults resolved in the faulting thread (`Delivery::Signal`) under the CLOCK sweep
    /// fill the inactive list for the evictor (see `Engine::stage_for_fault`): a page
    /// unmapped there costs no TLB flush on another CPU. On by default;
    /// `MEMTIDE_STAGE_IN_FAULTS=0` turns it off (the evictor stages every page). Handler
    /// threads never stage: there the fault waits for the staging and for a wake-up both, and
    /// it was slower than the flushes it saved.
    pub stage_in_faults: bool,
    /// Let a touch of an inactive page (under the CLOCK sweep) copy it back from its staging
    /// slot, which then holds its DRAM until the evictor's tail passes it, rather than move
    /// it: a move flushes the slot's translation on every other CPU running the program's
    /// threads (an interrupt each, about 20 µs per hint fault with handler threads here),
    /// while the tail releases its slots in runs, one flush per run. Only while the quota has
    /// room for the copy. On by default; `MEMTIDE_COPY_INACTIVE=0` turns it off.
    pub copy_inactive_hits: bool,
    /// Let a fault poll for its tier read's completion before sleeping (up to twice the
    /// device's usual read time; after a poll was preempted, the next reads sleep: see
    /// `tier::uring::ReadPoll`). On by default; `MEMTIDE_POLL_READS=0` turns it off.
    pub poll_reads: bool,
    /// Let only the handler threads on the CPUs the program's threads fault on wait on the
    /// userfaultfd (see `handlers::Follow`). On by default; `MEMTIDE_FOLLOW_THREADS=0` turns
    /// it off (every handler waits, and each fault wakes them all).
    pub follow_threads: bool,
    /// How pages are compressed into the pool in DRAM before the file (LZ4 by default; `Off`:
    /// no compressed level).
    pub compress: Compress,
    /// The DRAM the compressed pool takes, in bytes, within the quota (default: a sixteenth),
    /// or with `compressed_adaptive` the most it may grow to (default: half the quota). Never
    /// more than three quarters of the quota.
    pub compressed_max_bytes: Option<u64>,
    /// Let the pool size itself by what it saves (from a sixteenth of the quota).
    pub compressed_adaptive: bool,
    /// For tests: device faults to inject in front of the tier file.
    #[doc(hidden)]
    pub tier_faults: Option<Arc<TierFaults>>,
    /// The file the engines of one run share their quota through (in the run's statistics
    /// directory); `None`: this process and the children it forks share it alone.
    pub group_file: Option<PathBuf>,
}

impl Config {
    /// The defaults for a quota and a tier path.
    pub fn new(dram_bytes: u64, tier_path: impl Into<PathBuf>) -> Config {
        Config {
            dram_bytes,
            tier_path: tier_path.into(),
            tier_bytes: None,
            tier_max_bytes: None,
            arena_bytes: 1 << 40,
            epoch_ms: 200,
            faults: Delivery::Threads,
            encrypt_tier: false,
            policy: EvictionPolicy::Sweep,
            track_writes: true,
            stage_in_faults: true,
            copy_inactive_hits: true,
            poll_reads: true,
            follow_threads: true,
            compress: Compress::Lz4,
            compressed_max_bytes: None,
            compressed_adaptive: false,
            record: None,
            tier_faults: None,
            group_file: None,
        }
    }
}

/// Why the engine could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Uffd(#[from] OpenError),
    #[error(transparent)]
    Tier(#[from] TierOpenError),
    #[error("the DRAM quota must be at least 64 KiB")]
    QuotaTooSmall,
    #[error("the compressed pool's size ({0} bytes) must be less than the DRAM quota")]
    PoolTooLarge(u64),
    #[error("cannot {what}: {source}")]
    Io {
        what: &'static str,
        source: io::Error,
    },
}

fn io_err(what: &'static str) -> impl FnOnce(io::Error) -> StartError {
    move |source| StartError::Io { what, source }
}

/// Why a managed-memory call failed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MemError {
    #[error("the arena has no room for the request")]
    NoRoom,
    #[error("the range is not managed memory")]
    NotManaged,
    #[error("this form of the call is not supported on managed memory")]
    Unsupported,
}

/// What the engine's books say of one page (for tests).
#[doc(hidden)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageInfo {
    /// `Free`, `Unpopulated`, `Mapped`, `Staged`, `Writing`, `Evicted` or `Busy`.
    pub state: String,
    /// The file slot of its copy, if its copy is in the file.
    pub tier_slot: Option<u64>,
    /// Which level its copy below DRAM is in: `file`, `compressed` (a pool object or a
    /// repeated word), or none.
    pub level: Option<&'static str>,
    pub pins: u32,
    /// The program gave it a protection other than read-write.
    pub protected: bool,
}

/// The engine for one process's managed memory.
pub struct Engine {
    // Field order is drop order: the uffd goes after the mappings registered with it, which
    // is harmless either way; the engine is never dropped while the program runs.
    arena: Mapping,
    /// The inactive list: staged pages, unmapped from the program, still in DRAM.
    ring: StagingRing,
    pt: PageTable,
    uffd: Uffd,
    /// The levels below DRAM: the compressed pool (unless compression is off), then the file.
    compressed: Option<Compressed>,
    file: Store,
    ranges: Mutex<RangeAlloc>,
    high_water: AtomicUsize,
    zero: Mapping,
    /// Where the page tables say pages are (read after every failed move).
    pagemap: sys::Pagemap,
    quota: Quota,
    /// Wakes the evictor early.
    bell: Doorbell,
    epoch_ns: u64,
    /// Set after `fork` fallback: memory is all in DRAM and no longer registered.
    detached: AtomicBool,
    /// Whether the arena and staging area are locked in DRAM (see `start`).
    locked: AtomicBool,
    /// Asks the evictor to stop (for `fork` and for audits).
    pause: AtomicBool,
    /// Set by the evictor once it has seen `pause` and stopped.
    parked: AtomicBool,
    /// The error the kernel gave with the latest move that moved more than it reported.
    underreport_errno: AtomicI32,
    pub counters: Counters,
    inject: Inject,
    /// `--record`: the pages brought into DRAM, as they come.
    recorder: Option<Recorder>,
    /// Which pages leave DRAM.
    policy: EvictionPolicy,
    /// Held by whoever moves pages into the staging ring (the ring's head moves under it),
    /// with the CLOCK sweep's hand.
    staging: Mutex<evict::Staging>,
    /// Whether faults stage pages for the evictor (`Config::stage_in_faults`: CLOCK sweep,
    /// faults resolved in the faulting thread).
    stage_in_faults: bool,
    /// Whether touches of inactive pages copy them back (`Config::copy_inactive_hits`: the
    /// CLOCK sweep, whose tail passes every slot in order).
    copy_inactive_hits: bool,
    /// Set when a fault found nothing to stage within its reach; the evictor clears it each
    /// round.
    fault_staging_idle: AtomicBool,
    /// Pages faults could not stage and found gone, for the evictor.
    orphans: evict::Orphans,
    /// Whether the policy takes staged pages out of the ring out of its order.
    staged_out_of_order: bool,
    /// When the policy asks for them: the pages brought into DRAM, for the evictor to place.
    arrivals: Option<Arrivals>,
    warnings: Mutex<Vec<String>>,
    /// Faults at addresses that hold no memory, per thread (handler threads only).
    strays: handlers::Strays,
    /// Which handler threads wait on the userfaultfd, and whether that follows the program.
    follow: handlers::Follow,
    /// The kernel's ids of the handler threads and of the evictor (0 until it runs), for
    /// what the scheduler says of them.
    handler_tids: Mutex<Vec<u32>>,
    evictor_tid: std::sync::atomic::AtomicU32,
    start_ns: u64,
    /// This process (a forked child's engine changes it to its own).
    pid: AtomicU32,
    /// The process this engine was forked from (0: started here).
    forked_from: AtomicU32,
    /// Closed around a fork (see `fork.rs`).
    gate: fork::Gate,
    /// The engines of this run, which share its quota.
    group: group::Group,
    /// This process's member number in it.
    member: AtomicU32,
    /// Where a handler thread sends a fork's userfaultfd.
    fork_link: fork::ForkLink,
}

impl Engine {
    /// Creates the arena, the tier file and the evictor thread, and installs the fault handler.
    /// The engine lives as long as the process.
    pub fn start(cfg: &Config) -> Result<&'static Engine, StartError> {
        if cfg.dram_bytes < (ZERO_CHUNK * PAGE_SIZE) as u64 {
            return Err(StartError::QuotaTooSmall);
        }
        // Only the CLOCK sweep reads writes: placement would pay for protection it never uses.
        let uffd = Uffd::open(
            cfg.faults,
            cfg.track_writes && cfg.policy == EvictionPolicy::Sweep,
        )?;
        let (mut tier, tier_note) = tier::best(FileTier::create(&cfg.tier_path)?, cfg.poll_reads);
        if let Some(faults) = &cfg.tier_faults {
            tier = Box::new(Faulty::new(tier, faults.clone()));
        }
        if let Some(m) = cfg.compressed_max_bytes {
            if m >= cfg.dram_bytes {
                return Err(StartError::PoolTooLarge(m));
            }
        }
        let slots_of = |b: u64| (b / PAGE_SIZE as u64).min(TierCopy::MAX_FILE_SLOTS - 1);
        let tier_limit = slots_of(cfg.tier_bytes.unwrap_or(cfg.arena_bytes));
        let tier_cap = cfg
            .tier_max_bytes
            .map_or(tier_limit, |m| slots_of(m).max(tier_limit));
        if cfg.encrypt_tier {
            tier =
                Box::new(Encrypted::new(tier, tier_cap).map_err(io_err("set up tier encryption"))?);
        }
        let arena_pages = (cfg.arena_bytes as usize / PAGE_SIZE).max(ZERO_CHUNK);
        let arena = Mapping::anon(arena_pages * PAGE_SIZE).map_err(io_err("reserve the arena"))?;
        let quota_pages = cfg.dram_bytes / PAGE_SIZE as u64;
        // The quota may grow at run time (a host daemon's share): the staging area is address
        // space only, so size it for a quota of up to 4x the first one, at least 16 GiB, plus
        // room for the active-memory sample. A larger quota works with a smaller inactive list.
        let wm_max = Watermarks::for_quota(quota_pages.saturating_mul(4).max(16 << 18));
        let needs = cfg.policy.needs(quota_pages);
        let ring = StagingRing::new(
            needs.extra_staging + wm_max.inactive_target + 4 * wm_max.batch + active::SAMPLE,
        )
        .map_err(io_err("reserve the staging area"))?;
        let compressed = match cfg.compress.codec() {
            None => None,
            Some(codec) => Some(
                Compressed::new(
                    codec,
                    quota_pages,
                    quota_pages.saturating_mul(4).max(16 << 18),
                    arena_pages,
                    cfg.compressed_max_bytes.map(|b| b / PAGE_SIZE as u64),
                    cfg.compressed_adaptive,
                )
                .map_err(io_err("reserve the compressed pool"))?,
            ),
        };
        let pool_pages = compressed
            .as_ref()
            .map_or_else(Default::default, |c| c.pool.pages_counter());
        let arrivals = needs
            .arrivals
            .then(Arrivals::new)
            .transpose()
            .map_err(io_err("map the arrivals queue"))?;
        for m in [&arena, ring.area()] {
            prepare(&uffd, m.addr(), m.len())
                .map_err(io_err("register the arena with userfaultfd"))?;
        }
        // Managed DRAM is locked as it is faulted in: memtide decides what leaves DRAM, and
        // Linux must not swap managed pages out behind it (a page moved with UFFDIO_MOVE while
        // swapped out can come back as zeros on this kernel). Without the privilege to lock
        // (RLIMIT_MEMLOCK), the evictor skips swapped-out pages instead.
        let locked = [&arena, ring.area()]
            .iter()
            .all(|m| sys::lock_on_fault(m.addr(), m.len()).is_ok());
        let start_ns = sys::now_ns();
        let recorder = cfg
            .record
            .as_deref()
            .map(|p| Recorder::create(p, start_ns))
            .transpose()
            .map_err(io_err("create the --record file"))?;
        let mut slots =
            SlotMap::new(tier_limit, tier_cap).map_err(io_err("map the tier's slot map"))?;
        // The run's group: every engine of the run shares its quota (see group.rs).
        let mut group_note = None;
        let family = slots.shared().family();
        let pid = std::process::id();
        let joined = cfg
            .group_file
            .as_deref()
            .map(|f| group::Group::open(Some(f), quota_pages))
            .transpose()
            .unwrap_or_else(|e| {
                group_note = Some(format!(
                    "cannot share the run's quota with its other processes ({e}); this process keeps a quota of its own"
                ));
                None
            })
            .and_then(|g| g.reserve(family, pid).map(|m| (g, m)));
        let (group, member) = match joined {
            Some(j) => j,
            None => {
                if cfg.group_file.is_some() && group_note.is_none() {
                    group_note = Some("64 processes of this run already share its quota; this process keeps a quota of its own".into());
                }
                let g =
                    group::Group::open(None, quota_pages).map_err(io_err("map the run's group"))?;
                let m = g.reserve(family, pid).unwrap_or(0);
                (g, m)
            }
        };
        slots.become_member(member);
        let engine = Box::leak(Box::new(Engine {
            ring,
            pt: PageTable::new(arena_pages).map_err(io_err("map the page table"))?,
            compressed,
            file: Store::new(
                tier,
                slots,
                BouncePool::new().map_err(io_err("map bounce buffers"))?,
            ),
            ranges: Mutex::new(RangeAlloc::new(arena_pages)),
            high_water: AtomicUsize::new(0),
            zero: Mapping::anon(ZERO_CHUNK * PAGE_SIZE).map_err(io_err("map zeros"))?,
            pagemap: sys::Pagemap::open().map_err(io_err("open /proc/self/pagemap"))?,
            quota: Quota::new(quota_pages, pool_pages),
            bell: Doorbell::default(),
            epoch_ns: cfg.epoch_ms.max(1) * 1_000_000,
            detached: AtomicBool::new(false),
            locked: AtomicBool::new(locked),
            pause: AtomicBool::new(false),
            parked: AtomicBool::new(false),
            underreport_errno: AtomicI32::new(0),
            counters: Counters::default(),
            inject: Inject::default(),
            recorder,
            policy: cfg.policy,
            staging: Mutex::new(evict::Staging::new(cfg.policy == EvictionPolicy::Sweep)),
            stage_in_faults: cfg.stage_in_faults
                && cfg.policy == EvictionPolicy::Sweep
                && cfg.faults == Delivery::Signal,
            copy_inactive_hits: cfg.copy_inactive_hits && !needs.staged_out_of_order,
            fault_staging_idle: AtomicBool::new(false),
            orphans: evict::Orphans::new(),
            staged_out_of_order: needs.staged_out_of_order,
            arrivals,
            warnings: Mutex::new(Vec::new()),
            strays: handlers::Strays::new(),
            follow: handlers::Follow::new(cfg.follow_threads),
            handler_tids: Mutex::new(Vec::new()),
            evictor_tid: std::sync::atomic::AtomicU32::new(0),
            start_ns,
            pid: AtomicU32::new(std::process::id()),
            forked_from: AtomicU32::new(0),
            gate: fork::Gate::new(),
            group,
            member: AtomicU32::new(member),
            fork_link: fork::ForkLink::new(),
            arena,
            uffd,
        }));
        if let Some(note) = tier_note {
            engine.warn(note);
        }
        if let Some(note) = group_note {
            engine.warn(note);
        }
        let swap_on = std::fs::read_to_string("/proc/swaps").is_ok_and(|s| s.lines().count() > 1);
        if !engine.locked.load(Ordering::Acquire) && swap_on {
            engine.warn("cannot lock managed memory in DRAM (needs CAP_IPC_LOCK or a larger RLIMIT_MEMLOCK) and swap is on: Linux may swap managed pages out; memtide leaves those alone until they are touched".into());
        }
        if !engine.file.backend.direct() {
            engine.warn(format!(
                "tier {} does not support O_DIRECT; using buffered I/O (tier reads may be served from the page cache)",
                cfg.tier_path.display()
            ));
        }
        let e: &'static Engine = engine;
        if cfg.faults == Delivery::Signal {
            crate::signal::install().map_err(io_err("install the SIGBUS handler"))?;
            crate::signal::register(e);
        }
        e.start_threads()
            .map_err(io_err("start the engine's threads"))?;
        Ok(e)
    }

    /// Starts the engine's threads: the handler threads (faults delivered to threads), the
    /// evictor, and the recording thread (`--record`, not in a forked child).
    fn start_threads(&'static self) -> io::Result<()> {
        if self.uffd.delivery() == Delivery::Threads {
            self.start_handlers()?;
        }
        crate::threads::spawn("memtide-evict", move || self.evictor_main())?;
        if self.recorder.is_some() && !self.is_forked() {
            crate::threads::spawn("memtide-record", move || loop {
                std::thread::sleep(std::time::Duration::from_millis(20));
                self.flush_record();
            })?;
        }
        Ok(())
    }

    /// Whether this engine came to this process with a fork (its parent started it).
    pub fn is_forked(&self) -> bool {
        self.forked_from.load(Ordering::Relaxed) != 0
    }

    // ----- addresses -----

    pub fn contains(&self, addr: usize) -> bool {
        addr.wrapping_sub(self.arena.addr()) < self.arena.len()
    }

    fn page_of(&self, addr: usize) -> usize {
        (addr - self.arena.addr()) / PAGE_SIZE
    }

    fn addr_of(&self, page: usize) -> usize {
        self.arena.addr() + page * PAGE_SIZE
    }

    /// For tests: the points where a thread can be held (see [`Inject`]).
    #[doc(hidden)]
    pub fn inject(&self) -> &Inject {
        &self.inject
    }

    /// Whether a kernel access to a missing managed page fails (EFAULT) instead of waiting for
    /// it: with faults delivered by SIGBUS, memory a system call uses must be brought in and
    /// pinned first ([`pin`](Self::pin)).
    pub fn kernel_access_needs_pins(&self) -> bool {
        self.uffd.delivery() == Delivery::Signal
    }

    /// For tests: the userfaultfd, to inject kernel misreports.
    #[doc(hidden)]
    pub fn uffd(&self) -> &Uffd {
        &self.uffd
    }

    /// Writes out what `--record` has collected (the recording thread does so every 20 ms;
    /// call it once more at exit).
    pub fn flush_record(&self) {
        let _inside = self.gate.enter();
        if self.is_forked() {
            // The recording is the parent's.
            return;
        }
        if let Some(r) = &self.recorder {
            if let Err(e) = r.drain() {
                self.warn(format!(
                    "writing the recording to {} failed ({e}); it is incomplete",
                    r.path().display()
                ));
            }
        }
    }

    /// Notes that page `p` came into DRAM, for `--record` (async-signal-safe).
    fn note(&self, p: usize, why: Event) {
        if let Some(r) = &self.recorder {
            r.push(p, why);
        }
    }

    /// The DRAM quota in bytes: the program's, which covers every process it forks (one
    /// process's own share of it is [`Snapshot::quota_bytes`]).
    pub fn quota_bytes(&self) -> u64 {
        self.group.budget() * PAGE_SIZE as u64
    }

    /// Sets a new DRAM quota at run time (a host daemon's share), for this process and every
    /// process it forked (or was forked with). Returns the quota now in force (rounded down
    /// to pages, at least 64 KiB). A larger quota lets faulting threads through at once; a
    /// smaller one wakes the evictor, which demotes the coldest pages until the managed memory
    /// fits again.
    pub fn set_quota_bytes(&self, bytes: u64) -> u64 {
        let _inside = self.gate.enter();
        let q = Watermarks::for_quota(bytes / PAGE_SIZE as u64).quota;
        self.group.set_budget(q);
        self.apply_quota(q);
        self.bell.ring_always();
        q * PAGE_SIZE as u64
    }

    /// This process is held to `pages` from now on.
    fn apply_quota(&self, pages: u64) {
        let q = self.quota.set(pages);
        if let Some(c) = &self.compressed {
            c.quota_changed(q);
        }
        self.quota.wake_waiters();
    }

    /// The most bytes tier 1 may hold now.
    pub fn tier_limit_bytes(&self) -> u64 {
        self.file.slots().limit() * PAGE_SIZE as u64
    }

    /// Sets how much tier 1 may hold from now on (a host daemon's share of its tier capacity),
    /// at most the `tier_max_bytes` the engine started with; returns the limit in force. A
    /// lower limit is reached by dropping tier copies of pages that are also in DRAM, moving
    /// the copies of pages that live only in tier 1 from above the limit to free slots below
    /// it, cutting the file, and then evicting only into freed slots: when the pages that live
    /// only in tier 1 fill the limit, eviction stops and the program holds DRAM above its quota
    /// rather than lose a page.
    pub fn set_tier_bytes(&self, bytes: u64) -> u64 {
        let _inside = self.gate.enter();
        let limit = self.file.slots().set_limit(bytes / PAGE_SIZE as u64);
        self.file.reclaim.store(true, Ordering::Release);
        self.bell.ring_always();
        limit * PAGE_SIZE as u64
    }

    /// Slots of the staging area: how many pages can wait unmapped in DRAM at once. Its
    /// address space is sized for the largest quota this engine may be given, not the
    /// current one.
    pub fn staging_slots(&self) -> u64 {
        self.ring.slots()
    }

    /// Pages of managed memory the program currently has allocated.
    pub fn managed_pages(&self) -> u64 {
        self.counters.managed_pages.load(Ordering::Relaxed)
    }

    /// Pages currently holding DRAM: the program's pages and the compressed pool's.
    pub fn resident_pages(&self) -> u64 {
        self.quota.held()
    }

    /// Where the page tables say the page at `addr` is. The engine cannot go on without
    /// knowing (pagemap is kept open, so this does not fail in practice).
    fn presence(&self, addr: usize) -> sys::Presence {
        self.pagemap
            .of(addr)
            .unwrap_or_else(|e| fatal::fatal("reading the page tables failed", &e))
    }

    /// Counts the pages a move moved beyond what the kernel reported (async-signal-safe).
    fn count_underreported(&self, r: &MoveReport) {
        if r.underreported > 0 {
            Counters::add(&self.counters.moves_underreported, r.underreported as u64);
            let errno = r.error.as_ref().and_then(|e| e.raw_os_error()).unwrap_or(0);
            self.underreport_errno.store(errno, Ordering::Relaxed);
        }
    }

    fn warn(&self, msg: String) {
        if let Ok(mut w) = self.warnings.lock() {
            if !w.contains(&msg) {
                crate::say::line(&format!("memtide: warning: {msg}"));
                w.push(msg);
            }
        }
    }

    // ----- reporting -----

    /// The counters now.
    /// Whether the CLOCK sweep sees which pages were written ([`Config::track_writes`], where
    /// the kernel can tell).
    pub fn tracks_writes(&self) -> bool {
        self.uffd.tracks_writes()
    }

    pub fn snapshot(&self) -> Snapshot {
        let _inside = self.gate.enter();
        let c = &self.counters;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let page = PAGE_SIZE as u64;
        let (tier_reads_polled, tier_reads_slept) = self.file.backend.reads_polled();
        let (tier_pages, tier_file_pages, tier_limit_pages, tier_used_pages) = {
            let s = self.file.slots();
            (s.in_use(), s.len(), s.limit(), s.used_by_family())
        };
        let status = StatusMemory::read();
        let dram_bytes = self.quota.held() * page;
        let (pool, pool_capacity) = self
            .compressed
            .as_ref()
            .map_or((Default::default(), 0), |c| {
                (c.pool.stats(), c.pool.capacity_pages() * page)
            });
        let handlers = self
            .handler_tids
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter_map(|&t| SchedStat::of(t))
            .fold(SchedStat::default(), |a, b| a + b);
        let evictor = match self.evictor_tid.load(Ordering::Relaxed) {
            0 => SchedStat::default(),
            t => SchedStat::of(t).unwrap_or_default(),
        };
        Counters::peak(&c.peak_process_anon_bytes, status.anon);
        Counters::peak(
            &c.peak_process_unmanaged_bytes,
            status.anon.saturating_sub(dram_bytes),
        );
        Snapshot {
            pid: self.pid.load(Ordering::Relaxed),
            forked_from: self.forked_from.load(Ordering::Relaxed),
            forks: r(&c.forks),
            elapsed_seconds: (sys::now_ns() - self.start_ns) as f64 / 1e9,
            quota_bytes: self.quota.wm().quota * page,
            dram_bytes,
            peak_dram_bytes: r(&c.peak_resident_pages) * page,
            inactive_bytes: self.ring.staged.load(Ordering::Relaxed) * page,
            tier_bytes: tier_pages * page,
            tier_family_bytes: tier_used_pages * page,
            tier_file_bytes: tier_file_pages * page,
            tier_limit_bytes: tier_limit_pages * page,
            managed_bytes: r(&c.managed_pages) * page,
            peak_managed_bytes: r(&c.peak_managed_pages) * page,
            active_bytes: r(&c.active_pages) * page,
            process_rss_bytes: process_rss_bytes(),
            process_peak_rss_bytes: status.peak_rss,
            process_peak_anon_bytes: r(&c.peak_process_anon_bytes),
            process_peak_unmanaged_bytes: r(&c.peak_process_unmanaged_bytes),
            discarded_bytes: r(&c.discarded_pages) * page,
            faults_zero: r(&c.faults_zero),
            faults_tier: r(&c.faults_tier),
            faults_compressed: r(&c.faults_compressed),
            faults_inactive: r(&c.faults_inactive),
            faults_inactive_copied: r(&c.faults_inactive_copied),
            faults_wait: r(&c.faults_wait),
            moves_underreported: r(&c.moves_underreported),
            readahead_pages: r(&c.readahead_pages),
            readahead_pairs: r(&c.readahead_pairs),
            faults_tier_slot_follows: r(&c.faults_tier_slot_follows),
            faults_tier_slot_follows_only: r(&c.faults_tier_slot_follows_only),
            promotions: r(&c.promotions),
            demotions: r(&c.demotions),
            demotions_clean: r(&c.demotions_clean),
            demotions_zero: r(&c.demotions_zero),
            tier_copies_dropped: r(&c.tier_copies_dropped),
            tier_copies_moved: r(&c.tier_copies_moved),
            deactivations: r(&c.deactivations),
            deactivations_in_faults: r(&c.deactivations_in_faults),
            fault_stage_orphans: r(&c.fault_stage_orphans),
            pages_seen_written: r(&c.pages_seen_written),
            reactivations: r(&c.reactivations),
            recorded_events: self.recorder.as_ref().map_or(0, |r| r.written()),
            recorded_dropped: self.recorder.as_ref().map_or(0, |r| r.dropped()),
            tier_read_bytes: r(&c.tier_read_bytes),
            tier_write_bytes: r(&c.tier_write_bytes),
            tier_write_ops: r(&c.tier_write_ops),
            tier_errors: r(&c.tier_errors),
            tier_read_mismatches: r(&c.tier_read_mismatches),
            tier_reads_polled,
            tier_reads_slept,
            handlers_disarmed: self.follow.disarms(),
            handlers_armed: self.follow.arms(),
            handler_cpu_reads_skipped: self.follow.cpu_reads_skipped(),
            tier_read_latency_p50_us: c.tier_read_latency.quantile_us(0.5),
            tier_read_latency_p99_us: c.tier_read_latency.quantile_us(0.99),
            fault_tier_latency_p50_us: c.fault_tier_latency.quantile_us(0.5),
            fault_tier_latency_p99_us: c.fault_tier_latency.quantile_us(0.99),
            compress: match &self.compressed {
                Some(c) => match c.codec {
                    Codec::Lz4 => Compress::Lz4.name().into(),
                    Codec::Zstd => Compress::Zstd.name().into(),
                },
                None => Compress::Off.name().into(),
            },
            compressed_pool_bytes: pool.pool_bytes,
            compressed_capacity_bytes: pool_capacity,
            compressed_pages: pool.objects,
            compressed_data_bytes: pool.compressed_bytes,
            compressed_stores: r(&c.compressed_stores),
            compressed_same: r(&c.compressed_same),
            compressed_rejected: r(&c.compressed_rejected),
            compressed_skipped: r(&c.compressed_skipped),
            compressed_spills: r(&c.compressed_spills),
            compressed_drops: r(&c.compressed_drops),
            compressed_hole_bytes: pool.hole_bytes,
            compressed_compactions: r(&c.compressed_compactions),
            compressed_moves: r(&c.compressed_moves),
            compressed_young_hits: self.compressed.as_ref().map_or(0, |p| r(&p.young_hits)),
            compressed_ghost_hits: self.compressed.as_ref().map_or(0, |p| r(&p.ghost_hits)),
            compressed_grows: self.compressed.as_ref().map_or(0, |p| r(&p.grows)),
            compressed_shrinks: self.compressed.as_ref().map_or(0, |p| r(&p.shrinks)),
            compressed_adaptive: self.compressed.as_ref().is_some_and(|p| p.adaptive()),
            fault_compressed_latency_p50_us: c.fault_compressed_latency.quantile_us(0.5),
            fault_compressed_latency_p99_us: c.fault_compressed_latency.quantile_us(0.99),
            tier_read_latency_buckets: c
                .tier_read_latency
                .cumulative(&crate::stats::TIER_READ_BUCKETS_US),
            tier_read_latency_sum_us: c.tier_read_latency.sum_us(),
            tier_reads: c.tier_read_latency.count(),
            handler_runs: handlers.runs,
            handler_wait_seconds: handlers.wait_ns as f64 / 1e9,
            handler_cpu_seconds: handlers.run_ns as f64 / 1e9,
            evictor_runs: evictor.runs,
            evictor_wait_seconds: evictor.wait_ns as f64 / 1e9,
            quota_waits: r(&c.quota_waits),
            quota_wait_seconds: r(&c.quota_wait_ns) as f64 / 1e9,
            quota_overruns: r(&c.quota_overruns),
            epochs: r(&c.epochs),
            scan_cpu_seconds: r(&c.scan_cpu_ns) as f64 / 1e9,
            evict_cpu_seconds: r(&c.evict_cpu_ns) as f64 / 1e9,
            tier: self.file.backend.describe(),
            faults: self.uffd.delivery().name().into(),
            warnings: self.warnings.lock().map(|w| w.clone()).unwrap_or_default(),
        }
    }

    /// What the engine knows of the page at `addr`, for a test's failure message.
    #[doc(hidden)]
    pub fn describe_page(&self, addr: usize) -> String {
        if !self.contains(addr) {
            return "not managed".into();
        }
        let p = self.page_of(addr);
        let w = self.pt.load(p);
        format!(
            "page {p}: {:?}, copy {:?}, stage {}, arena {:?}",
            w.state(),
            self.pt.copy(p),
            self.pt.stage(p) as i64,
            self.pagemap.of(addr).ok()
        )
    }

    /// For tests: what the engine's books say of the page at `addr`, if it is managed memory.
    #[doc(hidden)]
    pub fn page_info(&self, addr: usize) -> Option<PageInfo> {
        if !self.contains(addr) {
            return None;
        }
        let p = self.page_of(addr);
        let w = self.pt.load(p);
        Some(PageInfo {
            state: format!("{:?}", w.state()),
            tier_slot: self.pt.slot(p),
            level: self.pt.copy(p).map(|c| match c {
                TierCopy::File(_) => "file",
                TierCopy::Pool(_) | TierCopy::Same => "compressed",
            }),
            pins: w.pins(),
            protected: w.protected(),
        })
    }

    /// Checks the page table's books (for tests, with the program's threads quiet): resident
    /// pages equal mapped and staged pages plus dead ring entries, every evicted page has a
    /// slot, every staged page is named by its ring slot, no page is pinned. Pauses the
    /// evictor while it looks.
    pub fn audit(&self) -> Result<(), String> {
        self.pause_evictor();
        let r = self.audit_paused();
        self.resume_evictor();
        r
    }

    fn audit_paused(&self) -> Result<(), String> {
        let hw = self.high_water.load(Ordering::Acquire);
        let mut mapped = 0u64;
        let mut staged = 0u64;
        let mut present = vec![sys::Presence::Absent; hw];
        if hw > 0 {
            self.pagemap
                .read(self.arena.addr(), &mut present)
                .map_err(|e| format!("pagemap: {e}"))?;
        }
        let mut staging = vec![sys::Presence::Absent; self.ring.slots() as usize];
        self.pagemap
            .read(self.ring.area().addr(), &mut staging)
            .map_err(|e| format!("pagemap: {e}"))?;
        for (i, &there) in present.iter().enumerate() {
            let w = self.pt.load(i);
            if w.state() == State::Lent {
                // The program's own mapping: present or not as the program left it.
                continue;
            }
            // The page table must agree with the hardware one: exactly the Mapped pages are
            // there in the arena, in DRAM or swapped out by Linux (others live in staging,
            // tier 1, or nowhere).
            let is_present = there != sys::Presence::Absent;
            if is_present != (w.state() == State::Mapped) {
                return Err(format!(
                    "page {i} is {:?} but {} in the arena ({there:?})",
                    w.state(),
                    if is_present { "present" } else { "missing" }
                ));
            }
            if w.pins() != 0 {
                return Err(format!(
                    "page {i} holds {} pin(s) while the program is quiet",
                    w.pins()
                ));
            }
            match w.state() {
                State::Mapped => mapped += 1,
                State::Staged | State::Writing => {
                    staged += 1;
                    let s = self.pt.stage(i);
                    if self.ring.entry(s as u64).load(Ordering::Acquire) != i as u32 + 1 {
                        return Err(format!(
                            "page {i} is staged at slot {s}, which does not name it"
                        ));
                    }
                    if staging[s as usize] == sys::Presence::Absent {
                        return Err(format!("page {i} is staged at slot {s}, which is empty"));
                    }
                }
                State::Evicted if self.pt.copy(i).is_none() => {
                    return Err(format!("page {i} is evicted without a copy below DRAM"))
                }
                State::Busy => return Err(format!("page {i} is busy while the engine is idle")),
                _ => {}
            }
        }
        let dead = self.ring.dead();
        let counted = self.ring.staged.load(Ordering::Acquire);
        if counted != staged + dead {
            return Err(format!(
                "staged counter {counted} != staged {staged} + dead {dead}"
            ));
        }
        let resident = self.quota.resident();
        if resident != mapped + staged + dead {
            return Err(format!(
                "resident {resident} != mapped {mapped} + staged {staged} + dead {dead}"
            ));
        }
        Ok(())
    }
}

/// Resident set size of this process, from /proc/self/statm.
pub fn process_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |p| p * PAGE_SIZE as u64)
}

/// Readies a fresh anonymous mapping of the engine's (the arena, the staging area, arena
/// memory taken back from the program) for managed pages: 4 KiB pages only (NOHUGEPAGE, so
/// that moves never split huge pages), registered with the userfaultfd.
fn prepare(uffd: &Uffd, addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: advice on a mapping of the engine's own.
    unsafe { sys::madvise(addr, len, libc::MADV_NOHUGEPAGE) }?;
    uffd.register(addr, len)
}

/// This process's memory as /proc/self/status gives it, in bytes (0 where unknown).
struct StatusMemory {
    /// VmHWM: the peak resident size.
    peak_rss: u64,
    /// RssAnon + RssShmem + VmPTE now: what a memory cgroup charges the process for, besides
    /// page cache it brought in itself.
    anon: u64,
}

impl StatusMemory {
    /// Reads /proc/self/status once.
    fn read() -> StatusMemory {
        let mut m = StatusMemory {
            peak_rss: 0,
            anon: 0,
        };
        let Ok(s) = std::fs::read_to_string("/proc/self/status") else {
            return m;
        };
        for l in s.lines() {
            let Some((name, rest)) = l.split_once(':') else {
                continue;
            };
            let Some(kib) = rest
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
            else {
                continue;
            };
            match name {
                "VmHWM" => m.peak_rss = kib * 1024,
                "RssAnon" | "RssShmem" | "VmPTE" => m.anon += kib * 1024,
                _ => {}
            }
        }
        m
    }
}

impl FaultHandler for Engine {
    fn contains(&self, addr: usize) -> bool {
        Engine::contains(self, addr)
    }

    fn handle_fault(&self, addr: usize) -> Fault {
        Engine::handle_fault(self, addr)
    }
}
