//! Probe (not part of the engine): does a BF16 product of an attention-sized matrix run faster
//! when its weights are in the L3 than from memory, on this machine? And an MXFP4 product of
//! an experts-sized one? Layers of 53 MB matrices, more of them than the L3 holds.
use std::sync::Arc;
use std::time::Instant;

use picchio::bench::parallel_stream_sum;
use picchio::quant::buffer::{AlignedBytes, ByteRegion};
use picchio::quant::{Matrix, MatrixData, WeightBuf, mxfp4};

fn aligned<T: bytemuck::Pod>(v: Vec<T>) -> (WeightBuf<T>, Arc<dyn ByteRegion>) {
    let bytes: &[u8] = bytemuck::cast_slice(&v);
    let mut buf = AlignedBytes::zeroed(bytes.len());
    buf.as_mut_slice().copy_from_slice(bytes);
    let region: Arc<dyn ByteRegion> = Arc::new(buf);
    (WeightBuf::shared(&region, 0, bytes.len()), region)
}

fn main() {
    let cols = 2880;
    let layers: usize = std::env::var("LAYERS").ok().and_then(|v| v.parse().ok()).unwrap_or(16);
    let (bf_rows, mx_rows) = (9216, 34560);
    let mut bf = Vec::new();
    let mut mx = Vec::new();
    for l in 0..layers {
        let w: Vec<u16> = (0..bf_rows * cols).map(|i| half::bf16::from_f32((((i + l) * 7919 % 1000) as f32 - 500.0) * 1e-3).to_bits()).collect();
        let (wb, rb) = aligned(w);
        bf.push((Matrix::new("bf", bf_rows, cols, MatrixData::Bf16(wb)).unwrap(), rb));
        let (mb, blocks) = (mxfp4::row_bytes(cols), mxfp4::blocks(cols));
        let codes: Vec<u8> = (0..mx_rows * mb).map(|i| ((i + l) * 7919 % 251) as u8).collect();
        let scales: Vec<u8> = (0..mx_rows * blocks).map(|i| 122 + (i % 7) as u8).collect();
        let ((c, rc), (s, rs)) = (aligned(codes), aligned(scales));
        mx.push((Matrix::new("mx", mx_rows, cols, MatrixData::Mxfp4 { codes: c, scales: s }).unwrap(), rc, rs));
    }
    let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
    let (mut ybf, mut ymx) = (vec![0f32; bf_rows], vec![0f32; mx_rows]);
    let gib = |b: usize, s: f64| b as f64 / s / (1u64 << 30) as f64;
    let bf_bytes = bf[0].0.byte_len();
    let mx_bytes = mx[0].0.byte_len();
    println!("{layers} layers, BF16 {:.1} MB, MXFP4 {:.1} MB each, {} threads", bf_bytes as f64 / 1e6, mx_bytes as f64 / 1e6, rayon::current_num_threads());
    for round in 0..3 {
        // Cold: each layer's matrices once, in order (the whole set is over the L3).
        let t = Instant::now();
        for l in 0..layers { bf[l].0.matvec(&x, &mut ybf); }
        let bf_cold = t.elapsed().as_secs_f64();
        let t = Instant::now();
        for l in 0..layers { mx[l].0.matvec(&x, &mut ymx); }
        let mx_cold = t.elapsed().as_secs_f64();
        // Warm: each matrix read once just before its product (so it is in the L3).
        let (mut bf_warm, mut mx_warm, mut bf_read, mut sink) = (0.0, 0.0, 0.0, 0u64);
        for l in 0..layers {
            let t = Instant::now();
            sink ^= parallel_stream_sum(bf[l].1.bytes());
            bf_read += t.elapsed().as_secs_f64();
            let t = Instant::now();
            bf[l].0.matvec(&x, &mut ybf);
            bf_warm += t.elapsed().as_secs_f64();
            sink ^= parallel_stream_sum(mx[l].1.bytes());
            let t = Instant::now();
            mx[l].0.matvec(&x, &mut ymx);
            mx_warm += t.elapsed().as_secs_f64();
        }
        println!(
            "round {round}: BF16 cold {:.1} GiB/s, warm {:.1}; MXFP4 cold {:.1}, warm {:.1}; read cold {:.1} GiB/s (sink {})",
            gib(bf_bytes * layers, bf_cold), gib(bf_bytes * layers, bf_warm),
            gib(mx_bytes * layers, mx_cold), gib(mx_bytes * layers, mx_warm),
            gib(bf_bytes * layers, bf_read), sink % 7
        );
    }
}
