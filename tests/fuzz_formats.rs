//! Fuzzing of the format readers: the safetensors header parser (arbitrary bytes and
//! mutated valid files) and the container manifest reader and verifier (mutations of a
//! valid fixture container's manifest.json, truncated data files). Every case must end in a
//! clean `Err` (never a panic, never a hang: the inputs are small, so a hang shows as a
//! timeout), and valid input must still open afterwards.

mod common;

use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use common::convert_fixture;
use picchio::format::container::verify::verify;
use picchio::format::container::{Container, DenseFormat, ExpertFormat, Formats};
use picchio::format::safetensors::Checkpoint;
use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::Value;

const DEFAULT: Formats = Formats { experts: ExpertFormat::Int4, dense: DenseFormat::Auto };

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() }
}

/// Runs `f` on another thread and fails if it takes longer than `secs` (a hang).
fn within<T: Send + 'static>(secs: u64, what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(secs)).unwrap_or_else(|_| panic!("{what}: no answer within {secs} s"))
}

// ---------------------------------------------------------------- safetensors headers

/// One tensor of a hand-made safetensors file.
#[derive(Clone, Debug)]
struct Entry {
    name: String,
    dtype: &'static str,
    shape: Vec<usize>,
    offsets: (u64, u64),
}

fn valid_entries() -> Vec<Entry> {
    let e =
        |name: &str, dtype, shape: Vec<usize>, offsets| Entry { name: name.into(), dtype, shape, offsets };
    vec![
        e("a", "F32", vec![2, 3], (0, 24)),
        e("b", "BF16", vec![4], (24, 32)),
        e("c", "U8", vec![5], (32, 37)),
    ]
}

/// The header JSON of `entries`; `dup` writes entry `dup` twice.
fn header_json(entries: &[Entry], dup: Option<usize>) -> String {
    let one = |e: &Entry| {
        format!(
            "\"{}\":{{\"dtype\":\"{}\",\"shape\":{:?},\"data_offsets\":[{},{}]}}",
            e.name, e.dtype, e.shape, e.offsets.0, e.offsets.1
        )
    };
    let mut items: Vec<String> = entries.iter().map(one).collect();
    if let Some(i) = dup {
        items.push(one(&entries[i]));
    }
    format!("{{{}}}", items.join(","))
}

/// A safetensors file: 8-byte length, header, `data_len` data bytes.
fn file_bytes(header: &[u8], data_len: usize) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header);
    out.extend((0..data_len).map(|i| (i * 7) as u8));
    out
}

/// Opens `bytes` as a single-file checkpoint; checks any success is self-consistent.
fn open_checkpoint(dir: &Path, bytes: &[u8]) -> Result<(), String> {
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
    match Checkpoint::open(dir) {
        Err(e) => {
            let e = e.to_string();
            assert!(e.contains("model.safetensors"), "error does not name the file: {e}");
            Err(e)
        }
        Ok(ck) => {
            for shard in ck.shards() {
                assert_eq!(shard.map.len(), bytes.len());
            }
            Ok(())
        }
    }
}

#[test]
fn a_valid_safetensors_file_opens() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = file_bytes(header_json(&valid_entries(), None).as_bytes(), 37);
    open_checkpoint(dir.path(), &bytes).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.require_shape("a", &[2, 3]).unwrap().len, 24);
    assert_eq!(ck.bytes(ck.require("c").unwrap()).len(), 5);
}

#[test]
fn a_name_given_twice_in_a_header_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for i in 0..3 {
        let bytes = file_bytes(header_json(&valid_entries(), Some(i)).as_bytes(), 37);
        let e = open_checkpoint(dir.path(), &bytes).unwrap_err();
        assert!(e.contains(&format!("names {} twice", valid_entries()[i].name)), "{e}");
    }
}

#[test]
fn deeply_nested_headers_are_refused_without_overflowing_the_stack() {
    let dir = tempfile::tempdir().unwrap();
    for depth in [200, 5_000, 100_000] {
        let header = format!("{{\"__metadata__\":{}{}}}", "[".repeat(depth), "]".repeat(depth));
        let e = open_checkpoint(dir.path(), &file_bytes(header.as_bytes(), 0)).unwrap_err();
        assert!(e.contains("header"), "{e}");
    }
}

/// A structural mutation of a valid file that must make it invalid.
#[derive(Clone, Debug)]
enum HeaderBreak {
    /// The length field says more than the file holds.
    HugeLength(u64),
    /// One tensor's end offset moved (gap, overlap or past the end).
    MoveEnd(usize, i64),
    /// One tensor's start offset moved.
    MoveStart(usize, i64),
    /// A dtype whose element size does not fit the byte range (or no dtype at all).
    WrongDtype(usize, Index),
    /// A byte that is not UTF-8 inside the header.
    NotUtf8(usize, u8),
    /// The file cut short inside the data.
    Truncate(usize),
}

fn header_break() -> impl Strategy<Value = HeaderBreak> {
    prop_oneof![
        (1000u64..=u64::MAX).prop_map(HeaderBreak::HugeLength),
        (0usize..3, prop_oneof![-30i64..=-1, 1i64..=1_000, Just(i64::MAX)])
            .prop_map(|(i, d)| HeaderBreak::MoveEnd(i, d)),
        (0usize..3, 1i64..=40).prop_map(|(i, d)| HeaderBreak::MoveStart(i, d)),
        (0usize..3, any::<Index>()).prop_map(|(i, d)| HeaderBreak::WrongDtype(i, d)),
        (0usize..100, 0x80u8..=0xff).prop_map(|(at, b)| HeaderBreak::NotUtf8(at, b)),
        (0usize..37).prop_map(HeaderBreak::Truncate),
    ]
}

fn apply_break(b: &HeaderBreak) -> Vec<u8> {
    let mut entries = valid_entries();
    let shift = |v: u64, d: i64| (v as i128 + d as i128).clamp(0, u64::MAX as i128) as u64;
    match b {
        HeaderBreak::HugeLength(n) => {
            let mut bytes = file_bytes(header_json(&entries, None).as_bytes(), 37);
            bytes[..8].copy_from_slice(&n.to_le_bytes());
            bytes
        }
        HeaderBreak::MoveEnd(i, d) => {
            entries[*i].offsets.1 = shift(entries[*i].offsets.1, *d);
            file_bytes(header_json(&entries, None).as_bytes(), 37)
        }
        HeaderBreak::MoveStart(i, d) => {
            entries[*i].offsets.0 = shift(entries[*i].offsets.0, *d);
            file_bytes(header_json(&entries, None).as_bytes(), 37)
        }
        HeaderBreak::WrongDtype(i, d) => {
            let size = |d: &str| match d {
                "F64" | "I64" => 8,
                "F32" | "U32" => 4,
                "BF16" | "F16" | "I16" => 2,
                "U8" | "BOOL" => 1,
                _ => 0,
            };
            let old = size(entries[*i].dtype);
            let other: Vec<&'static str> =
                ["F64", "I64", "F32", "U32", "BF16", "F16", "I16", "U8", "BOOL", "XX"]
                    .into_iter()
                    .filter(|&d| size(d) != old)
                    .collect();
            entries[*i].dtype = other[d.index(other.len())];
            file_bytes(header_json(&entries, None).as_bytes(), 37)
        }
        HeaderBreak::NotUtf8(at, byte) => {
            let mut header = header_json(&entries, None).into_bytes();
            // Inside a string (the first tensor name is at byte 2).
            let at = 2 + at % (header.len() - 4);
            header.insert(at, *byte);
            file_bytes(&header, 37)
        }
        HeaderBreak::Truncate(n) => {
            let mut bytes = file_bytes(header_json(&entries, None).as_bytes(), 37);
            bytes.truncate(bytes.len() - 37 + n);
            bytes
        }
    }
}

/// A byte-level mutation of a valid file (which may or may not stay valid).
#[derive(Clone, Debug)]
enum ByteEdit {
    Flip(Index, u8),
    Cut(Index),
    Insert(Index, Vec<u8>),
}

fn byte_edit() -> impl Strategy<Value = ByteEdit> {
    prop_oneof![
        (any::<Index>(), 1u8..=255).prop_map(|(i, x)| ByteEdit::Flip(i, x)),
        any::<Index>().prop_map(ByteEdit::Cut),
        (any::<Index>(), prop::collection::vec(any::<u8>(), 1..16)).prop_map(|(i, v)| ByteEdit::Insert(i, v)),
    ]
}

thread_local! {
    /// One directory per test thread for the checkpoint cases (a fresh one per case costs
    /// more than the parse).
    static CASE_DIR: tempfile::TempDir = tempfile::tempdir().unwrap();
}

proptest! {
    #![proptest_config(config(1000))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        CASE_DIR.with(|dir| { let _ = open_checkpoint(dir.path(), &bytes); });
    }

    #[test]
    fn broken_headers_are_refused(b in header_break()) {
        let bytes = apply_break(&b);
        let refused = CASE_DIR.with(|dir| open_checkpoint(dir.path(), &bytes).is_err());
        prop_assert!(refused, "{:?} was accepted", b);
    }

    #[test]
    fn mutated_files_never_panic(edits in prop::collection::vec(byte_edit(), 1..4)) {
        let mut bytes = file_bytes(header_json(&valid_entries(), None).as_bytes(), 37);
        for e in &edits {
            match e {
                ByteEdit::Flip(i, x) => { let i = i.index(bytes.len()); bytes[i] ^= x; }
                ByteEdit::Cut(i) => { let n = i.index(bytes.len()); bytes.truncate(n); }
                ByteEdit::Insert(i, v) => {
                    let at = i.index(bytes.len() + 1);
                    bytes.splice(at..at, v.iter().copied());
                }
            }
            if bytes.is_empty() { break; }
        }
        CASE_DIR.with(|dir| { let _ = open_checkpoint(dir.path(), &bytes); });
    }
}

// ---------------------------------------------------------------- container manifests

/// A step into a JSON value.
#[derive(Clone, Debug, PartialEq)]
enum Step {
    Key(String),
    At(usize),
}

fn get_mut<'a>(v: &'a mut Value, path: &[Step]) -> &'a mut Value {
    path.iter().fold(v, |v, s| match s {
        Step::Key(k) => &mut v[k.as_str()],
        Step::At(i) => &mut v[*i],
    })
}

/// Paths into a JSON value: (leaves, object members, arrays of two or more).
type Paths = (Vec<Vec<Step>>, Vec<Vec<Step>>, Vec<Vec<Step>>);

/// Every path in `v`.
fn paths(v: &Value) -> Paths {
    fn walk(v: &Value, at: &mut Vec<Step>, out: &mut Paths) {
        match v {
            Value::Object(m) => {
                for (k, x) in m {
                    at.push(Step::Key(k.clone()));
                    out.1.push(at.clone());
                    walk(x, at, out);
                    at.pop();
                }
            }
            Value::Array(a) => {
                if a.len() >= 2 {
                    out.2.push(at.clone());
                }
                for (i, x) in a.iter().enumerate() {
                    at.push(Step::At(i));
                    walk(x, at, out);
                    at.pop();
                }
            }
            _ => out.0.push(at.clone()),
        }
    }
    let mut out = (Vec::new(), Vec::new(), Vec::new());
    walk(v, &mut Vec::new(), &mut out);
    out
}

/// Leaves whose value the loader does not depend on (provenance only).
fn is_provenance(path: &[Step]) -> bool {
    matches!(path.first(), Some(Step::Key(k)) if k == "created_by" || k == "source")
}

fn is_hash(path: &[Step]) -> bool {
    matches!(path.last(), Some(Step::Key(k)) if k == "hash")
}

/// JSON text of `v` with the member `path` written twice.
fn with_duplicate_member(v: &Value, path: &[Step]) -> String {
    fn write(v: &Value, at: &mut Vec<Step>, target: &[Step], out: &mut String) {
        match v {
            Value::Object(m) => {
                out.push('{');
                let mut first = true;
                for (k, x) in m {
                    at.push(Step::Key(k.clone()));
                    let times = if at.as_slice() == target { 2 } else { 1 };
                    for _ in 0..times {
                        if !first {
                            out.push(',');
                        }
                        first = false;
                        out.push_str(&serde_json::to_string(k).unwrap());
                        out.push(':');
                        write(x, at, target, out);
                    }
                    at.pop();
                }
                out.push('}');
            }
            Value::Array(a) => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    at.push(Step::At(i));
                    write(x, at, target, out);
                    at.pop();
                }
                out.push(']');
            }
            other => out.push_str(&other.to_string()),
        }
    }
    let mut out = String::new();
    write(v, &mut Vec::new(), path, &mut out);
    out
}

/// Numbers that no field may take without the change being noticed (relative to `old`).
fn bad_numbers(old: &Value) -> Vec<String> {
    let mut v = vec![
        u64::MAX.to_string(),
        "-1".into(),
        "18446744073709551616".into(),
        "1e30".into(),
        "1.5".into(),
        (1u64 << 63).to_string(),
    ];
    if let Some(n) = old.as_u64() {
        v.push((n + 1).to_string());
        v.push(n.saturating_mul(2).saturating_add(4096).to_string());
        if n > 0 {
            v.push((n - 1).to_string());
            v.push("0".into());
        }
    }
    v
}

const BAD_STRINGS: [&str; 7] =
    ["/dev/zero", "../config.json", "config.json", "", "x", "/etc/passwd", "dense.bin/.."];

/// One mutation of a manifest.
#[derive(Clone, Debug)]
enum Mutation {
    /// Replace a leaf with a bad value (the choice indexes the candidates).
    Leaf(Index, Index),
    /// Remove an object member.
    Remove(Index),
    /// Write an object member twice.
    DuplicateMember(Index),
    /// Duplicate, remove or swap array elements.
    DuplicateElement(Index, Index),
    RemoveElement(Index, Index),
    Swap(Index, Index, Index),
    /// Cut a data file short.
    Truncate(bool, Index),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<Index>(), any::<Index>()).prop_map(|(a, b)| Mutation::Leaf(a, b)),
        1 => any::<Index>().prop_map(Mutation::Remove),
        1 => any::<Index>().prop_map(Mutation::DuplicateMember),
        1 => (any::<Index>(), any::<Index>()).prop_map(|(a, b)| Mutation::DuplicateElement(a, b)),
        1 => (any::<Index>(), any::<Index>()).prop_map(|(a, b)| Mutation::RemoveElement(a, b)),
        1 => (any::<Index>(), any::<Index>(), any::<Index>()).prop_map(|(a, b, c)| Mutation::Swap(a, b, c)),
        1 => (any::<bool>(), any::<Index>()).prop_map(|(a, b)| Mutation::Truncate(a, b)),
    ]
}

/// What a mutation must lead to.
#[derive(Debug, PartialEq)]
enum Expect {
    /// Both the loader and verify refuse it.
    Refused,
    /// It changes nothing the loader relies on: both accept it, verify finds no mismatch.
    Accepted,
    /// A hash replaced by another well-formed one: the loader opens, verify reports it.
    OneMismatch,
}

/// A converted fixture container, its pristine manifest and data files.
struct Fixture {
    dir: tempfile::TempDir,
    manifest: Value,
    text: Vec<u8>,
    data: [(String, Vec<u8>); 2],
    /// `paths(&manifest)`.
    paths: Paths,
}

impl Fixture {
    fn new() -> Self {
        let dir = convert_fixture("tiny-f32", DEFAULT);
        let text = std::fs::read(dir.path().join("manifest.json")).unwrap();
        let manifest = serde_json::from_slice(&text).unwrap();
        let data =
            ["dense.bin", "experts.bin"].map(|f| (f.to_string(), std::fs::read(dir.path().join(f)).unwrap()));
        let paths = paths(&manifest);
        Fixture { dir, manifest, text, data, paths }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Applies `m` to the container on disk; returns what must follow and how to undo it.
    fn apply(&self, m: &Mutation) -> (Expect, Option<(String, u64)>) {
        let (leaves, members, arrays) = &self.paths;
        let mut v = self.manifest.clone();
        let mut expect = Expect::Refused;
        let mut text = None;
        let mut undo = None;
        match m {
            Mutation::Leaf(which, choice) => {
                let path = &leaves[which.index(leaves.len())];
                let leaf = get_mut(&mut v, path);
                let new: Value = match leaf {
                    Value::Number(_) => {
                        let c = bad_numbers(leaf);
                        // Raw text: some candidates do not fit any Rust number.
                        let raw = c[choice.index(c.len())].clone();
                        *leaf = Value::String("\u{0}RAW".into());
                        let t = serde_json::to_string(&v).unwrap().replace("\"\\u0000RAW\"", &raw);
                        text = Some(t);
                        Value::Null
                    }
                    Value::Bool(b) => Value::Bool(!*b),
                    _ => {
                        let mut c: Vec<String> = BAD_STRINGS.iter().map(|s| s.to_string()).collect();
                        c.push("0".repeat(64));
                        c.push("A".repeat(64));
                        Value::String(c[choice.index(c.len())].clone())
                    }
                };
                if text.is_none() {
                    if is_provenance(path) {
                        expect = Expect::Accepted;
                    } else if is_hash(path) && new == Value::String("0".repeat(64)) {
                        expect = Expect::OneMismatch;
                    }
                    *get_mut(&mut v, path) = new;
                }
            }
            Mutation::Remove(which) => {
                let path = &members[which.index(members.len())];
                let (last, parent) = path.split_last().unwrap();
                let Step::Key(k) = last else { unreachable!() };
                get_mut(&mut v, parent).as_object_mut().unwrap().remove(k);
            }
            Mutation::DuplicateMember(which) => {
                text = Some(with_duplicate_member(&v, &members[which.index(members.len())]));
            }
            Mutation::DuplicateElement(which, at) | Mutation::RemoveElement(which, at) => {
                let path = &arrays[which.index(arrays.len())];
                let a = get_mut(&mut v, path).as_array_mut().unwrap();
                let i = at.index(a.len());
                if matches!(m, Mutation::DuplicateElement(..)) {
                    let x = a[i].clone();
                    a.insert(i, x);
                } else {
                    a.remove(i);
                }
            }
            Mutation::Swap(which, i, j) => {
                let path = &arrays[which.index(arrays.len())];
                let a = get_mut(&mut v, path).as_array_mut().unwrap();
                let (i, j) = (i.index(a.len()), j.index(a.len()));
                if a[i] == a[j] {
                    expect = Expect::Accepted;
                } else if path == &[Step::Key("tensors".into())] {
                    // The order of the tensor list is free.
                    expect = Expect::Accepted;
                }
                a.swap(i, j);
            }
            Mutation::Truncate(dense, at) => {
                let file = if *dense { "dense.bin" } else { "experts.bin" };
                let path = self.path().join(file);
                let len = std::fs::metadata(&path).unwrap().len();
                let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
                f.set_len(at.index(len as usize) as u64).unwrap();
                undo = Some((file.to_string(), len));
            }
        }
        let text = text.unwrap_or_else(|| serde_json::to_string(&v).unwrap());
        std::fs::write(self.path().join("manifest.json"), text).unwrap();
        (expect, undo)
    }

    /// Puts the container back as converted.
    fn restore(&self, undo: Option<(String, u64)>) {
        std::fs::write(self.path().join("manifest.json"), &self.text).unwrap();
        if let Some((file, _)) = undo {
            let (_, bytes) = self.data.iter().find(|(f, _)| *f == file).unwrap();
            std::fs::write(self.path().join(&file), bytes).unwrap();
        }
    }
}

fn check_outcome(dir: &Path, expect: &Expect, what: &str) -> Result<(), TestCaseError> {
    let opened = Container::open(dir);
    let verified = verify(dir, &mut |_, _| {});
    match expect {
        Expect::Refused => {
            prop_assert!(opened.is_err(), "{}: the loader accepted it", what);
            prop_assert!(verified.is_err(), "{}: verify accepted it", what);
        }
        Expect::Accepted => {
            prop_assert!(opened.is_ok(), "{}: {:?}", what, opened.err());
            let r = verified.map_err(|e| TestCaseError::fail(format!("{what}: {e}")))?;
            prop_assert!(r.mismatches.is_empty(), "{}: {:?}", what, r.mismatches);
        }
        Expect::OneMismatch => {
            prop_assert!(opened.is_ok(), "{}: {:?}", what, opened.err());
            let r = verified.map_err(|e| TestCaseError::fail(format!("{what}: {e}")))?;
            prop_assert_eq!(r.mismatches.len(), 1, "{}", what);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(500))]

    #[test]
    fn mutated_manifests_are_refused_by_loader_and_verify(m in mutation()) {
        thread_local! { static FIXTURE: Fixture = Fixture::new(); }
        FIXTURE.with(|f| {
            let (expect, undo) = f.apply(&m);
            let result = check_outcome(f.path(), &expect, &format!("{m:?}"));
            f.restore(undo);
            result
        })?;
    }
}

#[test]
fn valid_container_still_opens_after_the_fuzzing_edits() {
    let f = Fixture::new();
    // A few refusals in a row, then the pristine manifest is accepted again.
    let mut removed = f.manifest.clone();
    removed.as_object_mut().unwrap().remove("files");
    let texts = [
        serde_json::to_string(&removed).unwrap(),
        with_duplicate_member(&f.manifest, &[Step::Key("version".into())]),
    ];
    for text in texts {
        std::fs::write(f.path().join("manifest.json"), text).unwrap();
        assert!(Container::open(f.path()).is_err());
        assert!(verify(f.path(), &mut |_, _| {}).is_err());
        f.restore(None);
    }
    Container::open(f.path()).unwrap();
    assert!(verify(f.path(), &mut |_, _| {}).unwrap().mismatches.is_empty());
}

fn edit(dir: &Path, edit: impl FnOnce(&mut Value)) {
    let path = dir.join("manifest.json");
    let mut v: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
}

#[test]
fn a_device_part_with_a_huge_size_is_refused_without_reading_it() {
    let dir = convert_fixture("tiny-f32", DEFAULT);
    edit(dir.path(), |v| {
        let part = &mut v["tensors"][0]["parts"][0];
        part["file"] = "/dev/zero".into();
        part["bytes"] = (1u64 << 50).into();
    });
    let d = dir.path().to_path_buf();
    let e = within(20, "verify", move || verify(&d, &mut |_, _| {}).map(|r| r.mismatches.len()));
    assert!(e.is_err(), "verify accepted a part of /dev/zero: {e:?}");
}

#[test]
fn byte_totals_that_wrap_are_refused_without_looping() {
    let dir = convert_fixture("tiny-f32", DEFAULT);
    edit(dir.path(), |v| {
        let mut sum = 0u64;
        for t in v["tensors"].as_array().unwrap() {
            for p in t["parts"].as_array().unwrap() {
                sum = sum.wrapping_add(p["bytes"].as_u64().unwrap());
            }
        }
        for r in v["experts"]["records"].as_array().unwrap() {
            sum = sum.wrapping_add(r["bytes"].as_u64().unwrap());
        }
        // Grow one part so that the total wraps to exactly zero.
        let part = &mut v["tensors"][2]["parts"][0]["bytes"];
        let old = part.as_u64().unwrap();
        *part = old.wrapping_sub(sum).into();
    });
    let d = dir.path().to_path_buf();
    let e = within(20, "verify", move || verify(&d, &mut |_, _| {}).map(|r| r.mismatches.len()));
    assert!(e.is_err(), "verify accepted wrapping byte counts: {e:?}");
    assert!(Container::open(dir.path()).is_err());
}

#[test]
fn a_deeply_nested_or_non_object_manifest_is_refused() {
    let dir = convert_fixture("tiny-f32", DEFAULT);
    for text in [
        format!("{}{}", "[".repeat(100_000), "]".repeat(100_000)).into_bytes(),
        b"[]".to_vec(),
        b"\"picchio-container\"".to_vec(),
        b"{\"format\": \"\xff\"}".to_vec(),
    ] {
        std::fs::write(dir.path().join("manifest.json"), &text).unwrap();
        let Err(e) = Container::open(dir.path()).map(|_| ()) else { panic!("a broken manifest opened") };
        let e = e.to_string();
        assert!(e.contains("manifest.json"), "{e}");
        assert!(verify(dir.path(), &mut |_, _| {}).is_err());
    }
}
