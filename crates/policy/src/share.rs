//! Splitting a host's DRAM among tenants by activeness: each tenant is guaranteed its minimum,
//! pinned tenants (never tiered) are charged their reservation, and the rest of the budget goes
//! where it is used — to each tenant in proportion to how much of its memory is active, up to
//! what it can use. Quotas move only when the change is worth it (hysteresis), so they do not
//! flap with the noise of the activeness estimate. Entry point: [`split`].
//!
//! The host's tier capacity is shared too ([`split_tier`]): each tenant gets room for the pages
//! it holds beyond its DRAM quota (with headroom), never less than what lives only in its tier,
//! and the rest of the capacity in equal parts, so that a tenant that grows between two splits
//! can evict at once. A share grows only into capacity no tenant holds: a tenant whose share
//! shrank keeps what it holds until it has given it back.
//!
//! # Invariants (property-tested)
//!
//! - The quotas never add up to more than the budget.
//! - A tiered tenant never gets less than its minimum while the minimums fit the budget (the
//!   daemon refuses a tenant whose minimum does not fit), nor more than its maximum.
//! - A busy tenant cannot take another's minimum.
//! - The tier shares never add up to more than the capacity, nor do the shares and what tenants
//!   hold beyond them; a pinned tenant gets none.

/// What the host knows of one tenant when it splits the budget (all in pages).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Demand {
    /// Guaranteed DRAM.
    pub min: u64,
    /// Most DRAM it may get (`u64::MAX`: no limit of its own).
    pub max: u64,
    /// Never tiered: it is charged its minimum (its reservation), whatever it holds.
    pub pinned: bool,
    /// Pages it holds in DRAM or tier 1 (what more DRAM could hold at most).
    pub held: u64,
    /// Estimated active pages.
    pub active: u64,
}

/// How the split behaves.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ShareRules {
    /// A tenant's quota moves only when the new one differs from the current by more than
    /// this fraction of it (and of the budget divided among the tenants).
    pub hysteresis: f64,
    /// A tenant is given room for this multiple of its active memory before spare DRAM is
    /// shared out by size.
    pub active_headroom: f64,
}

impl Default for ShareRules {
    fn default() -> Self {
        ShareRules {
            hysteresis: 0.05,
            active_headroom: 1.25,
        }
    }
}

/// The quota of each tenant (in pages, in the order given) for a `budget` of pages, given the
/// quotas in force (`current`, same order; 0 for a tenant that has none yet). A pinned
/// tenant's "quota" is its reservation.
pub fn split(budget: u64, tenants: &[Demand], current: &[u64], rules: &ShareRules) -> Vec<u64> {
    let target = targets(budget, tenants, rules);
    // Hysteresis: keep a quota in force when the target is close to it, if the sum allows.
    let fair = budget / tenants.len().max(1) as u64;
    let kept: Vec<u64> = target
        .iter()
        .zip(tenants)
        .enumerate()
        .map(|(i, (&t, d))| {
            let cur = current.get(i).copied().unwrap_or(0);
            if d.pinned || cur == 0 || cur < d.min.min(d.max) || cur > d.max {
                return t;
            }
            let band = (cur.min(fair) as f64 * rules.hysteresis) as u64;
            if cur.abs_diff(t) <= band {
                cur
            } else {
                t
            }
        })
        .collect();
    if kept.iter().sum::<u64>() <= budget {
        kept
    } else {
        target
    }
}

/// The split without hysteresis.
fn targets(budget: u64, tenants: &[Demand], rules: &ShareRules) -> Vec<u64> {
    let n = tenants.len();
    let mut q = vec![0u64; n];
    // Every tenant starts at its minimum (a pinned one's is its reservation); minimums beyond
    // the budget are cut (the daemon refuses such a tenant at admission).
    let mut left = budget;
    for (i, d) in tenants.iter().enumerate() {
        q[i] = d.min.min(d.max).min(left);
        left -= q[i];
    }
    // First: room for each tiered tenant's active memory (with headroom), shared in
    // proportion to what is wanted when it does not all fit.
    let wants: Vec<u64> = tenants
        .iter()
        .zip(&q)
        .map(|(d, &have)| {
            if d.pinned {
                return 0;
            }
            let goal = ((d.active as f64 * rules.active_headroom) as u64).min(d.held);
            goal.min(d.max).saturating_sub(have)
        })
        .collect();
    if wants.iter().any(|&w| w > 0) && left > 0 {
        grant(&mut q, &wants, left);
        left = budget.saturating_sub(q.iter().sum());
    }
    // Then the spare DRAM, to tenants that hold more than their quota, in proportion to their
    // activeness (water-filling: what one cannot use goes round again to the others).
    for _ in 0..tenants.len().max(1) {
        let room: Vec<u64> = tenants
            .iter()
            .zip(&q)
            .map(|(d, &have)| {
                if d.pinned {
                    0
                } else {
                    d.held.min(d.max).saturating_sub(have)
                }
            })
            .collect();
        let weight: Vec<u128> = tenants
            .iter()
            .zip(&room)
            .map(|(d, &r)| if r > 0 { d.active as u128 + 1 } else { 0 })
            .collect();
        let total: u128 = weight.iter().sum();
        if total == 0 || left == 0 {
            break;
        }
        let mut given = 0;
        for i in 0..n {
            let g = ((left as u128 * weight[i] / total) as u64).min(room[i]);
            q[i] += g;
            given += g;
        }
        if given == 0 {
            // Less than one page each: the rounding's remainder goes to the most active.
            let i = (0..n)
                .max_by_key(|&i| weight[i])
                .expect("a tenant has weight");
            given = left.min(room[i]);
            q[i] += given;
        }
        left -= given;
    }
    // Whatever is still unclaimed (every tenant holds less than its share) is not handed out:
    // a tenant that grows gets it at the next split.
    q
}

/// Adds to each of `to` what it wants, or, when the wants do not all fit in `left`, its part
/// of `left` in proportion to its want (rounded down).
fn grant(to: &mut [u64], wants: &[u64], left: u64) {
    let total: u64 = wants.iter().sum();
    for (x, &w) in to.iter_mut().zip(wants) {
        *x += if total <= left {
            w
        } else {
            (w as u128 * left as u128 / total as u128) as u64
        };
    }
}

/// What the host knows of one tenant when it splits its tier capacity (all in pages).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierDemand {
    /// Never tiered: it needs no tier.
    pub pinned: bool,
    /// Pages its tier holds, or may fill before it has heard of a smaller share: the larger
    /// of what it holds and the limit its engine last reported (for a tenant that has not
    /// reported yet, the share it was given).
    pub may_hold: u64,
    /// Pages that live only in its tier (not in DRAM as well). They leave the tier only when
    /// the program brings them back or frees them, so its share is not cut below them.
    pub only_in_tier: u64,
    /// Pages it holds beyond its DRAM quota: what its tier must hold for the quota to be kept.
    pub beyond_quota: u64,
}

/// Room a tenant's tier share leaves above what it holds beyond its quota (a multiple).
const TIER_HEADROOM: f64 = 1.25;

/// Each tenant's tier share (in pages, in the order given) of a `capacity` of pages.
pub fn split_tier(capacity: u64, tenants: &[TierDemand]) -> Vec<u64> {
    let tiered = tenants.iter().filter(|d| !d.pinned).count() as u64;
    let floors: Vec<u64> = tenants
        .iter()
        .map(|d| if d.pinned { 0 } else { d.only_in_tier })
        .collect();
    let floor_sum: u64 = floors.iter().sum();
    if floor_sum >= capacity {
        // More lives in the tiers than the capacity (it was lowered, or tenants overran):
        // nobody grows; each keeps a part of the capacity in proportion to what it holds.
        let mut kept = vec![0; floors.len()];
        grant(&mut kept, &floors, capacity);
        return kept;
    }
    let mut share = floors;
    let mut left = capacity - floor_sum;
    // Room for what each holds beyond its quota, in proportion when it does not all fit.
    let wants: Vec<u64> = tenants
        .iter()
        .zip(&share)
        .map(|(d, &have)| {
            if d.pinned {
                0
            } else {
                ((d.beyond_quota as f64 * TIER_HEADROOM) as u64).saturating_sub(have)
            }
        })
        .collect();
    grant(&mut share, &wants, left);
    left = capacity.saturating_sub(share.iter().sum());
    // The rest in equal parts (the remainder of the division to the first).
    if let Some(each) = left.checked_div(tiered) {
        let mut extra = left - each * tiered;
        for (s, d) in share.iter_mut().zip(tenants) {
            if !d.pinned {
                *s += each + u64::from(extra > 0);
                extra = extra.saturating_sub(1);
            }
        }
    }
    // Growth only into capacity nobody holds: a tenant that must shrink may still fill what its
    // engine allows until it has heard of its new share and given back what it holds beyond
    // it, so the others' growth waits for it.
    let held_beyond: u64 = share
        .iter()
        .zip(tenants)
        .map(|(&x, d)| d.may_hold.saturating_sub(x))
        .sum();
    let growth: u64 = share
        .iter()
        .zip(tenants)
        .map(|(&x, d)| x.saturating_sub(d.may_hold))
        .sum();
    let committed: u64 = share.iter().sum::<u64>() + held_beyond;
    if committed > capacity && growth > 0 {
        let cut = (committed - capacity).min(growth);
        let mut cut_left = cut;
        for (x, d) in share.iter_mut().zip(tenants) {
            let g = x.saturating_sub(d.may_hold);
            let c = ((g as u128 * cut as u128).div_ceil(growth as u128) as u64)
                .min(g)
                .min(cut_left);
            *x -= c;
            cut_left -= c;
        }
    }
    share
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn tiered(min: u64, held: u64, active: u64) -> Demand {
        Demand {
            min,
            max: u64::MAX,
            pinned: false,
            held,
            active,
        }
    }

    #[test]
    fn busy_tenant_gets_the_spare_dram_idle_one_keeps_its_minimum() {
        let t = [tiered(100, 2000, 1500), tiered(100, 2000, 10)];
        let q = split(1000, &t, &[0, 0], &ShareRules::default());
        assert_eq!(
            q,
            vec![900, 100],
            "the idle tenant's minimum covers its active memory"
        );
    }

    #[test]
    fn spare_dram_follows_activeness_not_size() {
        let t = [tiered(100, 2000, 600), tiered(100, 2000, 50)];
        let q = split(1500, &t, &[0, 0], &ShareRules::default());
        assert_eq!(q.iter().sum::<u64>(), 1500);
        assert_eq!(q, vec![1350, 150]);
    }

    #[test]
    fn everything_fits_everyone_gets_what_it_holds() {
        let t = [tiered(10, 300, 50), tiered(10, 200, 200)];
        let q = split(1000, &t, &[0, 0], &ShareRules::default());
        assert_eq!(q, vec![300, 200]);
    }

    #[test]
    fn pinned_tenant_is_charged_its_reservation() {
        let t = [
            Demand {
                min: 400,
                max: u64::MAX,
                pinned: true,
                held: 300,
                active: 300,
            },
            tiered(100, 5000, 5000),
        ];
        let q = split(1000, &t, &[0, 0], &ShareRules::default());
        assert_eq!(q, vec![400, 600]);
    }

    #[test]
    fn maximum_caps_a_tenant() {
        let mut a = tiered(10, 5000, 5000);
        a.max = 300;
        let q = split(
            1000,
            &[a, tiered(10, 5000, 100)],
            &[0, 0],
            &ShareRules::default(),
        );
        assert_eq!(q[0], 300);
        assert_eq!(q[1], 700);
    }

    #[test]
    fn small_changes_keep_the_quota_in_force() {
        let t = [tiered(100, 5000, 500), tiered(100, 5000, 520)];
        let first = split(1000, &t, &[0, 0], &ShareRules::default());
        let t2 = [tiered(100, 5000, 510), tiered(100, 5000, 505)];
        let second = split(1000, &t2, &first, &ShareRules::default());
        assert_eq!(first, second, "a 2% wobble of activeness moved the quotas");
        let t3 = [tiered(100, 5000, 900), tiered(100, 5000, 100)];
        let third = split(1000, &t3, &second, &ShareRules::default());
        assert!(
            third[0] > first[0] + 100,
            "a real shift must move them: {third:?}"
        );
    }

    fn tier(only_in_tier: u64, beyond_quota: u64) -> TierDemand {
        TierDemand {
            pinned: false,
            may_hold: only_in_tier,
            only_in_tier,
            beyond_quota,
        }
    }

    #[test]
    fn tier_share_covers_what_each_holds_beyond_its_quota_then_splits_the_rest() {
        let pinned = TierDemand {
            pinned: true,
            may_hold: 0,
            only_in_tier: 0,
            beyond_quota: 0,
        };
        let s = split_tier(10_000, &[tier(1000, 4000), tier(0, 0), pinned]);
        // 5000 for the first (4000 x 1.25), then 5000 left in halves.
        assert_eq!(s, vec![7500, 2500, 0]);
    }

    #[test]
    fn tier_share_is_proportional_when_the_needs_do_not_fit() {
        let s = split_tier(1000, &[tier(200, 1600), tier(0, 800)]);
        // 200 kept, 800 left for wants of 1800 and 1000 (514 and 285, the page the rounding
        // left to the first).
        assert_eq!(s, vec![200 + 514 + 1, 285]);
        let s = split_tier(100, &[tier(300, 300), tier(100, 100)]);
        assert_eq!(s, vec![75, 25], "over capacity: kept in proportion");
    }

    #[test]
    fn tier_share_grows_only_into_capacity_nobody_holds() {
        // The first holds 900 (600 of it copies of pages in DRAM as well); a newcomer's share
        // waits until the first has given back what its smaller share leaves over.
        let mut first = tier(300, 300);
        first.may_hold = 900;
        // Targets: 375 + 63 and 500 + 62 (room beyond the quota, then the rest in halves).
        let s = split_tier(1000, &[first, tier(0, 400)]);
        assert_eq!(s, vec![438, 100], "only the 100 nobody holds");
        first.may_hold = 438;
        let s = split_tier(1000, &[first, tier(0, 400)]);
        assert_eq!(s, vec![438, 562]);
    }

    fn demand() -> impl Strategy<Value = Demand> {
        (
            0u64..400,
            prop::option::of(0u64..3000),
            any::<bool>(),
            0u64..3000,
            0u64..3000,
        )
            .prop_map(|(min, max, pinned, held, active)| Demand {
                min,
                max: max.map_or(u64::MAX, |m| m.max(min)),
                pinned,
                held,
                active: active.min(held),
            })
    }

    proptest! {
        /// Random join/leave/activity sequences: the quotas never exceed the budget, and every
        /// tiered tenant keeps its minimum and its maximum.
        #[test]
        fn quotas_stay_within_the_budget(
            budget in 1000u64..10_000,
            steps in prop::collection::vec(
                (prop::option::of(demand()), any::<prop::sample::Index>(), 0u64..3000),
                1..40,
            ),
        ) {
            let rules = ShareRules::default();
            let mut tenants: Vec<Demand> = Vec::new();
            let mut quotas: Vec<u64> = Vec::new();
            for (join, pick, activity) in steps {
                match join {
                    Some(d) => {
                        // Admission: the minimums (and what pinned tenants hold) must fit.
                        let committed: u64 = tenants.iter().map(|t| t.min).sum();
                        if committed + d.min <= budget {
                            tenants.push(d);
                            quotas.push(0);
                        }
                    }
                    None if !tenants.is_empty() => {
                        let i = pick.index(tenants.len());
                        if activity % 3 == 0 {
                            tenants.remove(i);
                            quotas.remove(i);
                        } else if !tenants[i].pinned {
                            tenants[i].active = activity.min(tenants[i].held);
                        }
                    }
                    None => {}
                }
                quotas = split(budget, &tenants, &quotas, &rules);
                prop_assert!(quotas.iter().sum::<u64>() <= budget, "{quotas:?} over {budget}");
                for (d, &q) in tenants.iter().zip(&quotas) {
                    if !d.pinned {
                        prop_assert!(q >= d.min, "{q} below the minimum of {d:?}");
                        prop_assert!(q <= d.max, "{q} above the maximum of {d:?}");
                    }
                }
            }
        }
    }

    proptest! {
        /// The tier shares never exceed the capacity, a pinned tenant gets none, and while what
        /// they need fits, every tiered tenant gets at least what lives only in its tier and
        /// room for what it holds beyond its quota.
        #[test]
        fn tier_shares_stay_within_the_capacity(
            capacity in 0u64..100_000,
            tenants in prop::collection::vec(
                (any::<bool>(), 0u64..20_000, 0u64..20_000, 0u64..20_000),
                0..12,
            ),
        ) {
            let t: Vec<TierDemand> = tenants
                .iter()
                .map(|&(pinned, a, b, c)| TierDemand {
                    pinned,
                    may_hold: if pinned { 0 } else { c.max(a.min(b)) },
                    only_in_tier: a.min(b),
                    beyond_quota: b,
                })
                .collect();
            let s = split_tier(capacity, &t);
            prop_assert!(s.iter().sum::<u64>() <= capacity, "{s:?} over {capacity}");
            let held: u64 = t.iter().map(|d| d.may_hold).sum();
            let committed: u64 = s.iter().zip(&t).map(|(&x, d)| x.max(d.may_hold)).sum();
            prop_assert!(
                held > capacity || committed <= capacity,
                "shares {s:?} and what is held beyond them exceed {capacity}: {t:?}"
            );
            let need: u64 = t
                .iter()
                .filter(|d| !d.pinned)
                .map(|d| (d.beyond_quota as f64 * TIER_HEADROOM) as u64)
                .sum();
            let settled = t.iter().zip(&s).all(|(d, &x)| d.may_hold <= x);
            for (d, &x) in t.iter().zip(&s) {
                if d.pinned {
                    prop_assert_eq!(x, 0);
                } else if need <= capacity && settled {
                    prop_assert!(x >= (d.beyond_quota as f64 * TIER_HEADROOM) as u64);
                }
            }
            if t.iter().any(|d| !d.pinned) && need <= capacity && settled {
                prop_assert_eq!(s.iter().sum::<u64>(), capacity, "capacity left unshared");
            }
        }
    }
}
