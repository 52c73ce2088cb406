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
fn mat(rows: usize, cols: usize, i: usize) -> Matrix {
    let w = (0..rows * cols).map(|j| half::bf16::from_f32(((j + i) % 1000) as f32 * 1e-3).to_bits()).collect();
    Matrix::new("s", rows, cols, MatrixData::Bf16(aligned(w))).unwrap()
}

fn main() {
    let cols = 2880;
    let layers = 36;
    let ms: Vec<[Matrix; 3]> = (0..layers).map(|i| [mat(4096, cols, i), mat(512, cols, i + 1), mat(512, cols, i + 2)]).collect();
    let x: Vec<f32> = (0..cols).map(|i| (i % 17) as f32 * 0.01).collect();
    let mut y = vec![0.0f32; 5120];
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    pool.install(|| {
        for round in 0..6 {
            for fused in [false, true] {
                let mut busy = Duration::ZERO;
                for l in &ms {
                    let t = Instant::now();
                    if fused {
                        Matrix::matvec_parts(&[&l[0], &l[1], &l[2]], &x, &mut y).unwrap();
                    } else {
                        let (a, rest) = y.split_at_mut(4096);
                        let (b, c) = rest.split_at_mut(512);
                        l[0].matvec(&x, a);
                        l[1].matvec(&x, b);
                        l[2].matvec(&x, c);
                    }
                    busy += t.elapsed();
                }
                let bytes = (layers * 5120 * cols * 2) as f64;
                println!("round {round} fused {fused}: {:.1} GB/s ({:.3} ms a layer)", bytes / busy.as_secs_f64() / 1e9, busy.as_secs_f64() * 1e3 / layers as f64);
            }
        }
    });
}
