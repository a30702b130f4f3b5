//! Times as the HTTP API and the reports write and read them: RFC 3339 in
//! UTC, from and to milliseconds since the Unix epoch (civil dates by Howard
//! Hinnant's algorithms, so no date library is needed for two functions).

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Milliseconds since the Unix epoch as RFC 3339 UTC (`…T…Z`, milliseconds).
pub fn rfc3339(ms: u64) -> String {
    let (days, rest) = ((ms / 86_400_000) as i64, ms % 86_400_000);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (h, m, sec, milli) = (rest / 3_600_000, rest / 60_000 % 60, rest / 1000 % 60, rest % 1000);
    format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{sec:02}.{milli:03}Z")
}

/// Milliseconds since the Unix epoch of `YYYY-MM-DD` (midnight UTC) or an
/// RFC 3339 time (`YYYY-MM-DDTHH:MM:SS[.fff](Z|±HH:MM)`; no zone: UTC).
pub fn parse(s: &str) -> Option<u64> {
    let b = s.as_bytes();
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let part = s.get(r)?;
        part.bytes().all(|c| c.is_ascii_digit()).then(|| part.parse().ok())?
    };
    if b.len() < 10 || b[4] != b'-' || b[7] != b'-' {
        return None;
    }
    let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) {
        return None;
    }
    let mut ms = days_from_civil(year, month, day) * 86_400_000;
    if b.len() > 10 {
        if !matches!(b[10], b'T' | b't' | b' ') || b.len() < 19 || b[13] != b':' || b[16] != b':' {
            return None;
        }
        let (h, m, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
        if h > 23 || m > 59 || sec > 60 {
            return None;
        }
        ms += ((h * 60 + m) * 60 + sec) * 1000;
        let mut rest = &s[19..];
        if let Some(frac) = rest.strip_prefix('.') {
            let digits = frac.bytes().take_while(u8::is_ascii_digit).count();
            if digits == 0 {
                return None;
            }
            let millis: String = frac[..digits].chars().chain("000".chars()).take(3).collect();
            ms += millis.parse::<i64>().ok()?;
            rest = &frac[digits..];
        }
        ms -= match rest {
            "" | "Z" | "z" => 0,
            zone => {
                let sign = match zone.as_bytes().first() {
                    Some(b'+') => 1,
                    Some(b'-') => -1,
                    _ => return None,
                };
                let (zh, zm) = zone[1..].split_once(':')?;
                let (zh, zm): (i64, i64) = (zh.parse().ok()?, zm.parse().ok()?);
                sign * (zh * 60 + zm) * 60_000
            }
        };
    }
    u64::try_from(ms).ok()
}

/// Days since 1970-01-01 of a civil date (Howard Hinnant's algorithm; the
/// inverse of [`rfc3339`]'s).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_rfc3339_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(rfc3339(1_796_281_818_123), "2026-12-03T07:10:18.123Z");
    }

    #[test]
    fn times_parse_as_utc_milliseconds() {
        assert_eq!(parse("1970-01-01"), Some(0));
        assert_eq!(parse("2000-02-29T00:00:00.000Z"), Some(951_782_400_000));
        assert_eq!(parse("2026-12-03T07:10:18.123Z"), Some(1_796_281_818_123));
        assert_eq!(parse("2026-12-03T08:10:18.123+01:00"), Some(1_796_281_818_123));
        assert_eq!(parse("2026-12-03 07:10:18"), Some(1_796_281_818_000));
        for bad in ["", "2026-13-01", "2026-12-3", "12/03/2026", "2026-12-03T07:10", "2026-12-03T07:10:18.Z"] {
            assert_eq!(parse(bad), None, "{bad}");
        }
    }
}
