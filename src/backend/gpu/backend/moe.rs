//! The MoE block on the device: routing (router, top-k, the next layer's prediction and its
//! score), the expert kernels over the VRAM expert cache, and the weighted combine.

use std::sync::Arc;
use std::time::Instant;

use crate::backend::{Backend, LinearId, NormId};
use crate::error::{Error, Result};

use super::super::buffers::{GpuAct, GpuRoutes, decode_routes, floats};
use super::super::context::{Bind, GBuf};
use super::super::params::{
    ExpertDownParams, ExpertGateUpParams, ExpertGroupParams, MoeCombineParams, RouteAgreeParams,
    RouterTopkParams,
};
use super::super::shaders::Op;
use super::super::vram::MissPolicy;
use super::split::SplitStats;
use super::{GpuBackend, activation_code, check_shape, routing_code};

/// The most experts a layer may have for the GROUPED expert kernels (expert_group.wgsl's
/// `MAX_EXPERTS`); a model with more runs its prompt blocks per pair.
const MAX_GROUPED_EXPERTS: usize = 1024;

/// The routing prediction for the next layer, kept across `route` calls.
pub(super) struct Prediction {
    pub(super) rows: usize,
    /// Ping-pong by layer parity: `bufs[l % 2]` holds the prediction for layer `l`.
    pub(super) bufs: [GpuRoutes; 2],
    /// The layer the latest prediction is for.
    pub(super) valid_for: Option<usize>,
}

impl GpuBackend {
    pub(super) fn topk(&mut self, logits: &GpuAct, routes: &GpuRoutes) -> Result<()> {
        let rows = logits.rows();
        let (nx, ny) = self.gpu.grid(rows.div_ceil(64) as u64)?;
        let params = RouterTopkParams {
            rows: rows as u32,
            experts: self.cfg.num_experts as u32,
            k: self.cfg.experts_per_token as u32,
            nx,
            rule: routing_code(self.cfg.recipe.routing),
            _pad: [0; 3],
        };
        let v = self.variant(Op::RouterTopk);
        self.gpu.dispatch(Op::RouterTopk, v, &params, &[logits.bind(), routes.bind()], (nx, ny, 1))
    }

    pub(super) fn prediction_buffers(&mut self, rows: usize) -> Result<()> {
        if self.pred.as_ref().is_some_and(|p| p.rows == rows) {
            return Ok(());
        }
        let k = self.cfg.experts_per_token;
        let bytes = (rows * 2 * k * 4) as u64;
        let a = GpuRoutes::new(rows, k, self.scratch(bytes)?);
        let b = GpuRoutes::new(rows, k, self.scratch(bytes)?);
        self.pred = Some(Prediction { rows, bufs: [a, b], valid_for: None });
        Ok(())
    }

    /// The parameters of expert_gate_up.wgsl for pool group `first`, pairs from `p0`.
    fn gate_up_params(&self, layer: usize, first: usize, nx: u32, p0: usize) -> ExpertGateUpParams {
        let cfg = &self.cfg;
        let lay = self.vram.layout;
        ExpertGateUpParams {
            layer: layer as u32,
            k: cfg.experts_per_token as u32,
            experts: cfg.num_experts as u32,
            hidden: cfg.hidden_size as u32,
            inter: cfg.intermediate_size as u32,
            pool_first: first as u32,
            slots_per_pool: self.vram.slots_per_pool as u32,
            stride: lay.stride,
            w_off: lay.gu_w,
            s_off: lay.gu_s,
            b_off: lay.gu_b,
            row_words: lay.gu_row_words,
            groups: lay.gu_groups,
            nx,
            pair_first: p0 as u32,
            limit: cfg.swiglu_limit,
            alpha: cfg.swiglu_alpha,
            activation: activation_code(cfg.recipe.activation),
            eps: cfg.rms_norm_eps,
            _pad: [0; 1],
        }
    }

    /// The parameters of expert_down.wgsl for pool group `first`, pairs from `p0`.
    fn down_params(&self, layer: usize, first: usize, nx: u32, p0: usize) -> ExpertDownParams {
        let cfg = &self.cfg;
        let lay = self.vram.layout;
        ExpertDownParams {
            layer: layer as u32,
            k: cfg.experts_per_token as u32,
            experts: cfg.num_experts as u32,
            hidden: cfg.hidden_size as u32,
            inter: cfg.intermediate_size as u32,
            pool_first: first as u32,
            slots_per_pool: self.vram.slots_per_pool as u32,
            stride: lay.stride,
            w_off: lay.dn_w,
            s_off: lay.dn_s,
            b_off: lay.dn_b,
            row_words: lay.dn_row_words,
            groups: lay.dn_groups,
            nx,
            pair_first: p0 as u32,
            _pad: [0; 1],
        }
    }

    /// The pool buffers of the group starting at `first`, padded with the placeholder to
    /// the pools a dispatch binds.
    fn pool_group(&self, first: usize) -> Vec<GBuf> {
        let per = self.vram.pools_per_dispatch as usize;
        let pools = &self.vram.pools;
        let mut group: Vec<GBuf> = pools[first..pools.len().min(first + per)].to_vec();
        while group.len() < per {
            group.push(self.gpu.dummy.clone());
        }
        group
    }

    /// Records expert_gate_up.wgsl for pool group `first` and every pair of `routes`
    /// (NORM variant when `norm` is given: `x` is then the raw residual; GROUPED, one
    /// workgroup per expert over its pairs, when `order` is given).
    #[allow(clippy::too_many_arguments)]
    fn dispatch_gate_up(
        &mut self,
        layer: usize,
        first: usize,
        x: &GpuAct,
        routes: &GpuRoutes,
        order: Option<&GBuf>,
        act: &GBuf,
        norm: Option<&GBuf>,
    ) -> Result<()> {
        if layer >= self.cfg.num_layers {
            return Err(Error::Backend(format!("no layer {layer}")));
        }
        let (i, k) = (self.cfg.intermediate_size, self.cfg.experts_per_token);
        let pairs = routes.rows() * k;
        let mut v = self.variant(Op::ExpertGateUp);
        v.norm = norm.is_some();
        v.grouped = order.is_some();
        // Two intermediate indices (four gate/up rows) per workgroup.
        let (gx, gy) = self.gpu.grid(i.div_ceil(2) as u64)?;
        let act_bytes = (pairs * i * 4) as u64;
        let table = self.vram.table.clone();
        let group = self.pool_group(first);
        for (p0, n) in self.z_ranges(pairs, order.is_some()) {
            let params = self.gate_up_params(layer, first, gx, p0);
            let pairs_bind = match order {
                Some(o) => Bind::whole(o),
                None => routes.bind(),
            };
            let mut binds = vec![x.bind(), pairs_bind, Bind::whole(&table), Bind::first(act, act_bytes)];
            binds.extend(group.iter().map(Bind::whole));
            if let Some(w) = norm {
                binds.push(Bind::whole(w));
            }
            self.gpu.dispatch(Op::ExpertGateUp, v, &params, &binds, (gx, gy, n as u32))?;
        }
        Ok(())
    }

    /// Whether the experts of a block of `rows` rows run grouped by expert: a prompt block
    /// (more than one row of one sequence, not a batched step, whose rows must compute as
    /// their solo steps do) of a model within expert_group.wgsl's limit.
    fn groups_experts(&self, rows: usize) -> bool {
        rows > 1 && !self.batched_step && self.cfg.num_experts <= MAX_GROUPED_EXPERTS
    }

    /// The grid's z ranges (first, count) of an expert dispatch: the layer's experts
    /// (`grouped`: a workgroup per expert), or its `pairs` in slices of the grid's limit.
    fn z_ranges(&self, pairs: usize, grouped: bool) -> Vec<(usize, usize)> {
        let total = if grouped { self.cfg.num_experts } else { pairs };
        let max = (self.gpu.max_groups as usize).max(1);
        (0..total).step_by(max).map(|p0| (p0, max.min(total - p0))).collect()
    }

    /// Groups the pairs of `routes` by expert on the device (expert_group.wgsl): the order
    /// the GROUPED expert kernels read. Counts the block's union in the device counters.
    fn group_pairs(&mut self, routes: &GpuRoutes) -> Result<super::super::buffers::Pooled> {
        let (e, k) = (self.cfg.num_experts, self.cfg.experts_per_token);
        let pairs = routes.rows() * k;
        let order = self.scratch(((e + 1 + pairs) * 4) as u64)?;
        let params = ExpertGroupParams { pairs: pairs as u32, k: k as u32, experts: e as u32, _pad: [0; 1] };
        let v = self.variant(Op::ExpertGroup);
        let agree = self.agree.clone();
        let binds = [routes.bind(), Bind::whole(order.buf()), Bind::whole(&agree)];
        self.gpu.dispatch(Op::ExpertGroup, v, &params, &binds, (1, 1, 1))?;
        Ok(order)
    }

    /// Records the expert kernels of `layer` for every pair whose expert is resident: per
    /// pair, or GROUPED by expert when `order` (from [`Self::group_pairs`]) is given.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn dispatch_experts(
        &mut self,
        layer: usize,
        x: &GpuAct,
        routes: &GpuRoutes,
        order: Option<&GBuf>,
        act: &GBuf,
        contrib: &GBuf,
    ) -> Result<()> {
        let (h, i, k) = (self.cfg.hidden_size, self.cfg.intermediate_size, self.cfg.experts_per_token);
        let pairs = routes.rows() * k;
        let mut vd = self.variant(Op::ExpertDown);
        vd.grouped = order.is_some();
        let per = self.vram.pools_per_dispatch as usize;
        let table = self.vram.table.clone();
        let (dx, dy) = self.gpu.grid(h.div_ceil(4) as u64)?; // four outputs per workgroup
        let act_bytes = (pairs * i * 4) as u64;
        let contrib_bytes = (pairs * h * 4) as u64;
        for first in (0..self.vram.pools.len()).step_by(per) {
            self.dispatch_gate_up(layer, first, x, routes, order, act, None)?;
            let group = self.pool_group(first);
            for (p0, n) in self.z_ranges(pairs, order.is_some()) {
                let params = self.down_params(layer, first, dx, p0);
                let pairs_bind = match order {
                    Some(o) => Bind::whole(o),
                    None => routes.bind(),
                };
                let mut binds = vec![
                    Bind::first(act, act_bytes),
                    pairs_bind,
                    Bind::whole(&table),
                    Bind::first(contrib, contrib_bytes),
                ];
                binds.extend(group.iter().map(Bind::whole));
                self.gpu.dispatch(Op::ExpertDown, vd, &params, &binds, (dx, dy, n as u32))?;
            }
        }
        Ok(())
    }

    /// True when [`Self::experts_fused`] applies to `rows` token rows: every expert
    /// resident, every pool bound by one dispatch, the norm weight bindable beside them
    /// (5 + pools storage bindings), and the rows within one grid dimension.
    pub(super) fn fused_experts_fit(&self, rows: usize) -> bool {
        let per = self.vram.pools_per_dispatch;
        self.vram.is_full()
            && self.vram.pools.len() <= per as usize
            && per + 5 <= self.gpu.max_storage_bindings
            && rows <= self.gpu.max_groups as usize
    }

    /// The whole MoE block of `layer` fused, when it applies:
    /// `out_residual[r] += sum_j w[r][j] * expert_{e_j}(rms_norm(residual_in[r]) * norm)` over
    /// each row's k routed experts in routing order (`routes`: k expert indices then k f32
    /// weights per row), where the norm is computed inside expert_gate_up.wgsl (NORM) and
    /// the down projection, bias, weighted sum and residual add in one expert_down.wgsl
    /// dispatch (COMBINE). The result is bit-identical to `rms_norm` + `experts` + `add`.
    ///
    /// Applies only when one dispatch covers every pair: every expert resident, every pool
    /// bound by one dispatch, the norm weight bindable beside them, and at most
    /// `max_compute_workgroups_per_dimension` rows. Otherwise returns `Ok(false)` having
    /// recorded nothing, and the caller runs the unfused chain. `residual_in` may be
    /// `out_residual` (the usual `h += moe(norm(h))`).
    /// The MoE half of a layer in four kernels when every expert is resident and no
    /// prediction runs: the router over the residual with the MLP norm inside the product
    /// (matvec NORM), router_topk, gate/up with the same norm inside (expert_gate_up NORM),
    /// and down with the routing-weighted sum and the residual add (expert_down COMBINE).
    /// `false`, having recorded nothing, otherwise (a dense layer, partial residency, or
    /// the prediction on): the forward pass then runs the ops.
    pub(super) fn run_fused_moe(&mut self, layer: usize, x: &GpuAct, routes: &GpuRoutes) -> Result<bool> {
        let rows = x.rows();
        // A prompt block runs the chain, whose experts are grouped (each read once for all
        // the block's pairs instead of once per pair).
        if self.predict || !self.fused_experts_fit(rows) || routes.rows() != rows || self.groups_experts(rows)
        {
            return Ok(false);
        }
        let owner = self.layer(layer)?;
        let Some(router) = owner.router() else {
            return Ok(false);
        };
        let logits = self.alloc(rows, self.cfg.num_experts)?;
        self.matvec_fused(&router.m, router.bias.as_ref(), x, &logits, Some(&owner.mlp_norm), false)?;
        self.topk(&logits, routes)?;
        if !self.experts_fused(layer, x, &owner.mlp_norm, routes, x)? {
            return Err(Error::Backend(format!("layer {layer}: the fused experts refused a fusable block")));
        }
        Ok(true)
    }

    pub(super) fn experts_fused(
        &mut self,
        layer: usize,
        residual_in: &GpuAct,
        norm: &GBuf,
        routes: &GpuRoutes,
        out_residual: &GpuAct,
    ) -> Result<bool> {
        let (h, i, k) = (self.cfg.hidden_size, self.cfg.intermediate_size, self.cfg.experts_per_token);
        let rows = residual_in.rows();
        check_shape("experts in", residual_in, rows, h)?;
        check_shape("experts out", out_residual, rows, h)?;
        if routes.rows() != rows {
            return Err(Error::Backend(format!("experts: {} routing rows for {rows} rows", routes.rows())));
        }
        if norm.size < (h * 4) as u64 {
            return Err(Error::Backend(format!("experts: a norm weight of {} bytes", norm.size)));
        }
        if !self.fused_experts_fit(rows) {
            return Ok(false);
        }
        let pairs = rows * k;
        self.vram.stats.hits += pairs as u64;
        let act = self.scratch((pairs * i * 4) as u64)?;
        self.dispatch_gate_up(layer, 0, residual_in, routes, None, act.buf(), Some(norm))?;
        let mut v = self.variant(Op::ExpertDown);
        v.combine = true;
        let (dx, dy) = self.gpu.grid(h.div_ceil(4) as u64)?; // four outputs per workgroup
        let params = self.down_params(layer, 0, dx, 0);
        let table = self.vram.table.clone();
        let group = self.pool_group(0);
        let mut binds = vec![
            Bind::first(act.buf(), (pairs * i * 4) as u64),
            routes.bind(),
            Bind::whole(&table),
            out_residual.bind(),
        ];
        binds.extend(group.iter().map(Bind::whole));
        self.gpu.dispatch(Op::ExpertDown, v, &params, &binds, (dx, dy, rows as u32))?;
        Ok(true)
    }

    /// [`Self::experts_fused`] with `layer`'s MLP norm weight, for the forward pass's fused
    /// orchestration and for tests: `out_residual += experts(rms_norm_mlp(residual_in))`
    /// (the two may be the same activation) when every
    /// expert is resident in one pool group (returns `Ok(true)`), else `Ok(false)` with
    /// nothing recorded.
    pub fn mlp_experts_fused(
        &mut self,
        layer: usize,
        residual_in: &GpuAct,
        routes: &GpuRoutes,
        out_residual: &GpuAct,
    ) -> Result<bool> {
        let w = self.norm_weight(NormId::Mlp(layer))?;
        self.experts_fused(layer, residual_in, &w, routes, out_residual)
    }

    pub(super) fn run_route(&mut self, layer: usize, x: &GpuAct, routes: &mut GpuRoutes) -> Result<()> {
        let cfg = Arc::clone(&self.cfg);
        let rows = x.rows();
        if routes.rows() != rows {
            return Err(Error::Backend(format!("route: {} routing rows for {rows} rows", routes.rows())));
        }
        let logits = self.alloc(rows, cfg.num_experts)?;
        let mut out = logits;
        self.linear(LinearId::Router(layer), x, &mut out)?;
        self.topk(&out, routes)?;
        if !self.predict {
            return Ok(());
        }
        // Score the prediction made for this layer at the previous one, on the GPU.
        self.prediction_buffers(rows)?;
        let pred = self.pred.take().ok_or_else(|| Error::Backend("prediction buffers".into()))?;
        let next_moe = self.layers.get(layer + 1).is_some_and(|l| l.router().is_some());
        let result = (|| {
            if pred.valid_for == Some(layer) {
                let (nx, ny) = self.gpu.grid(rows.div_ceil(64) as u64)?;
                let params =
                    RouteAgreeParams { rows: rows as u32, k: cfg.experts_per_token as u32, nx, _pad: [0; 1] };
                let v = self.variant(Op::RouteAgree);
                let agree = self.agree.clone();
                let binds = [pred.bufs[layer % 2].bind(), routes.bind(), Bind::whole(&agree)];
                self.gpu.dispatch(Op::RouteAgree, v, &params, &binds, (nx, ny, 1))?;
            }
            // Router L+1 on layer L's normalized activation: the prefetcher's hint (when
            // layer L+1 is a MoE layer).
            if next_moe {
                self.linear(LinearId::Router(layer + 1), x, &mut out)?;
                self.topk(&out, &pred.bufs[(layer + 1) % 2])?;
            }
            Ok(())
        })();
        let mut pred = pred;
        pred.valid_for = next_moe.then_some(layer + 1);
        self.pred = Some(pred);
        result
    }

    pub(super) fn run_experts(
        &mut self,
        layer: usize,
        x: &GpuAct,
        routes: &GpuRoutes,
        out: &mut GpuAct,
    ) -> Result<()> {
        let cfg = Arc::clone(&self.cfg);
        let (h, i, k) = (cfg.hidden_size, cfg.intermediate_size, cfg.experts_per_token);
        let rows = x.rows();
        check_shape("experts out", out, rows, h)?;
        let pairs = rows * k;
        let act = self.scratch((pairs * i * 4) as u64)?;
        let contrib = self.scratch((pairs * h * 4) as u64)?;
        // A prompt block's pairs are grouped by expert, so each expert of its union is read
        // once; a decoded token and a batched step (whose rows must compute as their solo
        // steps do) run per pair.
        let order = if self.groups_experts(rows) { Some(self.group_pairs(routes)?) } else { None };
        let order = order.as_ref().map(|o| o.buf().clone());
        let mut predicted: Vec<usize> = Vec::new();
        if self.vram.is_full() {
            // Every expert is resident: the kernels find their slots on the device.
            self.vram.stats.hits += pairs as u64;
            self.dispatch_experts(layer, x, routes, order.as_ref(), act.buf(), contrib.buf())?;
        } else {
            // Read back this layer's routing (with the CPU+GPU split, its input rows too;
            // and the prediction for the next layer), all in one readback.
            let host_rows = self.misses == MissPolicy::Cpu;
            let x_bytes = (rows * h * 4) as u64;
            let next = self.pred.as_ref().filter(|p| p.valid_for == Some(layer + 1) && p.rows == rows);
            let mut ranges = vec![(routes.buf().clone(), 0, routes.bytes())];
            if host_rows {
                ranges.push((x.buf().clone(), 0, x_bytes));
            }
            let has_next = next.is_some();
            if let Some(p) = next {
                let b = &p.bufs[(layer + 1) % 2];
                ranges.push((b.buf().clone(), 0, b.bytes()));
            }
            let refs: Vec<(&GBuf, u64, u64)> = ranges.iter().map(|(b, o, s)| (b, *o, *s)).collect();
            let waited = Instant::now();
            let bytes = self.read_back(&refs)?;
            let device_wait_s = waited.elapsed().as_secs_f64();
            self.stats.route_readbacks += 1;
            let table = decode_routes(&bytes, rows, k);
            let mut at = routes.bytes() as usize;
            let xs = if host_rows {
                let v = floats(&bytes[at..at + x_bytes as usize]);
                at += x_bytes as usize;
                v
            } else {
                Vec::new()
            };
            if has_next {
                let p = decode_routes(&bytes[at..], rows, k);
                predicted = p.experts.iter().map(|&e| e as usize).collect();
                predicted.sort_unstable();
                predicted.dedup();
                // Start the disk reads of the predicted experts now, in the RAM tier's
                // background readers, so they overlap this layer's work.
                if layer + 1 < cfg.num_layers {
                    self.source.prefetch(layer + 1, &predicted);
                }
            }
            let mut needed: Vec<usize> = table.experts.iter().map(|&e| e as usize).collect();
            needed.sort_unstable();
            needed.dedup();
            if needed.iter().any(|&e| e >= cfg.num_experts) {
                return Err(Error::Backend(format!("layer {layer}: routing names an expert out of range")));
            }
            let mut split = match self.misses {
                MissPolicy::Cpu => {
                    let mut s = self.split_experts(
                        layer,
                        x,
                        &xs,
                        &table,
                        &needed,
                        routes,
                        order.as_ref(),
                        act.buf(),
                        contrib.buf(),
                    )?;
                    s.bus_bytes += x_bytes;
                    s
                }
                MissPolicy::Upload => {
                    let misses = self.vram.stats.misses;
                    let started = Instant::now();
                    for chunk in needed.chunks(self.vram.slots) {
                        self.vram.ensure(&mut self.gpu, &self.source, layer, chunk, false)?;
                        self.dispatch_experts(layer, x, routes, order.as_ref(), act.buf(), contrib.buf())?;
                    }
                    let waited = self.vram.stats.misses > misses;
                    SplitStats {
                        layers: 1,
                        gpu_experts: needed.len() as u64,
                        upload_waits: waited as u64,
                        upload_wait_s: if waited { started.elapsed().as_secs_f64() } else { 0.0 },
                        ..Default::default()
                    }
                }
            };
            split.device_wait_s = device_wait_s;
            self.stats.split.add(&split);
            if self.in_decode {
                self.stats.decode_split.add(&split);
            }
        }
        let (nx, ny) = self.gpu.grid((rows * h).div_ceil(64) as u64)?;
        let params = MoeCombineParams { rows: rows as u32, hidden: h as u32, k: k as u32, nx };
        let v = self.variant(Op::MoeCombine);
        let cb = Bind::first(contrib.buf(), (pairs * h * 4) as u64);
        self.gpu.dispatch(Op::MoeCombine, v, &params, &[cb, routes.bind(), out.bind()], (nx, ny, 1))?;
        if self.misses == MissPolicy::Upload && !predicted.is_empty() && layer + 1 < cfg.num_layers {
            // Submit this layer's work, then fetch and upload the predicted experts of the
            // next layer while the device runs it.
            self.gpu.flush()?;
            predicted.truncate(self.vram.slots);
            self.vram.ensure(&mut self.gpu, &self.source, layer + 1, &predicted, true)?;
        }
        Ok(())
    }
}
