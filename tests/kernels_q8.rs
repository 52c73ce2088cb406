//! Batched products with int8 activations (`PICCHIO_INT8_ACTIVATIONS=1`): the setting is
//! process-wide and fixed at first use, so this binary turns it on before any kernel runs and
//! holds a single test. `Matrix::matmul` must then equal `Matrix::matvec` per input bit for
//! bit, as with the float kernels (`tests/kernels.rs`), on one and two threads.

use picchio::quant::kernels::{self, Product};
use picchio::quant::{Matrix, MatrixData, WeightBuf, int4, int8, mxfp4};

/// Xorshift64*, as in `tests/kernels.rs`.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        ((self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
}

/// A random `rows x cols` matrix in `format` ("int8", "int4", "bf16", "mxfp4": `cols` a
/// multiple of 32, random codes and scales near 1).
fn matrix(rng: &mut Rng, format: &str, rows: usize, cols: usize) -> Matrix {
    let w: Vec<f32> = rng.vec(rows * cols).iter().map(|v| v * 0.1).collect();
    let data = match format {
        "bf16" => {
            MatrixData::Bf16(WeightBuf::owned(w.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect()))
        }
        "int8" => {
            let mut codes = vec![0i8; rows * cols];
            let scales =
                w.chunks(cols).zip(codes.chunks_mut(cols)).map(|(r, c)| int8::quantize_row(r, c)).collect();
            MatrixData::Int8Rows { codes: WeightBuf::owned(codes), scales: WeightBuf::owned(scales) }
        }
        "mxfp4" => {
            let (rb, b) = (mxfp4::row_bytes(cols), mxfp4::blocks(cols));
            let codes = (0..rows * rb).map(|_| (rng.next().to_bits() >> 7) as u8).collect();
            let scales = (0..rows * b).map(|_| 120 + (rng.next().to_bits() >> 9) as u8 % 10).collect();
            MatrixData::Mxfp4 { codes: WeightBuf::owned(codes), scales: WeightBuf::owned(scales) }
        }
        _ => {
            let (rb, g) = (int4::row_bytes(cols), int4::groups(cols));
            let (mut codes, mut scales) = (vec![0u8; rows * rb], vec![0u16; rows * g]);
            for (r, row) in w.chunks(cols).enumerate() {
                int4::quantize_row(row, &mut codes[r * rb..(r + 1) * rb], &mut scales[r * g..(r + 1) * g]);
            }
            MatrixData::Int4G64 { codes: WeightBuf::owned(codes), scales: WeightBuf::owned(scales) }
        }
    };
    Matrix::new("test", rows, cols, data).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn matmul_equals_matvec_per_input_with_int8_activations() {
    assert!(kernels::set_int8_activations(true), "int8 activations were already fixed off");
    assert!(kernels::int8_activations());
    let path = kernels::selected();
    if path.has_integer_kernel(Product::Mxfp4Q8) {
        assert!(path.quantizes_activations());
    } else {
        eprintln!("SKIPPED (in part): the selected path {} does not quantize activations", path.name());
    }
    let pool = |n| rayon::ThreadPoolBuilder::new().num_threads(n).build().unwrap();
    let pools = [pool(1), pool(2)];
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for format in ["int8", "int4", "bf16", "mxfp4"] {
        for (rows, cols) in [(3, 5usize), (17, 65), (67, 100), (45, 2880), (130, 1000), (9, 4099)] {
            // MXFP4 rows are whole blocks of 32.
            let cols = if format == "mxfp4" { cols.div_ceil(32) * 32 } else { cols };
            let m = matrix(&mut rng, format, rows, cols);
            for n in (1..=17).chain([31, 64]) {
                let x = rng.vec(n * cols);
                let mut want = vec![0.0f32; n * rows];
                for (xt, yt) in x.chunks(cols).zip(want.chunks_mut(rows)) {
                    m.matvec(xt, yt);
                }
                // Where the path has an integer kernel for the format (VNNI: INT4, INT8 and
                // MXFP4; AVX2, AVX-512, NEON: MXFP4), the products are that kernel's here.
                let product = match format {
                    "int8" => Some(Product::Int8Q8),
                    "int4" => Some(Product::Int4Q8),
                    "mxfp4" => Some(Product::Mxfp4Q8),
                    _ => None,
                };
                if product.is_some_and(|p| path.has_integer_kernel(p)) {
                    let mut q8 = vec![0.0f32; n * rows];
                    for (xt, yt) in x.chunks(cols).zip(q8.chunks_mut(rows)) {
                        m.matvec_q8_with(path, xt, yt);
                    }
                    assert_eq!(
                        bits(&want),
                        bits(&q8),
                        "{format} {rows}x{cols}: matvec is not the q8 product"
                    );
                }
                for p in &pools {
                    let mut y = vec![f32::NAN; n * rows];
                    p.install(|| m.matmul(&x, n, &mut y));
                    assert_eq!(
                        bits(&y),
                        bits(&want),
                        "{format} {rows}x{cols}, n={n}, {} threads",
                        p.current_num_threads()
                    );
                }
            }
        }
    }
}
