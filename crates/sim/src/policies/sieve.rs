//! SIEVE (Zhang et al., "SIEVE is Simpler than LRU", NSDI 2024): one FIFO queue, new pages at
//! the head, a visited bit set on a hit. The hand walks from the tail towards the head,
//! clearing visited bits, and evicts the first page it finds unvisited; it stays where it
//! stopped (wrapping from the head back to the tail), and pages it spares keep their place.

use super::lists::{Links, List, Residency};
use super::{Outcome, Policy, NIL};

pub struct Sieve {
    c: u64,
    q: List,
    links: Links,
    visited: Vec<u8>,
    hand: u32,
    res: Residency,
}

impl Sieve {
    pub fn new(pages: u64, cap: u64) -> Sieve {
        Sieve {
            c: cap.max(1),
            q: List::EMPTY,
            links: Links::new(pages),
            visited: vec![0; pages as usize],
            hand: NIL,
            res: Residency::new(pages),
        }
    }

    fn evict(&mut self, o: &mut Outcome) {
        let mut v = if self.hand == NIL {
            self.q.tail
        } else {
            self.hand
        };
        while self.visited[v as usize] != 0 {
            self.visited[v as usize] = 0;
            v = match self.links.newer(v) {
                NIL => self.q.tail,
                n => n,
            };
        }
        self.hand = self.links.newer(v);
        self.links.remove(&mut self.q, v);
        self.res.leave(v, o);
    }
}

impl Policy for Sieve {
    fn name(&self) -> &'static str {
        "sieve"
    }

    fn state_bytes(&self) -> u64 {
        self.links.bytes() + self.visited.len() as u64 + self.res.bytes()
    }

    fn access(&mut self, page: u64, write: bool, o: &mut Outcome) {
        let x = page as u32;
        if self.res.resident(x) {
            self.visited[x as usize] = 1;
        } else {
            if self.q.len == self.c {
                self.evict(o);
            }
            self.links.push_head(&mut self.q, x);
            self.visited[x as usize] = 0;
            self.res.arrive(x, o);
        }
        if write {
            self.res.write(x);
        }
    }
}
