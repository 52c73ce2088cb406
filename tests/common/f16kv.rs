//! The CPU oracle with its key/value cache rounded as an F16 GPU cache rounds it: every key
//! and value stored is rounded to the nearest binary16 first, everything else is the CPU
//! backend's own op. The numbers `--kv-cache f16` is defined to have, computed on the CPU,
//! to tell whether a GPU result that differs from the f32 oracle is the rounding's doing.
//! (The CPU backend itself always keeps f32; this lives in the tests.)

use picchio::backend::cpu::{CpuAct, CpuBackend};
use picchio::backend::{Backend, LayerPoint, LinearId, NormId, RouteTable, RowKind, SeqPos};
use picchio::experts::ExpertStats;
use picchio::{ModelConfig, Result};

use super::gpu::f16_round;

/// [`CpuBackend`] storing binary16-rounded keys and values.
pub struct F16KvCpu(pub CpuBackend);

impl Backend for F16KvCpu {
    type Act = CpuAct;
    type Routes = RouteTable;

    fn describe(&self) -> String {
        format!("{} (keys and values rounded to binary16)", self.0.describe())
    }
    fn config(&self) -> &ModelConfig {
        self.0.config()
    }
    fn capacity(&self) -> usize {
        self.0.capacity()
    }
    fn alloc(&mut self, rows: usize, width: usize) -> Result<CpuAct> {
        self.0.alloc(rows, width)
    }
    fn alloc_routes(&mut self, rows: usize) -> Result<RouteTable> {
        self.0.alloc_routes(rows)
    }
    fn embed(&mut self, ids: &[u32], out: &mut CpuAct) -> Result<()> {
        self.0.embed(ids, out)
    }
    fn rms_norm(&mut self, norm: NormId, x: &CpuAct, out: &mut CpuAct) -> Result<()> {
        self.0.rms_norm(norm, x, out)
    }
    fn rms_norm_heads(&mut self, norm: NormId, x: &mut CpuAct) -> Result<()> {
        self.0.rms_norm_heads(norm, x)
    }
    fn linear(&mut self, w: LinearId, x: &CpuAct, out: &mut CpuAct) -> Result<()> {
        self.0.linear(w, x, out)
    }
    fn linear_qkv(
        &mut self,
        layer: usize,
        x: &CpuAct,
        q: &mut CpuAct,
        k: &mut CpuAct,
        v: &mut CpuAct,
    ) -> Result<()> {
        self.0.linear_qkv(layer, x, q, k, v)
    }
    fn rope(&mut self, x: &mut CpuAct, start_pos: usize) -> Result<()> {
        self.0.rope(x, start_pos)
    }
    fn attention(
        &mut self,
        layer: usize,
        start_pos: usize,
        q: &CpuAct,
        k: &CpuAct,
        v: &CpuAct,
        out: &mut CpuAct,
    ) -> Result<()> {
        let k = CpuAct { rows: k.rows, width: k.width, data: f16_round(&k.data) };
        let v = CpuAct { rows: v.rows, width: v.width, data: f16_round(&v.data) };
        self.0.attention(layer, start_pos, q, &k, &v, out)
    }
    fn route(&mut self, layer: usize, x: &CpuAct, routes: &mut RouteTable) -> Result<()> {
        self.0.route(layer, x, routes)
    }
    fn experts(&mut self, layer: usize, x: &CpuAct, routes: &RouteTable, out: &mut CpuAct) -> Result<()> {
        self.0.experts(layer, x, routes, out)
    }
    fn dense_mlp(&mut self, layer: usize, x: &CpuAct, out: &mut CpuAct) -> Result<()> {
        self.0.dense_mlp(layer, x, out)
    }
    fn add(&mut self, x: &mut CpuAct, y: &CpuAct) -> Result<()> {
        self.0.add(x, y)
    }
    fn copy_rows(&mut self, src: &CpuAct, first_row: usize, dst: &mut CpuAct) -> Result<()> {
        self.0.copy_rows(src, first_row, dst)
    }
    fn read(&mut self, x: &CpuAct) -> Result<Vec<f32>> {
        self.0.read(x)
    }
    fn read_routes(&mut self, routes: &RouteTable) -> Result<RouteTable> {
        self.0.read_routes(routes)
    }
    fn predict_next(&mut self, layer: usize, at: LayerPoint, rows: RowKind, x: &CpuAct) -> Result<()> {
        self.0.predict_next(layer, at, rows, x)
    }
    fn expert_stats(&self) -> ExpertStats {
        self.0.expert_stats()
    }
    fn add_sequence(&mut self) -> Result<usize> {
        self.0.add_sequence()
    }
    fn select_sequence(&mut self, seq: usize) -> Result<()> {
        self.0.select_sequence(seq)
    }
    fn rope_rows(&mut self, x: &mut CpuAct, rows: &[SeqPos]) -> Result<()> {
        self.0.rope_rows(x, rows)
    }
    fn attention_rows(
        &mut self,
        layer: usize,
        rows: &[SeqPos],
        q: &CpuAct,
        k: &CpuAct,
        v: &CpuAct,
        out: &mut CpuAct,
    ) -> Result<()> {
        let k = CpuAct { rows: k.rows, width: k.width, data: f16_round(&k.data) };
        let v = CpuAct { rows: v.rows, width: v.width, data: f16_round(&v.data) };
        self.0.attention_rows(layer, rows, q, &k, &v, out)
    }
}
