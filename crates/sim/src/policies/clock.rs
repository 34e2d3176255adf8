//! CLOCK (second chance) and GCLOCK (LFU with aging), as every other online policy here:
//! seeing every access. Entry point: [`Clock`].

use super::lists::Residency;
use super::{Outcome, Policy, LOOKAHEAD, NIL};

/// CLOCK (second chance), or with `counters` GCLOCK, LFU with aging: 5 bytes per page plus
/// 5 bytes per DRAM frame.
pub struct Clock {
    frames: Vec<u32>,
    weight: Vec<u8>,
    frame_of: Vec<u32>,
    res: Residency,
    hand: usize,
    used: usize,
    counters: bool,
}

impl Clock {
    pub fn new(pages: u64, cap: u64, counters: bool) -> Clock {
        let cap = cap.max(1) as usize;
        Clock {
            frames: vec![NIL; cap],
            weight: vec![0; cap],
            frame_of: vec![NIL; pages as usize],
            res: Residency::new(pages),
            hand: 0,
            used: 0,
            counters,
        }
    }
}

impl Policy for Clock {
    fn access_batch(&mut self, batch: &[u64], o: &mut Outcome) {
        batch_with_lookahead!(self, batch, o, frame_of)
    }
    fn state_bytes(&self) -> u64 {
        (self.frames.len() * 5 + self.frame_of.len() * 4) as u64 + self.res.bytes()
    }
    fn name(&self) -> &'static str {
        if self.counters {
            "gclock"
        } else {
            "clock"
        }
    }
    fn access(&mut self, page: u64, write: bool, o: &mut Outcome) {
        let p = page as usize;
        if self.res.resident(p as u32) {
            let f = self.frame_of[p] as usize;
            self.weight[f] = if self.counters {
                self.weight[f].saturating_add(1)
            } else {
                1
            };
        } else {
            let f = if self.used < self.frames.len() {
                self.used += 1;
                self.used - 1
            } else {
                loop {
                    let h = self.hand;
                    self.hand = (self.hand + 1) % self.frames.len();
                    if self.weight[h] == 0 {
                        let v = self.frames[h];
                        self.res.leave(v, o);
                        self.frame_of[v as usize] = NIL;
                        break h;
                    }
                    // Second chance; GCLOCK ages the count by halving.
                    self.weight[h] = if self.counters { self.weight[h] / 2 } else { 0 };
                }
            };
            self.frames[f] = p as u32;
            self.frame_of[p] = f as u32;
            self.weight[f] = 1;
            self.res.arrive(p as u32, o);
        }
        if write {
            self.res.write(p as u32);
        }
    }
}
