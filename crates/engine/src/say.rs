//! Where memtide's own words go from inside a program's processes: never into the program's
//! streams (a program, or a test, that reads a child's stderr must see only the child's
//! words), but to a messages file the launcher reads and prints to its own stderr
//! ([`Relay`]). Without a launcher (the engine used directly) they go to stderr. A fatal line
//! is written with async-signal-safe calls only (`open`, `write`, `close`), since it may come
//! from a fault served in a signal handler. Entry points: [`to_file`], [`line`], [`fatal_line`],
//! [`Relay`].

use std::collections::HashSet;
use std::ffi::CString;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The messages file's name in a launch's statistics directory.
pub const MESSAGES_FILE: &str = "messages";

/// Where this process's messages go, once set.
static FILE: OnceLock<CString> = OnceLock::new();

/// Sends this process's messages to the messages file of the statistics directory `dir` from
/// now on (once: later calls change nothing).
pub fn to_file(dir: &Path) {
    if let Ok(c) = CString::new(dir.join(MESSAGES_FILE).as_os_str().as_bytes()) {
        let _ = FILE.set(c);
    }
}

/// Says one line (without its newline).
pub fn line(text: &str) {
    let mut b = Vec::with_capacity(text.len() + 1);
    b.extend_from_slice(text.as_bytes());
    b.push(b'\n');
    if !append(&b) {
        eprintln!("{text}");
    }
}

/// Says a line already ending in a newline, allocating nothing (a fatal stop, possibly from a
/// signal handler).
pub fn fatal_line(b: &[u8]) {
    if !append(b) {
        // SAFETY: writing our own buffer to stderr.
        unsafe { libc::syscall(libc::SYS_write, 2, b.as_ptr(), b.len()) };
    }
}

/// Appends `b` to the messages file in one write (lines from several processes do not mix);
/// false when there is none or it cannot be written.
fn append(b: &[u8]) -> bool {
    let Some(path) = FILE.get() else {
        return false;
    };
    // SAFETY: open, write and close on a file of our own; `path` is a C string that lives
    // forever.
    unsafe {
        let fd = libc::open(
            path.as_ptr(),
            libc::O_WRONLY | libc::O_APPEND | libc::O_CREAT | libc::O_CLOEXEC | libc::O_NOFOLLOW,
            0o600,
        );
        if fd < 0 {
            return false;
        }
        let n = libc::write(fd, b.as_ptr() as *const libc::c_void, b.len());
        libc::close(fd);
        n == b.len() as isize
    }
}

/// The launcher's side: prints the lines the program's processes said, each once.
pub struct Relay {
    path: PathBuf,
    read: u64,
    seen: HashSet<String>,
    /// Fatal lines seen so far.
    pub fatal: Vec<String>,
}

impl Relay {
    pub fn new(stats_dir: &Path) -> Relay {
        Relay {
            path: stats_dir.join(MESSAGES_FILE),
            read: 0,
            seen: HashSet::new(),
            fatal: Vec::new(),
        }
    }

    /// Prints to stderr every whole line said since the last call, each line once (several
    /// processes may say the same); with `quiet`, only fatal ones.
    pub fn relay(&mut self, quiet: bool) {
        for (l, fatal) in self.take() {
            if (fatal || !quiet) && self.seen.insert(l.clone()) {
                eprintln!("{l}");
            }
        }
    }

    /// The whole lines said since the last call, each with whether it is fatal (a fatal line
    /// is also kept in [`Relay::fatal`]).
    pub fn take(&mut self) -> Vec<(String, bool)> {
        let Ok(mut f) = std::fs::File::open(&self.path) else {
            return Vec::new();
        };
        let mut new = Vec::new();
        if f.seek(SeekFrom::Start(self.read)).is_err() || f.read_to_end(&mut new).is_err() {
            return Vec::new();
        }
        let whole = new.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        self.read += whole as u64;
        String::from_utf8_lossy(&new[..whole])
            .lines()
            .map(|l| {
                // (A line cut short by a full disk may lead the next one.)
                let fatal = l.contains("memtide: fatal:");
                if fatal {
                    self.fatal.push(l.to_string());
                }
                (l.to_string(), fatal)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_reach_the_relay_once_and_quiet_keeps_fatal_ones() {
        let dir = std::env::temp_dir().join(format!("memtide-say-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        to_file(&dir);
        let mut r = Relay::new(&dir);
        line("memtide: warning: one");
        line("memtide: warning: one");
        fatal_line(b"memtide: fatal: two (errno 9)\n");
        r.relay(true);
        assert_eq!(r.fatal, ["memtide: fatal: two (errno 9)"]);
        assert_eq!(r.seen.len(), 1, "quiet: only the fatal line printed");
        line("memtide: warning: three");
        r.relay(false);
        assert!(r.seen.contains("memtide: warning: three"));
        let text = std::fs::read_to_string(dir.join(MESSAGES_FILE)).unwrap();
        assert_eq!(text.lines().count(), 4);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
