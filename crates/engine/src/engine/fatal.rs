//! Stopping the program when the engine cannot keep its data correct: one line (to the
//! launcher, see `say.rs`; without one, on stderr) naming what failed and the numbers that tell what state the engine was in, then abort.
//! Async-signal-safe (no allocation): it runs on the fault path. Entry points: [`fatal`],
//! [`fatal_with`].

use std::io;

use crate::sys;

/// The engine cannot keep the program's data correct: say why and abort, rather than let the
/// program run on with wrong bytes.
pub(super) fn fatal(what: &str, e: &io::Error) -> ! {
    fatal_with(what, &[], e)
}

/// [`fatal`], naming some numbers that tell what state the engine was in.
pub(super) fn fatal_with(what: &str, facts: &[(&str, u64)], e: &io::Error) -> ! {
    let mut line = Line { b: [0; 512], n: 0 };
    line.put(b"memtide: fatal: ");
    line.put(what.as_bytes());
    line.put(b" (errno ");
    line.num(e.raw_os_error().unwrap_or(0).unsigned_abs() as u64);
    for (name, v) in facts {
        line.put(b", ");
        line.put(name.as_bytes());
        line.put(b" ");
        line.num(*v);
    }
    line.put(b")\n");
    crate::say::fatal_line(&line.b[..line.n]);
    // SAFETY: abort never returns.
    unsafe { libc::abort() }
}

/// A page's presence as a fatal line prints it: 0 present, 1 swapped, 2 absent, 3 unknown.
pub(super) fn presence_code(p: Option<sys::Presence>) -> u64 {
    match p {
        Some(sys::Presence::Present) => 0,
        Some(sys::Presence::Swapped) => 1,
        Some(sys::Presence::Absent) => 2,
        None => 3,
    }
}

/// A fixed buffer the line is built in (no allocation in a signal handler).
struct Line {
    b: [u8; 512],
    n: usize,
}

impl Line {
    fn put(&mut self, s: &[u8]) {
        let take = s.len().min(self.b.len() - self.n);
        self.b[self.n..self.n + take].copy_from_slice(&s[..take]);
        self.n += take;
    }

    fn num(&mut self, mut v: u64) {
        let mut digits = [0u8; 20];
        let mut d = 0;
        loop {
            digits[d] = b'0' + (v % 10) as u8;
            d += 1;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        while d > 0 {
            d -= 1;
            self.put(&digits[d..d + 1]);
        }
    }
}
