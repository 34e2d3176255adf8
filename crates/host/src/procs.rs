//! What /proc says of a tenant's processes, so that the daemon does not take a tenant's word
//! for everything it reports: the process it names must be the one that connected or one of
//! its descendants, and it cannot claim to manage more memory than its processes map. Entry
//! points: [`mapped_by`], [`descends_from`].

use std::collections::HashSet;

/// Most processes followed below one tenant (a fork bomb is not followed to its end).
const MAX_TREE: usize = 4096;

/// Bytes of address space mapped by `root` and every process below it (their VmSize, summed);
/// `None` when `root` is not there (0: its connection came from another pid namespace).
pub fn mapped_by(root: u32) -> Option<u64> {
    if root == 0 {
        return None;
    }
    let mut total = vm_size(root)?;
    let mut seen = HashSet::from([root]);
    let mut todo = children(root);
    while let Some(pid) = todo.pop() {
        if seen.len() >= MAX_TREE || !seen.insert(pid) {
            continue;
        }
        // A process that has just exited maps nothing.
        total = total.saturating_add(vm_size(pid).unwrap_or(0));
        todo.extend(children(pid));
    }
    Some(total)
}

/// Whether `pid` is `root` or below it (following parents in /proc/PID/stat).
pub fn descends_from(pid: u32, root: u32) -> bool {
    let mut at = pid;
    for _ in 0..MAX_TREE {
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

/// VmSize of `pid` in bytes (the first field of /proc/PID/statm, in pages).
fn vm_size(pid: u32) -> Option<u64> {
    let statm = std::fs::read_to_string(format!("/proc/{pid}/statm")).ok()?;
    let pages: u64 = statm.split_whitespace().next()?.parse().ok()?;
    Some(pages.saturating_mul(memtide_policy::PAGE_SIZE as u64))
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
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_descends_and_its_mapping_counts() {
        let me = std::process::id();
        let alone = mapped_by(me).expect("this process is in /proc");
        assert!(alone > 0);
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        assert!(descends_from(pid, me));
        assert!(!descends_from(me, pid));
        assert!(!descends_from(1, me));
        let with_child = mapped_by(me).unwrap();
        assert!(
            with_child >= alone + vm_size(pid).unwrap(),
            "{with_child} < {alone} + the child's"
        );
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(mapped_by(0), None);
    }
}
