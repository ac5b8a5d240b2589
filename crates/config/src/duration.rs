//! Go's `time.ParseDuration` syntax, as kube-proxy's flags and `metav1.Duration` fields
//! take it: `300ms`, `1.5s`, `1m30s`, `24h0m0s`, `0`.

use std::time::Duration;

/// Parses a Go duration. Negative durations are refused (no kube-proxy field takes one).
pub fn parse_go_duration(s: &str) -> Result<Duration, String> {
    let bad = |why: &str| format!("invalid duration {:?}: {why}", s.escape_debug().to_string());
    let t = s.trim();
    let t = t.strip_prefix('+').unwrap_or(t);
    if t.starts_with('-') {
        return Err(bad("must not be negative"));
    }
    if t == "0" {
        return Ok(Duration::ZERO);
    }
    if t.is_empty() {
        return Err(bad("empty"));
    }
    let mut nanos: u128 = 0;
    let mut rest = t;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (num, tail) = rest.split_at(num_len);
        if num.is_empty() || num == "." || num.matches('.').count() > 1 {
            return Err(bad("expected a number"));
        }
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let scale: u128 = match unit {
            "ns" => 1,
            "us" | "µs" | "μs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60 * 1_000_000_000,
            "h" => 3600 * 1_000_000_000,
            "" => return Err(bad("missing unit (ns, us, ms, s, m, h)")),
            _ => return Err(bad("unknown unit (ns, us, ms, s, m, h)")),
        };
        // Integer arithmetic on the digits, so "0.1s" is exactly 100ms.
        let (int, frac) = num.split_once('.').unwrap_or((num, ""));
        let int: u128 = if int.is_empty() {
            0
        } else {
            int.parse().map_err(|_| bad("number too large"))?
        };
        let mut part = int.checked_mul(scale).ok_or_else(|| bad("too large"))?;
        let mut div = 1u128;
        for d in frac.bytes().take(18) {
            div *= 10;
            part += u128::from(d - b'0') * scale / div;
        }
        nanos = nanos.checked_add(part).ok_or_else(|| bad("too large"))?;
        rest = tail;
    }
    let secs = u64::try_from(nanos / 1_000_000_000).map_err(|_| bad("too large"))?;
    Ok(Duration::new(secs, (nanos % 1_000_000_000) as u32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations() {
        for (s, ms) in [
            ("0", 0),
            ("0s", 0),
            ("100ms", 100),
            ("1s", 1000),
            ("1.5s", 1500),
            ("0.1s", 100),
            ("1m30s", 90_000),
            ("24h0m0s", 86_400_000),
            ("1h0m0s", 3_600_000),
            ("250ms", 250),
            ("+2s", 2000),
            (" 3s ", 3000),
        ] {
            assert_eq!(parse_go_duration(s).map(|d| d.as_millis()), Ok(ms), "{s}");
        }
        assert_eq!(parse_go_duration("1500us"), Ok(Duration::from_micros(1500)));
        for bad in [
            "",
            "5",
            "1x",
            "s",
            "1s2",
            "-1s",
            ".s",
            "1..2s",
            "99999999999999999999999h",
        ] {
            assert!(parse_go_duration(bad).is_err(), "{bad}");
        }
    }
}
