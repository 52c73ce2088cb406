//! Matrix-vector kernels against a memory copy of the same weight bytes, in one run:
//! the ratio says how close each kernel gets to the memory-bandwidth floor.
//!
//! `cargo bench --bench kernels`; criterion reports each as bytes/second (throughput is
//! set to the weight bytes one product reads).

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use picchio::quant::{Matrix, MatrixData, WeightBuf};

/// A 2880 x 2880 matrix: one GPT-OSS expert's down projection.
const ROWS: usize = 2880;
const COLS: usize = 2880;

fn inputs() -> (Vec<f32>, Vec<f32>) {
    let w: Vec<f32> = (0..ROWS * COLS).map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-3).collect();
    let x: Vec<f32> = (0..COLS).map(|i| (i as f32 * 0.37).sin()).collect();
    (w, x)
}

fn bench(c: &mut Criterion) {
    let (w, x) = inputs();
    let mut y = vec![0.0f32; ROWS];
    let mut g = c.benchmark_group("matvec_2880x2880");

    let f32m = Matrix::from_f32("bench", ROWS, COLS, w.clone()).unwrap();
    g.throughput(Throughput::Bytes(f32m.byte_len() as u64));
    g.bench_function("memcpy_f32_bytes", |b| {
        let mut dst = vec![0.0f32; w.len()];
        b.iter(|| dst.copy_from_slice(black_box(&w)))
    });
    g.bench_function("f32_reference", |b| b.iter(|| f32m.matvec(black_box(&x), &mut y)));

    let bf: Vec<u16> = w.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
    let bfm = Matrix::new("bench", ROWS, COLS, MatrixData::Bf16(WeightBuf::owned(bf.clone()))).unwrap();
    g.throughput(Throughput::Bytes(bfm.byte_len() as u64));
    g.bench_function("memcpy_bf16_bytes", |b| {
        let mut dst = vec![0u16; bf.len()];
        b.iter(|| dst.copy_from_slice(black_box(&bf)))
    });
    g.bench_function("bf16_reference", |b| b.iter(|| bfm.matvec(black_box(&x), &mut y)));
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
