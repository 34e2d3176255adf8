//! Exact LFU: evicts the page in DRAM with the fewest hits since it came in (counts start at
//! one on arrival and are forgotten on eviction); among equals, the one that reached its count
//! first (libCacheSim's LFU). Not an online policy anyone would run on pages: it needs a count
//! per access and an ordered structure. GCLOCK ([`super::Clock`] with counters) is the
//! approximation with aging.

use std::collections::BTreeSet;

use super::lists::Residency;
use super::{Outcome, Policy};

pub struct Lfu {
    c: u64,
    /// (count, when it reached that count, page) for every page in DRAM.
    order: BTreeSet<(u32, u64, u32)>,
    count: Vec<u32>,
    since: Vec<u64>,
    tick: u64,
    res: Residency,
}

impl Lfu {
    pub fn new(pages: u64, cap: u64) -> Lfu {
        Lfu {
            c: cap.max(1),
            order: BTreeSet::new(),
            count: vec![0; pages as usize],
            since: vec![0; pages as usize],
            tick: 0,
            res: Residency::new(pages),
        }
    }
}

impl Policy for Lfu {
    fn name(&self) -> &'static str {
        "lfu"
    }

    fn state_bytes(&self) -> u64 {
        // A B-tree entry is about 16 bytes plus node overhead; count it as 24.
        self.count.len() as u64 * 12 + self.order.len() as u64 * 24 + self.res.bytes()
    }

    fn access(&mut self, page: u64, write: bool, o: &mut Outcome) {
        let x = page as u32;
        let i = x as usize;
        self.tick += 1;
        if self.res.resident(x) {
            self.order.remove(&(self.count[i], self.since[i], x));
            self.count[i] = self.count[i].saturating_add(1);
        } else {
            if self.order.len() as u64 == self.c {
                let (_, _, v) = self.order.pop_first().expect("DRAM is full");
                self.res.leave(v, o);
            }
            self.count[i] = 1;
            self.res.arrive(x, o);
        }
        self.since[i] = self.tick;
        self.order.insert((self.count[i], self.tick, x));
        if write {
            self.res.write(x);
        }
    }
}
