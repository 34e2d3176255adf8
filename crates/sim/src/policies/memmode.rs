//! A model of hardware "memory mode": DRAM as a direct-mapped cache in front of a slow tier,
//! indexed by physical page, with each tenant's memory placed the way a hypervisor places it —
//! linearly, in power-on order — so that the cache map repeats every cache size. The model works
//! at page granularity (the hardware's lines are smaller; the conflicts it shows are the same
//! kind). Entry point: [`MemoryMode`].

use super::{Outcome, Policy};

const NIL: u32 = u32::MAX;

/// Direct-mapped DRAM cache: 4 bytes per cache page, 1 bit per page.
pub struct MemoryMode {
    tags: Vec<u32>,
    dirty: Vec<bool>,
    touched: Vec<u64>,
}

impl MemoryMode {
    pub fn new(pages: u64, cache_pages: u64) -> MemoryMode {
        let c = cache_pages.max(1) as usize;
        MemoryMode {
            tags: vec![NIL; c],
            dirty: vec![false; c],
            touched: vec![0; (pages as usize).div_ceil(64)],
        }
    }
}

impl Policy for MemoryMode {
    fn name(&self) -> &'static str {
        "memory-mode"
    }
    fn state_bytes(&self) -> u64 {
        (self.tags.len() * 5 + self.touched.len() * 8) as u64
    }

    fn access(&mut self, page: u64, write: bool, o: &mut Outcome) {
        // Physical page = page: sources lay tenants out one after another in power-on order.
        let set = (page % self.tags.len() as u64) as usize;
        if self.tags[set] != page as u32 {
            let (w, b) = ((page / 64) as usize, page % 64);
            if self.touched[w] & (1 << b) == 0 {
                self.touched[w] |= 1 << b;
                o.first_touches += 1;
            } else {
                o.misses += 1;
            }
            if self.tags[set] != NIL {
                o.demotions += 1;
                if self.dirty[set] {
                    o.writebacks += 1;
                }
            }
            self.tags[set] = page as u32;
            self.dirty[set] = false;
        }
        if write {
            self.dirty[set] = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::Rng;

    /// Brute-force reference: a map from set to the line it holds, recomputed per access.
    fn brute(trace: &[u64], cache: u64) -> u64 {
        let mut held: std::collections::HashMap<u64, u64> = Default::default();
        let mut seen = std::collections::HashSet::new();
        let mut misses = 0;
        for &p in trace {
            let set = p % cache;
            if held.get(&set) != Some(&p) {
                if !seen.insert(p) {
                    misses += 1;
                }
                held.insert(set, p);
            }
        }
        misses
    }

    #[test]
    fn matches_brute_force() {
        for seed in 0..20 {
            let mut r = Rng::new(seed);
            let pages = 1 + r.below(200);
            let cache = 1 + r.below(pages);
            let trace: Vec<u64> = (0..2000).map(|_| r.below(pages)).collect();
            let mut m = MemoryMode::new(pages, cache);
            let mut o = Outcome::default();
            for &p in &trace {
                m.access(p, false, &mut o);
            }
            assert_eq!(o.misses, brute(&trace, cache), "seed {seed}");
        }
    }
}
