//! Attention over a long cache on the CPU, per decoded token: one key/value head's group of
//! query heads ([`attend_group`], GPT-OSS-20B's shape: 64 query heads, 8 key/value heads of
//! 64, sinks) over caches of 128 to 4,096 positions, and the softmax with sink alone over as
//! many scores. Throughput is in positions a second (one position: a key and a value read,
//! a score and a weight for each of the group's eight heads).
//!
//! ```sh
//! cargo bench --bench attention
//! ```
//!
//! One thread: the CPU backend runs the key/value heads as tasks on its pool, each an
//! `attend_group` call (which picks its AVX-512 or AVX2 copy). `softmax_with_sink` is called
//! here as compiled for the baseline target (SSE2 on x86-64); inside `attend_group` it runs in
//! that function's wider copy.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use picchio::backend::cpu::attention::{AttentionShape, LayerCache, attend_group};
use picchio::model::math::softmax_with_sink;

/// Cache lengths measured: a sliding layer's window, then long contexts.
const POSITIONS: [usize; 4] = [128, 1024, 2048, 4096];

/// Fixed values in [-1, 1): the cache and the queries.
fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32).map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 2000) as f32 / 1000.0 - 1.0).collect()
}

fn bench_attention(c: &mut Criterion) {
    let shape = AttentionShape { heads: 64, kv_heads: 8, head_dim: 64, window: None };
    let (group, d) = (shape.heads / shape.kv_heads, shape.head_dim);
    let mut g = c.benchmark_group("attend_group_20b");
    g.measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    for n in POSITIONS {
        let (keys, vals) = (values(shape.kv_heads * n * d, 1), values(shape.kv_heads * n * d, 2));
        let sinks = values(shape.heads, 3);
        let cache = LayerCache { positions: n, keys: &keys, values: &vals, sinks: Some(&sinks) };
        let q = values(group * d, 4);
        let (mut scores, mut out) = (Vec::new(), vec![0.0f32; group * d]);
        g.throughput(Throughput::Elements(n as u64));
        g.bench_function(format!("{n}"), |b| {
            b.iter(|| attend_group(shape, cache, 3, black_box(&q), n - 1, &mut scores, &mut out));
        });
    }
    g.finish();

    let mut g = c.benchmark_group("softmax_with_sink");
    g.measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_secs(1));
    for n in POSITIONS {
        let scores: Vec<f32> = values(n, 5).iter().map(|v| v * 8.0).collect();
        let mut work = scores.clone();
        g.throughput(Throughput::Elements(n as u64));
        g.bench_function(format!("{n}"), |b| {
            b.iter(|| {
                work.copy_from_slice(&scores);
                softmax_with_sink(black_box(&mut work), 0.5);
            });
        });
    }
    g.finish();
}

criterion_group!(benches, bench_attention);
criterion_main!(benches);
