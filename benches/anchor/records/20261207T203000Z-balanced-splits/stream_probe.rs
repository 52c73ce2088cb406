use std::sync::Arc;
use std::time::{Duration, Instant};
use picchio::quant::buffer::{AlignedBytes, ByteRegion, WeightBuf};
use picchio::quant::{Matrix, MatrixData};

fn aligned<T: bytemuck::Pod>(v: Vec<T>) -> WeightBuf<T> {
    let bytes: &[u8] = bytemuck::cast_slice(&v);
    let mut buf = AlignedBytes::zeroed(bytes.len());
    buf.as_mut_slice().copy_from_slice(bytes);
    let region: Arc<dyn ByteRegion> = Arc::new(buf);
    WeightBuf::shared(&region, 0, bytes.len())
}

fn main() {
    let rows: usize = std::env::args().nth(1).unwrap().parse().unwrap();
    let cols: usize = std::env::args().nth(2).unwrap().parse().unwrap();
    let gap_us: u64 = std::env::args().nth(3).unwrap().parse().unwrap();
    let n = (1usize << 30) / (rows * cols * 2);
    let ms: Vec<Matrix> = (0..n)
        .map(|i| {
            let w = (0..rows * cols).map(|j| half::bf16::from_f32(((j + i) % 1000) as f32 * 1e-3).to_bits()).collect();
            Matrix::new("s", rows, cols, MatrixData::Bf16(aligned(w))).unwrap()
        })
        .collect();
    let x: Vec<f32> = (0..cols).map(|i| (i % 17) as f32 * 0.01).collect();
    let mut y = vec![0.0f32; rows];
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    pool.install(|| {
        for round in 0..4 {
            let mut busy = Duration::ZERO;
            for m in &ms {
                if gap_us > 0 {
                    let t = Instant::now();
                    while t.elapsed() < Duration::from_micros(gap_us) {}
                }
                let t = Instant::now();
                m.matvec(&x, &mut y);
                busy += t.elapsed();
            }
            let bytes = (n * rows * cols * 2) as f64;
            println!("{rows}x{cols} gap {gap_us}us round {round}: {:.1} GB/s ({:.3} ms a product)", bytes / busy.as_secs_f64() / 1e9, busy.as_secs_f64() * 1e3 / n as f64);
        }
    });
}
