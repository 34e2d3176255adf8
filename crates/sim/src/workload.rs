//! Synthetic access profiles: a spec such as `zipf:footprint=64GiB,skew=0.99,accesses=200M`
//! parsed into a [`Spec`], and a deterministic [`Generator`] of `(page, write)` accesses.
//! Hot pages are scattered over the footprint (rank r lives at page `r * stride mod n`), as a
//! program's hot objects are. Entry points: [`Spec::parse`], [`Spec::generator`].

use std::fmt;

/// Why a workload spec did not parse; each message says what to write instead.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SpecError {
    #[error(
        "unknown workload kind `{0}`: choose uniform, zipf, hotcold, scan, phases, active or tiles"
    )]
    Kind(String),
    #[error("`{0}` is not key=value")]
    Pair(String),
    #[error("unknown key `{key}` for {kind}")]
    Key { kind: String, key: String },
    #[error("bad value `{value}` for {key}: {why}")]
    Value {
        key: String,
        value: String,
        why: String,
    },
}

/// The shape of the accesses.
#[derive(Clone, Debug, PartialEq)]
pub enum Kind {
    Uniform,
    /// Zipf over pages by popularity rank, exponent `skew`.
    Zipf {
        skew: f64,
    },
    /// A hot fraction of pages takes `share` of the accesses; the rest are uniform.
    HotCold {
        hot: f64,
        share: f64,
    },
    /// A hot set as in HotCold; the other accesses scan the footprint sequentially.
    Scan {
        hot: f64,
        share: f64,
    },
    /// HotCold whose hot set moves to other pages `phases` times during the run.
    Phases {
        hot: f64,
        share: f64,
        phases: u64,
    },
    /// One tenant's profile as an operator describes it: its `active` fraction of memory gets
    /// all accesses but a `cold` share (zipf-distributed with `skew` over the active pages, or
    /// uniform with skew 0); the cold share goes uniformly over all of its memory.
    Active {
        active: f64,
        skew: f64,
        cold: f64,
    },
    /// `n` tenants ("tiles") of `footprint` each, placed one after another in power-on order,
    /// taking turns; each accesses the first `active` fraction of its memory uniformly, except
    /// the last `noisy` tenants, which stream over all of theirs.
    Tiles {
        n: u64,
        active: f64,
        noisy: u64,
    },
}

/// A synthetic workload.
#[derive(Clone, Debug, PartialEq)]
pub struct Spec {
    pub kind: Kind,
    pub pages: u64,
    pub accesses: u64,
    pub writes: f64,
    pub seed: u64,
    /// Start with one write to every page in order, not counted (a program initializing its
    /// memory), so that the counted accesses show the steady state rather than first touches.
    pub fill: bool,
    /// Accesses replayed after the fill but not counted (DRAM settling into its steady
    /// state); the generator emits `warmup + accesses`.
    pub warmup: u64,
}

fn parse_count(v: &str) -> Option<u64> {
    let v = v.trim();
    let (num, mult) = match v.chars().last()? {
        'K' | 'k' => (&v[..v.len() - 1], 1e3),
        'M' | 'm' => (&v[..v.len() - 1], 1e6),
        'G' | 'g' | 'B' | 'b' => (&v[..v.len() - 1], 1e9),
        _ => (v, 1.0),
    };
    let n: f64 = num.parse().ok()?;
    (n >= 0.0 && n.is_finite()).then_some((n * mult).round() as u64)
}

fn parse_fraction(v: &str) -> Option<f64> {
    let f = match v.strip_suffix('%') {
        Some(p) => p.parse::<f64>().ok()? / 100.0,
        None => v.parse::<f64>().ok()?,
    };
    (0.0..=1.0).contains(&f).then_some(f)
}

impl Spec {
    /// Parses `kind:key=value,...`. Keys: `footprint` (bytes, e.g. 64GiB), `accesses`
    /// (e.g. 200M), `writes` (fraction), `seed`, `fill` (yes/no), and per kind `skew`, `hot`,
    /// `share`, `phases`.
    pub fn parse(
        s: &str,
        page_size: u64,
        parse_size: impl Fn(&str) -> Option<u64>,
    ) -> Result<Spec, SpecError> {
        let (kind, rest) = s.split_once(':').unwrap_or((s, ""));
        let kind = kind.trim().to_ascii_lowercase();
        let mut footprint = 1u64 << 30;
        let mut accesses = 10_000_000;
        let mut writes = 0.2;
        let mut seed = 1;
        let mut skew = 0.99;
        let mut hot = 0.1;
        let mut share = 0.9;
        let mut phases = 4;
        let mut fill = true;
        let mut tiles = 2u64;
        let mut active = 0.5;
        let mut noisy = 0u64;
        let mut cold = 0.01;
        let mut warmup = 0u64;
        let bad = |key: &str, value: &str, why: &str| SpecError::Value {
            key: key.into(),
            value: value.into(),
            why: why.into(),
        };
        for pair in rest.split(',').filter(|p| !p.trim().is_empty()) {
            let (k, v) = pair
                .split_once('=')
                .ok_or_else(|| SpecError::Pair(pair.into()))?;
            let (k, v) = (k.trim(), v.trim());
            let allowed = match kind.as_str() {
                "uniform" => &[][..],
                "zipf" => &["skew"][..],
                "hotcold" | "scan" => &["hot", "share"][..],
                "phases" => &["hot", "share", "phases"][..],
                "tiles" => &["n", "active", "noisy"][..],
                "active" => &["active", "skew", "cold"][..],
                _ => return Err(SpecError::Kind(kind)),
            };
            match k {
                "footprint" => {
                    footprint = parse_size(v)
                        .filter(|&b| b >= page_size)
                        .ok_or_else(|| bad(k, v, "a size of at least one page, like 64GiB"))?
                }
                "accesses" => {
                    accesses = parse_count(v)
                        .filter(|&n| n > 0)
                        .ok_or_else(|| bad(k, v, "a count like 200M"))?
                }
                "writes" => {
                    writes =
                        parse_fraction(v).ok_or_else(|| bad(k, v, "a fraction like 20% or 0.2"))?
                }
                "seed" => seed = v.parse().map_err(|_| bad(k, v, "an integer"))?,
                "warmup" => warmup = parse_count(v).ok_or_else(|| bad(k, v, "a count like 10M"))?,
                "fill" => {
                    fill = match v {
                        "yes" | "true" | "1" => true,
                        "no" | "false" | "0" => false,
                        _ => return Err(bad(k, v, "yes or no")),
                    }
                }
                _ if !allowed.contains(&k) => {
                    return Err(SpecError::Key {
                        kind: kind.clone(),
                        key: k.into(),
                    })
                }
                "skew" => {
                    skew = v
                        .parse::<f64>()
                        .ok()
                        .filter(|x| x.is_finite() && (*x > 0.0 || (*x == 0.0 && kind == "active")))
                        .ok_or_else(|| bad(k, v, "a positive number like 0.99"))?
                }
                "hot" => {
                    hot = parse_fraction(v)
                        .filter(|&f| f > 0.0)
                        .ok_or_else(|| bad(k, v, "a fraction like 10%"))?
                }
                "share" => {
                    share = parse_fraction(v).ok_or_else(|| bad(k, v, "a fraction like 90%"))?
                }
                "phases" => {
                    phases = v
                        .parse()
                        .ok()
                        .filter(|&n: &u64| n > 0)
                        .ok_or_else(|| bad(k, v, "a positive integer"))?
                }
                "n" => {
                    tiles = v
                        .parse()
                        .ok()
                        .filter(|&n: &u64| (1..=4096).contains(&n))
                        .ok_or_else(|| bad(k, v, "a tenant count from 1 to 4096"))?
                }
                "active" => {
                    active = parse_fraction(v)
                        .filter(|&f| f > 0.0)
                        .ok_or_else(|| bad(k, v, "a fraction like 50%"))?
                }
                "noisy" => noisy = v.parse().map_err(|_| bad(k, v, "a tenant count"))?,
                "cold" => {
                    cold = parse_fraction(v).ok_or_else(|| bad(k, v, "a fraction like 1%"))?
                }
                _ => unreachable!(),
            }
        }
        let kind = match kind.as_str() {
            "uniform" => Kind::Uniform,
            "zipf" => Kind::Zipf { skew },
            "hotcold" => Kind::HotCold { hot, share },
            "scan" => Kind::Scan { hot, share },
            "phases" => Kind::Phases { hot, share, phases },
            "active" => Kind::Active { active, skew, cold },
            "tiles" => {
                if noisy > tiles {
                    return Err(bad("noisy", &noisy.to_string(), "at most n"));
                }
                Kind::Tiles {
                    n: tiles,
                    active,
                    noisy,
                }
            }
            _ => return Err(SpecError::Kind(kind)),
        };
        let pages = match kind {
            // For tiles the footprint is each tenant's.
            Kind::Tiles { n, .. } => footprint / page_size * n,
            _ => footprint / page_size,
        };
        Ok(Spec {
            kind,
            pages,
            accesses,
            writes,
            seed,
            fill,
            warmup,
        })
    }

    pub fn generator(&self) -> Generator {
        Generator::new(self)
    }

    /// Number of tenants, and the tenant a page belongs to.
    pub fn tenants(&self) -> u64 {
        match self.kind {
            Kind::Tiles { n, .. } => n,
            _ => 1,
        }
    }

    pub fn tenant_of(&self, page: u64) -> u64 {
        match self.kind {
            Kind::Tiles { n, .. } => page / (self.pages / n).max(1),
            _ => 0,
        }
    }
}

impl fmt::Display for Spec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Uniform => write!(f, "uniform")?,
            Kind::Zipf { skew } => write!(f, "zipf skew {skew}")?,
            Kind::HotCold { hot, share } => write!(
                f,
                "hot/cold {:.0}% of pages take {:.0}%",
                hot * 100.0,
                share * 100.0
            )?,
            Kind::Scan { hot, share } => write!(
                f,
                "hot set {:.0}% taking {:.0}% + scan",
                hot * 100.0,
                share * 100.0
            )?,
            Kind::Phases { hot, share, phases } => write!(
                f,
                "hot/cold {:.0}%/{:.0}% moving {phases} times",
                hot * 100.0,
                share * 100.0
            )?,
            Kind::Active { active, skew, cold } => write!(
                f,
                "active {:.1}% (zipf skew {skew}), {:.1}% of accesses cold",
                active * 100.0,
                cold * 100.0
            )?,
            Kind::Tiles { n, active, noisy } => write!(
                f,
                "{n} tiles, {:.0}% of each active, {noisy} noisy",
                active * 100.0
            )?,
        }
        write!(
            f,
            ", {} pages, {} accesses, {:.0}% writes{}",
            self.pages,
            self.accesses,
            self.writes * 100.0,
            if self.fill { ", after a fill pass" } else { "" }
        )
    }
}

/// xorshift64* — fast, deterministic, good enough for access streams.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}

/// Zipf sampling over ranks 1..=n by rejection inversion (Hörmann and Derflinger), O(1) per
/// sample for any n.
#[derive(Clone, Debug)]
pub struct Zipf {
    n: f64,
    s: f64,
    h_x1: f64,
    h_n: f64,
    c: f64,
}

impl Zipf {
    /// Ranks 0..n with skew `s` (> 0).
    pub fn new(n: u64, s: f64) -> Zipf {
        let mut z = Zipf {
            n: n as f64,
            s,
            h_x1: 0.0,
            h_n: 0.0,
            c: 0.0,
        };
        z.h_x1 = z.h(1.5) - 1.0;
        z.h_n = z.h(z.n + 0.5);
        z.c = 2.0 - z.h_inv(z.h(2.5) - 2f64.powf(-s));
        z
    }
    fn h(&self, x: f64) -> f64 {
        let e = 1.0 - self.s;
        if e.abs() < 1e-9 {
            x.ln()
        } else {
            (x.powf(e) - 1.0) / e
        }
    }
    fn h_inv(&self, x: f64) -> f64 {
        let e = 1.0 - self.s;
        if e.abs() < 1e-9 {
            x.exp()
        } else {
            (1.0 + e * x).powf(1.0 / e)
        }
    }
    /// A rank in 0..n (0 the most popular).
    pub fn sample(&self, rng: &mut Rng) -> u64 {
        loop {
            let u = self.h_n + rng.unit() * (self.h_x1 - self.h_n);
            let x = self.h_inv(u);
            let k = x.round().clamp(1.0, self.n);
            if k - x <= self.c || u >= self.h(k + 0.5) - k.powf(-self.s) {
                return k as u64 - 1;
            }
        }
    }
}

fn n_pages_per(pages: u64, tenants: u64) -> u64 {
    pages / tenants.max(1)
}

/// A stride coprime with `n`: `rank * stride mod n` visits every one of `n` places once,
/// spreading popular ranks over the whole space.
pub fn scatter_stride(n: u64) -> u64 {
    let n = n.max(1);
    let mut stride = (0x9E37_79B9u64 % n) | 1;
    while gcd(stride, n) != 1 {
        stride += 2;
    }
    stride
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Deterministic access stream of a [`Spec`].
pub struct Generator {
    spec: Spec,
    rng: Rng,
    zipf: Option<Zipf>,
    stride: u64,
    emitted: u64,
    scan_pos: u64,
}

impl Generator {
    fn new(spec: &Spec) -> Generator {
        let n = spec.pages.max(1);
        let stride = scatter_stride(n);
        Generator {
            zipf: match spec.kind {
                Kind::Zipf { skew } => Some(Zipf::new(n, skew)),
                Kind::Active { active, skew, .. } if skew > 0.0 => {
                    Some(Zipf::new(((n as f64 * active) as u64).max(1), skew))
                }
                _ => None,
            },
            spec: spec.clone(),
            rng: Rng::new(spec.seed),
            stride,
            emitted: 0,
            scan_pos: 0,
        }
    }

    fn scatter(&self, rank: u64, shift: u64) -> u64 {
        // Ranks and the stride are below n: up to 2^32 pages (the simulator's limit) the
        // product fits in 64 bits.
        let n = self.spec.pages.max(1);
        if n <= 1 << 32 {
            (rank * self.stride % n + shift % n) % n
        } else {
            ((rank as u128 * self.stride as u128 + shift as u128) % n as u128) as u64
        }
    }
}

impl Iterator for Generator {
    /// `(page, write)`.
    type Item = (u64, bool);

    fn next(&mut self) -> Option<(u64, bool)> {
        if self.emitted >= self.spec.accesses + self.spec.warmup {
            return None;
        }
        let n = self.spec.pages.max(1);
        let page = match &self.spec.kind {
            Kind::Uniform | Kind::Tiles { .. } => self.rng.below(n),
            Kind::Zipf { .. } => {
                let r = self
                    .zipf
                    .as_ref()
                    .expect("zipf sampler")
                    .sample(&mut self.rng);
                self.scatter(r, 0)
            }
            Kind::Active { active, cold, .. } => {
                let active_pages = ((n as f64 * active) as u64).max(1);
                if self.rng.unit() < *cold {
                    self.rng.below(n)
                } else {
                    let r = match &self.zipf {
                        Some(z) => z.sample(&mut self.rng),
                        None => self.rng.below(active_pages),
                    };
                    self.scatter(r, 0)
                }
            }
            Kind::HotCold { hot, share }
            | Kind::Scan { hot, share }
            | Kind::Phases { hot, share, .. } => {
                let (hot, share) = (*hot, *share);
                let hot_pages = ((n as f64 * hot) as u64).max(1);
                if self.rng.unit() < share {
                    let shift = match self.spec.kind {
                        Kind::Phases { phases, .. } => {
                            let phase =
                                self.emitted * phases / (self.spec.accesses + self.spec.warmup);
                            phase * hot_pages * self.stride
                        }
                        _ => 0,
                    };
                    let r = self.rng.below(hot_pages);
                    self.scatter(r, shift)
                } else if matches!(self.spec.kind, Kind::Scan { .. }) {
                    self.scan_pos = (self.scan_pos + 1) % n;
                    self.scan_pos
                } else {
                    self.rng.below(n)
                }
            }
        };
        let page = if let Kind::Tiles { n, active, noisy } = self.spec.kind {
            let per = (n_pages_per(self.spec.pages, n)).max(1);
            let t = self.emitted % n;
            let off = if t >= n - noisy {
                // A noisy tenant streams over all its memory.
                (self.emitted / n) % per
            } else {
                self.rng.below(((per as f64 * active) as u64).max(1))
            };
            t * per + off
        } else {
            page
        };
        let write = self.rng.unit() < self.spec.writes;
        self.emitted += 1;
        Some((page, write))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn size(s: &str) -> Option<u64> {
        let s = s.trim();
        let (n, m) = if let Some(n) = s.strip_suffix("GiB") {
            (n, 1u64 << 30)
        } else if let Some(n) = s.strip_suffix("MiB") {
            (n, 1 << 20)
        } else {
            (s, 1)
        };
        n.parse::<u64>().ok().map(|v| v * m)
    }

    #[test]
    fn parses_specs() {
        let s = Spec::parse("zipf:footprint=64GiB,skew=0.99,accesses=200M", 4096, size).unwrap();
        assert_eq!(s.pages, 16 << 20);
        assert_eq!(s.accesses, 200_000_000);
        assert_eq!(s.kind, Kind::Zipf { skew: 0.99 });
        let s = Spec::parse("hotcold:footprint=1GiB,hot=20%,share=0.9", 4096, size).unwrap();
        assert_eq!(
            s.kind,
            Kind::HotCold {
                hot: 0.2,
                share: 0.9
            }
        );
    }

    #[test]
    fn rejects_bad_specs() {
        assert!(matches!(
            Spec::parse("nope", 4096, size),
            Err(SpecError::Kind(_))
        ));
        assert!(matches!(
            Spec::parse("zipf:skew", 4096, size),
            Err(SpecError::Pair(_))
        ));
        assert!(matches!(
            Spec::parse("uniform:skew=1", 4096, size),
            Err(SpecError::Key { .. })
        ));
        assert!(matches!(
            Spec::parse("zipf:skew=-1", 4096, size),
            Err(SpecError::Value { .. })
        ));
        assert!(matches!(
            Spec::parse("hotcold:hot=150%", 4096, size),
            Err(SpecError::Value { .. })
        ));
        assert!(matches!(
            Spec::parse("uniform:footprint=lots", 4096, size),
            Err(SpecError::Value { .. })
        ));
    }

    #[test]
    fn zipf_is_skewed_and_in_range() {
        let s = Spec::parse("zipf:footprint=4096MiB,accesses=200K,skew=1.0", 4096, size).unwrap();
        let mut counts = std::collections::HashMap::new();
        for (p, _) in s.generator() {
            assert!(p < s.pages);
            *counts.entry(p).or_insert(0u64) += 1;
        }
        let mut v: Vec<u64> = counts.values().copied().collect();
        v.sort_unstable_by(|a, b| b.cmp(a));
        // With skew 1 over 1M pages, the top page takes about 1/H(n) ≈ 7% of accesses.
        let top = v[0] as f64 / 200_000.0;
        assert!((0.05..0.10).contains(&top), "top page share {top}");
    }

    #[test]
    fn hotcold_share_holds() {
        let s = Spec::parse(
            "hotcold:footprint=400MiB,accesses=100K,hot=10%,share=90%",
            4096,
            size,
        )
        .unwrap();
        let g = s.generator();
        let hot: std::collections::HashSet<u64> = {
            let n = s.pages;
            (0..n / 10).map(|r| g.scatter(r, 0)).collect()
        };
        let in_hot = s.generator().filter(|(p, _)| hot.contains(p)).count() as f64 / 100_000.0;
        assert!((0.89..0.92).contains(&in_hot), "{in_hot}");
    }

    #[test]
    fn active_profile_keeps_to_its_active_pages_but_for_the_cold_share() {
        let s = Spec::parse(
            "active:footprint=400MiB,accesses=200K,warmup=50K,active=20%,skew=0.9,cold=2%",
            4096,
            size,
        )
        .unwrap();
        assert_eq!(s.warmup, 50_000);
        let g = s.generator();
        let active: std::collections::HashSet<u64> =
            (0..s.pages / 5).map(|r| g.scatter(r, 0)).collect();
        let all: Vec<u64> = s.generator().map(|(p, _)| p).collect();
        assert_eq!(
            all.len(),
            250_000,
            "warm-up accesses come first, then the counted ones"
        );
        let outside = all.iter().filter(|p| !active.contains(p)).count() as f64 / 250_000.0;
        // Cold accesses land anywhere: 80% of them outside the active pages.
        assert!((0.012..0.020).contains(&outside), "{outside}");
        // Skewed: the most popular active page gets far more than a uniform share.
        let top = all.iter().filter(|&&p| p == g.scatter(0, 0)).count();
        assert!(top > 100 * 250_000 / (s.pages as usize / 5), "{top}");
    }
}
