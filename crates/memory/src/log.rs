//! A durable append-only record log: the memory shard's source of truth.
//!
//! Layout: the 8-byte header `b"ISLOG\0\0\x01"` (magic, version 1), then one
//! frame per record: `[u32 LE payload length][u32 LE crc32][payload]`.
//!
//! The CRC covers the length field's 4 bytes followed by the payload, not the
//! payload alone: with payload-only CRCs an 8-byte run of zeros is a valid
//! empty record (crc32 of nothing is 0), so a tail the filesystem zero-filled
//! after a power loss would replay as phantom records.
//!
//! Crash model: a record is durable once [`RecordLog::append`] returns. A crash
//! at any instant (SIGKILL, power loss) or a failed write can leave only a torn
//! tail: the last append's bytes cut short (a partial frame header, a payload
//! shorter than its length) or, after a power loss, zeros. [`RecordLog::open`]
//! replays up to the last intact frame and truncates such a tail, so the
//! caller never sees garbage and never loses an acknowledged record.
//!
//! Anything else that fails its checks — a frame whose CRC fails with intact
//! frames after it, a length no append writes, a whole last frame whose CRC
//! fails — is damage to written bytes (a flipped bit, a bad sector), not a
//! tail: cutting it would drop every acknowledged record after it. `open`
//! refuses such a log ([`MemoryError::Damaged`]) and leaves it as it is;
//! [`salvage`](crate::salvage::salvage) recovers every intact record around
//! the damage, and the damaged record itself when one byte of it is wrong.
//!
//! One process appends to a log at a time; nothing here locks the file.

use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, ErrorKind, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

pub use crate::erase::Erased;
use crate::error::{self, MemoryError, Result};
pub use crate::frame::MAX_RECORD_BYTES;
pub(crate) use crate::frame::{FRAME_BYTES, HEADER, checksum};
use crate::salvage::{Tail, classify};

/// What opening a log found.
#[derive(Debug)]
pub struct Recovery {
    /// Intact records in append order.
    pub records: Vec<Vec<u8>>,
    /// Bytes dropped from the end (a torn or corrupt tail), 0 when clean.
    pub truncated_bytes: u64,
    /// Why the tail was dropped, for the caller to report.
    pub reason: Option<String>,
}

/// Where one record's payload sits in its log, for reading it by offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frame {
    /// Byte offset of the payload (after the frame's length and CRC).
    pub offset: u64,
    pub len: u32,
}

/// What [`RecordLog::open_frames`] found: each intact frame with the first
/// bytes of its payload (all of it when it is at most the `peek` asked for).
#[derive(Debug)]
pub struct FrameIndex {
    pub frames: Vec<(Frame, Vec<u8>)>,
    pub truncated_bytes: u64,
    pub reason: Option<String>,
}

/// An open log. It holds no file descriptor between calls: a node keeps
/// two logs per user it has read, thousands of users, and descriptors are
/// a per-process limit (1,024 by default on many systems); each call opens
/// the file, microseconds beside the read or fsync it does.
#[derive(Debug)]
pub struct RecordLog {
    path: PathBuf,
    /// Length of the intact prefix; a failed append truncates back to it.
    len: u64,
    /// Set when a failed append could not be rolled back: the file may end in a
    /// torn frame, and records appended behind it would be dropped by the next
    /// replay, so further appends are refused until the log is reopened.
    broken: bool,
    /// The last frame, when [`RecordLog::open_frames`] left its checksum
    /// unread ([`RecordLog::settle_tail`] reads it).
    unverified_tail: Option<Frame>,
}

impl RecordLog {
    /// Opens `path`, creating it (and its parent directory) if missing. Replays every record; the first
    /// record that is short, has an impossible length, or fails its CRC ends the replay: the file is
    /// truncated to the last intact record (fsynced) and the loss reported in `Recovery`. Never panics
    /// on any file content. A file with a wrong header is NOT truncated: it is an error
    /// ([`MemoryError::Corrupt`]), because it is not one of our logs.
    ///
    /// An existing empty file is taken as a new log: it holds nothing to lose.
    pub fn open(path: &Path) -> Result<(RecordLog, Recovery)> {
        let dir = parent_dir(path);
        fs::create_dir_all(dir).map_err(error::io(dir))?;
        let file = match OpenOptions::new().read(true).append(true).open(path) {
            Ok(file) => file,
            Err(e) if e.kind() == ErrorKind::NotFound => {
                // Created by rename, so a crash never leaves a log without its header.
                let file = replace(path, HEADER)?;
                sync_dir(dir)?;
                file
            }
            Err(e) => return Err(error::io(path)(e)),
        };
        let mut bytes = Vec::new();
        // From the start: a handle fresh from `replace` sits after what it wrote.
        (&file).seek(SeekFrom::Start(0)).and_then(|_| (&file).read_to_end(&mut bytes)).map_err(error::io(path))?;
        if bytes.is_empty() {
            (&file).write_all(HEADER).and_then(|()| file.sync_data()).map_err(error::io(path))?;
            bytes.extend_from_slice(HEADER);
        }
        check_header(path, &bytes)?;

        let (records, intact, reason) = replay(&bytes);
        let reason = match reason.map(|why| (classify(&bytes, intact, &why), why)) {
            Some((Tail::Damaged(what), _)) => {
                return Err(MemoryError::Damaged { path: path.to_path_buf(), offset: intact as u64, reason: what });
            }
            Some((Tail::Torn(what), why)) => Some(format!("{why} ({what})")),
            _ => None,
        };
        let truncated_bytes = (bytes.len() - intact) as u64;
        if truncated_bytes > 0 {
            // sync_all, not sync_data: the new length is the point of the call.
            file.set_len(intact as u64).and_then(|()| file.sync_all()).map_err(error::io(path))?;
        }
        let log = RecordLog { path: path.to_path_buf(), len: intact as u64, broken: false, unverified_tail: None };
        Ok((log, Recovery { records, truncated_bytes, reason }))
    }

    /// Opens `path` like [`RecordLog::open`] without reading the payloads
    /// whole: for a log of large records (a KV segment) read by offset
    /// later ([`RecordLog::read`]), so that opening costs a read of each
    /// frame's head, not of the log. Each frame comes with the first `peek`
    /// bytes of its payload.
    ///
    /// What a crash can tear is the tail: a short frame or impossible
    /// length ends the index, and the CRC of every frame whose payload fits
    /// in `peek` (a zero-filled tail is many empty frames) is verified; a
    /// failure truncates the log there. The last frame's CRC is not read
    /// here when its payload is longer than `peek`: a KV record is
    /// megabytes, and a node opening thousands of users would read one
    /// whole record each to check it (78 GB for 10,000 users of an 8B
    /// model). It is read before anything is appended behind it
    /// ([`RecordLog::settle_tail`]), and like any other record's when the
    /// record is read.
    pub fn open_frames(path: &Path, peek: usize) -> Result<(RecordLog, FrameIndex)> {
        if fs::metadata(path).map_or(0, |m| m.len()) <= HEADER.len() as u64 {
            // Missing, empty or header only: nothing to index (`open` creates
            // the log, or refuses a short foreign file).
            let (log, rec) = RecordLog::open(path)?;
            return Ok((
                log,
                FrameIndex { frames: Vec::new(), truncated_bytes: rec.truncated_bytes, reason: rec.reason },
            ));
        }
        let file = OpenOptions::new().read(true).append(true).open(path).map_err(error::io(path))?;
        let size = file.metadata().map_err(error::io(path))?.len();
        let mut head = [0u8; 8];
        file.read_exact_at(&mut head, 0).map_err(error::io(path))?;
        check_header(path, &head)?;
        let mut frames = Vec::new();
        let mut at = HEADER.len() as u64;
        let mut reason = None;
        let mut buf = vec![0u8; FRAME_BYTES + peek];
        while at < size {
            let want = (FRAME_BYTES + peek).min((size - at) as usize);
            file.read_exact_at(&mut buf[..want], at).map_err(error::io(path))?;
            let got = &buf[..want];
            let Some((len_bytes, crc)) = got.first_chunk::<4>().zip(got.get(4..8)) else {
                reason = Some(format!(
                    "record {} at byte {at}: torn frame header ({want} of {FRAME_BYTES} bytes)",
                    frames.len()
                ));
                break;
            };
            let len = u32::from_le_bytes(*len_bytes) as usize;
            let crc = u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]);
            let end = at + (FRAME_BYTES + len) as u64;
            if len > MAX_RECORD_BYTES || end > size {
                let why = match len > MAX_RECORD_BYTES {
                    true => format!("impossible length {len} (limit {MAX_RECORD_BYTES})"),
                    false => format!("torn payload ({} of {len} bytes)", size - at - FRAME_BYTES as u64),
                };
                reason = Some(format!("record {} at byte {at}: {why}", frames.len()));
                break;
            }
            let frame = Frame { offset: at + FRAME_BYTES as u64, len: len as u32 };
            let whole = len <= peek;
            if whole && checksum(*len_bytes, &got[FRAME_BYTES..FRAME_BYTES + len]) != crc {
                reason = Some(format!("record {} at byte {at}: CRC mismatch", frames.len()));
                break;
            }
            frames.push((frame, got[FRAME_BYTES..FRAME_BYTES + len.min(peek)].to_vec()));
            at = end;
        }
        let truncated_bytes = size - at;
        if truncated_bytes > 0 {
            file.set_len(at).and_then(|()| file.sync_all()).map_err(error::io(path))?;
        }
        let unverified_tail = frames.last().map(|(f, _)| *f).filter(|f| f.len as usize > peek);
        let log = RecordLog { path: path.to_path_buf(), len: at, broken: false, unverified_tail };
        Ok((log, FrameIndex { frames, truncated_bytes, reason }))
    }

    /// Checks the last frame's CRC if [`RecordLog::open_frames`] left it
    /// unread, and cuts it off if it fails: a torn tail (a crash in the
    /// middle of its append), behind which no record may be appended.
    /// Returns the frame cut off, for the caller to drop from its index.
    pub fn settle_tail(&mut self) -> Result<Option<Frame>> {
        let Some(tail) = self.unverified_tail else { return Ok(None) };
        let torn = match self.read(tail) {
            Ok(_) => None,
            Err(MemoryError::Corrupt { .. }) => {
                self.truncate(tail.offset - FRAME_BYTES as u64)?;
                Some(tail)
            }
            Err(e) => return Err(e),
        };
        self.unverified_tail = None;
        Ok(torn)
    }

    /// The payload of `frame`, checked against its CRC (an error names the
    /// record's offset when it does not match).
    pub fn read(&self, frame: Frame) -> Result<Vec<u8>> {
        read_frame_at(&self.path, frame)
    }

    /// The log opened for appending (O_APPEND: a write after a truncation
    /// lands at the new end).
    fn appender(&self) -> Result<File> {
        OpenOptions::new().append(true).open(&self.path).map_err(error::io(&self.path))
    }

    /// The first `n` bytes of `frame`'s payload, unchecked (the CRC covers
    /// the whole payload): for reading a record's head.
    pub fn read_head(&self, frame: Frame, n: usize) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; n.min(frame.len as usize)];
        let file = File::open(&self.path).map_err(error::io(&self.path))?;
        file.read_exact_at(&mut buf, frame.offset).map_err(error::io(&self.path))?;
        Ok(buf)
    }

    /// Appends records and makes them durable (write_all + sync_data) before returning.
    ///
    /// All records go out in one write, so a crash keeps a prefix of them. On
    /// an error the file is truncated back to its previous length; if even
    /// that fails, the partial frame stays on disk, the next [`open`] drops it
    /// as a torn tail, and this log refuses further appends until then.
    /// Records over [`MAX_RECORD_BYTES`] are refused before anything is written.
    ///
    /// [`open`]: RecordLog::open
    pub fn append(&mut self, records: &[&[u8]]) -> Result<()> {
        self.append_frames(records).map(drop)
    }

    /// [`RecordLog::append`], returning where each record landed.
    pub fn append_frames(&mut self, records: &[&[u8]]) -> Result<Vec<Frame>> {
        if self.broken {
            let why = "an earlier append failed and could not be rolled back; reopen the log";
            return Err(error::io(&self.path)(std::io::Error::other(why)));
        }
        let buf = encode(records, Vec::new())?;
        if buf.is_empty() {
            return Ok(Vec::new());
        }
        // Never behind a torn frame, where replay would not reach them.
        self.settle_tail()?;
        let file = self.appender()?;
        let written = match crate::faults::charge(buf.len()) {
            Ok(()) => (&file).write_all(&buf).and_then(|()| file.sync_data()),
            Err(part) => (&file).write_all(&buf[..part]).and_then(|()| Err(crate::faults::full())),
        };
        if let Err(e) = written {
            // Without this, later appends would land behind a torn frame, where
            // replay never reaches them: acknowledged records would be lost.
            self.broken = file.set_len(self.len).and_then(|()| file.sync_all()).is_err();
            return Err(error::io(&self.path)(e));
        }
        let frames = frames_from(self.len, records.iter().map(|r| r.len()));
        self.len += buf.len() as u64;
        Ok(frames)
    }

    /// Atomically replaces the whole log with `records` (write a temp file beside it, sync, rename over,
    /// sync the directory): used to physically remove forgotten data.
    ///
    /// A crash leaves either the old log or the new one, never a mix; a stale
    /// temp file (`<path>.tmp`) holds only the new contents and the next
    /// rewrite replaces it.
    pub fn rewrite(&mut self, records: &[Vec<u8>]) -> Result<()> {
        self.rewrite_keeping(records, &[]).map(drop)
    }

    /// [`RecordLog::rewrite`] to `head` followed by this log's records at
    /// `keep`, copied from the current file one at a time: a user's KV log
    /// runs to gigabytes, and a rewrite that gathered it in memory first
    /// held it twice over. A kept record that cannot be read back intact is
    /// left out. Returns where `head`'s records landed and, per `keep`,
    /// where it did (`None`: left out). On an error the log is as it was.
    pub fn rewrite_keeping(&mut self, head: &[Vec<u8>], keep: &[Frame]) -> Result<(Vec<Frame>, Vec<Option<Frame>>)> {
        // The current file, to copy `keep` from (not opened for none).
        let src = match keep.is_empty() {
            true => None,
            false => Some(File::open(&self.path).map_err(error::io(&self.path))?),
        };
        let mut at = HEADER.len() as u64;
        let (mut heads, mut kept) = (Vec::with_capacity(head.len()), Vec::with_capacity(keep.len()));
        let mut put = |out: &mut Charged, record: &[u8]| -> Result<Frame> {
            out.put(&frame_header(record)?)?;
            out.put(record)?;
            let frame = Frame { offset: at + FRAME_BYTES as u64, len: record.len() as u32 };
            at = frame.offset + record.len() as u64;
            Ok(frame)
        };
        replace_with(&self.path, |out| {
            out.put(HEADER)?;
            for record in head {
                heads.push(put(out, record)?);
            }
            if let Some(src) = &src {
                for &frame in keep {
                    kept.push(match read_frame(src, &self.path, frame) {
                        Ok(record) => Some(put(out, &record)?),
                        Err(_) => None,
                    });
                }
            }
            Ok(())
        })?;
        self.len = at;
        self.broken = false;
        self.unverified_tail = None;
        sync_dir(parent_dir(&self.path))?;
        Ok((heads, kept))
    }

    /// Erases the records at `frames` where they lie, durably: each keeps
    /// its frame and length, its payload becomes zeros (freed from the
    /// file where the filesystem can punch holes) and its checksum theirs.
    /// Takes no new space (`erase.rs` says how, and what a crash leaves).
    pub fn erase(&mut self, frames: &[Frame]) -> Result<Erased> {
        crate::erase::erase(&self.path, self.len, frames)
    }

    /// Cuts the log back to `len` bytes (a frame boundary the caller knows,
    /// at most the current length), durably. Needs no free space.
    pub fn truncate(&mut self, len: u64) -> Result<()> {
        if len > self.len || len < HEADER.len() as u64 {
            let why = format!("cannot cut a log of {} bytes back to {len}", self.len);
            return Err(error::io(&self.path)(std::io::Error::other(why)));
        }
        let file = self.appender()?;
        file.set_len(len).and_then(|()| file.sync_all()).map_err(error::io(&self.path))?;
        self.len = len;
        self.broken = false;
        self.unverified_tail = self.unverified_tail.filter(|f| f.offset + u64::from(f.len) <= len);
        Ok(())
    }

    /// The records from byte `offset` (a frame boundary) to the end, if
    /// every frame there is intact; `None` if `offset` is not where frames
    /// run cleanly to the end.
    pub fn records_from(&self, offset: u64) -> Result<Option<Vec<Vec<u8>>>> {
        if offset > self.len || offset < HEADER.len() as u64 {
            return Ok(None);
        }
        let mut bytes = vec![0u8; (self.len - offset) as usize];
        let file = File::open(&self.path).map_err(error::io(&self.path))?;
        file.read_exact_at(&mut bytes, offset).map_err(error::io(&self.path))?;
        let mut out = Vec::new();
        let mut at = 0;
        while at < bytes.len() {
            match frame_payload(&bytes[at..]) {
                Ok(p) => {
                    out.push(p.to_vec());
                    at += FRAME_BYTES + p.len();
                }
                Err(_) => return Ok(None),
            }
        }
        Ok(Some(out))
    }

    /// Writes a new log holding `records` at `path` (aside, synced, renamed
    /// over whatever was there); the caller syncs the directory.
    pub fn write_new(path: &Path, records: &[&[u8]]) -> Result<()> {
        let bytes = encode(records, HEADER.to_vec())?;
        replace(path, &bytes).map(drop)
    }

    /// Bytes of intact records on disk.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes in the file.
    pub fn len_bytes(&self) -> u64 {
        self.len
    }
}

/// The payload of `frame` in the log at `path`, read through a handle of
/// its own (for reads off the thread that owns the log), checked against
/// its CRC. A log rewritten since `frame` was taken fails the check or
/// holds another record: the caller checks what it read.
pub fn read_frame_at(path: &Path, frame: Frame) -> Result<Vec<u8>> {
    let file = File::open(path).map_err(error::io(path))?;
    read_frame(&file, path, frame)
}

fn read_frame(file: &File, path: &Path, frame: Frame) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; FRAME_BYTES + frame.len as usize];
    let at = frame.offset.saturating_sub(FRAME_BYTES as u64);
    let corrupt = |reason: String| MemoryError::Corrupt { path: path.to_path_buf(), offset: at, reason };
    file.read_exact_at(&mut buf, at).map_err(error::io(path))?;
    match frame_payload(&buf) {
        Ok(payload) if payload.len() == frame.len as usize => Ok(payload.to_vec()),
        Ok(_) => Err(corrupt("the frame's length changed".into())),
        Err(why) => Err(corrupt(why)),
    }
}

/// The first record of the log at `path`, read without opening the log
/// for writing (no recovery, no truncation): `None` when the file is
/// missing or holds no intact first record.
pub fn read_first(path: &Path) -> Result<Option<Vec<u8>>> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(error::io(path)(e)),
    };
    let mut head = [0u8; HEADER.len() + FRAME_BYTES];
    if file.read_exact_at(&mut head, 0).is_err() || &head[..HEADER.len()] != HEADER {
        return Ok(None);
    }
    let len = u32::from_le_bytes([head[8], head[9], head[10], head[11]]) as usize;
    if len > MAX_RECORD_BYTES {
        return Ok(None);
    }
    let frame = Frame { offset: (HEADER.len() + FRAME_BYTES) as u64, len: len as u32 };
    Ok(read_frame(&file, path, frame).ok())
}

/// Every intact record of the log at `path` (those before the first bad
/// frame), read without opening the log for writing: no recovery, no
/// truncation. For tools that study a log; serving opens it.
pub fn read_all(path: &Path) -> Result<Vec<Vec<u8>>> {
    let bytes = fs::read(path).map_err(error::io(path))?;
    check_header(path, &bytes)?;
    Ok(replay(&bytes).0)
}

/// Every record of the log at `path`, which must be intact to its end: a
/// file written whole and renamed into place has no torn tail, so any bad
/// frame is damage ([`MemoryError::Damaged`]).
pub fn read_checked(path: &Path) -> Result<Vec<Vec<u8>>> {
    let bytes = fs::read(path).map_err(error::io(path))?;
    check_header(path, &bytes).map_err(|e| MemoryError::Damaged {
        path: path.to_path_buf(),
        offset: 0,
        reason: e.to_string(),
    })?;
    match replay(&bytes) {
        (records, _, None) => Ok(records),
        (_, at, Some(why)) => Err(MemoryError::Damaged { path: path.to_path_buf(), offset: at as u64, reason: why }),
    }
}

/// Where records of payload lengths `lens`, framed back to back from byte
/// `at`, land.
fn frames_from(mut at: u64, lens: impl Iterator<Item = usize>) -> Vec<Frame> {
    lens.map(|len| {
        let f = Frame { offset: at + FRAME_BYTES as u64, len: len as u32 };
        at += (FRAME_BYTES + len) as u64;
        f
    })
    .collect()
}

/// fsyncs a directory so that a create/rename/remove in it is durable.
pub fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(error::io(dir))
}

/// Writes `bytes` to `<path>.tmp`, syncs it and renames it over `path`, so a
/// reader (or a crash) sees the old file or the new one, whole. Returns an
/// append handle on the renamed file; the caller syncs the directory.
pub(crate) fn replace(path: &Path, bytes: &[u8]) -> Result<File> {
    replace_with(path, |out| out.put(bytes))
}

/// [`replace`] with the new contents written by `body`, piece by piece.
fn replace_with(path: &Path, body: impl FnOnce(&mut Charged) -> Result<()>) -> Result<File> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    // A stale temp from a crashed rewrite: create_new below must not reuse it.
    match fs::remove_file(&tmp) {
        Err(e) if e.kind() != ErrorKind::NotFound => return Err(error::io(&tmp)(e)),
        _ => {}
    }
    let replaced = OpenOptions::new()
        .read(true)
        .append(true)
        .create_new(true)
        .open(&tmp)
        .map_err(error::io(&tmp))
        .and_then(|file| {
            let mut out = Charged { out: BufWriter::with_capacity(1 << 20, file), path: &tmp };
            body(&mut out)?;
            let file = out.out.into_inner().map_err(|e| error::io(&tmp)(e.into_error()))?;
            file.sync_all().map_err(error::io(&tmp))?;
            Ok(file)
        })
        .and_then(|file| fs::rename(&tmp, path).map(|()| file).map_err(error::io(path)));
    if replaced.is_err() {
        let _ = fs::remove_file(&tmp); // best effort: the old log is intact either way
    }
    replaced
}

/// A new file's writes, each charged to the fault suite's byte budget
/// (`faults.rs`) as it goes.
struct Charged<'a> {
    out: BufWriter<File>,
    path: &'a Path,
}

impl Charged<'_> {
    fn put(&mut self, bytes: &[u8]) -> Result<()> {
        match crate::faults::charge(bytes.len()) {
            Ok(()) => self.out.write_all(bytes),
            Err(part) => self.out.write_all(&bytes[..part]).and_then(|()| Err(crate::faults::full())),
        }
        .map_err(error::io(self.path))
    }
}

/// `path.parent()`, except that a bare file name lives in `.`.
fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    }
}

fn check_header(path: &Path, bytes: &[u8]) -> Result<()> {
    let corrupt = |reason: String| MemoryError::Corrupt { path: path.to_path_buf(), offset: 0, reason };
    match bytes.first_chunk::<8>() {
        Some(head) if head == HEADER => Ok(()),
        Some(head) if head[..7] == HEADER[..7] => Err(corrupt(format!("unsupported record log version {}", head[7]))),
        _ => {
            let head = &bytes[..bytes.len().min(HEADER.len())];
            Err(corrupt(format!("not an InferScale record log (header {})", head.escape_ascii())))
        }
    }
}

/// Appends the frames of `records` to `buf`.
fn encode(records: &[&[u8]], mut buf: Vec<u8>) -> Result<Vec<u8>> {
    buf.reserve(records.iter().map(|r| FRAME_BYTES + r.len()).sum());
    for record in records {
        buf.extend_from_slice(&frame_header(record)?);
        buf.extend_from_slice(record);
    }
    Ok(buf)
}

/// The frame header that goes before `record`: its length and checksum.
fn frame_header(record: &[u8]) -> Result<[u8; FRAME_BYTES]> {
    if record.len() > MAX_RECORD_BYTES {
        let reason = format!("{} bytes, the limit is {MAX_RECORD_BYTES}", record.len());
        return Err(MemoryError::Invalid { what: "log record", reason });
    }
    let len = (record.len() as u32).to_le_bytes();
    let mut header = [0u8; FRAME_BYTES];
    header[..4].copy_from_slice(&len);
    header[4..].copy_from_slice(&checksum(len, record).to_le_bytes());
    Ok(header)
}

/// Decodes frames after the header: the intact records, the byte length of
/// the intact prefix, and why the rest (if any) is not intact.
fn replay(bytes: &[u8]) -> (Vec<Vec<u8>>, usize, Option<String>) {
    let mut records = Vec::new();
    let mut at = HEADER.len();
    while at < bytes.len() {
        match frame_payload(&bytes[at..]) {
            Ok(payload) => {
                records.push(payload.to_vec());
                at += FRAME_BYTES + payload.len();
            }
            Err(why) => {
                let reason = format!("record {} at byte {at}: {why}", records.len());
                return (records, at, Some(reason));
            }
        }
    }
    (records, at, None)
}

/// The payload of the frame at the start of `rest`, or why it is not intact.
fn frame_payload(rest: &[u8]) -> std::result::Result<&[u8], String> {
    let Some(([l0, l1, l2, l3, c0, c1, c2, c3], body)) = rest.split_first_chunk::<FRAME_BYTES>() else {
        return Err(format!("torn frame header ({} of {FRAME_BYTES} bytes)", rest.len()));
    };
    let len_bytes = [*l0, *l1, *l2, *l3];
    let len = u32::from_le_bytes(len_bytes) as usize;
    if len > MAX_RECORD_BYTES {
        return Err(format!("impossible length {len} (limit {MAX_RECORD_BYTES})"));
    }
    let Some(payload) = body.get(..len) else {
        return Err(format!("torn payload ({} of {len} bytes)", body.len()));
    };
    if checksum(len_bytes, payload) != u32::from_le_bytes([*c0, *c1, *c2, *c3]) {
        return Err("CRC mismatch".to_string());
    }
    Ok(payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_log() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard").join("facts.log");
        (dir, path)
    }

    fn three() -> Vec<Vec<u8>> {
        vec![b"alpha".to_vec(), Vec::new(), (0..300u32).map(|i| i as u8).collect()]
    }

    fn write_three(path: &Path) -> Vec<u8> {
        let (mut log, _) = RecordLog::open(path).unwrap();
        let recs = three();
        log.append(&recs.iter().map(Vec::as_slice).collect::<Vec<_>>()).unwrap();
        fs::read(path).unwrap()
    }

    #[test]
    fn the_first_record_reads_without_opening_the_log() {
        let (_dir, path) = temp_log();
        assert_eq!(read_first(&path).unwrap(), None, "no file");
        let (mut log, _) = RecordLog::open(&path).unwrap();
        assert_eq!(read_first(&path).unwrap(), None, "no record");
        log.append(&[b"header", b"two"]).unwrap();
        drop(log);
        assert_eq!(read_first(&path).unwrap(), Some(b"header".to_vec()));
        // A torn first frame reads as none, and the file is left as it was.
        let bytes = fs::read(&path).unwrap();
        fs::write(&path, &bytes[..8 + 8 + 3]).unwrap();
        assert_eq!(read_first(&path).unwrap(), None);
        assert_eq!(fs::metadata(&path).unwrap().len(), 19);
    }

    #[test]
    fn round_trip_and_reopen_after_append() {
        let (_dir, path) = temp_log();
        let (mut log, rec) = RecordLog::open(&path).unwrap();
        assert!(rec.records.is_empty() && rec.truncated_bytes == 0 && rec.reason.is_none());
        assert_eq!(log.len_bytes(), 8);
        log.append(&[b"one", b"two"]).unwrap();
        log.append(&[b"three"]).unwrap();
        assert_eq!(log.len_bytes(), fs::metadata(&path).unwrap().len());
        assert_eq!(log.path(), path);
        drop(log);

        let (mut log, rec) = RecordLog::open(&path).unwrap();
        assert_eq!(rec.records, [b"one".to_vec(), b"two".to_vec(), b"three".to_vec()]);
        assert_eq!(rec.truncated_bytes, 0);
        log.append(&[b"four"]).unwrap();
        drop(log);
        let (_, rec) = RecordLog::open(&path).unwrap();
        assert_eq!(rec.records.len(), 4);
        assert_eq!(rec.records[3], b"four");
    }

    #[test]
    fn every_truncation_point_recovers_the_intact_prefix() {
        let (dir, path) = temp_log();
        let full = write_three(&path);
        let mut ends = vec![8];
        for r in three() {
            ends.push(ends[ends.len() - 1] + FRAME_BYTES + r.len());
        }
        assert_eq!(full.len(), ends[3]);
        let cut_path = dir.path().join("cut.log");
        for cut in 0..=full.len() {
            fs::write(&cut_path, &full[..cut]).unwrap();
            let opened = RecordLog::open(&cut_path);
            if (1..8).contains(&cut) {
                assert!(matches!(opened, Err(MemoryError::Corrupt { offset: 0, .. })), "cut {cut}");
                assert_eq!(fs::read(&cut_path).unwrap(), &full[..cut], "cut {cut} must not be touched");
                continue;
            }
            let (log, rec) = opened.unwrap();
            let intact = ends.iter().rposition(|&e| e <= cut.max(8)).unwrap();
            assert_eq!(rec.records, three()[..intact], "cut {cut}");
            assert_eq!(rec.truncated_bytes, (cut.max(8) - ends[intact]) as u64, "cut {cut}");
            assert_eq!(rec.reason.is_some(), rec.truncated_bytes > 0, "cut {cut}");
            assert_eq!(log.len_bytes(), ends[intact] as u64);
            assert_eq!(fs::read(&cut_path).unwrap(), &full[..ends[intact]], "cut {cut}");
            drop(log);
            let (_, again) = RecordLog::open(&cut_path).unwrap();
            assert_eq!((again.records.len(), again.truncated_bytes), (intact, 0), "cut {cut}");
        }
    }

    /// A flipped bit anywhere in written records — the middle or the last
    /// record — is damage, not a torn tail: the log is refused and left as
    /// it was (truncating would drop acknowledged records after it).
    #[test]
    fn a_flipped_byte_is_damage_and_the_log_is_left_untouched() {
        let (_dir, path) = temp_log();
        let full = write_three(&path);
        for i in [8 + FRAME_BYTES + 2, 8 + FRAME_BYTES + 5 + 3, full.len() - 10, full.len() - 300 - 6] {
            let mut bytes = full.clone();
            bytes[i] ^= 0x40;
            fs::write(&path, &bytes).unwrap();
            let err = RecordLog::open(&path).unwrap_err();
            assert!(matches!(err, MemoryError::Damaged { .. }), "byte {i}: {err}");
            assert_eq!(fs::read(&path).unwrap(), bytes, "byte {i}: nothing cut");
        }
    }

    #[test]
    fn zero_filled_tails_are_dropped_and_garbage_after_the_last_record_is_not() {
        let (_dir, path) = temp_log();
        let mut bytes = write_three(&path);
        bytes.extend_from_slice(&[0; 16]);
        fs::write(&path, &bytes).unwrap();
        let (_, rec) = RecordLog::open(&path).unwrap();
        assert_eq!(rec.records, three());
        assert_eq!(rec.truncated_bytes, 16);
        assert!(rec.reason.unwrap().contains("zero-filled"));
        // A header no append writes (an impossible length): not a crash's doing.
        let mut bytes = write_three(&path);
        bytes.extend_from_slice(&[0xff; 12]);
        fs::write(&path, &bytes).unwrap();
        let err = RecordLog::open(&path).unwrap_err();
        assert!(matches!(err, MemoryError::Damaged { .. }), "{err}");
        assert_eq!(fs::read(&path).unwrap(), bytes);
    }

    #[test]
    fn wrong_header_is_an_error_and_left_untouched() {
        let (_dir, path) = temp_log();
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        for bytes in [&b"NOTALOG!plus some data"[..], b"ISLOG\0\0\x02\0\0\0\0\0\0\0\0"] {
            fs::write(&path, bytes).unwrap();
            let err = RecordLog::open(&path).unwrap_err();
            assert!(matches!(err, MemoryError::Corrupt { offset: 0, .. }), "{err}");
            assert_eq!(fs::read(&path).unwrap(), bytes);
        }
    }

    #[test]
    fn rewrite_replaces_contents_and_survives_reopen() {
        let (_dir, path) = temp_log();
        write_three(&path);
        let (mut log, _) = RecordLog::open(&path).unwrap();
        log.rewrite(&[b"kept".to_vec()]).unwrap();
        assert_eq!(log.len_bytes(), (8 + FRAME_BYTES + 4) as u64);
        log.append(&[b"after"]).unwrap(); // must reach the new file, not the replaced one
        assert_eq!(log.len_bytes(), fs::metadata(&path).unwrap().len());
        drop(log);
        let (_, rec) = RecordLog::open(&path).unwrap();
        assert_eq!(rec.records, [b"kept".to_vec(), b"after".to_vec()]);
        let names: Vec<_> = fs::read_dir(path.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["facts.log"]);
    }

    #[test]
    fn rewrite_keeping_copies_the_kept_records_and_leaves_out_a_damaged_one() {
        let (_dir, path) = temp_log();
        let (mut log, _) = RecordLog::open(&path).unwrap();
        let frames = log.append_frames(&[b"head", b"one", b"two", b"three", b"four"]).unwrap();
        // "three" is damaged on disk: a flipped byte in its payload.
        let mut bytes = fs::read(&path).unwrap();
        bytes[frames[3].offset as usize] ^= 0x40;
        fs::write(&path, &bytes).unwrap();
        let keep = [frames[1], frames[3], frames[4]];
        let (heads, kept) = log.rewrite_keeping(&[b"new head".to_vec()], &keep).unwrap();
        assert_eq!(kept.iter().map(Option::is_some).collect::<Vec<_>>(), [true, false, true]);
        assert_eq!(log.read(heads[0]).unwrap(), b"new head");
        assert_eq!(log.read(kept[0].unwrap()).unwrap(), b"one");
        assert_eq!(log.read(kept[2].unwrap()).unwrap(), b"four");
        assert_eq!(log.len_bytes(), fs::metadata(&path).unwrap().len());
        log.append(&[b"after"]).unwrap();
        drop(log);
        let (_, rec) = RecordLog::open(&path).unwrap();
        assert_eq!(rec.records, [b"new head".to_vec(), b"one".to_vec(), b"four".to_vec(), b"after".to_vec()]);
        let names: Vec<_> = fs::read_dir(path.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["facts.log"], "no temp file left");
    }

    #[test]
    fn zero_length_records_work() {
        let (_dir, path) = temp_log();
        let (mut log, _) = RecordLog::open(&path).unwrap();
        log.append(&[b"", b"x", b""]).unwrap();
        log.append(&[]).unwrap();
        drop(log);
        let (_, rec) = RecordLog::open(&path).unwrap();
        assert_eq!(rec.records, [Vec::new(), b"x".to_vec(), Vec::new()]);
    }

    #[test]
    fn oversized_record_is_refused_before_writing() {
        let (_dir, path) = temp_log();
        let (mut log, _) = RecordLog::open(&path).unwrap();
        let big = vec![0u8; MAX_RECORD_BYTES + 1];
        let err = log.append(&[b"ok", &big]).unwrap_err();
        assert!(matches!(err, MemoryError::Invalid { .. }), "{err}");
        assert_eq!(log.len_bytes(), 8);
        assert_eq!(fs::metadata(&path).unwrap().len(), 8);
    }

    #[test]
    fn empty_file_becomes_a_new_log() {
        let (_dir, path) = temp_log();
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(&path, b"").unwrap();
        let (mut log, rec) = RecordLog::open(&path).unwrap();
        assert!(rec.records.is_empty());
        log.append(&[b"a"]).unwrap();
        drop(log);
        assert_eq!(RecordLog::open(&path).unwrap().1.records, [b"a".to_vec()]);
    }
}
