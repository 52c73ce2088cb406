//! Probe (not part of the engine): MXFP4 matrix-vector products from memory, by matrix size
//! and by how the two threads share them: each product split across the pool (as decode does
//! today), or each thread taking whole matrices on its own.
use std::sync::Arc;
use std::time::Instant;

use picchio::quant::buffer::{AlignedBytes, ByteRegion};
use picchio::quant::{Matrix, MatrixData, WeightBuf, mxfp4};

fn aligned<T: bytemuck::Pod>(v: Vec<T>) -> WeightBuf<T> {
    let bytes: &[u8] = bytemuck::cast_slice(&v);
    let mut buf = AlignedBytes::zeroed(bytes.len());
    buf.as_mut_slice().copy_from_slice(bytes);
    let region: Arc<dyn ByteRegion> = Arc::new(buf);
    WeightBuf::shared(&region, 0, bytes.len())
}

fn mats(rows: usize, cols: usize, total: usize) -> Vec<Matrix> {
    let (mb, blocks) = (mxfp4::row_bytes(cols), mxfp4::blocks(cols));
    let n = total / (rows * (mb + blocks));
    (0..n)
        .map(|i| {
            let codes: Vec<u8> = (0..rows * mb).map(|j| ((j + i) * 7919 % 251) as u8).collect();
            let scales: Vec<u8> = (0..rows * blocks).map(|j| 122 + ((j + i) % 7) as u8).collect();
            Matrix::new("m", rows, cols, MatrixData::Mxfp4 { codes: aligned(codes), scales: aligned(scales) }).unwrap()
        })
        .collect()
}

fn main() {
    let cols = 2880;
    let total = 1600usize << 20; // over the 480 MiB L3
    let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
    let pool2 = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    let singles: Vec<rayon::ThreadPool> =
        (0..2).map(|_| rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap()).collect();
    for (rows, label) in [(2880, "2880x2880 (down)"), (5760, "5760x2880 (gate_up)"), (34560, "34560x2880")] {
        let ms = mats(rows, cols, total);
        let bytes: usize = ms.iter().map(Matrix::byte_len).sum();
        let gib = |s: f64| bytes as f64 / s / (1u64 << 30) as f64;
        for round in 0..3 {
            let mut y = vec![0f32; rows];
            let t = Instant::now();
            for m in &ms {
                m.matvec(&x, &mut y);
            }
            let split = t.elapsed().as_secs_f64();
            let t = Instant::now();
            pool2.install(|| {
                for m in &ms {
                    m.matvec(&x, &mut y);
                }
            });
            let inside = t.elapsed().as_secs_f64();
            let t = Instant::now();
            std::thread::scope(|s| {
                for (k, pool) in singles.iter().enumerate() {
                    let (ms, x) = (&ms, &x);
                    s.spawn(move || {
                        let mut y = vec![0f32; rows];
                        pool.install(|| {
                            for m in ms.iter().skip(k).step_by(2) {
                                m.matvec(x, &mut y);
                            }
                        });
                    });
                }
            });
            let whole = t.elapsed().as_secs_f64();
            println!("{label} x{} round {round}: split, called from outside the pool {:.1} GiB/s, from inside it {:.1}, whole matrices per thread {:.1} GiB/s", ms.len(), gib(split), gib(inside), gib(whole));
        }
    }
}
