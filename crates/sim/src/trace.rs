//! The `.mtt` access-trace format, version 1: what the simulator replays and what the engine
//! will record. Compact (a few bytes per access), streamable to write, validated before a
//! replay starts. Entry points: [`Writer`], [`Trace::parse`].
//!
//! # Layout (all integers little-endian)
//!
//! ```text
//! header   8  magic "MTTRACE\0"
//!          2  version = 1
//!          2  flags: bit 0 LEVELS (each record says which level served it), bit 1 POOL
//!             (the pool block follows); others 0
//!          4  page size in bytes
//! pool     16 with POOL only: what the recording run's compressed pool measured
//!          8  pages it held per page of its DRAM (f64, 1 to 64)
//!          8  a fault served from it, median as the engine timed it (without the
//!             wake-ups around it), in ns (f64; 0 if none was)
//! records  one per access, LEB128 varints:
//!            time delta in ns since the previous record
//!            tag = zigzag(page - previous page of the same stream) << 2
//!                  | tenant_changed << 1 | write
//!                  (with LEVELS: zigzag(...) << 4 | level << 2 | tenant_changed << 1 | write,
//!                  level 0 not said, 1 DRAM (a first touch or a hint fault: nothing read
//!                  from below DRAM), 2 the compressed pool, 3 the file)
//!            tenant id, only when tenant_changed (the stream starts at tenant 0)
//! trailer  8  magic "MTTEND\0\0"
//!          8  number of records
//!          8  FNV-1a 64 of the pool block (if any) and the record bytes
//! ```
//!
//! The pool block came after the first traces: a reader from before it refuses a trace with
//! one ("unknown header flags"); traces without it read as they always did.
//!
//! Page numbers are per tenant (each tenant has its own address space); page deltas are taken
//! against the previous record whatever its tenant. A file without a valid trailer is
//! truncated; a trailer whose count or checksum disagrees with the records is corruption.

use std::io::{self, Write};

const MAGIC: &[u8; 8] = b"MTTRACE\0";
const END: &[u8; 8] = b"MTTEND\0\0";
const VERSION: u16 = 1;
const HEADER: usize = 16;
/// The pool block's size (after the header, with [`FLAG_POOL`]).
const POOL_BLOCK: usize = 16;
const TRAILER: usize = 24;

/// Why a trace could not be read; one line each.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TraceError {
    #[error("not a memtide trace (bad magic)")]
    Magic,
    #[error("trace version {0} is not supported (this memtide reads version 1)")]
    Version(u16),
    #[error("trace is truncated (no end marker): was the recording interrupted?")]
    Truncated,
    #[error("trace is corrupted: {0}")]
    Corrupt(&'static str),
}

/// Which level served a recorded access (in a trace written with levels).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Level {
    /// Not said (a trace without levels, or an access not recorded by the engine).
    #[default]
    Unknown = 0,
    /// DRAM: a first touch or a hint fault, nothing read from below DRAM.
    Dram = 1,
    /// The compressed pool.
    Pool = 2,
    /// The file.
    File = 3,
}

impl Level {
    fn from_bits(b: u64) -> Level {
        match b & 3 {
            1 => Level::Dram,
            2 => Level::Pool,
            3 => Level::File,
            _ => Level::Unknown,
        }
    }
}

/// Header flag: records carry a [`Level`].
const FLAG_LEVELS: u16 = 1;
/// Header flag: the pool block ([`PoolFigures`]) follows the header.
const FLAG_POOL: u16 = 2;

/// What the recording run's compressed pool measured, kept in its trace so that a replay
/// can model the same pool (`memtide sim --trace --compressed`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PoolFigures {
    /// Pages the pool held per page of its DRAM (the engine's compressed_pages over
    /// compressed_pool_bytes): what compression and packing made of this program's pages.
    pub ratio: f64,
    /// A fault served from the pool, median, in ns, as the engine timed it inside the fault
    /// (without the wake-ups of the handler and the faulting thread around it); 0 if none was.
    pub fault_ns: f64,
}

impl PoolFigures {
    fn valid(&self) -> bool {
        (1.0..=64.0).contains(&self.ratio) && self.fault_ns.is_finite() && self.fault_ns >= 0.0
    }
}

/// One access.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record {
    pub time_ns: u64,
    pub tenant: u32,
    pub page: u64,
    pub write: bool,
}

/// FNV-1a over `bytes`, continuing from `h` ([`FNV_START`] to begin).
pub(crate) fn fnv1a(h: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(h, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3)
    })
}

pub(crate) const FNV_START: u64 = 0xCBF2_9CE4_8422_2325;

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn zigzag(d: i64) -> u64 {
    ((d << 1) ^ (d >> 63)) as u64
}

fn unzigzag(v: u64) -> i64 {
    (v >> 1) as i64 ^ -((v & 1) as i64)
}

/// Writes a trace.
pub struct Writer<W: Write> {
    out: W,
    buf: Vec<u8>,
    hash: u64,
    count: u64,
    last_time: u64,
    last_page: u64,
    tenant: u32,
    levels: bool,
}

impl<W: Write> Writer<W> {
    /// A trace whose records say nothing of levels.
    pub fn new(out: W, page_size: u32) -> io::Result<Writer<W>> {
        Writer::start(out, page_size, false, None)
    }

    /// A trace whose records say which level served each ([`Writer::record_at`]).
    pub fn with_levels(out: W, page_size: u32) -> io::Result<Writer<W>> {
        Writer::start(out, page_size, true, None)
    }

    /// A recording's trace: with levels, and what its compressed pool measured, if it had
    /// one (a ratio below 1, from a pool left with holes, is kept as 1).
    pub fn recording(out: W, page_size: u32, pool: Option<PoolFigures>) -> io::Result<Writer<W>> {
        let finite = |v: f64, or: f64| if v.is_finite() { v } else { or };
        let pool = pool.map(|p| PoolFigures {
            ratio: finite(p.ratio, 1.0).clamp(1.0, 64.0),
            fault_ns: finite(p.fault_ns, 0.0).max(0.0),
        });
        Writer::start(out, page_size, true, pool)
    }

    fn start(
        mut out: W,
        page_size: u32,
        levels: bool,
        pool: Option<PoolFigures>,
    ) -> io::Result<Writer<W>> {
        let mut h = Vec::with_capacity(HEADER + POOL_BLOCK);
        h.extend_from_slice(MAGIC);
        h.extend_from_slice(&VERSION.to_le_bytes());
        let flags =
            if levels { FLAG_LEVELS } else { 0 } | if pool.is_some() { FLAG_POOL } else { 0 };
        h.extend_from_slice(&flags.to_le_bytes());
        h.extend_from_slice(&page_size.to_le_bytes());
        if let Some(p) = pool {
            h.extend_from_slice(&p.ratio.to_le_bytes());
            h.extend_from_slice(&p.fault_ns.to_le_bytes());
        }
        out.write_all(&h)?;
        Ok(Writer {
            out,
            buf: Vec::with_capacity(1 << 16),
            // The checksum covers the pool block too.
            hash: fnv1a(FNV_START, &h[HEADER..]),
            count: 0,
            last_time: 0,
            last_page: 0,
            tenant: 0,
            levels,
        })
    }

    pub fn record(&mut self, r: Record) -> io::Result<()> {
        self.record_at(r, Level::Unknown)
    }

    /// Writes `r`, served from `level` (not written unless the trace has levels).
    pub fn record_at(&mut self, r: Record, level: Level) -> io::Result<()> {
        let start = self.buf.len();
        put_varint(&mut self.buf, r.time_ns.saturating_sub(self.last_time));
        let changed = r.tenant != self.tenant;
        let delta = r.page.wrapping_sub(self.last_page) as i64;
        let tag = if self.levels {
            (zigzag(delta) << 4) | (level as u64) << 2
        } else {
            zigzag(delta) << 2
        };
        put_varint(&mut self.buf, tag | (changed as u64) << 1 | r.write as u64);
        if changed {
            put_varint(&mut self.buf, r.tenant as u64);
        }
        self.hash = fnv1a(self.hash, &self.buf[start..]);
        self.last_time = self.last_time.max(r.time_ns);
        self.last_page = r.page;
        self.tenant = r.tenant;
        self.count += 1;
        if self.buf.len() >= 1 << 16 {
            self.out.write_all(&self.buf)?;
            self.buf.clear();
        }
        Ok(())
    }

    /// Writes the trailer; a trace without it reads as truncated.
    pub fn finish(mut self) -> io::Result<W> {
        self.out.write_all(&self.buf)?;
        self.out.write_all(END)?;
        self.out.write_all(&self.count.to_le_bytes())?;
        self.out.write_all(&self.hash.to_le_bytes())?;
        self.out.flush()?;
        Ok(self.out)
    }
}

/// A validated trace in memory.
#[derive(Debug)]
pub struct Trace {
    data: Vec<u8>,
    pub page_size: u32,
    pub records: u64,
    /// Pages per tenant (highest page + 1), tenant ids 0..len.
    pub tenant_pages: Vec<u64>,
    /// In a trace with levels: records served from each [`Level`], in its order.
    pub levels: Option<[u64; 4]>,
    /// In a recording's trace: what its compressed pool measured.
    pub pool: Option<PoolFigures>,
    /// Where the records start (after the header and its pool block).
    body_start: usize,
    /// A one-tenant trace's accesses as `page << 1 | write`, decoded once by `parse` (which
    /// reads every record anyway) when they take at most [`DECODED_MAX`] bytes, so that
    /// replays need not decode them again.
    decoded: Option<Vec<u64>>,
}

/// The most memory a trace's decoded accesses may take (8 bytes each).
pub const DECODED_MAX: u64 = 2 << 30;

impl Trace {
    /// Checks the header, the trailer and every record, so a replay never starts on a bad file.
    pub fn parse(data: Vec<u8>) -> Result<Trace, TraceError> {
        if data.len() < 8 || &data[..8] != MAGIC {
            return Err(TraceError::Magic);
        }
        if data.len() < HEADER {
            return Err(TraceError::Truncated);
        }
        let version = u16::from_le_bytes([data[8], data[9]]);
        if version != VERSION {
            return Err(TraceError::Version(version));
        }
        let flags = u16::from_le_bytes([data[10], data[11]]);
        if flags & !(FLAG_LEVELS | FLAG_POOL) != 0 {
            return Err(TraceError::Corrupt("unknown header flags"));
        }
        let levels = flags & FLAG_LEVELS != 0;
        let body_start = if flags & FLAG_POOL != 0 {
            HEADER + POOL_BLOCK
        } else {
            HEADER
        };
        let page_size = u32::from_le_bytes(data[12..16].try_into().expect("4 bytes"));
        if !page_size.is_power_of_two() || page_size < 512 {
            return Err(TraceError::Corrupt("page size is not a power of two"));
        }
        if data.len() < body_start + TRAILER || &data[data.len() - TRAILER..data.len() - 16] != END
        {
            return Err(TraceError::Truncated);
        }
        let f64_at = |at: usize| f64::from_le_bytes(data[at..at + 8].try_into().expect("8 bytes"));
        let pool = (flags & FLAG_POOL != 0).then(|| PoolFigures {
            ratio: f64_at(HEADER),
            fault_ns: f64_at(HEADER + 8),
        });
        if pool.is_some_and(|p| !p.valid()) {
            return Err(TraceError::Corrupt("pool figures out of range"));
        }
        let t = &data[data.len() - 16..];
        let count = u64::from_le_bytes(t[..8].try_into().expect("8 bytes"));
        let hash = u64::from_le_bytes(t[8..].try_into().expect("8 bytes"));
        let body = &data[body_start..data.len() - TRAILER];
        if fnv1a(fnv1a(FNV_START, &data[HEADER..body_start]), body) != hash {
            return Err(TraceError::Corrupt("checksum mismatch"));
        }
        let mut trace = Trace {
            page_size,
            records: count,
            tenant_pages: vec![],
            levels: None,
            pool,
            body_start,
            data: Vec::new(),
            decoded: None,
        };
        let mut by_level = [0u64; 4];
        let mut n = 0u64;
        let mut tenant_pages: Vec<u64> = vec![0];
        let mut decoded =
            (count.saturating_mul(8) <= DECODED_MAX).then(|| Vec::with_capacity(count as usize));
        {
            let mut it = Records::new(body, levels);
            for r in &mut it {
                let (r, level) = r?;
                by_level[level as usize] += 1;
                if r.tenant as usize >= tenant_pages.len() {
                    if r.tenant > 1 << 16 {
                        return Err(TraceError::Corrupt("tenant id out of range"));
                    }
                    tenant_pages.resize(r.tenant as usize + 1, 0);
                }
                if r.page >= 1 << 40 {
                    return Err(TraceError::Corrupt("page number out of range"));
                }
                let tp = &mut tenant_pages[r.tenant as usize];
                *tp = (*tp).max(r.page + 1);
                if let Some(d) = &mut decoded {
                    if r.tenant == 0 && n < count {
                        d.push(r.page << 1 | r.write as u64);
                    } else {
                        decoded = None;
                    }
                }
                n += 1;
            }
        }
        if n != count {
            return Err(TraceError::Corrupt("record count mismatch"));
        }
        trace.tenant_pages = tenant_pages;
        trace.levels = levels.then_some(by_level);
        trace.data = data;
        trace.decoded = decoded;
        Ok(trace)
    }

    /// A one-tenant trace's accesses as `page << 1 | write`, if they were decoded (see
    /// [`DECODED_MAX`]).
    pub fn decoded(&self) -> Option<&[u64]> {
        self.decoded.as_deref()
    }

    /// The records, in order.
    pub fn records(&self) -> impl Iterator<Item = Record> + '_ {
        self.records_at().map(|(r, _)| r)
    }

    /// The records, in order, with the level that served each ([`Level::Unknown`] in a trace
    /// without levels).
    pub fn records_at(&self) -> impl Iterator<Item = (Record, Level)> + '_ {
        Records::new(
            &self.data[self.body_start..self.data.len() - TRAILER],
            self.levels.is_some(),
        )
        .map(|r| r.expect("validated by parse"))
    }
}

struct Records<'a> {
    body: &'a [u8],
    pos: usize,
    time: u64,
    page: u64,
    tenant: u32,
    levels: bool,
}

impl<'a> Records<'a> {
    fn new(body: &'a [u8], levels: bool) -> Records<'a> {
        Records {
            body,
            pos: 0,
            time: 0,
            page: 0,
            tenant: 0,
            levels,
        }
    }

    fn varint(&mut self) -> Result<u64, TraceError> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let Some(&b) = self.body.get(self.pos) else {
                return Err(TraceError::Corrupt("record cut short"));
            };
            self.pos += 1;
            v |= ((b & 0x7F) as u64) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(TraceError::Corrupt("varint too long"))
    }
}

impl Iterator for Records<'_> {
    type Item = Result<(Record, Level), TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.pos >= self.body.len() {
            return None;
        }
        let r = (|| {
            let dt = self.varint()?;
            let tag = self.varint()?;
            if tag & 2 != 0 {
                let t = self.varint()?;
                if t > u32::MAX as u64 {
                    return Err(TraceError::Corrupt("tenant id out of range"));
                }
                self.tenant = t as u32;
            }
            self.time = self.time.wrapping_add(dt);
            let (delta, level) = if self.levels {
                (tag >> 4, Level::from_bits(tag >> 2))
            } else {
                (tag >> 2, Level::Unknown)
            };
            self.page = self.page.wrapping_add(unzigzag(delta) as u64);
            let r = Record {
                time_ns: self.time,
                tenant: self.tenant,
                page: self.page,
                write: tag & 1 != 0,
            };
            Ok((r, level))
        })();
        if r.is_err() {
            self.pos = self.body.len();
        }
        Some(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> Vec<Record> {
        vec![
            Record {
                time_ns: 10,
                tenant: 0,
                page: 5,
                write: false,
            },
            Record {
                time_ns: 15,
                tenant: 0,
                page: 3,
                write: true,
            },
            Record {
                time_ns: 15,
                tenant: 2,
                page: 1 << 30,
                write: false,
            },
            Record {
                time_ns: 99,
                tenant: 1,
                page: 0,
                write: true,
            },
        ]
    }

    fn encode(rs: &[Record]) -> Vec<u8> {
        let mut w = Writer::new(Vec::new(), 4096).unwrap();
        for &r in rs {
            w.record(r).unwrap();
        }
        w.finish().unwrap()
    }

    #[test]
    fn round_trip() {
        let t = Trace::parse(encode(&sample())).unwrap();
        assert_eq!(t.records().collect::<Vec<_>>(), sample());
        assert_eq!(t.tenant_pages, vec![6, 1, (1 << 30) + 1]);
        assert_eq!(t.records, 4);
    }

    #[test]
    fn levels_round_trip_and_are_counted() {
        let levels = [Level::Dram, Level::Pool, Level::File, Level::Pool];
        let mut w = Writer::with_levels(Vec::new(), 4096).unwrap();
        for (r, &l) in sample().into_iter().zip(&levels) {
            w.record_at(r, l).unwrap();
        }
        let t = Trace::parse(w.finish().unwrap()).unwrap();
        let back: Vec<(Record, Level)> = t.records_at().collect();
        assert_eq!(back.iter().map(|b| b.0).collect::<Vec<_>>(), sample());
        assert_eq!(back.iter().map(|b| b.1).collect::<Vec<_>>(), levels);
        assert_eq!(t.levels, Some([0, 1, 2, 1]));
        assert_eq!(t.tenant_pages, vec![6, 1, (1 << 30) + 1]);
        // Without levels, none are told.
        let plain = Trace::parse(encode(&sample())).unwrap();
        assert_eq!(plain.levels, None);
        assert!(plain.records_at().all(|(_, l)| l == Level::Unknown));
        // A flag this version does not know is refused.
        let mut odd = encode(&sample());
        odd[10] |= 4;
        assert_eq!(
            Trace::parse(odd).unwrap_err(),
            TraceError::Corrupt("unknown header flags")
        );
    }

    #[test]
    fn a_recording_keeps_what_its_pool_measured() {
        let figures = PoolFigures {
            ratio: 1.74,
            fault_ns: 13_824.0,
        };
        let mut w = Writer::recording(Vec::new(), 4096, Some(figures)).unwrap();
        for r in sample() {
            w.record_at(r, Level::Pool).unwrap();
        }
        let bytes = w.finish().unwrap();
        let t = Trace::parse(bytes.clone()).unwrap();
        assert_eq!(t.pool, Some(figures));
        assert_eq!(t.records().collect::<Vec<_>>(), sample());
        assert_eq!(t.levels, Some([0, 0, 4, 0]));
        // Without a pool, no block; a ratio below 1 (a pool left with holes) is kept as 1.
        let none = Writer::recording(Vec::new(), 4096, None)
            .unwrap()
            .finish()
            .unwrap();
        assert_eq!(Trace::parse(none).unwrap().pool, None);
        // What a recording's figures read back as.
        let written = |f: PoolFigures| {
            let t = Writer::recording(Vec::new(), 4096, Some(f))
                .unwrap()
                .finish()
                .unwrap();
            Trace::parse(t).unwrap().pool
        };
        let floor = Some(PoolFigures {
            ratio: 1.0,
            fault_ns: 0.0,
        });
        let holed = PoolFigures {
            ratio: 0.8,
            fault_ns: f64::NAN,
        };
        assert_eq!(written(holed), floor);
        // Figures out of range are corruption; so is a changed figure (the checksum covers
        // them).
        let mut bad = bytes.clone();
        bad[HEADER..HEADER + 8].copy_from_slice(&1000.0f64.to_le_bytes());
        assert_eq!(
            Trace::parse(bad).unwrap_err(),
            TraceError::Corrupt("pool figures out of range")
        );
        let mut flipped = bytes;
        flipped[HEADER + 3] ^= 0x10;
        assert_eq!(
            Trace::parse(flipped).unwrap_err(),
            TraceError::Corrupt("checksum mismatch")
        );
        // A writer never makes a trace its reader refuses.
        let nan = PoolFigures {
            ratio: f64::NAN,
            fault_ns: f64::INFINITY,
        };
        assert_eq!(written(nan), floor);
    }

    #[test]
    fn truncated_and_corrupted_are_told_apart() {
        let good = encode(&sample());
        assert_eq!(
            Trace::parse(good[..good.len() - 3].to_vec()).unwrap_err(),
            TraceError::Truncated
        );
        assert_eq!(
            Trace::parse(good[..10].to_vec()).unwrap_err(),
            TraceError::Truncated
        );
        let mut bad = good.clone();
        bad[HEADER + 1] ^= 0x40;
        assert!(matches!(
            Trace::parse(bad).unwrap_err(),
            TraceError::Corrupt(_)
        ));
        let mut v2 = good.clone();
        v2[8] = 2;
        assert_eq!(Trace::parse(v2).unwrap_err(), TraceError::Version(2));
        assert_eq!(
            Trace::parse(b"hello world, not a trace".to_vec()).unwrap_err(),
            TraceError::Magic
        );
    }

    proptest! {
        // Fuzzing the parser: arbitrary bytes, and valid traces with bytes flipped or cut,
        // never panic and never parse into something other than what was written.
        #[test]
        fn parser_survives_garbage(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = Trace::parse(bytes.clone());
            let mut with_magic = MAGIC.to_vec();
            with_magic.extend_from_slice(&bytes);
            let _ = Trace::parse(with_magic);
        }

        #[test]
        fn damaged_traces_are_rejected_or_exact(
            recs in proptest::collection::vec((0u64..1000, 0u32..4, 0u64..1 << 20, any::<bool>()), 1..50),
            flip in any::<usize>(),
            bit in 0u8..8,
            cut in any::<bool>(),
        ) {
            let rs: Vec<Record> = recs.iter().map(|&(t, tenant, page, write)| Record { time_ns: t, tenant, page, write }).collect();
            let mut rs = rs;
            let mut now = 0;
            for r in &mut rs { now += r.time_ns; r.time_ns = now; }
            let good = encode(&rs);
            let mut bad = good.clone();
            if cut {
                bad.truncate(flip % good.len());
            } else {
                let i = flip % good.len();
                bad[i] ^= 1 << bit;
            }
            if let Ok(t) = Trace::parse(bad) {
                prop_assert_eq!(t.records().collect::<Vec<_>>(), rs);
            }
        }
    }
}
