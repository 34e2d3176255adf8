//! S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP 2023), with
//! libCacheSim's defaults: a small FIFO S of 10% of DRAM takes new pages, a main FIFO M the
//! rest, a ghost FIFO G remembers as many page numbers as M holds pages. Each page counts hits
//! up to 3. Leaving S, a page hit at least twice moves to M; others are forgotten into G. A page
//! found in G goes straight to M. Leaving M, a page with hits is reinserted with one fewer.

use super::lists::{Links, List, Residency};
use super::{Outcome, Policy};

const NONE: u8 = 0;
const S: u8 = 1;
const M: u8 = 2;
const G: u8 = 3;

/// Hits in S a page needs to move to M (libCacheSim's `move-to-main-threshold`).
const MOVE_TO_MAIN: u8 = 2;

pub struct S3Fifo {
    c: u64,
    m_size: u64,
    g_size: u64,
    pub(super) s: List,
    pub(super) m: List,
    pub(super) g: List,
    links: Links,
    on: Vec<u8>,
    freq: Vec<u8>,
    res: Residency,
}

impl S3Fifo {
    pub fn new(pages: u64, cap: u64) -> S3Fifo {
        let c = cap.max(1);
        let s_size = ((c as f64 * 0.1) as u64).max(1).min(c);
        S3Fifo {
            c,
            m_size: c - s_size,
            g_size: (c as f64 * 0.9) as u64,
            s: List::EMPTY,
            m: List::EMPTY,
            g: List::EMPTY,
            links: Links::new(pages),
            on: vec![NONE; pages as usize],
            freq: vec![0; pages as usize],
            res: Residency::new(pages),
        }
    }

    fn evict(&mut self, o: &mut Outcome) {
        if self.m.len > self.m_size || self.s.len == 0 {
            self.evict_main(o);
        } else {
            self.evict_small(o);
        }
    }

    fn evict_small(&mut self, o: &mut Outcome) {
        while let Some(t) = self.links.pop_tail(&mut self.s) {
            if self.freq[t as usize] >= MOVE_TO_MAIN {
                self.freq[t as usize] = 0;
                self.links.push_head(&mut self.m, t);
                self.on[t as usize] = M;
            } else {
                self.res.leave(t, o);
                self.remember(t);
                return;
            }
        }
    }

    fn evict_main(&mut self, o: &mut Outcome) {
        while let Some(t) = self.links.pop_tail(&mut self.m) {
            let f = self.freq[t as usize];
            if f >= 1 {
                self.freq[t as usize] = f.min(3) - 1;
                self.links.push_head(&mut self.m, t);
            } else {
                self.res.leave(t, o);
                self.on[t as usize] = NONE;
                return;
            }
        }
    }

    fn remember(&mut self, t: u32) {
        if self.g_size == 0 {
            self.on[t as usize] = NONE;
            return;
        }
        self.links.push_head(&mut self.g, t);
        self.on[t as usize] = G;
        if self.g.len > self.g_size {
            let old = self.links.pop_tail(&mut self.g).expect("G has pages");
            self.on[old as usize] = NONE;
        }
    }
}

impl Policy for S3Fifo {
    fn name(&self) -> &'static str {
        "s3fifo"
    }

    fn state_bytes(&self) -> u64 {
        self.links.bytes() + 2 * self.on.len() as u64 + self.res.bytes()
    }

    fn access(&mut self, page: u64, write: bool, o: &mut Outcome) {
        let x = page as u32;
        match self.on[x as usize] {
            S | M => {
                self.freq[x as usize] = self.freq[x as usize].saturating_add(1);
            }
            on => {
                let ghost = on == G;
                if ghost {
                    self.links.remove(&mut self.g, x);
                    self.on[x as usize] = NONE;
                }
                while self.s.len + self.m.len >= self.c {
                    self.evict(o);
                }
                if ghost {
                    self.links.push_head(&mut self.m, x);
                    self.on[x as usize] = M;
                } else {
                    self.links.push_head(&mut self.s, x);
                    self.on[x as usize] = S;
                }
                self.freq[x as usize] = 0;
                self.res.arrive(x, o);
            }
        }
        if write {
            self.res.write(x);
        }
    }
}
