//! Recording what the engine sees (`memtide run --record`): every page it brings into DRAM —
//! first touches (with the neighbours a zero fill maps), tier faults, hint faults — with its
//! time, so that the simulator can replay a real program at other DRAM sizes. The fault path
//! appends to a bounded ring (one compare-and-swap and two stores: no lock, no allocation;
//! when the ring is full the event is dropped and counted); a thread drains it to a raw file
//! every 20 ms, which the launcher turns into a `.mtt` trace when the program exits. Entry
//! points: [`Recorder`], [`Event`].
//!
//! Raw file: 16 bytes per event, little-endian: nanoseconds since the engine started, then
//! `page << 3 | kind` (kind 1 first touch, 2 fault served from the file, 3 hint fault, 4 fault
//! served from the compressed pool).

use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::sys::{self, Mapping};

/// What brought a page into DRAM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u64)]
pub enum Event {
    FirstTouch = 1,
    /// A fault served from the file.
    TierFault = 2,
    HintFault = 3,
    /// A fault served from the compressed pool.
    PoolFault = 4,
}

impl Event {
    /// Bits of a raw word below the page number.
    pub const BITS: u32 = 3;
}

/// Events the ring holds before the drain must have run (at 300,000 faults a second, over
/// three seconds).
const RING: u64 = 1 << 20;

pub struct Recorder {
    words: Mapping,
    times: Mapping,
    head: AtomicU64,
    tail: AtomicU64,
    dropped: AtomicU64,
    written: AtomicU64,
    start_ns: u64,
    out: Mutex<Option<crate::fds::Lifted<std::fs::File>>>,
    path: PathBuf,
}

impl Recorder {
    /// A recorder writing to `path` (created, truncated).
    pub fn create(path: &Path, start_ns: u64) -> io::Result<Recorder> {
        let file = std::fs::File::create(path)?;
        Ok(Recorder {
            words: Mapping::anon(RING as usize * 8)?,
            times: Mapping::anon(RING as usize * 8)?,
            head: AtomicU64::new(0),
            tail: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            written: AtomicU64::new(0),
            start_ns,
            out: Mutex::new(Some(crate::fds::lift(file))),
            path: path.to_path_buf(),
        })
    }

    fn word(&self, i: u64) -> &AtomicU64 {
        &self.words.as_slice::<AtomicU64>()[(i % RING) as usize]
    }

    fn time(&self, i: u64) -> &AtomicU64 {
        &self.times.as_slice::<AtomicU64>()[(i % RING) as usize]
    }

    /// Records that `page` came into DRAM for `why` (async-signal-safe).
    pub fn push(&self, page: usize, why: Event) {
        let mut h = self.head.load(Ordering::Relaxed);
        loop {
            if h - self.tail.load(Ordering::Acquire) >= RING {
                self.dropped.fetch_add(1, Ordering::Relaxed);
                return;
            }
            match self
                .head
                .compare_exchange_weak(h, h + 1, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => break,
                Err(now) => h = now,
            }
        }
        self.time(h)
            .store(sys::now_ns() - self.start_ns, Ordering::Relaxed);
        self.word(h)
            .store((page as u64) << Event::BITS | why as u64, Ordering::Release);
    }

    /// Writes every complete event to the file (the drain thread, and once more at exit).
    pub fn drain(&self) -> io::Result<()> {
        let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
        let Some(file) = out.as_mut() else {
            return Ok(());
        };
        let mut buf = Vec::with_capacity(64 << 10);
        let mut t = self.tail.load(Ordering::Acquire);
        loop {
            let w = self.word(t).load(Ordering::Acquire);
            if w == 0 {
                // Not yet written (a producer is between its claim and its store), or empty.
                break;
            }
            let time = self.time(t).load(Ordering::Relaxed);
            self.word(t).store(0, Ordering::Relaxed);
            buf.extend_from_slice(&time.to_le_bytes());
            buf.extend_from_slice(&w.to_le_bytes());
            t += 1;
            self.tail.store(t, Ordering::Release);
            if buf.len() >= 64 << 10 {
                file.write_all(&buf)?;
                buf.clear();
            }
        }
        file.write_all(&buf)?;
        self.written.store(t, Ordering::Relaxed);
        Ok(())
    }

    /// Events dropped because the ring was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Events written so far.
    pub fn written(&self) -> u64 {
        self.written.load(Ordering::Relaxed)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}
