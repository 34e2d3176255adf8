//! ARC (Megiddo and Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache", FAST 2003):
//! T1 holds pages seen once recently, T2 pages seen at least twice, B1 and B2 remember pages
//! recently evicted from each; a hit in B1 grows T1's target `p`, a hit in B2 shrinks it. `p`
//! is a real number, as in libCacheSim and the authors' reference code.

use super::lists::{Links, List, Residency};
use super::{Outcome, Policy};

const NONE: u8 = 0;
const T1: u8 = 1;
const T2: u8 = 2;
const B1: u8 = 3;
const B2: u8 = 4;

pub struct Arc {
    c: u64,
    pub(super) p: f64,
    t1: List,
    t2: List,
    b1: List,
    b2: List,
    links: Links,
    on: Vec<u8>,
    res: Residency,
}

impl Arc {
    pub fn new(pages: u64, cap: u64) -> Arc {
        Arc {
            c: cap.max(1),
            p: 0.0,
            t1: List::EMPTY,
            t2: List::EMPTY,
            b1: List::EMPTY,
            b2: List::EMPTY,
            links: Links::new(pages),
            on: vec![NONE; pages as usize],
            res: Residency::new(pages),
        }
    }

    /// The paper's REPLACE: evicts T1's LRU page into B1 or T2's into B2, whichever side is
    /// over its target.
    fn replace(&mut self, hit_in_b2: bool, o: &mut Outcome) {
        let t1 = self.t1.len as f64;
        let from_t1 =
            self.t1.len >= 1 && ((hit_in_b2 && t1 == self.p) || t1 > self.p || self.t2.len == 0);
        let (from, to, tag) = if from_t1 {
            (&mut self.t1, &mut self.b1, B1)
        } else {
            (&mut self.t2, &mut self.b2, B2)
        };
        let v = self
            .links
            .pop_tail(from)
            .expect("a full cache has a page to replace");
        self.links.push_head(to, v);
        self.on[v as usize] = tag;
        self.res.leave(v, o);
    }
}

impl Policy for Arc {
    fn name(&self) -> &'static str {
        "arc"
    }

    fn state_bytes(&self) -> u64 {
        self.links.bytes() + self.on.len() as u64 + self.res.bytes()
    }

    fn access(&mut self, page: u64, write: bool, o: &mut Outcome) {
        let x = page as u32;
        let c = self.c as f64;
        match self.on[x as usize] {
            T1 | T2 => {
                // Case I: a hit; x moves to T2's MRU end.
                let l = if self.on[x as usize] == T1 {
                    &mut self.t1
                } else {
                    &mut self.t2
                };
                self.links.remove(l, x);
            }
            B1 => {
                // Case II: recently evicted from T1, so T1 should have been larger.
                let delta = (self.b2.len as f64 / self.b1.len as f64).max(1.0);
                self.p = (self.p + delta).min(c);
                self.replace(false, o);
                self.links.remove(&mut self.b1, x);
                self.res.arrive(x, o);
            }
            B2 => {
                // Case III: recently evicted from T2, so T2 should have been larger.
                let delta = (self.b1.len as f64 / self.b2.len as f64).max(1.0);
                self.p = (self.p - delta).max(0.0);
                self.replace(true, o);
                self.links.remove(&mut self.b2, x);
                self.res.arrive(x, o);
            }
            _ => {
                // Case IV: not remembered at all; it goes to T1.
                let l1 = self.t1.len + self.b1.len;
                let total = l1 + self.t2.len + self.b2.len;
                if l1 == self.c {
                    if self.t1.len < self.c {
                        let g = self.links.pop_tail(&mut self.b1).expect("B1 is not empty");
                        self.on[g as usize] = NONE;
                        self.replace(false, o);
                    } else {
                        let v = self.links.pop_tail(&mut self.t1).expect("T1 is full");
                        self.on[v as usize] = NONE;
                        self.res.leave(v, o);
                    }
                } else if total >= self.c {
                    if total == 2 * self.c {
                        let g = self.links.pop_tail(&mut self.b2).expect("B2 is not empty");
                        self.on[g as usize] = NONE;
                    }
                    self.replace(false, o);
                }
                self.links.push_head(&mut self.t1, x);
                self.on[x as usize] = T1;
                self.res.arrive(x, o);
                if write {
                    self.res.write(x);
                }
                return;
            }
        }
        self.links.push_head(&mut self.t2, x);
        self.on[x as usize] = T2;
        if write {
            self.res.write(x);
        }
    }
}
