//! 2Q, the full version (Johnson and Shasha, "2Q: A Low Overhead High Performance Buffer
//! Management Replacement Algorithm", VLDB 1994): new pages enter the FIFO A1in (a quarter of
//! DRAM); pages leaving it are remembered in the ghost FIFO A1out (half of DRAM's worth of
//! page numbers); a page touched while remembered goes to the LRU list Am.

use super::lists::{Links, List, Residency};
use super::{Outcome, Policy};

const NONE: u8 = 0;
const A1IN: u8 = 1;
const A1OUT: u8 = 2;
const AM: u8 = 3;

pub struct TwoQ {
    c: u64,
    kin: u64,
    kout: u64,
    pub(super) a1in: List,
    pub(super) a1out: List,
    pub(super) am: List,
    links: Links,
    on: Vec<u8>,
    res: Residency,
}

impl TwoQ {
    pub fn new(pages: u64, cap: u64) -> TwoQ {
        let c = cap.max(1);
        TwoQ {
            c,
            kin: (c / 4).max(1),
            kout: (c / 2).max(1),
            a1in: List::EMPTY,
            a1out: List::EMPTY,
            am: List::EMPTY,
            links: Links::new(pages),
            on: vec![NONE; pages as usize],
            res: Residency::new(pages),
        }
    }

    /// Frees a frame if DRAM is full: from A1in while it is over its share (remembering the
    /// page in A1out), from Am's LRU end otherwise.
    fn reclaim(&mut self, o: &mut Outcome) {
        if self.a1in.len + self.am.len < self.c {
            return;
        }
        if self.a1in.len > self.kin || self.am.len == 0 {
            let v = self.links.pop_tail(&mut self.a1in).expect("A1in has pages");
            self.res.leave(v, o);
            self.links.push_head(&mut self.a1out, v);
            self.on[v as usize] = A1OUT;
            if self.a1out.len > self.kout {
                let g = self
                    .links
                    .pop_tail(&mut self.a1out)
                    .expect("A1out has pages");
                self.on[g as usize] = NONE;
            }
        } else {
            let v = self.links.pop_tail(&mut self.am).expect("Am has pages");
            self.res.leave(v, o);
            self.on[v as usize] = NONE;
        }
    }
}

impl Policy for TwoQ {
    fn name(&self) -> &'static str {
        "2q"
    }

    fn state_bytes(&self) -> u64 {
        self.links.bytes() + self.on.len() as u64 + self.res.bytes()
    }

    fn access(&mut self, page: u64, write: bool, o: &mut Outcome) {
        let x = page as u32;
        match self.on[x as usize] {
            AM => {
                self.links.remove(&mut self.am, x);
                self.links.push_head(&mut self.am, x);
            }
            A1IN => {}
            A1OUT => {
                // Off A1out first, so that reclaiming cannot forget it meanwhile.
                self.links.remove(&mut self.a1out, x);
                self.on[x as usize] = NONE;
                self.reclaim(o);
                self.links.push_head(&mut self.am, x);
                self.on[x as usize] = AM;
                self.res.arrive(x, o);
            }
            _ => {
                self.reclaim(o);
                self.links.push_head(&mut self.a1in, x);
                self.on[x as usize] = A1IN;
                self.res.arrive(x, o);
            }
        }
        if write {
            self.res.write(x);
        }
    }
}
