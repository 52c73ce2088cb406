//! `manifest.json`: the L0 description of a container. Every tensor's name, shape,
//! quantization scheme and group size, and for each stored part its dtype, file, offset,
//! byte count and content hash; every expert record's location and hash.
//!
//! The manifest is written last and atomically, so its presence (with `complete: true`)
//! is what makes a directory a usable container.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::format::container::layout::Formats;

/// The `format` value of every manifest.
pub const FORMAT: &str = "picchio-container";
/// The manifest version this build reads and writes.
pub const VERSION: u32 = 1;
/// File name of the manifest.
pub const MANIFEST_FILE: &str = "manifest.json";
/// File holding the dense tensors.
pub const DENSE_FILE: &str = "dense.bin";
/// File holding the expert records.
pub const EXPERTS_FILE: &str = "experts.bin";
/// Alignment of every dense part in `dense.bin` (enough for SIMD loads and GPU bindings).
pub const DENSE_ALIGN: u64 = 256;
/// Alignment and size granularity of expert records (one direct-I/O read per expert).
pub const RECORD_ALIGN: u64 = 4096;
/// Largest `manifest.json` read (64 MiB). GPT-OSS-120B's is about 2 MB; a larger file is
/// refused before it is read into memory.
pub const MAX_MANIFEST_BYTES: u64 = 64 << 20;

/// How a tensor's values are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scheme {
    /// Stored as is, in `dtype` (f32 or bf16): one `data` part.
    None,
    /// INT8 per row: an i8 `codes` part and an f32 `scales` part (one per row).
    Int8Row,
    /// INT4 in groups of 64 inputs: a u8 `codes` part and an f16 `scales` part.
    Int4Gs64,
    /// MXFP4 as released: a u8 `codes` part (E2M1 pairs) and a u8 `scales` part (E8M0,
    /// one per block of 32 inputs). See `quant::format::WeightFormat::Mxfp4`.
    Mxfp4,
}

/// Element type of a stored part.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// 32-bit float.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half (INT4 group scales).
    F16,
    /// Signed byte (INT8 codes).
    I8,
    /// Unsigned byte (packed INT4 or MXFP4 codes, E8M0 scales).
    U8,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::I8 | Dtype::U8 => 1,
        }
    }
}

/// One stored array of a tensor.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Part {
    /// `data`, `codes` or `scales`.
    pub role: String,
    /// Element type.
    pub dtype: Dtype,
    /// File within the container.
    pub file: String,
    /// Byte offset in the file.
    pub offset: u64,
    /// Byte count.
    pub bytes: u64,
    /// BLAKE3 of the bytes, hex.
    pub hash: String,
}

/// One dense tensor.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorRecord {
    /// Hugging Face name, e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub name: String,
    /// Logical shape (`[rows, cols]` for matrices).
    pub shape: Vec<usize>,
    /// Quantization scheme.
    pub scheme: Scheme,
    /// Inputs per scale group (INT4), else absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_size: Option<usize>,
    /// Stored arrays.
    pub parts: Vec<Part>,
}

impl TensorRecord {
    /// The part with `role`.
    pub fn part(&self, role: &str) -> Option<&Part> {
        self.parts.iter().find(|p| p.role == role)
    }
}

/// One array inside every expert record, at the same place in each.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Component {
    /// `gate_up.codes`, `gate_up.scales`, `gate_up.bias`, `down.codes`, ... (or `.data`
    /// for unquantized experts).
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Logical shape of the array.
    pub shape: Vec<usize>,
    /// Byte offset within the record.
    pub offset: u64,
    /// Byte count.
    pub bytes: u64,
}

/// One expert's record in the expert store.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExpertRecord {
    /// Layer index.
    pub layer: usize,
    /// Expert index within the layer.
    pub expert: usize,
    /// Byte offset in the experts file (a multiple of 4096).
    pub offset: u64,
    /// Payload bytes (the record is padded to a multiple of 4096 on disk).
    pub bytes: u64,
    /// BLAKE3 of the payload, hex.
    pub hash: String,
}

/// The expert store: one flat file of equally laid out records.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExpertStoreInfo {
    /// File within the container.
    pub file: String,
    /// Scheme of the two matrices (`mxfp4`, `int4-gs64` or `none`).
    pub scheme: Scheme,
    /// Inputs per scale group (INT4: 64, MXFP4: 32), else absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_size: Option<usize>,
    /// Distance between records (payload padded to 4096).
    pub record_stride: u64,
    /// Payload bytes of every record.
    pub payload_bytes: u64,
    /// The arrays of a record, in order.
    pub components: Vec<Component>,
    /// Every record, layer-major.
    pub records: Vec<ExpertRecord>,
}

impl ExpertStoreInfo {
    /// Bytes one record occupies once read: the payload rounded up to whole 4 KiB blocks
    /// (the unit of direct I/O).
    pub fn record_bytes(&self) -> u64 {
        align_up(self.payload_bytes, RECORD_ALIGN)
    }
}

/// Where the container came from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SourceInfo {
    /// The source directory, as given to `convert`.
    pub dir: String,
    /// Identity of the source files (config, index, shard names, sizes, mtimes).
    pub identity: String,
}

/// Sizes of the data files, checked on load (a short file is a truncated container).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FileSizes {
    /// `dense.bin`.
    pub dense: u64,
    /// `experts.bin`.
    pub experts: u64,
}

/// The whole manifest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// [`VERSION`].
    pub version: u32,
    /// True once every byte is written and synced.
    pub complete: bool,
    /// The program that wrote it.
    pub created_by: String,
    /// Hash function of every `hash` field.
    pub hash_algorithm: String,
    /// The source checkpoint.
    pub source: SourceInfo,
    /// The formats chosen at conversion.
    pub formats: Formats,
    /// Sizes of the data files.
    pub files: FileSizes,
    /// Dense tensors.
    pub tensors: Vec<TensorRecord>,
    /// Experts.
    pub experts: ExpertStoreInfo,
}

impl Manifest {
    /// Reads and checks the header fields of `dir/manifest.json` (a regular file of at most
    /// [`MAX_MANIFEST_BYTES`]). The rest is checked by [`Manifest::validate`].
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join(MANIFEST_FILE);
        let text = read_capped(&path)?;
        let m: Manifest = serde_json::from_slice(&text)
            .map_err(|e| Error::format(&path, format!("not a valid manifest: {e}")))?;
        if m.format != FORMAT {
            return Err(Error::format(&path, format!("format is \"{}\", expected \"{FORMAT}\"", m.format)));
        }
        if m.version != VERSION {
            return Err(Error::format(
                &path,
                format!(
                    "version {} is not supported by this build (reads version {VERSION}); re-convert",
                    m.version
                ),
            ));
        }
        if !m.complete {
            return Err(Error::format(&path, "the container is incomplete (conversion did not finish)"));
        }
        Ok(m)
    }

    /// The record of tensor `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorRecord> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// Reads `path`, a regular file of at most [`MAX_MANIFEST_BYTES`], without ever holding
/// more than that in memory (the length is checked before reading, and the read stops past
/// the cap in case the file grows meanwhile).
fn read_capped(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        return Err(Error::format(path, "is not a regular file"));
    }
    let too_big = |len: u64| {
        Error::format(
            path,
            format!("is {len} bytes or more; a manifest has at most {MAX_MANIFEST_BYTES} bytes (64 MiB)"),
        )
    };
    if meta.len() > MAX_MANIFEST_BYTES {
        return Err(too_big(meta.len()));
    }
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut text = Vec::with_capacity(meta.len() as usize);
    file.take(MAX_MANIFEST_BYTES + 1).read_to_end(&mut text).map_err(|e| Error::io(path, e))?;
    if text.len() as u64 > MAX_MANIFEST_BYTES {
        return Err(too_big(text.len() as u64));
    }
    Ok(text)
}

/// Hex BLAKE3 of `bytes`.
pub fn hash_hex(bytes: &[u8]) -> String {
    blake3::hash(bytes).to_hex().to_string()
}

/// Rounds `x` up to a multiple of `align` (saturating at `u64::MAX`, so a size from a
/// damaged manifest cannot wrap around to a small one).
pub fn align_up(x: u64, align: u64) -> u64 {
    x.div_ceil(align).saturating_mul(align)
}
