//! Tier-1 encryption (`--encrypt-tier`): a backend in front of another that encrypts every
//! page with AES-256-GCM before it leaves DRAM and checks and decrypts it when it comes back,
//! so the tier file holds no plaintext and a page altered there is refused, never served. The
//! key is drawn from the kernel's random source when the engine starts and lives only in this
//! process's memory. Entry point: [`Encrypted`].
//!
//! # Nonces and tags
//!
//! Each write of a slot takes the next value of a 64-bit counter (shared with the children the
//! process forks, which write to the same file with the same key); the nonce is that value and
//! the slot number, so no (key, nonce) pair repeats and a page moved to another slot does not
//! decrypt there. The counter value and the 16-byte tag of every slot are kept beside the
//! backend in memory (24 bytes per slot of address space, touched only for slots in use). A
//! slot is read only after the write that filled it was published through the page's state
//! word, which orders these side arrays too.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use aes_gcm::aead::{AeadInOut, KeyInit, Nonce, Tag};
use aes_gcm::Aes256Gcm;
use memtide_policy::PAGE_SIZE;

use super::{Backend, ReadError};
use crate::sys::{self, Mapping};

pub struct Encrypted {
    inner: Box<dyn Backend>,
    cipher: Aes256Gcm,
    /// Per slot: the counter value its last write used (0: never written).
    counters: Mapping,
    /// Per slot: its tag, as two words.
    tags: Mapping,
    /// The counter for nonces, in memory shared with the children the process forks: they
    /// write to the same file with the same key, so they draw from the same counter.
    next: Mapping,
    slots: u64,
    /// Where ciphertext is made before it is written: kept, so that a batch costs no mapping
    /// of its own (and no TLB shootdown to unmap it).
    scratch: Mutex<Mapping>,
}

/// Pages of ciphertext the kept scratch area holds (the evictor's largest batch).
const SCRATCH_PAGES: usize = 256;

impl Encrypted {
    /// Encrypts `inner`'s pages with a fresh random key; `slots` is the most slots it can have.
    pub fn new(inner: Box<dyn Backend>, slots: u64) -> io::Result<Encrypted> {
        let mut key = [0u8; 32];
        sys::random_bytes(&mut key)?;
        let cipher = Aes256Gcm::new(&key.into());
        key.fill(0);
        Ok(Encrypted {
            inner,
            cipher,
            counters: Mapping::anon(slots as usize * 8)?,
            tags: Mapping::anon(slots as usize * 16)?,
            next: Mapping::shared_anon(8)?,
            slots,
            scratch: Mutex::new(Mapping::anon(SCRATCH_PAGES * PAGE_SIZE)?),
        })
    }

    fn nonce(slot: u64, counter: u64) -> Nonce<Aes256Gcm> {
        let mut n = [0u8; 12];
        n[..8].copy_from_slice(&counter.to_le_bytes());
        n[8..].copy_from_slice(&(slot as u32).to_le_bytes());
        n.into()
    }

    fn counter(&self, slot: u64) -> &AtomicU64 {
        &self.counters.as_slice::<AtomicU64>()[slot as usize]
    }

    fn tag_words(&self, slot: u64) -> (&AtomicU64, &AtomicU64) {
        let t = self.tags.as_slice::<AtomicU64>();
        (&t[2 * slot as usize], &t[2 * slot as usize + 1])
    }

    /// Encrypts the page at `src` into the page at `dst` for slot `slot`, and records the
    /// slot's counter and tag.
    ///
    /// # Safety
    ///
    /// `src` must be a readable page and `dst` a writable page not overlapping it.
    unsafe fn seal(&self, slot: u64, src: usize, dst: usize) -> io::Result<()> {
        if slot >= self.slots {
            return Err(io::Error::other("tier slot beyond the encrypted range"));
        }
        // SAFETY: the caller's contract.
        let buf = unsafe {
            std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, PAGE_SIZE);
            std::slice::from_raw_parts_mut(dst as *mut u8, PAGE_SIZE)
        };
        let c = self.next.as_slice::<AtomicU64>()[0].fetch_add(1, Ordering::Relaxed) + 1;
        let tag = self
            .cipher
            .encrypt_inout_detached(&Self::nonce(slot, c), &[], buf.into())
            .map_err(|_| io::Error::other("encrypting a page failed"))?;
        let (a, b) = self.tag_words(slot);
        a.store(
            u64::from_le_bytes(tag[..8].try_into().expect("8 bytes")),
            Ordering::Relaxed,
        );
        b.store(
            u64::from_le_bytes(tag[8..].try_into().expect("8 bytes")),
            Ordering::Relaxed,
        );
        self.counter(slot).store(c, Ordering::Relaxed);
        Ok(())
    }
}

impl Backend for Encrypted {
    unsafe fn read(&self, slot: u64, count: usize, buf: *mut u8) -> Result<(), ReadError> {
        // SAFETY: forwarded contract.
        unsafe { self.inner.read(slot, count, buf)? };
        for i in 0..count {
            let s = slot + i as u64;
            if s >= self.slots {
                // (No allocation here: this runs in the fault path.)
                return Err(io::Error::from_raw_os_error(libc::EINVAL).into());
            }
            let (a, b) = self.tag_words(s);
            let mut t = [0u8; 16];
            t[..8].copy_from_slice(&a.load(Ordering::Relaxed).to_le_bytes());
            t[8..].copy_from_slice(&b.load(Ordering::Relaxed).to_le_bytes());
            let tag: Tag<Aes256Gcm> = t.into();
            // SAFETY: `buf` holds `count` pages (the caller's contract).
            let page = unsafe { std::slice::from_raw_parts_mut(buf.add(i * PAGE_SIZE), PAGE_SIZE) };
            let nonce = Self::nonce(s, self.counter(s).load(Ordering::Relaxed));
            if self
                .cipher
                .decrypt_inout_detached(&nonce, &[], page.into(), &tag)
                .is_err()
            {
                // Never hand the program bytes that did not authenticate. EBADMSG is what the
                // engine takes for "altered" (no allocation: this runs in the fault path).
                page.fill(0);
                return Err(io::Error::from_raw_os_error(libc::EBADMSG).into());
            }
        }
        Ok(())
    }

    unsafe fn write(&self, slot: u64, pages: &[usize]) -> io::Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.write_runs(&[(slot, pages)]) }
    }

    unsafe fn write_runs(&self, runs: &[(u64, &[usize])]) -> io::Result<()> {
        // The ciphertext goes to a scratch mapping: the pages themselves stay as they are (a
        // failed write puts them back in the program's hands).
        let total: usize = runs.iter().map(|r| r.1.len()).sum();
        let kept = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let extra = if total > SCRATCH_PAGES {
            Some(Mapping::anon(total * PAGE_SIZE)?)
        } else {
            None
        };
        let out = extra.as_ref().unwrap_or(&kept);
        let addrs: Vec<usize> = (0..total).map(|i| out.addr() + i * PAGE_SIZE).collect();
        let mut sealed: Vec<(u64, &[usize])> = Vec::with_capacity(runs.len());
        let mut at = 0;
        for &(slot, pages) in runs {
            for (i, &src) in pages.iter().enumerate() {
                // SAFETY: `src` is a readable page (the caller's contract); the destination is
                // a page of `out`.
                unsafe { self.seal(slot + i as u64, src, addrs[at + i])? };
            }
            sealed.push((slot, &addrs[at..at + pages.len()]));
            at += pages.len();
        }
        // SAFETY: every address is a page of `out`, readable and aligned.
        unsafe { self.inner.write_runs(&sealed) }
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
        format!(
            "{}, encrypted (AES-256-GCM, key in memory only)",
            self.inner.describe()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tier::FileTier;
    use std::os::unix::fs::FileExt;

    fn page(seed: u8) -> Mapping {
        let m = Mapping::anon(PAGE_SIZE).unwrap();
        // SAFETY: a page of our own mapping.
        let s = unsafe { std::slice::from_raw_parts_mut(m.addr() as *mut u8, PAGE_SIZE) };
        for (i, b) in s.iter_mut().enumerate() {
            *b = seed.wrapping_add(i as u8);
        }
        m
    }

    fn bytes(m: &Mapping) -> &[u8] {
        // SAFETY: a page of our own mapping.
        unsafe { std::slice::from_raw_parts(m.addr() as *const u8, PAGE_SIZE) }
    }

    #[test]
    fn round_trip_and_every_alteration_is_refused() {
        let dir = std::env::temp_dir().join(format!("memtide-enc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("t.tier");
        let tier = Encrypted::new(Box::new(FileTier::create(&file).unwrap()), 16).unwrap();
        tier.grow(4).unwrap();
        // The tier file is unlinked once created: reach it through our descriptor.
        let file = std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .find(|p| std::fs::read_link(p).is_ok_and(|t| t.to_string_lossy().contains("t.tier")))
            .expect("the tier file is open");
        let (a, b) = (page(1), page(99));
        // SAFETY: both are readable pages.
        unsafe { tier.write_runs(&[(0, &[a.addr(), b.addr()])]).unwrap() };
        // The device holds neither page's bytes.
        let mut raw = vec![0u8; 2 * PAGE_SIZE];
        std::fs::File::open(&file)
            .unwrap()
            .read_exact_at(&mut raw, 0)
            .unwrap();
        assert_ne!(&raw[..PAGE_SIZE], bytes(&a));
        assert_ne!(&raw[PAGE_SIZE..], bytes(&b));
        let back = Mapping::anon(2 * PAGE_SIZE).unwrap();
        // SAFETY: `back` holds two pages.
        unsafe { tier.read(0, 2, back.addr() as *mut u8).unwrap() };
        // SAFETY: as above.
        let got = unsafe { std::slice::from_raw_parts(back.addr() as *const u8, 2 * PAGE_SIZE) };
        assert_eq!(&got[..PAGE_SIZE], bytes(&a));
        assert_eq!(&got[PAGE_SIZE..], bytes(&b));
        // The two slots swapped on the device: each is refused in the other's place.
        let f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
        f.write_all_at(&raw[PAGE_SIZE..], 0).unwrap();
        f.write_all_at(&raw[..PAGE_SIZE], PAGE_SIZE as u64).unwrap();
        f.sync_all().unwrap();
        // SAFETY: as above.
        let e = unsafe { tier.read(0, 1, back.addr() as *mut u8) }.unwrap_err();
        assert_eq!(e.error.raw_os_error(), Some(libc::EBADMSG));
        assert!(
            got[..PAGE_SIZE].iter().all(|&x| x == 0),
            "refused bytes were left in the buffer"
        );
        // One flipped bit in the original place is refused too.
        let mut flipped = raw[..PAGE_SIZE].to_vec();
        flipped[1234] ^= 1;
        f.write_all_at(&flipped, 0).unwrap();
        f.sync_all().unwrap();
        // SAFETY: as above.
        let e = unsafe { tier.read(0, 1, back.addr() as *mut u8) }.unwrap_err();
        assert_eq!(e.error.raw_os_error(), Some(libc::EBADMSG));
        // Rewriting a slot uses a new nonce: the same bytes encrypt differently.
        // SAFETY: a readable page.
        unsafe { tier.write(0, &[a.addr()]).unwrap() };
        let mut again = vec![0u8; PAGE_SIZE];
        std::fs::File::open(&file)
            .unwrap()
            .read_exact_at(&mut again, 0)
            .unwrap();
        assert_ne!(again, raw[..PAGE_SIZE].to_vec());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
