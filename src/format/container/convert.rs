//! `picchio convert`: a Hugging Face checkpoint to a Picchio container, streaming.
//!
//! The whole layout is computed first, so every tensor and every expert record has a fixed
//! place in the output files. Work items (one dense tensor, or all experts of one layer)
//! are then converted in source order, each in bounded memory (row chunks of at most
//! [`CHUNK_BYTES`], one expert at a time), written with positioned writes and synced. A
//! state file lists the finished items, so an interrupted run resumes where it stopped;
//! `manifest.json` is written last and atomically, so a partial container is never taken
//! for a complete one.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::time::{Instant, UNIX_EPOCH};

use half::bf16;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rayon::prelude::*;
use safetensors::Dtype as SrcDtype;
use serde::{Deserialize, Serialize};

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::format::container::layout::{Formats, plan_dense, plan_experts};
use crate::format::container::manifest::{
    self, DENSE_FILE, Dtype, EXPERTS_FILE, ExpertStoreInfo, FileSizes, MANIFEST_FILE, Manifest, Scheme,
    SourceInfo, TensorRecord, hash_hex,
};
use crate::format::hf::{ExpertLayout, expert_layout};
use crate::format::mxfp4;
use crate::format::safetensors::{Checkpoint, INDEX_FILE, SINGLE_FILE, TensorEntry, decode_floats};
use crate::io::{read_exact_at, write_all_at};
use crate::quant::{int4, int8};

/// Largest slice of a dense tensor held in memory at once.
pub const CHUNK_BYTES: usize = 64 << 20;
/// File recording finished work items while a conversion runs.
pub const STATE_FILE: &str = "convert.state.json";

/// Options of a conversion.
#[derive(Clone, Debug)]
pub struct ConvertOptions {
    /// Output formats.
    pub formats: Formats,
    /// Draw a progress bar on stderr (when it is a terminal).
    pub progress: bool,
    /// Stop with an error after this many items, as an interruption would (for tests of
    /// resumption).
    #[doc(hidden)]
    pub interrupt_after: Option<usize>,
}

/// What a conversion did.
#[derive(Clone, Debug)]
pub struct ConvertReport {
    /// The container directory.
    pub out: PathBuf,
    /// Items converted by this run.
    pub converted: usize,
    /// Items found already done (resumed run).
    pub resumed: usize,
    /// Source bytes read by this run.
    pub bytes_read: u64,
    /// Bytes of the container (dense + experts).
    pub bytes_written: u64,
    /// Wall time of this run.
    pub seconds: f64,
    /// Peak resident memory of the process, if known.
    pub peak_rss: Option<u64>,
}

/// The progress record kept beside a running conversion.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct State {
    /// Hash of the layout, formats and source identity this state belongs to.
    plan: String,
    /// Finished items and the hashes of what they wrote.
    done: BTreeMap<String, Vec<String>>,
}

/// A unit of conversion work.
#[derive(Clone, Debug)]
enum Item {
    /// Dense tensor `index` of the plan.
    Dense(usize),
    /// Every expert of a layer.
    Experts(usize),
}

impl Item {
    fn key(&self, plan: &[TensorRecord]) -> String {
        match self {
            Item::Dense(i) => format!("dense:{}", plan[*i].name),
            Item::Experts(l) => format!("experts:{l}"),
        }
    }
}

/// A stable identity of a source checkpoint: its config, index and every shard's name,
/// size and modification time. A changed source gets a new identity.
pub fn source_identity(src: &Path) -> Result<String> {
    let mut h = blake3::Hasher::new();
    for name in ["config.json", INDEX_FILE] {
        let p = src.join(name);
        if p.exists() {
            h.update(name.as_bytes());
            h.update(&std::fs::read(&p).map_err(|e| Error::io(&p, e))?);
        }
    }
    let mut shards: Vec<PathBuf> = std::fs::read_dir(src)
        .map_err(|e| Error::io(src, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    shards.sort();
    for p in shards {
        let meta = std::fs::metadata(&p).map_err(|e| Error::io(&p, e))?;
        let mtime =
            meta.modified().ok().and_then(|t| t.duration_since(UNIX_EPOCH).ok()).map_or(0, |d| d.as_nanos());
        h.update(p.file_name().map(|n| n.as_encoded_bytes()).unwrap_or_default());
        h.update(&meta.len().to_le_bytes());
        h.update(&mtime.to_le_bytes());
    }
    Ok(h.finalize().to_hex().to_string())
}

/// Converts the checkpoint in `src` into a container in `out`.
pub fn convert(src: &Path, out: &Path, opts: &ConvertOptions) -> Result<ConvertReport> {
    let started = Instant::now();
    let cfg = ModelConfig::from_dir(src)?;
    let ck = Checkpoint::open(src)?;
    let layout = expert_layout(&ck)?;
    check_source(&ck, &cfg, layout)?;

    let is_bf16 = |name: &str| ck.get(name).is_some_and(|t| t.dtype == SrcDtype::BF16);
    let (mut dense, dense_bytes) = plan_dense(&cfg, opts.formats, is_bf16);
    let (mut experts, experts_bytes) = plan_experts(&cfg, opts.formats.experts);
    let identity = source_identity(src)?;
    let plan_id = {
        let mut h = blake3::Hasher::new();
        h.update(identity.as_bytes());
        h.update(&serde_json::to_vec(&(&dense, &experts, opts.formats)).expect("plan serializes"));
        h.finalize().to_hex().to_string()
    };

    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    if let Some(report) = already_converted(out, &identity, opts.formats, started)? {
        return Ok(report);
    }
    let state_path = out.join(STATE_FILE);
    let mut state = read_state(&state_path);
    let resuming = state.as_ref().is_some_and(|s| s.plan == plan_id);
    if !resuming {
        if state.is_some() {
            tracing::info!(
                "{}: the previous partial conversion used other options or source; restarting",
                out.display()
            );
        }
        state = Some(State { plan: plan_id.clone(), done: BTreeMap::new() });
    }
    let mut state = state.expect("set above");

    let dense_file = open_output(&out.join(DENSE_FILE), dense_bytes, resuming)?;
    let experts_file = open_output(&out.join(EXPERTS_FILE), experts_bytes, resuming)?;
    let cfg_src = src.join("config.json");
    std::fs::copy(&cfg_src, out.join("config.json")).map_err(|e| Error::io(&cfg_src, e))?;

    let reader = SourceReader::open(&ck)?;
    let items = ordered_items(&ck, &cfg, &dense, layout);
    let total: u64 = items.iter().map(|it| item_source_bytes(&ck, &cfg, &dense, layout, it)).sum();
    let done_bytes: u64 = items
        .iter()
        .filter(|it| state.done.contains_key(&it.key(&dense)))
        .map(|it| item_source_bytes(&ck, &cfg, &dense, layout, it))
        .sum();
    let bar = progress_bar(opts.progress, total, done_bytes);
    let (mut converted, mut resumed, mut bytes_read) = (0, 0, 0u64);
    for item in &items {
        if opts.interrupt_after == Some(converted) {
            return Err(Error::invalid(format!("conversion interrupted after {converted} items")));
        }
        let key = item.key(&dense);
        if state.done.contains_key(&key) {
            resumed += 1;
            continue;
        }
        let hashes = match item {
            Item::Dense(i) => {
                let src_t = ck.require(&dense[*i].name)?;
                let h = convert_dense(&reader, &dense[*i], src_t, &dense_file, &bar)?;
                sync(&dense_file, &out.join(DENSE_FILE))?;
                h
            }
            Item::Experts(l) => {
                let h = convert_expert_layer(&reader, &ck, &cfg, layout, &experts, *l, &experts_file, &bar)?;
                sync(&experts_file, &out.join(EXPERTS_FILE))?;
                h
            }
        };
        bytes_read += item_source_bytes(&ck, &cfg, &dense, layout, item);
        state.done.insert(key, hashes);
        write_atomically(&state_path, &serde_json::to_vec(&state).expect("state serializes"))?;
        converted += 1;
    }
    bar.finish_and_clear();

    fill_hashes(&mut dense, &mut experts, &state, &cfg)?;
    let manifest = Manifest {
        format: manifest::FORMAT.into(),
        version: manifest::VERSION,
        complete: true,
        created_by: format!("picchio {}", env!("CARGO_PKG_VERSION")),
        hash_algorithm: "blake3".into(),
        source: SourceInfo { dir: src.display().to_string(), identity },
        formats: opts.formats,
        files: FileSizes { dense: dense_bytes, experts: experts_bytes },
        tensors: dense,
        experts,
    };
    write_atomically(
        &out.join(MANIFEST_FILE),
        &serde_json::to_vec_pretty(&manifest).expect("manifest serializes"),
    )?;
    let _ = std::fs::remove_file(&state_path);
    Ok(ConvertReport {
        out: out.to_path_buf(),
        converted,
        resumed,
        bytes_read,
        bytes_written: dense_bytes + experts_bytes,
        seconds: started.elapsed().as_secs_f64(),
        peak_rss: crate::system::peak_rss(),
    })
}

/// A finished container of the same source and formats needs no work; any other complete
/// container in `out` is refused rather than overwritten.
fn already_converted(
    out: &Path,
    identity: &str,
    formats: Formats,
    started: Instant,
) -> Result<Option<ConvertReport>> {
    if !out.join(MANIFEST_FILE).exists() {
        return Ok(None);
    }
    let m = Manifest::read(out)?;
    if m.source.identity == identity && m.formats == formats {
        tracing::info!("{} is already a complete conversion of this source", out.display());
        return Ok(Some(ConvertReport {
            out: out.to_path_buf(),
            converted: 0,
            resumed: 0,
            bytes_read: 0,
            bytes_written: m.files.dense + m.files.experts,
            seconds: started.elapsed().as_secs_f64(),
            peak_rss: crate::system::peak_rss(),
        }));
    }
    Err(Error::format(
        out,
        "already holds a complete container of another source or other formats; remove it or choose another directory",
    ))
}

/// Checks every tensor the conversion will read before writing anything.
fn check_source(ck: &Checkpoint, cfg: &ModelConfig, layout: ExpertLayout) -> Result<()> {
    for (name, shape, _) in crate::format::container::layout::dense_tensors(cfg) {
        let t = ck.require_shape(&name, &shape)?;
        if !matches!(t.dtype, SrcDtype::F32 | SrcDtype::BF16 | SrcDtype::F16) {
            return Err(Error::tensor(&name, format!("dtype {:?}, expected F32, BF16 or F16", t.dtype)));
        }
    }
    let (h, i, e) = (cfg.hidden_size, cfg.intermediate_size, cfg.num_experts);
    for l in 0..cfg.num_layers {
        let p = format!("model.layers.{l}.mlp.experts");
        for (m, rows, cols) in [("gate_up_proj", 2 * i, h), ("down_proj", h, i)] {
            match layout {
                ExpertLayout::Mxfp4 => {
                    if cols % mxfp4::BLOCK != 0 {
                        return Err(Error::tensor(
                            format!("{p}.{m}_blocks"),
                            format!("input dimension {cols} is not a multiple of 32"),
                        ));
                    }
                    let g = cols / mxfp4::BLOCK;
                    for (suffix, shape) in [("blocks", vec![e, rows, g, 16]), ("scales", vec![e, rows, g])] {
                        let name = format!("{p}.{m}_{suffix}");
                        let t = ck.require_shape(&name, &shape)?;
                        if t.dtype != SrcDtype::U8 {
                            return Err(Error::tensor(&name, format!("dtype {:?}, expected U8", t.dtype)));
                        }
                    }
                }
                ExpertLayout::Dequantized => {
                    ck.require_shape(&format!("{p}.{m}"), &[e, cols, rows])?;
                }
            }
            ck.require_shape(&format!("{p}.{m}_bias"), &[e, rows])?;
        }
    }
    Ok(())
}

/// Work items in the order their source bytes lie on disk (shard, then offset).
fn ordered_items(
    ck: &Checkpoint,
    cfg: &ModelConfig,
    dense: &[TensorRecord],
    layout: ExpertLayout,
) -> Vec<Item> {
    let mut items: Vec<(usize, u64, Item)> = Vec::new();
    for (i, t) in dense.iter().enumerate() {
        let e = ck.get(&t.name).expect("checked");
        items.push((e.shard, e.offset as u64, Item::Dense(i)));
    }
    for l in 0..cfg.num_layers {
        let first = match layout {
            ExpertLayout::Mxfp4 => format!("model.layers.{l}.mlp.experts.gate_up_proj_blocks"),
            ExpertLayout::Dequantized => format!("model.layers.{l}.mlp.experts.gate_up_proj"),
        };
        let e = ck.get(&first).expect("checked");
        items.push((e.shard, e.offset as u64, Item::Experts(l)));
    }
    items.sort_by_key(|(s, o, _)| (*s, *o));
    items.into_iter().map(|(_, _, it)| it).collect()
}

/// Source bytes an item reads.
fn item_source_bytes(
    ck: &Checkpoint,
    cfg: &ModelConfig,
    dense: &[TensorRecord],
    layout: ExpertLayout,
    item: &Item,
) -> u64 {
    match item {
        Item::Dense(i) => ck.get(&dense[*i].name).map_or(0, |t| t.len as u64),
        Item::Experts(l) => expert_tensor_names(*l, layout)
            .iter()
            .filter_map(|n| ck.get(n))
            .map(|t| t.len as u64)
            .sum::<u64>()
            .max(cfg.num_experts as u64),
    }
}

fn expert_tensor_names(layer: usize, layout: ExpertLayout) -> Vec<String> {
    let p = format!("model.layers.{layer}.mlp.experts");
    let mut v = Vec::new();
    for m in ["gate_up_proj", "down_proj"] {
        match layout {
            ExpertLayout::Mxfp4 => {
                v.push(format!("{p}.{m}_blocks"));
                v.push(format!("{p}.{m}_scales"));
            }
            ExpertLayout::Dequantized => v.push(format!("{p}.{m}")),
        }
        v.push(format!("{p}.{m}_bias"));
    }
    v
}

/// Positioned reads of source tensors (not mapped, so resident memory stays bounded).
struct SourceReader {
    files: Vec<(PathBuf, File)>,
}

impl SourceReader {
    fn open(ck: &Checkpoint) -> Result<Self> {
        let files = ck
            .shards()
            .iter()
            .map(|s| File::open(&s.path).map(|f| (s.path.clone(), f)).map_err(|e| Error::io(&s.path, e)))
            .collect::<Result<_>>()?;
        Ok(SourceReader { files })
    }

    /// `len` bytes starting `start` bytes into tensor `t`.
    fn read(&self, t: &TensorEntry, start: usize, len: usize) -> Result<Vec<u8>> {
        let (path, file) = &self.files[t.shard];
        let mut buf = vec![0u8; len];
        read_exact_at(file, &mut buf, (t.offset + start) as u64)
            .map_err(|e| Error::format(path, format!("reading {len} bytes at {}: {e}", t.offset + start)))?;
        Ok(buf)
    }
}

fn open_output(path: &Path, len: u64, keep: bool) -> Result<File> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(!keep)
        .open(path)
        .map_err(|e| Error::io(path, e))?;
    f.set_len(len).map_err(|e| Error::io(path, e))?;
    Ok(f)
}

fn sync(f: &File, path: &Path) -> Result<()> {
    f.sync_data().map_err(|e| Error::io(path, e))
}

/// Writes `bytes` to `path` via a temporary file and a rename, so readers see either the
/// old or the new content.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    {
        let f = File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
        write_all_at(&f, bytes, 0).map_err(|e| Error::io(&tmp, e))?;
        f.sync_all().map_err(|e| Error::io(&tmp, e))?;
    }
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
}

fn read_state(path: &Path) -> Option<State> {
    let text = std::fs::read(path).ok()?;
    serde_json::from_slice(&text).ok()
}

fn progress_bar(enabled: bool, total: u64, done: u64) -> ProgressBar {
    if !enabled {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template(
            "converting [{bar:40}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} ETA {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.set_position(done);
    bar
}

/// Bytes per row of each part of `t` (parts are row-major).
fn part_row_bytes(t: &TensorRecord, cols: usize) -> Vec<usize> {
    t.parts
        .iter()
        .map(|p| match (t.scheme, p.role.as_str()) {
            (Scheme::Int8Row, "codes") => cols,
            (Scheme::Int8Row, _) => 4,
            (_, _) => cols * p.dtype.size() as usize,
        })
        .collect()
}

/// Converts one dense tensor in row chunks; returns the hash of each part.
fn convert_dense(
    reader: &SourceReader,
    t: &TensorRecord,
    src: &TensorEntry,
    out: &File,
    bar: &ProgressBar,
) -> Result<Vec<String>> {
    let (rows, cols) = match t.shape[..] {
        [r, c] => (r, c),
        [n] => (1, n),
        _ => return Err(Error::tensor(&t.name, format!("unexpected shape {:?}", t.shape))),
    };
    let elem = src.len / (rows * cols);
    let chunk_rows = (CHUNK_BYTES / (cols * elem).max(1)).max(1);
    let row_bytes = part_row_bytes(t, cols);
    let mut hashers: Vec<blake3::Hasher> = t.parts.iter().map(|_| blake3::Hasher::new()).collect();
    let mut r0 = 0;
    while r0 < rows {
        let n = chunk_rows.min(rows - r0);
        let raw = reader.read(src, r0 * cols * elem, n * cols * elem)?;
        let raw_len = raw.len() as u64;
        let encoded: Vec<Vec<u8>> = match (t.scheme, t.parts[0].dtype) {
            // Already in the target format: written as read.
            (Scheme::None, Dtype::Bf16) if src.dtype == SrcDtype::BF16 => vec![raw],
            (Scheme::None, Dtype::F32) if src.dtype == SrcDtype::F32 => vec![raw],
            (Scheme::None, Dtype::Bf16) => {
                let f = decode_floats(&t.name, src.dtype, &raw)?;
                vec![f.iter().flat_map(|v| bf16::from_f32(*v).to_bits().to_le_bytes()).collect()]
            }
            (Scheme::None, _) => {
                let f = decode_floats(&t.name, src.dtype, &raw)?;
                vec![f.iter().flat_map(|v| v.to_le_bytes()).collect()]
            }
            (Scheme::Int8Row, _) => {
                let f = decode_floats(&t.name, src.dtype, &raw)?;
                let mut codes = vec![0u8; n * cols];
                let mut scales = vec![0u8; n * 4];
                codes.par_chunks_mut(cols).zip(scales.par_chunks_mut(4)).zip(f.par_chunks(cols)).for_each(
                    |((c, s), x)| {
                        let scale = int8::quantize_row(x, bytemuck::cast_slice_mut(c));
                        s.copy_from_slice(&scale.to_le_bytes());
                    },
                );
                vec![codes, scales]
            }
            (Scheme::Int4Gs64, _) => {
                return Err(Error::tensor(&t.name, "dense INT4 is not a conversion target"));
            }
        };
        for (((part, data), per_row), hasher) in
            t.parts.iter().zip(&encoded).zip(&row_bytes).zip(&mut hashers)
        {
            write_all_at(out, data, part.offset + (r0 * per_row) as u64)
                .map_err(|e| Error::format(DENSE_FILE, format!("writing {}: {e}", t.name)))?;
            hasher.update(data);
        }
        bar.inc(raw_len);
        r0 += n;
    }
    Ok(hashers.into_iter().map(|h| h.finalize().to_hex().to_string()).collect())
}

/// Source rows of one expert matrix, decoded to f32 on demand.
enum ExpertRows {
    /// MXFP4 blocks and scales of this expert, rows = outputs.
    Mxfp4 { blocks: Vec<u8>, scales: Vec<u8>, groups: usize, name: String },
    /// A dequantized `[in, out]` slice, transposed on access.
    Transposed { data: Vec<f32>, inputs: usize, outputs: usize },
}

impl ExpertRows {
    fn row(&self, r: usize, out: &mut [f32]) -> Result<()> {
        match self {
            ExpertRows::Mxfp4 { blocks, scales, groups, name } => mxfp4::decode_row(
                &blocks[r * groups * mxfp4::BLOCK_BYTES..(r + 1) * groups * mxfp4::BLOCK_BYTES],
                &scales[r * groups..(r + 1) * groups],
                out,
            )
            .map_err(|g| {
                Error::tensor(format!("{name}_scales"), format!("row {r}, block {g}: scale byte 255 (NaN)"))
            }),
            ExpertRows::Transposed { data, inputs, outputs } => {
                for (c, o) in out.iter_mut().enumerate().take(*inputs) {
                    *o = data[c * outputs + r];
                }
                Ok(())
            }
        }
    }
}

/// Converts every expert of `layer`; returns the hash of each record, in expert order.
#[allow(clippy::too_many_arguments)]
fn convert_expert_layer(
    reader: &SourceReader,
    ck: &Checkpoint,
    cfg: &ModelConfig,
    layout: ExpertLayout,
    info: &ExpertStoreInfo,
    layer: usize,
    out: &File,
    bar: &ProgressBar,
) -> Result<Vec<String>> {
    let (h, i, e_count) = (cfg.hidden_size, cfg.intermediate_size, cfg.num_experts);
    let p = format!("model.layers.{layer}.mlp.experts");
    let mut hashes = Vec::with_capacity(e_count);
    for expert in 0..e_count {
        let mut record = vec![0u8; info.payload_bytes as usize];
        let mut read = 0usize;
        for (m, rows, cols) in [("gate_up", 2 * i, h), ("down", h, i)] {
            let src_name = format!("{p}.{m}_proj");
            let source = match layout {
                ExpertLayout::Mxfp4 => {
                    let g = cols / mxfp4::BLOCK;
                    let bt = ck.require(&format!("{src_name}_blocks"))?;
                    let st = ck.require(&format!("{src_name}_scales"))?;
                    let (bb, sb) = (rows * g * mxfp4::BLOCK_BYTES, rows * g);
                    let blocks = reader.read(bt, expert * bb, bb)?;
                    let scales = reader.read(st, expert * sb, sb)?;
                    read += bb + sb;
                    ExpertRows::Mxfp4 { blocks, scales, groups: g, name: src_name.clone() }
                }
                ExpertLayout::Dequantized => {
                    let t = ck.require(&src_name)?;
                    let elem = t.len / (e_count * rows * cols);
                    let per = rows * cols * elem;
                    let raw = reader.read(t, expert * per, per)?;
                    read += per;
                    ExpertRows::Transposed {
                        data: decode_floats(&src_name, t.dtype, &raw)?,
                        inputs: cols,
                        outputs: rows,
                    }
                }
            };
            encode_matrix(&source, info, m, rows, cols, &mut record)?;
            let bt = ck.require(&format!("{src_name}_bias"))?;
            let elem = bt.len / (e_count * rows);
            let raw = reader.read(bt, expert * rows * elem, rows * elem)?;
            read += raw.len();
            let bias = decode_floats(&format!("{src_name}_bias"), bt.dtype, &raw)?;
            let c = component(info, &format!("{m}.bias"))?;
            record[c.0..c.0 + c.1].copy_from_slice(bytemuck::cast_slice(&bias));
        }
        let rec = &info.records[layer * e_count + expert];
        write_all_at(out, &record, rec.offset).map_err(|e| {
            Error::format(EXPERTS_FILE, format!("writing layer {layer} expert {expert}: {e}"))
        })?;
        hashes.push(hash_hex(&record));
        bar.inc(read as u64);
    }
    Ok(hashes)
}

/// Offset and length of a record component.
fn component(info: &ExpertStoreInfo, name: &str) -> Result<(usize, usize)> {
    info.components
        .iter()
        .find(|c| c.name == name)
        .map(|c| (c.offset as usize, c.bytes as usize))
        .ok_or_else(|| Error::format(EXPERTS_FILE, format!("layout has no `{name}` component")))
}

/// Encodes one expert matrix into its record components, rows in parallel.
fn encode_matrix(
    src: &ExpertRows,
    info: &ExpertStoreInfo,
    m: &str,
    rows: usize,
    cols: usize,
    record: &mut [u8],
) -> Result<()> {
    match info.scheme {
        Scheme::Int4Gs64 => {
            let (co, cb) = component(info, &format!("{m}.codes"))?;
            let (so, sb) = component(info, &format!("{m}.scales"))?;
            let (rb, g) = (int4::row_bytes(cols), int4::groups(cols));
            // Components are disjoint and in order: codes before scales.
            let (head, tail) = record.split_at_mut(so);
            let codes = &mut head[co..co + cb];
            let scales = &mut tail[..sb];
            codes.par_chunks_mut(rb).zip(scales.par_chunks_mut(2 * g)).enumerate().try_for_each(
                |(r, (c, s))| {
                    let mut x = vec![0.0f32; cols];
                    src.row(r, &mut x)?;
                    let mut sc = vec![0u16; g];
                    int4::quantize_row(&x, c, &mut sc);
                    for (dst, v) in s.chunks_exact_mut(2).zip(&sc) {
                        dst.copy_from_slice(&v.to_le_bytes());
                    }
                    Ok::<(), Error>(())
                },
            )?;
            debug_assert_eq!(codes.len(), rows * rb);
        }
        _ => {
            let (o, b) = component(info, &format!("{m}.data"))?;
            record[o..o + b].par_chunks_mut(cols * 4).enumerate().try_for_each(|(r, dst)| {
                let mut x = vec![0.0f32; cols];
                src.row(r, &mut x)?;
                dst.copy_from_slice(bytemuck::cast_slice(&x));
                Ok::<(), Error>(())
            })?;
        }
    }
    Ok(())
}

/// Copies the hashes recorded in the state into the manifest records.
fn fill_hashes(
    dense: &mut [TensorRecord],
    experts: &mut ExpertStoreInfo,
    state: &State,
    cfg: &ModelConfig,
) -> Result<()> {
    for t in dense.iter_mut() {
        let key = format!("dense:{}", t.name);
        let hashes =
            state.done.get(&key).ok_or_else(|| Error::invalid(format!("conversion lost track of {key}")))?;
        for (p, h) in t.parts.iter_mut().zip(hashes) {
            p.hash = h.clone();
        }
    }
    for l in 0..cfg.num_layers {
        let key = format!("experts:{l}");
        let hashes =
            state.done.get(&key).ok_or_else(|| Error::invalid(format!("conversion lost track of {key}")))?;
        for (e, h) in hashes.iter().enumerate() {
            experts.records[l * cfg.num_experts + e].hash = h.clone();
        }
    }
    Ok(())
}

/// Whether `dir` is a Hugging Face checkpoint (not a container).
pub fn is_hf_checkpoint(dir: &Path) -> bool {
    dir.join("config.json").is_file() && (dir.join(SINGLE_FILE).is_file() || dir.join(INDEX_FILE).is_file())
}
