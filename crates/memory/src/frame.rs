//! A log's framing, shared by the log that writes and replays it
//! (`log.rs`) and the salvage that reads a damaged one (`salvage.rs`): an
//! 8-byte header, then frames of `[u32 len][u32 crc][payload]`.

/// The header every log starts with (its format's version in the last byte).
pub(crate) const HEADER: &[u8; 8] = b"ISLOG\0\0\x01";

/// Bytes of a frame before its payload: the length and the checksum.
pub(crate) const FRAME_BYTES: usize = 8;

/// The largest record accepted. A length field above it can only be a torn or
/// corrupt frame, so replay never tries to allocate gigabytes for one.
pub const MAX_RECORD_BYTES: usize = 64 << 20;

/// A frame's checksum: CRC-32 of its length field and its payload.
pub(crate) fn checksum(len: [u8; 4], payload: &[u8]) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&len);
    hasher.update(payload);
    hasher.finalize()
}
