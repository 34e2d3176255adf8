//! What /proc says of a tenant's processes, so that the daemon does not take a tenant's word
//! for everything it reports: the process it names must be the one that connected or one of
//! its descendants, and what it claims to hold is bounded by what its processes hold
//! ([`Usage`]). Entry points: [`usage_of`], [`descends_from`].

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;

use memtide_policy::PAGE_SIZE;

/// Most processes followed below one tenant (a fork bomb is not followed to its end).
const MAX_TREE: usize = 4096;

/// Most parents followed up from a process.
const MAX_DEPTH: usize = 64;

/// Most descriptors looked at over one tenant's processes.
const MAX_FDS: usize = 65536;

/// What a tenant's processes hold, summed over the process that connected and every process
/// below it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Address space (VmSize): an upper bound of the memory it manages.
    pub mapped: u64,
    /// Resident memory (RSS): an upper bound of its managed memory in DRAM.
    pub resident: u64,
    /// memtide tier files its processes hold open: blocks allocated (an upper bound of what
    /// its tiers hold) and lengths.
    pub tier_allocated: u64,
    pub tier_length: u64,
}

impl Usage {
    /// No bound: what nothing in /proc limits.
    pub const UNBOUNDED: Usage = Usage {
        mapped: u64::MAX,
        resident: u64::MAX,
        tier_allocated: u64::MAX,
        tier_length: u64::MAX,
    };
}

/// What `root` and the processes below it hold; `None` when `root` is not there (0: its
/// connection came from another pid namespace).
pub fn usage_of(root: u32) -> Option<Usage> {
    if root == 0 {
        return None;
    }
    let mut u = Usage::default();
    let (size, rss) = statm(root)?;
    u.mapped = size;
    u.resident = rss;
    let mut files = HashSet::new();
    let mut fds = 0;
    tier_files(root, &mut u, &mut files, &mut fds);
    let mut seen = HashSet::from([root]);
    let mut todo = children(root);
    while let Some(pid) = todo.pop() {
        if seen.len() >= MAX_TREE || !seen.insert(pid) {
            continue;
        }
        // A process that has just exited holds nothing.
        let (size, rss) = statm(pid).unwrap_or((0, 0));
        u.mapped = u.mapped.saturating_add(size);
        u.resident = u.resident.saturating_add(rss);
        tier_files(pid, &mut u, &mut files, &mut fds);
        todo.extend(children(pid));
    }
    Some(u)
}

/// Whether `pid` is `root` or below it (following parents in /proc/PID/stat, at most
/// [`MAX_DEPTH`] of them).
pub fn descends_from(pid: u32, root: u32) -> bool {
    let mut at = pid;
    for _ in 0..MAX_DEPTH {
        if at == root {
            return true;
        }
        match parent(at) {
            Some(p) if p != 0 && p != at => at = p,
            _ => return false,
        }
    }
    false
}

/// VmSize and RSS of `pid` in bytes (the first two fields of /proc/PID/statm, in pages).
fn statm(pid: u32) -> Option<(u64, u64)> {
    let statm = std::fs::read_to_string(format!("/proc/{pid}/statm")).ok()?;
    let mut f = statm
        .split_whitespace()
        .map(|v| v.parse::<u64>().map(|p| p.saturating_mul(PAGE_SIZE as u64)));
    Some((f.next()?.ok()?, f.next()?.ok()?))
}

/// Adds the memtide tier files `pid` holds open (unlinked files named `memtide-*.tier`),
/// each file once however many descriptors name it.
fn tier_files(pid: u32, u: &mut Usage, files: &mut HashSet<(u64, u64)>, fds: &mut usize) {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return;
    };
    for fd in dir.flatten() {
        *fds += 1;
        if *fds > MAX_FDS {
            return;
        }
        let Ok(target) = std::fs::read_link(fd.path()) else {
            continue;
        };
        let name = target.to_string_lossy();
        let Some(file) = name.rsplit('/').next() else {
            continue;
        };
        if !(file.starts_with("memtide-") && file.ends_with(".tier (deleted)")) {
            continue;
        }
        // Through the descriptor: the file itself, not a name anyone could put there.
        if let Ok(m) = std::fs::metadata(fd.path()) {
            if m.is_file() && files.insert((m.dev(), m.ino())) {
                u.tier_allocated = u.tier_allocated.saturating_add(m.blocks() * 512);
                u.tier_length = u.tier_length.saturating_add(m.len());
            }
        }
    }
}

/// The children of every thread of `pid`.
fn children(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for t in tasks.flatten() {
        if let Ok(list) = std::fs::read_to_string(t.path().join("children")) {
            out.extend(
                list.split_whitespace()
                    .filter_map(|c| c.parse::<u32>().ok()),
            );
        }
    }
    out
}

/// The parent of `pid` (the field after the command name, which may hold spaces and ')').
fn parent(pid: u32) -> Option<u32> {
    memtide_engine::sys::stat_fields(&format!("/proc/{pid}/stat"))?
        .get(1)?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_descends_and_what_it_holds_counts() {
        use std::io::BufRead;
        let me = std::process::id();
        let alone = usage_of(me).expect("this process is in /proc");
        assert!(alone.mapped > 0 && alone.resident > 0);
        assert!(alone.resident <= alone.mapped);
        // A tier file, unlinked, with 1 MiB allocated, held open by a shell (as its stdin)
        // whose child sleeps: a tree whose memory does not move while it is measured (this
        // process's does, as other tests run on its other threads).
        let dir = std::env::temp_dir().join(format!("memtide-procs-{me}"));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("memtide-{me}.tier"));
        let f = std::fs::File::create(&path).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, &vec![7u8; 1 << 20], 0).unwrap();
        std::fs::remove_file(&path).unwrap();
        let twice = f.try_clone().unwrap();
        let mut shell = std::process::Command::new("sh")
            .args(["-c", "sleep 30 & echo $!; wait"])
            .stdin(std::process::Stdio::from(twice))
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let root = shell.id();
        let mut line = String::new();
        std::io::BufReader::new(shell.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let sleeper: u32 = line.trim().parse().unwrap();
        assert!(descends_from(sleeper, root));
        assert!(descends_from(sleeper, me));
        assert!(!descends_from(root, sleeper));
        assert!(!descends_from(1, me));
        // The sleeper may still be between fork and exec: measure until the sizes held still
        // across the measurement.
        let sizes = || (statm(root).unwrap().0, statm(sleeper).unwrap().0);
        let (tree, (shell_size, sleeper_size)) = (0..10_000)
            .find_map(|_| {
                let before = sizes();
                let tree = usage_of(root).unwrap();
                std::thread::yield_now();
                (sizes() == before).then_some((tree, before))
            })
            .expect("the tree's sizes hold still");
        assert_eq!(tree.mapped, shell_size + sleeper_size, "{tree:?}");
        assert!(tree.resident > 0 && tree.resident <= tree.mapped);
        assert_eq!(
            tree.tier_length,
            1 << 20,
            "one file, counted once: {tree:?}"
        );
        assert!(tree.tier_allocated >= 1 << 20);
        let leaf = usage_of(sleeper).unwrap();
        assert!(leaf.mapped < tree.mapped, "a leaf holds only itself");
        let killed = std::process::Command::new("kill")
            .args(["-KILL", &sleeper.to_string()])
            .status()
            .unwrap();
        assert!(killed.success());
        shell.wait().unwrap();
        drop(f);
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(usage_of(0), None);
    }
}
