//! Device qualification I/O for `memtide probe`: a test file with O_DIRECT on the filesystem to
//! be judged, and timed runs of random or sequential reads or writes at a given queue depth,
//! through io_uring (one ring, `depth` operations in flight) or, where io_uring is unavailable,
//! `depth` threads doing `pread`/`pwrite`. Entry points: [`ProbeFile::create`],
//! [`ProbeFile::run`].

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use io_uring::{opcode, types, IoUring};

use memtide_engine::sys;

/// Why a probe file could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("{0}: no such directory")]
    Missing(PathBuf),
    #[error("{0} is not a directory: give a directory on the device to probe")]
    NotDir(PathBuf),
    #[error(
        "cannot create a test file in {0}: not writable (read-only filesystem or no permission)"
    )]
    NotWritable(PathBuf),
    #[error("{0} does not support O_DIRECT, so its device cannot be measured without the page cache in the way (memtide would fall back to buffered I/O there)")]
    NoDirect(PathBuf),
    #[error("no room for a {size_mib} MiB test file in {path}")]
    NoSpace { path: PathBuf, size_mib: u64 },
    #[error("{what} in {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

/// What a run does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pattern {
    RandomRead,
    RandomWrite,
    SequentialRead,
    SequentialWrite,
}

impl Pattern {
    fn writes(self) -> bool {
        matches!(self, Pattern::RandomWrite | Pattern::SequentialWrite)
    }
    fn random(self) -> bool {
        matches!(self, Pattern::RandomRead | Pattern::RandomWrite)
    }
}

/// What a run measured.
#[derive(Clone, Debug, Default)]
pub struct Run {
    pub ops: u64,
    pub bytes: u64,
    pub secs: f64,
    /// Completion latency of every operation, in nanoseconds, unsorted.
    pub latencies_ns: Vec<u64>,
}

impl Run {
    pub fn iops(&self) -> f64 {
        self.ops as f64 / self.secs.max(1e-9)
    }
    pub fn bytes_per_sec(&self) -> f64 {
        self.bytes as f64 / self.secs.max(1e-9)
    }
}

/// Next value of a xorshift generator (random offsets).
fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// The test file.
pub struct ProbeFile {
    fd: OwnedFd,
    path: PathBuf,
    size: u64,
    uring: bool,
}

/// An anonymous, page-aligned buffer for O_DIRECT transfers.
struct Buffers {
    map: sys::Mapping,
    each: usize,
}

impl Buffers {
    fn new(count: usize, each: usize) -> io::Result<Buffers> {
        let map = sys::Mapping::anon(count * each)?;
        // Non-zero bytes, so that nothing below can shortcut zero pages.
        // SAFETY: the mapping is ours, writable, and `count * each` bytes long.
        unsafe { std::ptr::write_bytes(map.addr() as *mut u8, 0x5A, count * each) };
        Ok(Buffers { map, each })
    }
    fn get(&self, i: usize) -> *mut u8 {
        (self.map.addr() + i * self.each) as *mut u8
    }
}

impl ProbeFile {
    /// Creates a `size`-byte test file in directory `dir`, written through once (so that reads
    /// hit allocated blocks). It is unlinked at once unless `keep` (for comparing with other
    /// tools on the same file; then it is the caller's to remove).
    pub fn create(dir: &Path, size: u64, keep: bool) -> Result<ProbeFile, ProbeError> {
        match std::fs::metadata(dir) {
            Err(_) => return Err(ProbeError::Missing(dir.to_path_buf())),
            Ok(m) if !m.is_dir() => return Err(ProbeError::NotDir(dir.to_path_buf())),
            Ok(_) => {}
        }
        let path = dir.join(format!("memtide-probe-{}.dat", std::process::id()));
        let io_err = |what, source| ProbeError::Io {
            what,
            path: dir.to_path_buf(),
            source,
        };
        let (file, direct) = sys::create_new_direct(&path).map_err(|e| match e.raw_os_error() {
            Some(libc::EACCES) | Some(libc::EROFS) | Some(libc::EPERM) => {
                ProbeError::NotWritable(dir.to_path_buf())
            }
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => ProbeError::NoSpace {
                path: dir.to_path_buf(),
                size_mib: size >> 20,
            },
            _ => io_err("cannot create a test file", e),
        })?;
        let cleanup = |e: ProbeError| {
            let _ = std::fs::remove_file(&path);
            e
        };
        if !direct {
            return Err(cleanup(ProbeError::NoDirect(dir.to_path_buf())));
        }
        if let Err(e) = sys::allocate(&file, size) {
            return Err(cleanup(match e.raw_os_error() {
                Some(libc::ENOSPC) | Some(libc::EDQUOT) | Some(libc::EFBIG) => {
                    ProbeError::NoSpace {
                        path: dir.to_path_buf(),
                        size_mib: size >> 20,
                    }
                }
                _ => io_err("cannot size the test file", e),
            }));
        }
        let fd = OwnedFd::from(file);
        if !keep {
            let _ = std::fs::remove_file(&path);
        }
        let uring = std::env::var_os("MEMTIDE_NO_IO_URING").is_none() && IoUring::new(4).is_ok();
        Ok(ProbeFile {
            fd,
            path,
            size,
            uring,
        })
    }

    /// Where the file is (already removed unless kept).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether runs go through io_uring (else `pread`/`pwrite` from threads).
    pub fn uses_io_uring(&self) -> bool {
        self.uring
    }

    /// Runs `pattern` in `block`-byte transfers with `depth` in flight for `duration` (or, for
    /// a sequential pass, until the end of the file if that comes first). `tick` is called now
    /// and then with the fraction of the time used.
    pub fn run(
        &self,
        pattern: Pattern,
        depth: usize,
        block: usize,
        duration: Duration,
        tick: &(dyn Fn(f64) + Sync),
    ) -> io::Result<Run> {
        let depth = depth.max(1);
        let blocks = (self.size / block as u64).max(1);
        if self.uring {
            self.run_uring(pattern, depth, block, blocks, duration, tick)
        } else {
            self.run_threads(pattern, depth, block, blocks, duration, tick)
        }
    }

    fn run_uring(
        &self,
        pattern: Pattern,
        depth: usize,
        block: usize,
        blocks: u64,
        duration: Duration,
        tick: &(dyn Fn(f64) + Sync),
    ) -> io::Result<Run> {
        let mut ring = IoUring::new(depth.next_power_of_two() as u32)?;
        let bufs = Buffers::new(depth, block)?;
        let mut rng = sys::now_ns() | 1;
        let mut next_seq = 0u64;
        let mut started = vec![0u64; depth];
        let mut run = Run::default();
        let t0 = Instant::now();
        let end = t0 + duration;
        let mut in_flight = 0usize;
        let mut done_issuing = false;
        let fd = types::Fd(self.fd.as_raw_fd());
        let mut last_tick = t0;
        let mut next_offset = |seq: &mut u64| -> Option<u64> {
            if pattern.random() {
                Some((xorshift(&mut rng) % blocks) * block as u64)
            } else if *seq < blocks {
                *seq += 1;
                Some((*seq - 1) * block as u64)
            } else {
                None
            }
        };
        let submit = |ring: &mut IoUring, slot: usize, off: u64| -> io::Result<()> {
            let buf = bufs.get(slot);
            let sqe = if pattern.writes() {
                opcode::Write::new(fd, buf, block as u32)
                    .offset(off)
                    .build()
            } else {
                opcode::Read::new(fd, buf, block as u32).offset(off).build()
            }
            .user_data(slot as u64);
            // SAFETY: the buffer is ours and outlives the operation (we reap every operation
            // before returning).
            unsafe { ring.submission().push(&sqe) }
                .map_err(|_| io::Error::other("io_uring submission queue full"))
        };
        for (slot, start) in started.iter_mut().enumerate() {
            let Some(off) = next_offset(&mut next_seq) else {
                break;
            };
            *start = sys::now_ns();
            submit(&mut ring, slot, off)?;
            in_flight += 1;
        }
        let mut first_err = None;
        while in_flight > 0 {
            match ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            let now = sys::now_ns();
            let cqes: Vec<(u64, i32)> = ring
                .completion()
                .map(|c| (c.user_data(), c.result()))
                .collect();
            for (slot, res) in cqes {
                in_flight -= 1;
                let slot = slot as usize;
                if res < 0 {
                    first_err.get_or_insert(io::Error::from_raw_os_error(-res));
                    done_issuing = true;
                } else {
                    run.ops += 1;
                    run.bytes += res as u64;
                    run.latencies_ns.push(now - started[slot]);
                }
                if !done_issuing && Instant::now() >= end {
                    done_issuing = true;
                }
                if done_issuing {
                    continue;
                }
                match next_offset(&mut next_seq) {
                    Some(off) => {
                        started[slot] = sys::now_ns();
                        submit(&mut ring, slot, off)?;
                        in_flight += 1;
                    }
                    None => done_issuing = true,
                }
            }
            if last_tick.elapsed() > Duration::from_millis(200) {
                last_tick = Instant::now();
                tick(t0.elapsed().as_secs_f64() / duration.as_secs_f64());
            }
        }
        run.secs = t0.elapsed().as_secs_f64();
        first_err.map_or(Ok(run), Err)
    }

    fn run_threads(
        &self,
        pattern: Pattern,
        depth: usize,
        block: usize,
        blocks: u64,
        duration: Duration,
        tick: &(dyn Fn(f64) + Sync),
    ) -> io::Result<Run> {
        let t0 = Instant::now();
        let end = t0 + duration;
        let next_seq = std::sync::atomic::AtomicU64::new(0);
        let fd = self.fd.as_raw_fd();
        let results: Vec<io::Result<Run>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..depth)
                .map(|t| {
                    let next_seq = &next_seq;
                    s.spawn(move || -> io::Result<Run> {
                        let buf = Buffers::new(1, block)?;
                        let mut rng = (sys::now_ns() + t as u64 * 7919) | 1;
                        let mut run = Run::default();
                        while Instant::now() < end {
                            let off = if pattern.random() {
                                (xorshift(&mut rng) % blocks) * block as u64
                            } else {
                                let b = next_seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                if b >= blocks {
                                    break;
                                }
                                b * block as u64
                            };
                            let start = sys::now_ns();
                            // SAFETY: the buffer is ours, `block` bytes, page-aligned.
                            let n = unsafe {
                                if pattern.writes() {
                                    libc::pwrite(fd, buf.get(0) as *const _, block, off as i64)
                                } else {
                                    libc::pread(fd, buf.get(0) as *mut _, block, off as i64)
                                }
                            };
                            if n < 0 {
                                return Err(io::Error::last_os_error());
                            }
                            run.ops += 1;
                            run.bytes += n as u64;
                            run.latencies_ns.push(sys::now_ns() - start);
                            if t == 0 && run.ops % 256 == 0 {
                                tick(t0.elapsed().as_secs_f64() / duration.as_secs_f64());
                            }
                        }
                        Ok(run)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(io::Error::other("probe thread")))
                })
                .collect()
        });
        let mut total = Run::default();
        for r in results {
            let r = r?;
            total.ops += r.ops;
            total.bytes += r.bytes;
            total.latencies_ns.extend(r.latencies_ns);
        }
        total.secs = t0.elapsed().as_secs_f64();
        Ok(total)
    }
}
