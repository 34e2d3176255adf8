//! Byte sizes as users write them: `512MiB`, `4GiB`, `1.5G`, `65536`. Binary units (KiB = 1024)
//! whether or not the `i` is written; `K`/`M`/`G`/`T` accepted. Entry points: [`parse`],
//! [`format`].

/// Why a size did not parse.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SizeError {
    #[error("`{0}` is not a size: write a number with an optional unit, like 512MiB or 4GiB")]
    Malformed(String),
    #[error("`{0}` is too large")]
    TooLarge(String),
}

/// Parses a size in bytes.
pub fn parse(s: &str) -> Result<u64, SizeError> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = unit.trim();
    if num.is_empty() || num.starts_with('.') || num.matches('.').count() > 1 {
        return Err(SizeError::Malformed(s.to_string()));
    }
    let mult: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return Err(SizeError::Malformed(s.to_string())),
    };
    let v: f64 = num
        .parse()
        .map_err(|_| SizeError::Malformed(s.to_string()))?;
    let bytes = v * mult as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(SizeError::TooLarge(s.to_string()));
    }
    Ok(bytes.round() as u64)
}

/// Formats bytes with a binary unit, e.g. `1.50 GiB`.
pub fn format(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    // A value that would print as 1024.00 goes up a unit (1 GiB less a page is "1.00 GiB").
    while v >= 1023.995 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!(parse("512MiB"), Ok(512 << 20));
        assert_eq!(parse("4GiB"), Ok(4 << 30));
        assert_eq!(parse("1.5G"), Ok(3 << 29));
        assert_eq!(parse("65536"), Ok(65536));
        assert_eq!(parse(" 2 kb "), Ok(2048));
        assert_eq!(parse("0"), Ok(0));
    }

    #[test]
    fn rejects_garbage() {
        for bad in ["lots", "", "GiB", "1..2G", "-1G", "1XB", ".5G"] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        assert!(matches!(parse("99999999999T"), Err(SizeError::TooLarge(_))));
    }

    #[test]
    fn formats() {
        assert_eq!(format(512), "512 B");
        assert_eq!(format(3 << 29), "1.50 GiB");
        assert_eq!(format((1 << 30) - 4096), "1.00 GiB");
        assert_eq!(format(1023), "1023 B");
    }
}
