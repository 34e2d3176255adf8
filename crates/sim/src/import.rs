//! Traces from other tools, read into the simulator's own form ([`Trace`]): libCacheSim's
//! `oracleGeneral` binary and plain CSV. Each distinct object becomes one page, numbered in
//! the order objects first appear; object sizes are ignored (memtide places pages, all the
//! same size). Entry points: [`Format`], [`load`].

use std::collections::HashMap;
use std::path::Path;

use crate::trace::{fnv1a, Record, Writer, FNV_START};
use crate::Trace;

/// A trace file's format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// memtide's own `.mtt` (written by `memtide sim --save-trace`).
    Mtt,
    /// libCacheSim's `oracleGeneral`: 24-byte little-endian records (u32 time, u64 object id,
    /// u32 size, i64 next access), uncompressed.
    OracleGeneral,
    /// One access per line: `id`, or `time,id[,...]`; or, with a header line, the column named
    /// `obj_id`, `id`, `key`, `page` or `addr` (a byte address: its 4 KiB page is used), and an
    /// optional `op` column (`w`, `write`, `set` or `1` mark writes).
    Csv,
}

impl Format {
    pub fn parse(s: &str) -> Option<Option<Format>> {
        Some(match s {
            "auto" => None,
            "mtt" => Some(Format::Mtt),
            "oracle-general" | "oracleGeneral" => Some(Format::OracleGeneral),
            "csv" => Some(Format::Csv),
            _ => return None,
        })
    }
}

/// Why a trace could not be read; one line each.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ImportError {
    #[error("cannot tell its format: give --trace-format mtt, oracle-general or csv")]
    Unknown,
    #[error("it is zstd-compressed: decompress it first (zstd -d)")]
    Zstd,
    #[error("its length is not a whole number of 24-byte oracleGeneral records")]
    OracleLength,
    #[error("line {0}: {1}")]
    Csv(u64, String),
    #[error("it holds no accesses")]
    Empty,
    #[error("it has more than 2^32 distinct objects, the simulator's limit")]
    TooMany,
    #[error("{0}")]
    Mtt(#[from] crate::TraceError),
}

/// Reads `data` (the contents of `path`) as `format`, or guesses the format: the `.mtt` magic,
/// a `.csv` name, or `oracleGeneral` in the name.
pub fn load(path: &Path, data: Vec<u8>, format: Option<Format>) -> Result<Trace, ImportError> {
    if data.starts_with(&[0x28, 0xB5, 0x2F, 0xFD]) {
        return Err(ImportError::Zstd);
    }
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_lowercase())
        .unwrap_or_default();
    let format = match format {
        Some(f) => f,
        None if data.starts_with(b"MTTRACE\0") => Format::Mtt,
        None if name.ends_with(".csv") => Format::Csv,
        None if name.contains("oraclegeneral") => Format::OracleGeneral,
        None => return Err(ImportError::Unknown),
    };
    match format {
        Format::Mtt => Ok(Trace::parse(data)?),
        Format::OracleGeneral => oracle_general(&data),
        Format::Csv => csv(&data),
    }
}

/// Numbers objects densely in order of first appearance and writes the accesses as `.mtt`.
struct Builder {
    pages: HashMap<u64, u32>,
    writer: Writer<Vec<u8>>,
    n: u64,
}

impl Builder {
    fn new() -> Builder {
        Builder {
            pages: HashMap::new(),
            writer: Writer::new(Vec::new(), 4096).expect("writing to memory"),
            n: 0,
        }
    }

    fn access(&mut self, id: u64, write: bool) -> Result<(), ImportError> {
        let next = self.pages.len();
        if next > u32::MAX as usize {
            return Err(ImportError::TooMany);
        }
        let page = *self.pages.entry(id).or_insert(next as u32);
        self.writer
            .record(Record {
                time_ns: self.n * 100,
                tenant: 0,
                page: page as u64,
                write,
            })
            .expect("writing to memory");
        self.n += 1;
        Ok(())
    }

    fn finish(self) -> Result<Trace, ImportError> {
        if self.n == 0 {
            return Err(ImportError::Empty);
        }
        let data = self.writer.finish().expect("writing to memory");
        Ok(Trace::parse(data)?)
    }
}

fn oracle_general(data: &[u8]) -> Result<Trace, ImportError> {
    if !data.len().is_multiple_of(24) {
        return Err(ImportError::OracleLength);
    }
    let mut b = Builder::new();
    for rec in data.chunks_exact(24) {
        let id = u64::from_le_bytes(rec[4..12].try_into().expect("8 bytes"));
        b.access(id, false)?;
    }
    b.finish()
}

const ID_COLUMNS: [&str; 6] = ["obj_id", "id", "key", "page", "addr", "address"];

fn csv(data: &[u8]) -> Result<Trace, ImportError> {
    let text = String::from_utf8_lossy(data);
    let mut lines = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty() && !l.starts_with('#'))
        .peekable();
    let number = |f: &str| -> Option<u64> {
        let f = f.trim();
        match f.strip_prefix("0x").or_else(|| f.strip_prefix("0X")) {
            Some(h) => u64::from_str_radix(h, 16).ok(),
            None => f.parse().ok(),
        }
    };
    // A first line with a field that is not a number is a header.
    let mut id_col = None;
    let mut op_col = None;
    let mut addr = false;
    if let Some((_, first)) = lines.peek() {
        let fields: Vec<String> = first.split(',').map(|f| f.trim().to_lowercase()).collect();
        if fields.iter().any(|f| number(f).is_none()) {
            let found = ID_COLUMNS
                .iter()
                .find_map(|want| fields.iter().position(|f| f == want));
            let Some(c) = found else {
                return Err(ImportError::Csv(
                    1,
                    format!(
                        "a header without an object column (name one {})",
                        ID_COLUMNS.join(", ")
                    ),
                ));
            };
            addr = fields[c].starts_with("addr");
            id_col = Some(c);
            op_col = ["op", "write", "type", "rw"]
                .iter()
                .find_map(|want| fields.iter().position(|f| f == want));
            lines.next();
        }
    }
    let mut b = Builder::new();
    for (n, line) in lines {
        let fields: Vec<&str> = line.split(',').collect();
        let col = id_col.unwrap_or(if fields.len() == 1 { 0 } else { 1 });
        let Some(field) = fields.get(col) else {
            return Err(ImportError::Csv(
                n as u64 + 1,
                format!("no column {}", col + 1),
            ));
        };
        let id = match number(field) {
            Some(v) if addr => v >> 12,
            Some(v) => v,
            // Names are objects too: hash them.
            None => fnv1a(FNV_START, field.trim().as_bytes()),
        };
        let write = op_col
            .and_then(|c| fields.get(c))
            .map(|op| {
                matches!(
                    op.trim().to_lowercase().as_str(),
                    "w" | "write" | "set" | "put" | "1" | "true"
                )
            })
            .unwrap_or(false);
        b.access(id, write)?;
    }
    b.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn oracle(ids: &[u64]) -> Vec<u8> {
        let mut v = Vec::new();
        for (t, &id) in ids.iter().enumerate() {
            v.extend((t as u32).to_le_bytes());
            v.extend(id.to_le_bytes());
            v.extend(4096u32.to_le_bytes());
            v.extend((-1i64).to_le_bytes());
        }
        v
    }

    fn pages(t: &Trace) -> Vec<(u64, bool)> {
        t.records().map(|r| (r.page, r.write)).collect()
    }

    #[test]
    fn oracle_general_objects_become_dense_pages() {
        let t = load(
            Path::new("x.oracleGeneral.bin"),
            oracle(&[900, 7, 900, 1 << 40]),
            None,
        )
        .unwrap();
        assert_eq!(pages(&t), [(0, false), (1, false), (0, false), (2, false)]);
        assert_eq!(t.tenant_pages, [3]);
        let mut short = oracle(&[1]);
        short.pop();
        assert_eq!(
            load(Path::new("t"), short, Some(Format::OracleGeneral)).unwrap_err(),
            ImportError::OracleLength
        );
    }

    #[test]
    fn csv_with_and_without_header() {
        // time,id: the second column.
        let t = load(Path::new("a.csv"), b"1,50\n2,60\n3,50\n".to_vec(), None).unwrap();
        assert_eq!(pages(&t), [(0, false), (1, false), (0, false)]);
        // A header naming the columns; addresses map to their page; ops mark writes.
        let data = b"timestamp,op,addr\n1,r,0x1000\n2,w,0x1fff\n3,r,0x2000\n".to_vec();
        let t = load(Path::new("b.csv"), data, None).unwrap();
        assert_eq!(pages(&t), [(0, false), (0, true), (1, false)]);
        // Names are objects too.
        let t = load(
            Path::new("c"),
            b"key\nalpha\nbeta\nalpha\n".to_vec(),
            Some(Format::Csv),
        )
        .unwrap();
        assert_eq!(pages(&t), [(0, false), (1, false), (0, false)]);
        let e = load(Path::new("d.csv"), b"time,size\n1,2\n".to_vec(), None).unwrap_err();
        assert!(e.to_string().starts_with("line 1: a header without"), "{e}");
        assert_eq!(
            load(Path::new("e.csv"), b"\n".to_vec(), None).unwrap_err(),
            ImportError::Empty
        );
    }

    #[test]
    fn unknown_and_compressed_files_are_named() {
        assert_eq!(
            load(Path::new("t.bin"), vec![1, 2, 3], None).unwrap_err(),
            ImportError::Unknown
        );
        assert_eq!(
            load(Path::new("t.zst"), vec![0x28, 0xB5, 0x2F, 0xFD, 0], None).unwrap_err(),
            ImportError::Zstd
        );
    }
}
