//! Belady's optimum over a stored trace. Entry point: [`opt`].

use std::collections::BinaryHeap;

use super::{Outcome, DIRTY, IN_DRAM, NEVER, OUT};

/// Belady's OPT over a stored trace: on a miss with DRAM full, evict the resident page whose
/// next use is farthest away. O(n log n) with a max-heap of next uses (stale entries skipped).
/// Only accesses from index `count_from` on are counted (the ones before warm DRAM up).
pub fn opt(trace: &[(u32, bool)], pages: u64, cap: u64, count_from: usize) -> Outcome {
    let n = trace.len();
    // next_use[i]: index of the next access to the same page after i, or usize::MAX.
    let mut next_use = vec![usize::MAX; n];
    let mut last = vec![usize::MAX; pages as usize];
    for i in (0..n).rev() {
        let p = trace[i].0 as usize;
        next_use[i] = last[p];
        last[p] = i;
    }
    drop(last);
    let mut o = Outcome {
        policy: "opt".into(),
        dram_pages: cap,
        ..Outcome::default()
    };
    let mut warm = Outcome::default();
    let mut state = vec![NEVER; pages as usize];
    // The next use currently recorded for each resident page (to spot stale heap entries).
    let mut cur_next = vec![usize::MAX; pages as usize];
    let mut heap: BinaryHeap<(usize, u32)> = BinaryHeap::new();
    let mut resident = 0u64;
    let cap = cap.max(1);
    for (i, &(p, write)) in trace.iter().enumerate() {
        let o = if i < count_from {
            &mut warm
        } else {
            o.accesses += 1;
            &mut o
        };
        let pi = p as usize;
        let st = state[pi];
        if st & 3 != IN_DRAM {
            if st & 3 == NEVER {
                o.first_touches += 1;
            } else {
                o.misses += 1;
            }
            if resident == cap {
                loop {
                    let (nu, v) = heap.pop().expect("a resident page to evict");
                    let vi = v as usize;
                    if state[vi] & 3 == IN_DRAM && cur_next[vi] == nu {
                        o.demotions += 1;
                        if state[vi] & DIRTY != 0 {
                            o.writebacks += 1;
                        }
                        state[vi] = OUT;
                        resident -= 1;
                        break;
                    }
                }
            }
            state[pi] = IN_DRAM | (st & DIRTY);
            resident += 1;
        }
        if write {
            state[pi] |= DIRTY;
        }
        cur_next[pi] = next_use[i];
        heap.push((next_use[i], p));
        // Keep the heap from growing without bound on long traces.
        if heap.len() > 4 * cap as usize + 1024 {
            heap.retain(|&(nu, v)| state[v as usize] & 3 == IN_DRAM && cur_next[v as usize] == nu);
        }
    }
    o
}
