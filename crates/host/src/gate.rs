//! Who may hold a connection to the daemon and how fast each user may ask: a member of the
//! socket's group holds at most [`Limits::per_user`] connections, all members together at most
//! [`Limits::connections`], and each user's requests come out of a bucket of tokens that
//! refills at [`Limits::rate`] per second (a change of terms costs [`CHANGE_COST`]). A request
//! beyond the bucket is not refused: its connection waits, so a flood slows to the rate
//! instead of taking the daemon's CPU. Admins are neither counted nor slowed. Time is passed
//! in. Entry point: [`Gate`].

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// What a request to register or change terms costs, in tokens (each rebalances the host).
pub const CHANGE_COST: f64 = 16.0;

#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections of all non-admin users together.
    pub connections: usize,
    /// Connections of one non-admin user.
    pub per_user: usize,
    /// Tokens per second a user's bucket gains, and the most it holds.
    pub rate: f64,
    pub burst: f64,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            connections: 256,
            per_user: 32,
            // 32 tenants reporting every second fit, with room for status requests.
            rate: 64.0,
            burst: 128.0,
        }
    }
}

struct User {
    open: usize,
    tokens: f64,
    at: Instant,
}

/// The connections held and the buckets of the users that hold them.
pub struct Gate {
    limits: Limits,
    users: HashMap<u32, User>,
    open: usize,
}

impl Gate {
    pub fn new(limits: Limits) -> Gate {
        Gate {
            limits,
            users: HashMap::new(),
            open: 0,
        }
    }

    /// Takes a connection for `uid`, or says why not.
    pub fn admit(&mut self, uid: u32, admin: bool, now: Instant) -> Result<(), String> {
        if admin {
            return Ok(());
        }
        let l = self.limits;
        let u = self.users.entry(uid).or_insert(User {
            open: 0,
            tokens: l.burst,
            at: now,
        });
        if u.open >= l.per_user {
            return Err(format!(
                "too many connections: user {uid} holds {} (at most {})",
                u.open, l.per_user
            ));
        }
        if self.open >= l.connections {
            return Err(format!(
                "too many connections: members hold {} (at most {})",
                self.open, l.connections
            ));
        }
        u.open += 1;
        self.open += 1;
        Ok(())
    }

    /// Gives back a connection [`Gate::admit`] took.
    pub fn release(&mut self, uid: u32, admin: bool, now: Instant) {
        if admin {
            return;
        }
        self.open = self.open.saturating_sub(1);
        let l = self.limits;
        if let Some(u) = self.users.get_mut(&uid) {
            u.open = u.open.saturating_sub(1);
            refill(u, &l, now);
            // A user with nothing open and a full bucket needs no entry; one that emptied its
            // bucket keeps it, so reconnecting does not refill it.
            if u.open == 0 && u.tokens >= l.burst {
                self.users.remove(&uid);
            }
        }
    }

    /// Takes `cost` tokens from `uid`'s bucket; returns how long its connection must wait
    /// before it is served (zero while the bucket holds enough).
    pub fn take(&mut self, uid: u32, admin: bool, cost: f64, now: Instant) -> Duration {
        if admin {
            return Duration::ZERO;
        }
        let l = self.limits;
        let u = self.users.entry(uid).or_insert(User {
            open: 0,
            tokens: l.burst,
            at: now,
        });
        refill(u, &l, now);
        u.tokens -= cost;
        if u.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_micros((-u.tokens / l.rate * 1e6).round() as u64)
        }
    }

    /// Connections non-admin users hold now.
    pub fn open(&self) -> usize {
        self.open
    }
}

fn refill(u: &mut User, l: &Limits, now: Instant) {
    let dt = now.saturating_duration_since(u.at).as_secs_f64();
    u.tokens = (u.tokens + dt * l.rate).min(l.burst);
    u.at = now;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> Limits {
        Limits {
            connections: 3,
            per_user: 2,
            rate: 10.0,
            burst: 20.0,
        }
    }

    #[test]
    fn connections_are_capped_per_user_and_in_all_but_not_for_admins() {
        let now = Instant::now();
        let mut g = Gate::new(small());
        assert!(g.admit(1000, false, now).is_ok());
        assert!(g.admit(1000, false, now).is_ok());
        let e = g.admit(1000, false, now).unwrap_err();
        assert!(e.contains("user 1000 holds 2"), "{e}");
        assert!(g.admit(1001, false, now).is_ok());
        let e = g.admit(1002, false, now).unwrap_err();
        assert!(e.contains("members hold 3"), "{e}");
        for _ in 0..100 {
            assert!(g.admit(0, true, now).is_ok());
        }
        assert_eq!(g.open(), 3);
        g.release(1000, false, now);
        assert!(g.admit(1002, false, now).is_ok());
        assert_eq!(g.open(), 3);
    }

    #[test]
    fn a_flood_waits_at_the_rate_and_reconnecting_does_not_refill() {
        let t0 = Instant::now();
        let mut g = Gate::new(small());
        g.admit(7, false, t0).unwrap();
        // The burst is served at once, the rest waits 1/rate per token owed.
        for _ in 0..20 {
            assert_eq!(g.take(7, false, 1.0, t0), Duration::ZERO);
        }
        assert_eq!(g.take(7, false, 1.0, t0), Duration::from_millis(100));
        assert_eq!(
            g.take(7, false, CHANGE_COST, t0),
            Duration::from_millis(1700)
        );
        g.release(7, false, t0);
        g.admit(7, false, t0).unwrap();
        assert_eq!(g.take(7, false, 1.0, t0), Duration::from_millis(1800));
        // Tokens come back with time.
        let later = t0 + Duration::from_secs(10);
        assert_eq!(g.take(7, false, 1.0, later), Duration::ZERO);
        assert_eq!(g.take(0, true, 1e9, t0), Duration::ZERO);
    }
}
