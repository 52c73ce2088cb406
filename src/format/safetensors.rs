//! Reading Hugging Face safetensors checkpoints, single-file or sharded through
//! `model.safetensors.index.json`, memory-mapped.
//!
//! Opening a checkpoint parses and validates every shard header up front (with the
//! `safetensors` crate), so a truncated shard, an index naming a missing file, or an index
//! entry whose tensor is not in its shard fails immediately, naming the file and tensor.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensorError, SafeTensors};

use crate::error::{Error, Result};
use crate::quant::buffer::ByteRegion;
use crate::quant::reference::bf16_to_f32;
use crate::quant::{Matrix, MatrixData, WeightBuf};

/// Where one tensor lives.
#[derive(Clone, Debug)]
pub struct TensorEntry {
    /// Element type.
    pub dtype: Dtype,
    /// Dimensions.
    pub shape: Vec<usize>,
    /// Index into the shard list.
    pub shard: usize,
    /// Absolute byte offset of the data in the shard file.
    pub offset: usize,
    /// Byte length of the data.
    pub len: usize,
}

/// One memory-mapped shard.
pub struct Shard {
    /// The shard's path.
    pub path: PathBuf,
    /// The mapping.
    pub map: Arc<Mmap>,
}

/// A checkpoint directory: every tensor of every shard, by name.
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    tensors: HashMap<String, TensorEntry>,
}

/// File name of the shard index.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// File name of an unsharded checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Largest shard index read (64 MiB; GPT-OSS-120B's is about 30 KB), so that a damaged or
/// hostile index is refused before it is read into memory.
pub const MAX_INDEX_BYTES: u64 = 64 << 20;

impl Checkpoint {
    /// Opens `dir`, through its shard index if present, else `model.safetensors`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join(INDEX_FILE);
        let single_path = dir.join(SINGLE_FILE);
        if index_path.exists() {
            Self::open_index(dir, &index_path)
        } else if single_path.exists() {
            let mut ck = Checkpoint { dir: dir.to_path_buf(), shards: Vec::new(), tensors: HashMap::new() };
            ck.add_shard(&single_path, None)?;
            Ok(ck)
        } else {
            Err(Error::format(
                dir,
                format!("no {SINGLE_FILE} or {INDEX_FILE}: not a Hugging Face checkpoint directory"),
            ))
        }
    }

    fn open_index(dir: &Path, index_path: &Path) -> Result<Self> {
        let len = std::fs::metadata(index_path).map_err(|e| Error::io(index_path, e))?.len();
        if len > MAX_INDEX_BYTES {
            return Err(Error::format(
                index_path,
                format!("is {len} bytes; a shard index has at most {MAX_INDEX_BYTES} bytes (64 MiB)"),
            ));
        }
        let text = std::fs::read_to_string(index_path).map_err(|e| Error::io(index_path, e))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::format(index_path, format!("not valid JSON: {e}")))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::format(index_path, "no weight_map object"))?;
        // Shard file -> tensor names the index assigns to it.
        let mut by_file: Vec<(String, Vec<String>)> = Vec::new();
        for (name, file) in map {
            let file = file.as_str().ok_or_else(|| {
                Error::format(index_path, format!("weight_map entry for {name} is not a file name"))
            })?;
            if file.contains('/') || file.contains('\\') || file.contains("..") {
                return Err(Error::format(
                    index_path,
                    format!("weight_map entry for {name} points outside the directory: {file}"),
                ));
            }
            match by_file.iter_mut().find(|(f, _)| f == file) {
                Some((_, names)) => names.push(name.clone()),
                None => by_file.push((file.to_string(), vec![name.clone()])),
            }
        }
        by_file.sort();
        let mut ck = Checkpoint { dir: dir.to_path_buf(), shards: Vec::new(), tensors: HashMap::new() };
        for (file, names) in &by_file {
            let path = dir.join(file);
            if !path.exists() {
                return Err(Error::format(
                    index_path,
                    format!("shard {file} (holding {}) does not exist", names[0]),
                ));
            }
            ck.add_shard(&path, Some(names))?;
        }
        Ok(ck)
    }

    fn add_shard(&mut self, path: &Path, expected: Option<&[String]>) -> Result<()> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the mapping is read-only; checkpoints are not modified while in use.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let shard = self.shards.len();
        for (name, entry) in parse_header(path, &map, shard)? {
            if self.tensors.contains_key(&name) {
                return Err(Error::format(path, format!("tensor {name} appears in more than one shard")));
            }
            self.tensors.insert(name, entry);
        }
        if let Some(names) = expected {
            for name in names {
                match self.tensors.get(name) {
                    Some(t) if t.shard == shard => {}
                    _ => {
                        return Err(Error::format(
                            path,
                            format!("the index says this shard holds {name}, but it does not"),
                        ));
                    }
                }
            }
        }
        self.shards.push(Shard { path: path.to_path_buf(), map: Arc::new(map) });
        Ok(())
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The shards, in index order.
    pub fn shards(&self) -> &[Shard] {
        &self.shards
    }

    /// The entry for `name`, if present.
    pub fn get(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.get(name)
    }

    /// Whether `name` is present.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The entry for `name`, or an error naming the missing tensor.
    pub fn require(&self, name: &str) -> Result<&TensorEntry> {
        self.tensors
            .get(name)
            .ok_or_else(|| Error::MissingTensor { name: name.to_string(), dir: self.dir.clone() })
    }

    /// The entry for `name`, checked to have exactly `shape`.
    pub fn require_shape(&self, name: &str, shape: &[usize]) -> Result<&TensorEntry> {
        let t = self.require(name)?;
        if t.shape != shape {
            return Err(Error::tensor(name, format!("shape {:?}, expected {shape:?}", t.shape)));
        }
        Ok(t)
    }

    /// The raw bytes of a tensor. `t` must be an entry of this checkpoint ([`get`](Self::get),
    /// [`require`](Self::require)): [`parse_header`] checked its range against the shard.
    pub fn bytes(&self, t: &TensorEntry) -> &[u8] {
        &self.shards[t.shard].map[t.offset..t.offset + t.len]
    }

    /// A float tensor of exactly `shape`, widened to f32 (F32, BF16 and F16 accepted).
    pub fn f32_tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let t = self.require_shape(name, shape)?;
        decode_floats(name, t.dtype, self.bytes(t))
    }

    /// Elements `[start, start + count)` of a float tensor of exactly `shape`, widened to
    /// f32 (one expert's slice of a stacked `[E, ...]` tensor).
    pub fn f32_range(&self, name: &str, shape: &[usize], start: usize, count: usize) -> Result<Vec<f32>> {
        let t = self.require_shape(name, shape)?;
        let elem = float_size(name, t.dtype)?;
        let range = start
            .checked_mul(elem)
            .zip(start.checked_add(count).and_then(|end| end.checked_mul(elem)))
            .filter(|&(a, b)| a <= b && b <= t.len);
        let Some((a, b)) = range else {
            return Err(Error::tensor(
                name,
                format!("elements {start}..+{count} lie outside its {} bytes", t.len),
            ));
        };
        decode_floats(name, t.dtype, &self.bytes(t)[a..b])
    }

    /// A `[rows, cols]` float matrix. F32 and BF16 stay in the mapped file; F16 is widened.
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let t = self.require_shape(name, &[rows, cols])?;
        let region: Arc<dyn ByteRegion> = self.shards[t.shard].map.clone();
        let data = match t.dtype {
            Dtype::F32 => MatrixData::F32(WeightBuf::shared(&region, t.offset, t.len)),
            Dtype::BF16 => MatrixData::Bf16(WeightBuf::shared(&region, t.offset, t.len)),
            Dtype::F16 => MatrixData::F32(WeightBuf::owned(self.f32_tensor(name, &[rows, cols])?)),
            other => {
                return Err(Error::tensor(name, format!("dtype {other:?}, expected F32, BF16 or F16")));
            }
        };
        Matrix::new(name, rows, cols, data)
    }

    /// A `u8` tensor of exactly `shape` (MXFP4 blocks and scales).
    pub fn u8_tensor(&self, name: &str, shape: &[usize]) -> Result<&[u8]> {
        let t = self.require_shape(name, shape)?;
        if t.dtype != Dtype::U8 {
            return Err(Error::tensor(name, format!("dtype {:?}, expected U8", t.dtype)));
        }
        Ok(self.bytes(t))
    }
}

/// Parses and checks the header of a safetensors file whose bytes are `bytes` (`path` only
/// names it in errors; `shard` is stored in each entry): the header length, UTF-8 JSON
/// within the crate's limits (100 MB, nesting), known dtypes, shapes whose element count
/// matches the byte range, ranges that tile the data section exactly (no gap, no overlap,
/// nothing past the end) and no tensor name given twice.
pub fn parse_header(path: &Path, bytes: &[u8], shard: usize) -> Result<Vec<(String, TensorEntry)>> {
    let (header_len, metadata) =
        SafeTensors::read_metadata(bytes).map_err(|e| describe_header_error(path, bytes, e))?;
    let header = 8usize
        .checked_add(header_len)
        .and_then(|end| bytes.get(8..end))
        .ok_or_else(|| Error::format(path, "header length exceeds the file"))?;
    check_unique_names(path, header)?;
    let data_start = 8 + header_len;
    let mut out = Vec::new();
    for (name, info) in metadata.tensors() {
        let (start, end) = info.data_offsets;
        let range = data_start
            .checked_add(start)
            .zip(data_start.checked_add(end))
            .filter(|&(a, b)| a <= b && b <= bytes.len());
        let Some((offset, stop)) = range else {
            return Err(Error::format(
                path,
                format!("tensor {name}: data offsets [{start}, {end}] lie outside the file"),
            ));
        };
        out.push((
            name,
            TensorEntry { dtype: info.dtype, shape: info.shape.clone(), shard, offset, len: stop - offset },
        ));
    }
    Ok(out)
}

/// Refuses a header naming a tensor twice (JSON parsers keep the last silently).
fn check_unique_names(path: &Path, header: &[u8]) -> Result<()> {
    struct Keys(Option<String>);
    impl<'de> serde::Deserialize<'de> for Keys {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
            struct V;
            impl<'de> serde::de::Visitor<'de> for V {
                type Value = Keys;
                fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                    f.write_str("a JSON object")
                }
                fn visit_map<A: serde::de::MapAccess<'de>>(
                    self,
                    mut map: A,
                ) -> std::result::Result<Keys, A::Error> {
                    // Reads the whole object (the parser checks its end), keeping the first
                    // name seen twice.
                    let (mut seen, mut twice) = (std::collections::HashSet::new(), None);
                    while let Some(k) = map.next_key::<String>()? {
                        map.next_value::<serde::de::IgnoredAny>()?;
                        if twice.is_none() && seen.contains(&k) {
                            twice = Some(k);
                        } else {
                            seen.insert(k);
                        }
                    }
                    Ok(Keys(twice))
                }
            }
            d.deserialize_map(V)
        }
    }
    match serde_json::from_slice::<Keys>(header) {
        Ok(Keys(None)) => Ok(()),
        Ok(Keys(Some(name))) => Err(Error::format(path, format!("the header names {name} twice"))),
        Err(e) => Err(Error::format(path, format!("invalid safetensors header: {e}"))),
    }
}

/// Size in bytes of one element of a float dtype.
fn float_size(name: &str, dtype: Dtype) -> Result<usize> {
    match dtype {
        Dtype::F32 => Ok(4),
        Dtype::BF16 | Dtype::F16 => Ok(2),
        other => Err(Error::tensor(name, format!("dtype {other:?}, expected F32, BF16 or F16"))),
    }
}

/// Widens little-endian F32, BF16 or F16 bytes to f32 (exactly).
pub fn decode_floats(name: &str, dtype: Dtype, bytes: &[u8]) -> Result<Vec<f32>> {
    match dtype {
        Dtype::F32 => {
            Ok(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
        }
        Dtype::BF16 => {
            Ok(bytes.chunks_exact(2).map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]]))).collect())
        }
        Dtype::F16 => Ok(bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect()),
        other => Err(Error::tensor(name, format!("dtype {other:?}, expected F32, BF16 or F16"))),
    }
}

/// Turns a header error into a message that says what is wrong with the file.
fn describe_header_error(path: &Path, map: &[u8], e: SafeTensorError) -> Error {
    match e {
        SafeTensorError::MetadataIncompleteBuffer => {
            let described = header_data_len(map);
            match described {
                Some((header, data)) => {
                    let want = 8 + header + data;
                    let what = if map.len() < want { "truncated" } else { "longer than its header says" };
                    Error::format(
                        path,
                        format!(
                            "shard is {what}: its header describes {want} bytes, the file has {}",
                            map.len()
                        ),
                    )
                }
                None => Error::format(path, "shard is truncated or its header is inconsistent"),
            }
        }
        SafeTensorError::HeaderTooSmall | SafeTensorError::InvalidHeaderLength => Error::format(
            path,
            format!("not a safetensors file or truncated inside its header ({} bytes)", map.len()),
        ),
        other => Error::format(path, format!("invalid safetensors header: {other}")),
    }
}

/// Header length and total data length described by a safetensors header, if parseable.
fn header_data_len(map: &[u8]) -> Option<(usize, usize)> {
    let n = usize::try_from(u64::from_le_bytes(map.get(..8)?.try_into().ok()?)).ok()?;
    let header: serde_json::Value = serde_json::from_slice(map.get(8..n.checked_add(8)?)?).ok()?;
    let end = header
        .as_object()?
        .iter()
        .filter(|(k, _)| k.as_str() != "__metadata__")
        .filter_map(|(_, v)| v.get("data_offsets")?.get(1)?.as_u64())
        .max()
        .unwrap_or(0);
    Some((n, usize::try_from(end).ok()?))
}
