//! Durations on the command line (`30s`, `500ms`, `2m`, `1h`, `7d`): operators write leases,
//! polls and retention ages in the unit that reads best, and a bare number is refused rather
//! than guessed.

use std::time::Duration;

/// Parse `<number><unit>` with unit `ms`, `s`, `m`, `h` or `d` (a fractional number is
/// allowed: `1.5s`).
pub(crate) fn parse(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 =
        number.parse().map_err(|_| format!("{text:?} is not a duration: expected a number and a unit, like 30s"))?;
    let scale = match unit {
        "ms" => 0.001,
        "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        "d" => 86_400.0,
        "" => return Err(format!("{text:?} has no unit: write {text}ms or {text}s")),
        other => return Err(format!("{text:?}: unknown unit {other:?} (ms, s, m, h, d)")),
    };
    Duration::try_from_secs_f64(value * scale).map_err(|e| format!("{text:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_and_errors() {
        assert_eq!(parse("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert_eq!(parse("1.5d"), Ok(Duration::from_secs(129_600)));
        for bad in ["30", "", "s", "-1s", "3 parsecs", "1.2.3s", "d", "-1d", "7days", "x d"] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }
}
