//! The KV cache with its rows on the GPU ([`CudaKvStore`]) against the host cache: the
//! same random adds, writes, removals, copies, position shifts (keys re-rotated on the
//! device) and clears leave both holding the same cells with bit-identical rows, also
//! after the pool grows past `n_ctx`. Without a GPU the test prints a SKIPPED line and
//! passes.

use std::io::Write;

use rustorch_core::kernels::ops::{Rope, RopeMode};
use rustorch_core::kv_cache::{KvCache, SeqId};
use rustorch_cuda::{CudaDevice, CudaKvStore, KeyRope};

const N_LAYER: usize = 3;
const HEAD_DIM: usize = 16;
const KV_DIM: usize = 2 * HEAD_DIM;
const N_CTX: usize = 40;

fn same(host: &KvCache, dev: &KvCache) {
    let ids: Vec<SeqId> = host.seq_ids().collect();
    assert_eq!(ids, dev.seq_ids().collect::<Vec<_>>());
    for id in ids {
        let (h, d) = (host.seq(id).unwrap(), dev.seq(id).unwrap());
        assert_eq!(h.pos, d.pos, "seq {id}");
        for l in 0..N_LAYER {
            let (k, v) = dev.store().unwrap().read(l, &d.slots);
            assert_eq!(h.k[l], k, "seq {id} layer {l} keys");
            assert_eq!(h.v[l], v, "seq {id} layer {l} values");
        }
    }
}

#[test]
fn device_store_mirrors_the_host_cache() {
    let dev = match CudaDevice::open(0) {
        Ok(d) => d,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "SKIPPED: CUDA KV store test: {e}");
            return;
        }
    };
    for mode in [RopeMode::Normal, RopeMode::Neox] {
        let rope = Rope {
            mode,
            n_rot: HEAD_DIM - 4,
            freq_base: 10000.0,
            freq_scale: 1.0,
            yarn: None,
        };
        let freqs: Vec<f32> = (0..rope.n_rot / 2).map(|i| 1.0 + (i % 3) as f32).collect();
        let rotate = |row: &mut [f32], delta: i64| {
            let half = rope.n_rot / 2;
            let (mut c, mut s) = (vec![0f32; half], vec![0f32; half]);
            rope.angles(delta as f32, Some(&freqs), &mut c, &mut s);
            for head in row.chunks_exact_mut(HEAD_DIM) {
                rope.apply(head, &c, &s);
            }
        };
        let key_rope = KeyRope {
            rope,
            head_dim: HEAD_DIM,
            freqs: Some(freqs.clone()),
        };
        let store = CudaKvStore::new(&dev, N_LAYER, KV_DIM, N_CTX, key_rope).expect("pool");
        let mut gpu = KvCache::with_store(N_LAYER, KV_DIM, N_CTX, Box::new(store));
        let mut host = KvCache::new(N_LAYER, KV_DIM, N_CTX);
        let mut seed = 0x9e3779b97f4a7c15u64;
        let mut rnd = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let mut shifts = 0;
        for step in 0..400usize {
            let seq = rnd(3) as SeqId;
            let other = rnd(3) as SeqId;
            let (a, b) = (rnd(30) as u32, rnd(30) as u32);
            let (p0, p1) = (a.min(b), a.max(b) + 1);
            match rnd(16) {
                0..=6 => {
                    if host.check_room(1).is_ok() {
                        let pos = host.seq_pos_max(seq).map_or(0, |p| p + 1 + rnd(2) as u32);
                        for c in [&mut host, &mut gpu] {
                            let cell = c.add_cell(seq, pos);
                            for l in 0..N_LAYER {
                                let k: Vec<f32> = (0..KV_DIM)
                                    .map(|i| ((step * 31 + i * 7 + l) % 97) as f32 * 0.043 - 2.0)
                                    .collect();
                                let v: Vec<f32> = (0..KV_DIM)
                                    .map(|i| ((step * 13 + i * 5 + l) % 89) as f32 * -0.021)
                                    .collect();
                                c.write(seq, cell, l, &k, &v);
                            }
                        }
                    }
                }
                7 | 8 => {
                    host.seq_rm(seq, Some(p0), Some(p1));
                    gpu.seq_rm(seq, Some(p0), Some(p1));
                }
                9 | 10 => {
                    let r = host.seq_cp_range(seq, other, None, Some(p1));
                    assert_eq!(r, gpu.seq_cp_range(seq, other, None, Some(p1)));
                }
                11 => {
                    // may go past n_ctx: the pool grows
                    host.seq_cp(seq, other);
                    gpu.seq_cp(seq, other);
                }
                12 | 13 => {
                    let delta = rnd(9) as i64 - 5;
                    shifts += usize::from(host.seq_len(seq) > 0);
                    host.seq_add(seq, p0, Some(p1), delta, &rotate);
                    gpu.seq_add(seq, p0, Some(p1), delta, &|_, _| unreachable!());
                }
                14 => {
                    host.seq_keep(seq);
                    gpu.seq_keep(seq);
                }
                _ => {
                    if rnd(6) == 0 {
                        host.clear();
                        gpu.clear();
                    }
                }
            }
            if step % 8 == 0 {
                same(&host, &gpu);
            }
        }
        same(&host, &gpu);
        let store = gpu.store().unwrap().as_any().downcast_ref::<CudaKvStore>();
        assert!(store.unwrap().error().is_none());
        assert!(shifts > 10, "{shifts} shifts");
    }
}
