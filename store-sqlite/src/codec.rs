//! Headers in one BLOB column.
//!
//! Header values are arbitrary bytes, so a text format would need escaping; a length-prefixed
//! encoding round-trips every byte and is trivial to read back:
//! `count: u32 BE`, then per header `name_len: u32 BE, name, value_len: u32 BE, value`.
//! Names are stored in the map's sorted order, so equal headers encode to equal bytes.

use outbox_core::{Headers, Result};

use crate::error::corrupt;

pub(crate) fn encode_headers(headers: &Headers) -> Vec<u8> {
    let size = 4 + headers.iter().map(|(k, v)| 8 + k.len() + v.len()).sum::<usize>();
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&len32(headers.len()).to_be_bytes());
    for (name, value) in headers {
        out.extend_from_slice(&len32(name.len()).to_be_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&len32(value.len()).to_be_bytes());
        out.extend_from_slice(value);
    }
    out
}

fn len32(n: usize) -> u32 {
    // A header of 4 GiB or more makes the BLOB larger than SQLite's limit (1e9 bytes), so the
    // insert fails with TooLarge before a clamped length could be stored.
    u32::try_from(n).unwrap_or(u32::MAX)
}

pub(crate) fn decode_headers(bytes: &[u8]) -> Result<Headers> {
    let mut r = Reader { bytes, at: 0 };
    let count = r.u32()?;
    let mut headers = Headers::new();
    for _ in 0..count {
        let name_len = r.u32()? as usize;
        let name = r.take(name_len)?;
        let name = String::from_utf8(name.to_vec()).map_err(|_| corrupt("stored header name is not UTF-8".into()))?;
        let value_len = r.u32()? as usize;
        let value = r.take(value_len)?.to_vec();
        headers.insert(name, value);
    }
    if r.at != bytes.len() {
        return Err(corrupt(format!("stored headers have {} trailing bytes", bytes.len() - r.at)));
    }
    Ok(headers)
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len()).ok_or_else(|| {
            corrupt(format!("stored headers end after {} bytes, {} more were announced", self.bytes.len(), n))
        })?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_core::ErrorKind;

    #[test]
    fn round_trips_arbitrary_bytes() {
        let mut h = Headers::new();
        assert_eq!(decode_headers(&encode_headers(&h)).unwrap(), h);
        h.insert("bin".into(), vec![0, 0xff, 0xfe, b'\n', 0]);
        h.insert("empty".into(), Vec::new());
        h.insert("text".into(), b"hello".to_vec());
        assert_eq!(decode_headers(&encode_headers(&h)).unwrap(), h);
    }

    #[test]
    fn truncated_or_padded_is_corrupt() {
        let mut h = Headers::new();
        h.insert("a".into(), b"xyz".to_vec());
        let bytes = encode_headers(&h);
        for cut in 0..bytes.len() {
            assert_eq!(decode_headers(&bytes[..cut]).unwrap_err().kind(), ErrorKind::Corrupt, "cut at {cut}");
        }
        let mut padded = bytes.clone();
        padded.push(0);
        assert_eq!(decode_headers(&padded).unwrap_err().kind(), ErrorKind::Corrupt);
    }
}
