//! The LD_PRELOAD library: puts an unmodified program's large anonymous memory under memtide.
//!
//! `memtide run` loads it with settings in the environment (`MEMTIDE_DRAM`, `MEMTIDE_TIER`, …).
//! The engine starts lazily, on the program's first allocation at or above the size threshold,
//! so short-lived helper processes (a shell, `ls`) pay nothing. The overridden symbols live in
//! `overrides.rs` (and `lifetime.rs`, for threads); this file holds the start-up, the settings and the stats writer.
//!
//! Rust code here allocates through glibc's internal entry points (`__libc_malloc`), never
//! through the `malloc` symbol this library overrides, so the library never re-enters itself;
//! so does everything the engine's own threads call (see `memtide_engine::threads`).

/// Resolves the next definition of a symbol (libc's), once.
macro_rules! real {
    ($name:literal, $ty:ty) => {{
        static P: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let mut f = P.load(std::sync::atomic::Ordering::Relaxed);
        if f == 0 {
            // SAFETY: NUL-terminated symbol name; RTLD_NEXT from a shared object.
            f = unsafe {
                libc::dlsym(
                    libc::RTLD_NEXT,
                    concat!($name, "\0").as_ptr() as *const libc::c_char,
                )
            } as usize;
            if f == 0 {
                let msg = concat!("memtide: fatal: libc has no ", $name, "\n");
                memtide_engine::say::fatal_line(msg.as_bytes());
                // SAFETY: aborting.
                unsafe { libc::abort() }
            }
            P.store(f, std::sync::atomic::Ordering::Relaxed);
        }
        // SAFETY: `f` is the address of libc's function of this signature.
        unsafe { std::mem::transmute::<usize, $ty>(f) }
    }};
}

mod lifetime;
mod next;
mod overrides;

use std::alloc::{GlobalAlloc, Layout};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU8, AtomicUsize, Ordering};

use memtide_engine::launch::{self, Settings};
use memtide_engine::{say, Config, Delivery, Engine, ForkPlan};

extern "C" {
    pub(crate) fn __libc_malloc(size: usize) -> *mut libc::c_void;
    pub(crate) fn __libc_calloc(n: usize, size: usize) -> *mut libc::c_void;
    pub(crate) fn __libc_realloc(p: *mut libc::c_void, size: usize) -> *mut libc::c_void;
    pub(crate) fn __libc_free(p: *mut libc::c_void);
    pub(crate) fn __libc_memalign(align: usize, size: usize) -> *mut libc::c_void;
}

/// The Rust side of this library allocates straight from glibc.
struct LibcAlloc;

// SAFETY: forwards to glibc's allocator, which meets GlobalAlloc's contract for the alignments
// it is asked for (memalign for anything above malloc's 16 bytes).
unsafe impl GlobalAlloc for LibcAlloc {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: plain calls into glibc's allocator.
        unsafe {
            if l.align() <= 16 {
                __libc_malloc(l.size()) as *mut u8
            } else {
                __libc_memalign(l.align(), l.size()) as *mut u8
            }
        }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        // SAFETY: as above.
        unsafe {
            if l.align() <= 16 {
                __libc_calloc(1, l.size()) as *mut u8
            } else {
                let p = __libc_memalign(l.align(), l.size()) as *mut u8;
                if !p.is_null() {
                    std::ptr::write_bytes(p, 0, l.size());
                }
                p
            }
        }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        if l.align() <= 16 {
            // SAFETY: `p` came from __libc_malloc.
            unsafe { __libc_realloc(p as *mut libc::c_void, new) as *mut u8 }
        } else {
            // SAFETY: standard realloc-by-copy for over-aligned blocks.
            unsafe {
                let q = self.alloc(Layout::from_size_align_unchecked(new, l.align()));
                if !q.is_null() {
                    std::ptr::copy_nonoverlapping(p, q, l.size().min(new));
                    self.dealloc(p, l);
                }
                q
            }
        }
    }
    unsafe fn dealloc(&self, p: *mut u8, _l: Layout) {
        // SAFETY: `p` came from this allocator.
        unsafe { __libc_free(p as *mut libc::c_void) }
    }
}

#[global_allocator]
static GLOBAL: LibcAlloc = LibcAlloc;

const OFF: u8 = 0;
const IDLE: u8 = 1;
const STARTING: u8 = 2;
const READY: u8 = 3;
const FAILED: u8 = 4;

/// OFF: no settings (pass-through). IDLE: settings read, engine not started. STARTING: one
/// thread is starting it (allocations meanwhile go to glibc). READY / FAILED.
static STATE: AtomicU8 = AtomicU8::new(OFF);
static ENGINE: AtomicPtr<Engine> = AtomicPtr::new(std::ptr::null_mut());
static SETTINGS: AtomicPtr<Settings> = AtomicPtr::new(std::ptr::null_mut());
/// Allocations at or above this many bytes are managed.
static THRESHOLD: AtomicUsize = AtomicUsize::new(usize::MAX);
/// Most bytes of managed memory one system call may pin at once.
static IO_CHUNK: AtomicUsize = AtomicUsize::new(8 << 20);
/// Faults are delivered as SIGBUS (`MEMTIDE_FAULTS=signal`): SIGBUS must reach memtide's
/// handler first, and memory a system call touches must be pinned around the call.
static SIGNAL_FAULTS: AtomicBool = AtomicBool::new(false);

/// Whether faults are delivered as SIGBUS in this process (known from the settings, before
/// the engine starts).
fn signal_faults() -> bool {
    SIGNAL_FAULTS.load(Ordering::Relaxed)
}

/// The engine, if it is running in this process.
fn engine() -> Option<&'static Engine> {
    let p = ENGINE.load(Ordering::Acquire);
    // SAFETY: the engine is leaked ('static) once started.
    (!p.is_null()).then(|| unsafe { &*p })
}

/// The engine, starting it on first use; `None` while another thread starts it, when memtide
/// is off, or when it failed to start.
fn engine_or_start() -> Option<&'static Engine> {
    if let Some(e) = engine() {
        return Some(e);
    }
    if STATE
        .compare_exchange(IDLE, STARTING, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        return None;
    }
    // SAFETY: SETTINGS is set before STATE becomes IDLE and never freed.
    let s = unsafe { &*SETTINGS.load(Ordering::Acquire) };
    let mut cfg = Config::new(s.dram, s.tier.clone());
    cfg.tier_bytes = s.tier_size;
    cfg.tier_max_bytes = s.tier_max;
    cfg.arena_bytes = s.arena;
    cfg.faults = s.faults;
    cfg.policy = s.policy;
    cfg.track_writes = switched_on("MEMTIDE_TRACK_WRITES");
    cfg.stage_in_faults = switched_on("MEMTIDE_STAGE_IN_FAULTS");
    cfg.copy_inactive_hits = switched_on("MEMTIDE_COPY_INACTIVE");
    cfg.poll_reads = switched_on("MEMTIDE_POLL_READS");
    cfg.follow_threads = switched_on("MEMTIDE_FOLLOW_THREADS");
    cfg.encrypt_tier = s.encrypt_tier;
    cfg.compress = s.compress;
    cfg.compressed_max_bytes = s.compressed_max;
    cfg.compressed_adaptive = s.compressed_adaptive;
    // Every engine of the run shares its quota through the statistics directory.
    cfg.group_file = s.stats_dir.as_ref().map(|d| d.join(launch::GROUP_FILE));
    if s.record {
        cfg.record = s.stats_dir.as_ref().map(|d| {
            d.join(format!(
                "{}{}.raw",
                launch::RECORD_PREFIX,
                std::process::id()
            ))
        });
    }
    match Engine::start(&cfg) {
        Ok(e) => {
            ENGINE.store(e as *const Engine as *mut Engine, Ordering::Release);
            STATE.store(READY, Ordering::Release);
            if let Some(dir) = &s.stats_dir {
                start_stats_thread(e, dir.clone(), s.stats_interval_ms);
            }
            Some(e)
        }
        Err(err) => {
            say::line(&format!(
                "memtide: {err}; running this program without tiering"
            ));
            STATE.store(FAILED, Ordering::Release);
            None
        }
    }
}

/// Reads the settings; called once from the library's constructor.
/// Whether the engine's switch `name` is on: it is unless the variable is set to `0`.
fn switched_on(name: &str) -> bool {
    std::env::var_os(name).is_none_or(|v| v != "0")
}

fn load_settings() {
    // memtide's words go to the launcher from here on, never into the program's stderr.
    if let Some(dir) = Settings::stats_dir_from_env() {
        say::to_file(&dir);
    }
    let Some(s) = Settings::from_env(|line| say::line(&line)) else {
        return;
    };
    THRESHOLD.store(s.min_bytes as usize, Ordering::Release);
    IO_CHUNK.store(
        ((s.dram / 4).clamp(64 << 10, 8 << 20)) as usize,
        Ordering::Release,
    );
    SIGNAL_FAULTS.store(s.faults == Delivery::Signal, Ordering::Release);
    SETTINGS.store(Box::into_raw(Box::new(s)), Ordering::Release);
    STATE.store(IDLE, Ordering::Release);
}

fn write_stats(e: &Engine, dir: &std::path::Path) {
    let snap = e.snapshot();
    let path = dir.join(format!("memtide-{}.json", snap.pid));
    let tmp = dir.join(format!(".memtide-{}.json.tmp", snap.pid));
    if let Ok(json) = serde_json::to_vec_pretty(&snap) {
        if std::fs::write(&tmp, json).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
}

/// A number of bytes the launcher asks for through `file` in the stats directory (a new
/// quota or tier size: `memtide run --host` passes on the host daemon's), if other than `now`.
fn asked(dir: &std::path::Path, file: &str, now: u64) -> Option<u64> {
    let text = std::fs::read_to_string(dir.join(file)).ok()?;
    let q: u64 = text.trim().parse().ok()?;
    (q != now).then_some(q)
}

fn start_stats_thread(e: &'static Engine, dir: PathBuf, interval_ms: u64) {
    let _ = memtide_engine::threads::spawn("memtide-stats", move || {
        let mut quota = e.quota_bytes();
        let mut tier = e.tier_limit_bytes();
        loop {
            std::thread::sleep(std::time::Duration::from_millis(interval_ms.max(50)));
            if let Some(q) = asked(&dir, launch::QUOTA_FILE, quota) {
                quota = q;
                e.set_quota_bytes(q);
            }
            if let Some(t) = asked(&dir, launch::TIER_FILE, tier) {
                tier = t;
                e.set_tier_bytes(t);
            }
            write_stats(e, &dir);
        }
    });
}

extern "C" fn at_exit() {
    if let Some(e) = engine() {
        if e.in_child() {
            return;
        }
        // SAFETY: SETTINGS is set whenever the engine runs.
        let s = unsafe { &*SETTINGS.load(Ordering::Acquire) };
        e.flush_record();
        if let Some(dir) = &s.stats_dir {
            write_stats(e, dir);
        }
    }
}

/// One fork at a time goes through the engine (two threads forking at once take turns).
static FORKING: AtomicBool = AtomicBool::new(false);
/// What the prepare handler decided, for the parent's and the child's handlers.
static FORK_PLAN: std::sync::Mutex<Option<ForkPlan>> = std::sync::Mutex::new(None);

/// The prepare handler, registered before the program's own, so it runs after them (glibc
/// runs prepare handlers in reverse order): the program's handlers may still use managed
/// memory; from here to the fork only glibc runs.
extern "C" fn before_fork() {
    let Some(e) = engine() else {
        return;
    };
    while FORKING
        .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        std::thread::yield_now();
    }
    let plan = e.fork_prepare();
    *FORK_PLAN.lock().unwrap_or_else(|p| p.into_inner()) = Some(plan);
}

fn take_plan() -> ForkPlan {
    FORK_PLAN
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take()
        .unwrap_or(ForkPlan::Nothing)
}

/// The parent's handler (after the fork, or after a failed one), first of the program's.
extern "C" fn after_fork_parent() {
    let Some(e) = engine() else {
        return;
    };
    e.fork_parent(take_plan());
    FORKING.store(false, Ordering::Release);
}

/// The child's handler, first of the program's: the child's engine starts, on the books the
/// fork copied. Where the engine did not come with the fork (the parent detached, or it is
/// off), it serves nothing here: the descriptors the child inherited are the program's to
/// close like any other (they keep the parent's tier file allocated).
extern "C" fn in_fork_child() {
    // The child's one thread has an id of its own.
    memtide_engine::threads::note_program_thread();
    let plan = take_plan();
    FORKING.store(false, Ordering::Release);
    let Some(e) = engine() else {
        memtide_engine::fds::forget_all();
        return;
    };
    if !matches!(plan, ForkPlan::Tiered { .. }) {
        memtide_engine::fds::forget_all();
        return;
    }
    e.fork_child(plan);
    // SAFETY: SETTINGS is set whenever the engine runs.
    let s = unsafe { &*SETTINGS.load(Ordering::Acquire) };
    if let Some(dir) = &s.stats_dir {
        start_stats_thread(e, dir.clone(), s.stats_interval_ms);
    }
}

extern "C" fn init() {
    // Resolve libc's close now: memtide's own fatal path closes a file, and must not be the
    // first to call dlsym (not async-signal-safe) from a signal handler.
    // SAFETY: closing no descriptor fails with EBADF; errno is put back as it was.
    unsafe {
        let errno = *libc::__errno_location();
        overrides::close(-1);
        *libc::__errno_location() = errno;
    }
    load_settings();
    // Handler threads follow the CPUs the program's threads fault on.
    memtide_engine::threads::note_program_thread();
    if STATE.load(Ordering::Acquire) == IDLE {
        // SAFETY: registering plain extern "C" callbacks with the C runtime.
        unsafe {
            libc::atexit(at_exit);
            libc::pthread_atfork(
                Some(before_fork),
                Some(after_fork_parent),
                Some(in_fork_child),
            );
        }
    }
}

#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = init;
