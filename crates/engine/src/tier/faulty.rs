//! A tier-1 layer that injects device faults for tests: reads that fail (EIO), reads that
//! return wrong bytes, writes that fail. It wraps a real backend and passes everything else
//! through. The engine puts it in front of the tier file only when a test asks for it
//! (`Config::tier_faults`). Entry points: [`TierFaults`], [`Faulty`].

use std::io;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use memtide_policy::PAGE_SIZE;

use super::{Backend, ReadError};

/// Which faults to inject, as counts of operations still to fail: `n` makes the next `n`
/// operations fail, [`TierFaults::ALWAYS`] every one from now on.
#[derive(Debug, Default)]
pub struct TierFaults {
    /// Reads fail with EIO.
    pub read_errors: AtomicU32,
    /// Reads fail with EIO as if the request were still in flight (the buffer is lost).
    pub read_lost: AtomicU32,
    /// Reads succeed but one byte of every page read is wrong.
    pub read_corrupt: AtomicU32,
    /// Writes fail with EIO.
    pub write_errors: AtomicU32,
}

impl TierFaults {
    pub const ALWAYS: u32 = u32::MAX;

    /// Whether this operation fails, counting it down.
    fn hit(count: &AtomicU32) -> bool {
        let mut v = count.load(Ordering::Relaxed);
        loop {
            match v {
                0 => return false,
                Self::ALWAYS => return true,
                _ => match count.compare_exchange(v, v - 1, Ordering::AcqRel, Ordering::Relaxed) {
                    Ok(_) => return true,
                    Err(now) => v = now,
                },
            }
        }
    }
}

/// A backend with faults injected.
pub struct Faulty {
    inner: Box<dyn Backend>,
    faults: Arc<TierFaults>,
}

impl Faulty {
    pub fn new(inner: Box<dyn Backend>, faults: Arc<TierFaults>) -> Faulty {
        Faulty { inner, faults }
    }
}

impl Backend for Faulty {
    unsafe fn read(&self, slot: u64, count: usize, buf: *mut u8) -> Result<(), ReadError> {
        if TierFaults::hit(&self.faults.read_errors) {
            return Err(io::Error::from_raw_os_error(libc::EIO).into());
        }
        if TierFaults::hit(&self.faults.read_lost) {
            return Err(ReadError {
                error: io::Error::from_raw_os_error(libc::EIO),
                buffer_lost: true,
            });
        }
        // SAFETY: forwarded contract.
        unsafe { self.inner.read(slot, count, buf)? };
        if TierFaults::hit(&self.faults.read_corrupt) {
            for i in 0..count {
                // SAFETY: the caller's buffer holds `count` pages; we flip a byte of each.
                unsafe { *buf.add(i * PAGE_SIZE + 100) ^= 0x5a };
            }
        }
        Ok(())
    }

    unsafe fn write(&self, slot: u64, pages: &[usize]) -> io::Result<()> {
        if TierFaults::hit(&self.faults.write_errors) {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        // SAFETY: forwarded contract.
        unsafe { self.inner.write(slot, pages) }
    }

    unsafe fn write_runs(&self, runs: &[(u64, &[usize])]) -> io::Result<()> {
        if TierFaults::hit(&self.faults.write_errors) {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        // SAFETY: forwarded contract.
        unsafe { self.inner.write_runs(runs) }
    }

    fn grow(&self, slots: u64) -> io::Result<()> {
        self.inner.grow(slots)
    }

    fn shrink(&self, slots: u64) -> io::Result<()> {
        self.inner.shrink(slots)
    }

    fn direct(&self) -> bool {
        self.inner.direct()
    }

    fn forked(&self) {
        self.inner.forked();
    }

    fn reads_polled(&self) -> (u64, u64) {
        self.inner.reads_polled()
    }

    fn describe(&self) -> String {
        format!("{} (with injected faults)", self.inner.describe())
    }
}
