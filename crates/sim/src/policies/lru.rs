//! LRU by timestamps: each page keeps the time of its last access (and its residency flags) in
//! one 32-bit word, and every access appends `(page, time)` to a queue. The least recently used
//! page is the oldest queue entry still current (its page is in DRAM and was last accessed at
//! that time); older entries of pages accessed again since are skipped when eviction reaches
//! them. A hit touches one word of per-page state and appends to the queue, where a linked list
//! touches the page's links and both neighbours'. The queue is compacted (only current entries
//! kept, renumbered in order) when it grows past a few times the DRAM size or time runs out of
//! bits. Misses, first touches, demotions and write-backs are exactly LRU's.

use super::{Outcome, Policy, LOOKAHEAD};

/// Written since it was last in tier 1.
const DIRTY: u32 = 1 << 31;
/// Accessed at least once (a later arrival is a miss, not a first touch).
const TOUCHED: u32 = 1 << 30;
/// The time of the page's last access while it is in DRAM; 0 while it is not.
const TIME: u32 = TOUCHED - 1;

/// Queue entries beyond `QUEUE_PER_FRAME` per DRAM page before a compaction.
const QUEUE_SLACK: usize = 1 << 16;
const QUEUE_PER_FRAME: usize = 4;

pub struct Lru {
    cap: u64,
    len: u64,
    /// Per page: `DIRTY | TOUCHED | time`.
    page: Vec<u32>,
    /// `(page, time)` per access since the last compaction; entries before `head` are gone.
    queue: Vec<(u32, u32)>,
    head: usize,
    /// The longest the queue was (for the state it took).
    queue_peak: usize,
    now: u32,
    /// Compact when the queue holds this many entries, or time reaches `time_limit`.
    queue_limit: usize,
    time_limit: u32,
}

impl Lru {
    pub fn new(pages: u64, cap: u64) -> Lru {
        let cap = cap.max(1);
        let frames = cap.min(pages.max(1)) as usize;
        Lru::with_limits(pages, cap, frames * QUEUE_PER_FRAME + QUEUE_SLACK, TIME)
    }

    fn with_limits(pages: u64, cap: u64, queue_limit: usize, time_limit: u32) -> Lru {
        Lru {
            cap: cap.max(1),
            len: 0,
            page: vec![0; pages as usize],
            // Address space only until used.
            queue: Vec::with_capacity(queue_limit),
            head: 0,
            queue_peak: 0,
            now: 0,
            queue_limit,
            time_limit,
        }
    }

    /// Keeps only the current entries (one per page in DRAM, in recency order) and numbers
    /// them again from 1.
    fn compact(&mut self) {
        self.queue_peak = self.queue_peak.max(self.queue.len());
        let mut t = 0u32;
        let mut keep = 0;
        for i in self.head..self.queue.len() {
            let (p, at) = self.queue[i];
            let w = self.page[p as usize];
            if w & TIME == at {
                t += 1;
                self.page[p as usize] = (w & !TIME) | t;
                self.queue[keep] = (p, t);
                keep += 1;
            }
        }
        self.queue.truncate(keep);
        self.head = 0;
        self.now = t;
    }

    /// Evicts the least recently used page.
    fn evict(&mut self, o: &mut Outcome) {
        loop {
            let (q, at) = self.queue[self.head];
            self.head += 1;
            let w = self.page[q as usize];
            if w & TIME == at {
                o.demotions += 1;
                if w & DIRTY != 0 {
                    o.writebacks += 1;
                }
                self.page[q as usize] = TOUCHED;
                o.left(q);
                self.len -= 1;
                return;
            }
        }
    }
}

impl Policy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }

    fn access_batch(&mut self, batch: &[u64], o: &mut Outcome) {
        for (i, &a) in batch.iter().enumerate() {
            // Touch what the accesses ahead will need: their pages' words, and the words of
            // the entries eviction will look at next.
            if let Some(&next) = batch.get(i + LOOKAHEAD) {
                std::hint::black_box(self.page[(next >> 1) as usize]);
            }
            if let Some(&(q, _)) = self.queue.get(self.head + LOOKAHEAD) {
                std::hint::black_box(self.page[q as usize]);
            }
            self.access(a >> 1, a & 1 != 0, o);
        }
    }

    fn state_bytes(&self) -> u64 {
        (self.page.len() * 4 + self.queue_peak.max(self.queue.len()) * 8) as u64
    }

    fn access(&mut self, page: u64, write: bool, o: &mut Outcome) {
        if self.now == self.time_limit || self.queue.len() >= self.queue_limit {
            self.compact();
        }
        let p = page as usize;
        let w = self.page[p];
        if w & TIME == 0 {
            if self.len == self.cap {
                self.evict(o);
            }
            if w & TOUCHED != 0 {
                o.missed(page as u32);
            } else {
                o.first_touches += 1;
            }
            self.len += 1;
        }
        self.now += 1;
        let dirty = if write { DIRTY } else { w & DIRTY };
        self.page[p] = dirty | TOUCHED | self.now;
        self.queue.push((page as u32, self.now));
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::naive_lru;
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The same counts as the plain LRU, with compactions forced often (a queue of a few
        /// entries beyond the DRAM size, or time of a few bits).
        #[test]
        fn counts_what_plain_lru_counts(
            pages in 2u64..40,
            cap in 1u64..20,
            len in 1usize..600,
            queue_extra in 0usize..8,
            time_limit in prop::option::of(45u32..100),
            seed in any::<u64>(),
        ) {
            let mut x = seed | 1;
            let trace: Vec<(u32, bool)> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    ((x % pages) as u32, x >> 60 < 5)
                })
                .collect();
            let limit = cap.min(pages) as usize + 1 + queue_extra;
            let mut lru = Lru::with_limits(pages, cap, limit, time_limit.unwrap_or(TIME));
            let mut o = Outcome::default();
            for &(p, w) in &trace {
                lru.access(p as u64, w, &mut o);
            }
            let want = naive_lru(&trace, cap as usize);
            prop_assert_eq!((o.misses, o.first_touches, o.demotions, o.writebacks), want);
        }
    }
}
