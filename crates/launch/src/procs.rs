//! What /proc says of a program's processes: whether one still runs, the tree below one, and
//! the DRAM a tree's anonymous memory takes. Entry points: [`running`], [`process_tree`],
//! [`tree_pss_anon_bytes`].

/// The state letter and parent of process `pid`, from /proc/<pid>/stat (the fields after the
/// command's closing parenthesis, which may itself hold spaces and parentheses).
fn state_and_parent(pid: u32) -> Option<(char, u32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut rest = stat.rsplit_once(')')?.1.split_whitespace();
    let state = rest.next()?.chars().next()?;
    let parent = rest.next()?.parse().ok()?;
    Some((state, parent))
}

/// Whether process `pid` still runs (not ended, not a zombie).
pub fn running(pid: u32) -> bool {
    state_and_parent(pid).is_some_and(|(state, _)| state != 'Z' && state != 'X')
}

/// The processes of the tree rooted at `root`: it and its descendants.
pub fn process_tree(root: u32) -> Vec<u32> {
    let parent_of: Vec<(u32, u32)> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<u32>().ok())
        .filter_map(|pid| Some((pid, state_and_parent(pid)?.1)))
        .collect();
    let mut tree = vec![root];
    let mut i = 0;
    while i < tree.len() {
        let p = tree[i];
        tree.extend(
            parent_of
                .iter()
                .filter(|&&(_, pp)| pp == p)
                .map(|&(c, _)| c),
        );
        i += 1;
    }
    tree
}

/// The DRAM a process tree's anonymous memory takes, in bytes: the sum of its processes'
/// proportional shares (`Pss_Anon`), so that a page two processes share copy-on-write counts
/// once, as the machine holds it.
pub fn tree_pss_anon_bytes(root: u32) -> u64 {
    process_tree(root)
        .iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/smaps_rollup")).ok())
        .filter_map(|s| {
            s.lines()
                .find(|l| l.starts_with("Pss_Anon:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .sum::<u64>()
        * 1024
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_runs_heads_its_tree_and_holds_anonymous_memory() {
        let me = std::process::id();
        assert!(running(me));
        assert_eq!(process_tree(me)[0], me);
        // 8 MiB written (black_box: kept, not optimized away).
        let v = std::hint::black_box(vec![1u8; 8 << 20]);
        assert!(tree_pss_anon_bytes(me) >= 8 << 20);
        assert_eq!(std::hint::black_box(&v)[4096], 1);
        assert!(!running(u32::MAX));
    }
}
