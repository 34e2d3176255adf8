//! Tier 1 as a file on an SSD/NVMe filesystem, read and written with O_DIRECT (buffered I/O
//! where the filesystem refuses O_DIRECT, said once in the summary). The file is unlinked right
//! after it is created, so it disappears when the process exits however it exits; its space
//! shows in `df` while the program runs. Entry point: [`FileTier::create`].

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use memtide_policy::PAGE_SIZE;

use super::{Backend, ReadError};
use crate::sys;

/// Why the tier file could not be created; each says what to do.
#[derive(Debug, thiserror::Error)]
pub enum TierOpenError {
    #[error("tier path {0} does not exist: create the directory or give an existing one")]
    Missing(PathBuf),
    #[error("tier path {0} is not writable: choose a directory this user can write to")]
    NotWritable(PathBuf),
    #[error("tier file {0} already exists: give a directory, or a file name that is not taken")]
    Exists(PathBuf),
    #[error("cannot create tier file {path}: {source}")]
    Create { path: PathBuf, source: io::Error },
}

/// A tier-1 file.
pub struct FileTier {
    fd: crate::fds::Lifted<OwnedFd>,
    direct: bool,
    path: PathBuf,
    /// Bytes the file has been grown to.
    size: AtomicU64,
}

impl FileTier {
    /// Creates the tier file: `path` is either a directory (a file named after the process is
    /// created in it) or the name of a file to create.
    pub fn create(path: &Path) -> Result<FileTier, TierOpenError> {
        let target = if path.is_dir() {
            path.join(format!("memtide-{}.tier", std::process::id()))
        } else {
            match path.parent() {
                Some(p) if !p.as_os_str().is_empty() && !p.is_dir() => {
                    return Err(TierOpenError::Missing(p.to_path_buf()))
                }
                _ => {}
            }
            if path.exists() {
                return Err(TierOpenError::Exists(path.to_path_buf()));
            }
            path.to_path_buf()
        };
        let (file, direct) =
            sys::create_new_direct(&target).map_err(|e| match e.raw_os_error() {
                Some(libc::EACCES) | Some(libc::EROFS) | Some(libc::EPERM) => {
                    TierOpenError::NotWritable(target.clone())
                }
                Some(libc::EEXIST) => TierOpenError::Exists(target.clone()),
                Some(libc::ENOENT) => TierOpenError::Missing(target.clone()),
                _ => TierOpenError::Create {
                    path: target.clone(),
                    source: e,
                },
            })?;
        let fd = crate::fds::lift(OwnedFd::from(file));
        // Unlinked at once: nothing is left behind, even if the program is killed.
        let _ = std::fs::remove_file(&target);
        Ok(FileTier {
            fd,
            direct,
            path: target,
            size: AtomicU64::new(0),
        })
    }

    pub(super) fn raw_fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    /// Path the file was created at (already unlinked).
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Backend for FileTier {
    unsafe fn read(&self, slot: u64, count: usize, buf: *mut u8) -> Result<(), ReadError> {
        // SAFETY: the caller provides a writable, aligned buffer of `count` pages.
        unsafe {
            sys::pread_full(
                self.fd.as_raw_fd(),
                buf,
                count * PAGE_SIZE,
                slot * PAGE_SIZE as u64,
            )
        }
        .map_err(ReadError::from)
    }

    unsafe fn write(&self, slot: u64, pages: &[usize]) -> io::Result<()> {
        let mut iov = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; 256];
        let mut off = slot * PAGE_SIZE as u64;
        for chunk in pages.chunks(iov.len()) {
            for (v, &p) in iov.iter_mut().zip(chunk) {
                *v = libc::iovec {
                    iov_base: p as *mut libc::c_void,
                    iov_len: PAGE_SIZE,
                };
            }
            // SAFETY: the caller guarantees readable pages.
            unsafe { sys::pwritev_full(self.fd.as_raw_fd(), &mut iov[..chunk.len()], off)? };
            off += (chunk.len() * PAGE_SIZE) as u64;
        }
        Ok(())
    }

    fn grow(&self, slots: u64) -> io::Result<()> {
        let bytes = slots * PAGE_SIZE as u64;
        if bytes <= self.size.load(Ordering::Relaxed) {
            return Ok(());
        }
        if let Err(e) = sys::allocate(&*self.fd, bytes) {
            if e.raw_os_error() != Some(libc::EOPNOTSUPP) {
                return Err(e);
            }
            // SAFETY: plain system call on our own fd.
            if unsafe { libc::ftruncate(self.fd.as_raw_fd(), bytes as libc::off_t) } < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        self.size.store(bytes, Ordering::Relaxed);
        Ok(())
    }

    fn shrink(&self, slots: u64) -> io::Result<()> {
        let bytes = slots * PAGE_SIZE as u64;
        if bytes >= self.size.load(Ordering::Relaxed) {
            return Ok(());
        }
        // SAFETY: plain system call on our own fd.
        if unsafe { libc::ftruncate(self.fd.as_raw_fd(), bytes as libc::off_t) } < 0 {
            return Err(io::Error::last_os_error());
        }
        self.size.store(bytes, Ordering::Relaxed);
        Ok(())
    }

    fn direct(&self) -> bool {
        self.direct
    }

    fn describe(&self) -> String {
        format!(
            "file {} ({})",
            self.path.display(),
            if self.direct {
                "O_DIRECT"
            } else {
                "buffered: the filesystem has no O_DIRECT"
            }
        )
    }
}
