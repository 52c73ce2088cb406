// expert_common.wgsl: what expert_gate_up.wgsl and expert_down.wgsl share, placed by the
// loader after the pool bindings and before the kernel: the slot lookup and the partial
// products of four consecutive rows of an expert matrix in a pool slot.
//
// The kernel binds `p` (ExpertGateUpParams or ExpertDownParams, src/backend/gpu/params.rs,
// whose first 15 fields are the same), `slots`, and `routes` (or, GROUPED, `order` from
// expert_group.wgsl), and defines `in_at(base, c)` (its input column c of
// the row at `base`, 0 past the input width `in_cols()`, never read out of bounds) and
// `row_count()` (rows of the matrix). Pools are bound as
// `array<vec4<u32>>`: slots start on 4 KiB and components on 64-byte boundaries, and every
// INT4-gs64 row (32-byte groups) and MXFP4 row (16-byte blocks of 32 codes) is whole
// 16-byte chunks, so each chunk is one aligned 16-byte load. F32 rows are whole chunks when
// their width is a multiple of 4; otherwise (`row_words` not a multiple of 4) each chunk's
// four words are loaded one by one and the words past the row masked to zero.
//
// The block between `//#pools` and `//#endpools` is emitted by the loader once per bound
// pool (`POOL` becomes `pool0`, `pool1`, ..., `POOL_INDEX` its index), so the pool is chosen
// once per workgroup (`partial`), outside the loops.

const NO_SLOT: u32 = 0xffffffffu;

// Input rows one workgroup multiplies by each weight chunk it loads: a tile of 8 pairs
// routed to one expert in GROUPED variants, one pair otherwise. Each row's sums are
// computed alone, in the same order whatever the tile holds.
//#if GROUPED
const TOKENS: u32 = 8u;
//#else
const TOKENS: u32 = 1u;
//#endif

var<workgroup> wg_slot: u32;

//#if GROUPED
var<workgroup> wg_range: vec2<u32>;

// Expert `e`'s VRAM slot and its entries `order[e] .. order[e + 1]` (uniform across the
// workgroup); entries past the pairs are clamped.
fn expert_slot(e: u32, lid: u32) -> u32 {
    if lid == 0u {
        wg_slot = slots[p.layer * p.experts + min(e, p.experts - 1u)];
        let total = order[p.experts];
        wg_range = vec2<u32>(min(order[e], total), min(order[e + 1u], total));
    }
    return workgroupUniformLoad(&wg_slot);
}

fn expert_range() -> vec2<u32> {
    return workgroupUniformLoad(&wg_range);
}

// The pair of entry `at` of the grouped order.
fn entry_pair(at: u32) -> u32 {
    return order[p.experts + 1u + at];
}
//#else
// The slot of pair `pair`'s expert (uniform across the workgroup).
fn pair_slot(pair: u32, lid: u32) -> u32 {
    if lid == 0u {
        let r = pair / p.k;
        // Clamped: the table is read without bounds checks (the routes come from
        // router_topk, or from a host upload).
        let e = min(routes[r * 2u * p.k + pair % p.k], p.experts - 1u);
        wg_slot = slots[p.layer * p.experts + e];
    }
    return workgroupUniformLoad(&wg_slot);
}
//#endif

// The slot's pool among the bound ones, or POOLS when it is not resident or not bound here.
fn local_pool(slot: u32) -> u32 {
    if slot == NO_SLOT {
        return POOLS;
    }
    let pool = slot / p.slots_per_pool;
    if pool < p.pool_first || pool >= p.pool_first + POOLS {
        return POOLS;
    }
    return pool - p.pool_first;
}

// Input columns c, c + 2, c + 4, c + 6 (`step` 2) or c .. c + 3 (`step` 1).
fn in4(base: u32, c: u32, step: u32) -> vec4<f32> {
    return vec4<f32>(in_at(base, c), in_at(base, c + step), in_at(base, c + 2u * step), in_at(base, c + 3u * step));
}

//#pools
// Word `i` of POOL.
fn word_POOL(i: u32) -> u32 {
    return POOL[i >> 2u][i & 3u];
}

// This invocation's share of rows row0 .. row0 + 3 (clamped to the matrix) of the matrix at
// word `base` (the slot) + `p.w_off` of POOL, times each of the TOKENS input rows at `ib`:
// 64 invocations stride over the rows' 16-byte chunks, four independent loads per step,
// each chunk used for every input row.
fn partial_POOL(base: u32, row0: u32, ib: array<u32, TOKENS>, lid: u32) -> array<vec4<f32>, TOKENS> {
    var rows: vec4<u32>;
    for (var r = 0u; r < 4u; r++) {
        rows[r] = min(row0 + r, row_count() - 1u);
    }
    var acc: array<vec4<f32>, TOKENS>;
//#if INT4
    // A chunk is half a group of 64: codes of elements 16h .. 16h + 15 (low nibbles) and
    // 16h + 32 .. 16h + 47 (high nibbles); one f16 scale per row and chunk.
    let chunks = p.row_words / 4u;
    let w0 = (base + p.w_off) / 4u;
    for (var q = lid; q < chunks; q += WG) {
        let g = q >> 1u;
        let c = g * 64u + (q & 1u) * 16u;
        var wv: array<vec4<u32>, 4>;
        var sc: vec4<f32>;
        for (var r = 0u; r < 4u; r++) {
            wv[r] = POOL[w0 + rows[r] * chunks + q];
            let d = rows[r] * p.groups + g;
            sc[r] = f16_at(word_POOL(base + p.s_off + (d >> 1u)), (d & 1u) == 1u);
        }
        for (var t = 0u; t < TOKENS; t++) {
            var s = vec4<f32>(0.0);
            for (var i = 0u; i < 4u; i++) {
                let xl = in4(ib[t], c + 4u * i, 1u);
                let xh = in4(ib[t], c + 4u * i + 32u, 1u);
                for (var r = 0u; r < 4u; r++) {
                    s[r] += dot(int4_lo(wv[r][i]), xl) + dot(int4_hi(wv[r][i]), xh);
                }
            }
            acc[t] += sc * s;
        }
    }
//#endif
//#if MXFP4
    // A chunk is one block of 32 codes (word i: elements 8i .. 8i + 7, low nibble the even
    // one) and its E8M0 scale byte; the block's 32 doubled products are summed in f32 and
    // scaled once (`mx_scaled`).
    let chunks = p.row_words / 4u;
    let w0 = (base + p.w_off) / 4u;
    for (var q = lid; q < chunks; q += WG) {
        let c = q * 32u;
        var wv: array<vec4<u32>, 4>;
        var e: vec4<u32>;
        for (var r = 0u; r < 4u; r++) {
            wv[r] = POOL[w0 + rows[r] * chunks + q];
            let d = rows[r] * p.groups + q;
            e[r] = (word_POOL(base + p.s_off + (d >> 2u)) >> (8u * (d & 3u))) & 255u;
        }
        for (var t = 0u; t < TOKENS; t++) {
            var s = vec4<f32>(0.0);
            for (var i = 0u; i < 4u; i++) {
                let xe = in4(ib[t], c + 8u * i, 2u);
                let xo = in4(ib[t], c + 8u * i + 1u, 2u);
                for (var r = 0u; r < 4u; r++) {
                    let wd = wv[r][i];
                    s[r] += dot(fp4x4_x2(wd & 0x0f0f0f0fu), xe) + dot(fp4x4_x2((wd >> 4u) & 0x0f0f0f0fu), xo);
                }
            }
            for (var r = 0u; r < 4u; r++) {
                acc[t][r] += mx_scaled(s[r], e[r]);
            }
        }
    }
//#endif
//#if !INT4
//#if !MXFP4
    let chunks = (p.row_words + 3u) / 4u;
    let aligned = (p.row_words & 3u) == 0u;
    for (var q = lid; q < chunks; q += WG) {
        let c = q * 4u;
        let live = (vec4<u32>(c) + vec4<u32>(0u, 1u, 2u, 3u)) < vec4<u32>(p.row_words);
        var wf: array<vec4<f32>, 4>;
        for (var r = 0u; r < 4u; r++) {
            let at = base + p.w_off + rows[r] * p.row_words + c;
            var wv: vec4<u32>;
            if aligned {
                wv = POOL[at >> 2u];
            } else {
                wv = vec4<u32>(word_POOL(at), word_POOL(at + 1u), word_POOL(at + 2u), word_POOL(at + 3u));
            }
            wf[r] = select(vec4<f32>(0.0), bitcast<vec4<f32>>(wv), live);
        }
        for (var t = 0u; t < TOKENS; t++) {
            let xv = in4(ib[t], c, 1u);
            for (var r = 0u; r < 4u; r++) {
                acc[t][r] += dot(wf[r], xv);
            }
        }
    }
//#endif
//#endif
    return acc;
}
//#endpools

// This invocation's share of rows row0 .. row0 + 3 of the expert matrix in `slot` of bound
// pool `lp` (< POOLS) times each input row at `ib`; sum each over the workgroup with wg_sum.
fn partial(lp: u32, slot: u32, row0: u32, ib: array<u32, TOKENS>, lid: u32) -> array<vec4<f32>, TOKENS> {
    let base = (slot % p.slots_per_pool) * p.stride;
    var acc: array<vec4<f32>, TOKENS>;
    switch lp {
//#pools
        case POOL_INDEXu: {
            acc = partial_POOL(base, row0, ib, lid);
        }
//#endpools
        default: {}
    }
    return acc;
}
