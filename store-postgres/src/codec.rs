//! Headers as one `bytea`: values are arbitrary bytes, which neither `jsonb` nor `hstore` holds
//! faithfully, and a length-prefixed encoding round-trips every byte without escaping.
//!
//! Layout: a format byte (1), a `u32` count, then per header a `u32` name length, the name, a
//! `u32` value length and the value; all integers big-endian.

use outbox_core::{Error, ErrorKind, Headers, Result};

use crate::error::BACKEND;

const FORMAT: u8 = 1;

pub(crate) fn encode_headers(headers: &Headers) -> Vec<u8> {
    let size = 5 + headers.iter().map(|(k, v)| 8 + k.len() + v.len()).sum::<usize>();
    let mut out = Vec::with_capacity(size);
    out.push(FORMAT);
    out.extend_from_slice(&len32(headers.len()).to_be_bytes());
    for (name, value) in headers {
        out.extend_from_slice(&len32(name.len()).to_be_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&len32(value.len()).to_be_bytes());
        out.extend_from_slice(value);
    }
    out
}

/// Lengths beyond `u32` cannot reach here: PostgreSQL rejects values over 1 GiB, and header
/// names are validated short. Saturate rather than panic; decoding then reports corruption.
fn len32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

pub(crate) fn decode_headers(bytes: &[u8]) -> Result<Headers> {
    let corrupt = |what: &str| Error::permanent(ErrorKind::Corrupt, BACKEND, format!("stored headers: {what}"));
    let mut rest = bytes;
    let mut take = |n: usize| -> Result<&[u8]> {
        if rest.len() < n {
            return Err(corrupt("truncated"));
        }
        let (head, tail) = rest.split_at(n);
        rest = tail;
        Ok(head)
    };
    let format = take(1)?;
    if format != [FORMAT] {
        return Err(corrupt("unknown format byte"));
    }
    // Big-endian; `take(4)` guarantees four bytes.
    let u32_at = |b: &[u8]| -> usize { b.iter().fold(0usize, |n, &byte| (n << 8) | usize::from(byte)) };
    let count = u32_at(take(4)?);
    let mut headers = Headers::new();
    for _ in 0..count {
        let name_len = u32_at(take(4)?);
        let name = std::str::from_utf8(take(name_len)?).map_err(|_| corrupt("header name is not UTF-8"))?;
        let value_len = u32_at(take(4)?);
        let value = take(value_len)?.to_vec();
        headers.insert(name.to_string(), value);
    }
    if !rest.is_empty() {
        return Err(corrupt("trailing bytes"));
    }
    Ok(headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_arbitrary_bytes() {
        let mut h = Headers::new();
        h.insert("a".into(), vec![]);
        h.insert("bin".into(), vec![0, 255, 0xc3, 0x28, b'\n', 0]);
        h.insert("x-trace".into(), b"abc".to_vec());
        let bytes = encode_headers(&h);
        assert_eq!(decode_headers(&bytes).unwrap(), h);
        assert_eq!(decode_headers(&encode_headers(&Headers::new())).unwrap(), Headers::new());
    }

    #[test]
    fn damage_is_corrupt() {
        let mut h = Headers::new();
        h.insert("k".into(), b"v".to_vec());
        let bytes = encode_headers(&h);
        for bad in [&bytes[..bytes.len() - 1], &[], &[2, 0, 0, 0, 0][..], &[bytes.clone(), vec![0]].concat()[..]] {
            assert_eq!(decode_headers(bad).unwrap_err().kind(), ErrorKind::Corrupt);
        }
    }
}
