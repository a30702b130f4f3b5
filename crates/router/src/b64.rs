//! Base64 (RFC 4648) for the two places the API speaks it, without a
//! crate: the standard alphabet with padding (embeddings with
//! `encoding_format: "base64"`, what the official client asks for) and the
//! URL-safe alphabet without (Mem0 ids, which travel in paths).

const STANDARD: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
const URL_SAFE: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

/// Standard base64 with padding.
pub fn standard(bytes: &[u8]) -> String {
    encode(bytes, STANDARD, true)
}

/// URL-safe base64 without padding.
pub fn url(bytes: &[u8]) -> String {
    encode(bytes, URL_SAFE, false)
}

/// The bytes of unpadded URL-safe base64; `None` for anything else.
pub fn from_url(s: &str) -> Option<Vec<u8>> {
    let digit = |c: u8| URL_SAFE.iter().position(|&a| a == c).map(|p| p as u32);
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    for chunk in s.as_bytes().chunks(4) {
        if chunk.len() == 1 {
            return None;
        }
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            n |= digit(c)? << (18 - 6 * i);
        }
        out.extend_from_slice(&n.to_be_bytes()[1..chunk.len()]);
    }
    Some(out)
}

fn encode(bytes: &[u8], abc: &[u8; 64], pad: bool) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], chunk.get(1).copied().unwrap_or(0), chunk.get(2).copied().unwrap_or(0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            match i <= chunk.len() {
                true => out.push(abc[((n >> (18 - 6 * i)) & 63) as usize] as char),
                false if pad => out.push('='),
                false => {}
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_the_standard_alphabet_and_padding() {
        assert_eq!(standard(b""), "");
        assert_eq!(standard(b"M"), "TQ==");
        assert_eq!(standard(b"Ma"), "TWE=");
        assert_eq!(standard(b"Man"), "TWFu");
        assert_eq!(standard(&[0xfb, 0xff, 0xbf]), "+/+/");
        assert_eq!(standard(&1.0f32.to_le_bytes()), "AACAPw==");
    }

    #[test]
    fn url_safe_base64_round_trips_without_padding() {
        assert_eq!(url(&[0xfb, 0xff, 0xbf, 0x4d]), "-_-_TQ");
        for bytes in [&b""[..], b"M", b"Ma", b"Man", b"a/b c", "ünï".as_bytes()] {
            assert_eq!(from_url(&url(bytes)).as_deref(), Some(bytes));
        }
        assert_eq!(from_url("T"), None);
        assert_eq!(from_url("TQ=="), None);
    }
}
