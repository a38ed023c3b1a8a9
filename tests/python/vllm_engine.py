#!/usr/bin/python3
"""One "engine process" for test_vllm_connector.py: drives TqkvConnector exactly as
vLLM's scheduler and GPU model runner call it, on a real paged KV cache (torch,
FlashAttention's layout: per layer [2][num_blocks][block_size][num_kv_heads][head_size]
BF16), for one request. Prints a JSON result on its last line.

The model is simulated: the KV a "prefill" computes for token position p at layer l is
a deterministic function of (seed, layer, p) (the same in every process), written into
the request's blocks through its block table, which is a permutation of the cache's
blocks chosen by table_seed (so two engines hold the same tokens in different blocks).

Config (JSON in argv[1], or on stdin): targets, tokens (the prompt: a list of ints), seed,
layers, heads, dim, block_size, num_blocks, table_seed, lease_ms, namespace,
kill_pid / kill_at_layer (SIGKILL a server once that layer's load was waited for),
expire_then_delete (sleep past the lease after the Lookup, then delete the prompt's
blocks from the server: an eviction after the lease expired), verify (compare loaded
blocks with tqkv-codec decode-kv of the same pages: the list of layers to check).
"""
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import numpy as np
import torch

import tqkv
from tqkv.vllm_connector import KVConnectorRole, TqkvConnector, token_block_hashes


def original_kv(seed, layer, positions, H, D, bs=16):
    """The "model's" K and V [len(positions)][H][D] BF16 for token positions: random
    per (seed, layer, 16-position group), so any position reads the same in every call
    and every process."""
    pos = np.asarray(list(positions), dtype=np.int64)
    if len(pos) == 0:
        return (torch.empty((0, H, D), dtype=torch.bfloat16),) * 2
    b0, b1 = int(pos.min()) // bs, int(pos.max()) // bs
    ks, vs = [], []
    for blk in range(b0, b1 + 1):
        g = torch.Generator().manual_seed((seed * 1000003 + layer) * 1000003 + blk)
        ks.append(torch.randn((bs, H, D), generator=g))
        vs.append(torch.randn((bs, H, D), generator=g) * 0.5)
    k = torch.cat(ks).to(torch.bfloat16)
    v = torch.cat(vs).to(torch.bfloat16)
    idx = torch.from_numpy(pos - b0 * bs)
    return k[idx], v[idx]


class Blocks:
    """vllm.v1.core.kv_cache_manager.KVCacheBlocks, as the connector uses it."""

    def __init__(self, ids):
        self._ids = list(ids)

    def get_block_ids(self):
        return (list(self._ids),)


def main():
    cfg = json.loads(sys.argv[1] if len(sys.argv) > 1 else sys.stdin.read())
    L, H, D, bs = cfg["layers"], cfg["heads"], cfg["dim"], cfg["block_size"]
    NB = cfg["num_blocks"]
    tokens = cfg["tokens"]
    extra = {"tqkv_targets": cfg["targets"], "tqkv_lease_ms": cfg.get("lease_ms", 30000),
             "tqkv_namespace": cfg.get("namespace", "llama3-8b-test"),
             "tqkv_deadline_ms": cfg.get("deadline_ms", 5000)}
    if "tqkv_layers_per_get" in cfg:
        extra["tqkv_layers_per_get"] = cfg["tqkv_layers_per_get"]
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector="TqkvConnector",
                                           kv_connector_module_path="tqkv.vllm_connector",
                                           kv_role="kv_both", kv_connector_extra_config=extra),
        cache_config=SimpleNamespace(block_size=bs),
        model_config=SimpleNamespace(model="meta-llama/Meta-Llama-3-8B",
                                     get_num_layers=lambda pc: L),
        parallel_config=SimpleNamespace(tensor_parallel_size=1))
    sched = TqkvConnector(vllm_config, KVConnectorRole.SCHEDULER)
    worker = TqkvConnector(vllm_config, KVConnectorRole.WORKER)
    names = ["model.layers.%d.self_attn.attn" % i for i in range(L)]
    kv = {n: torch.zeros((2, NB, bs, H, D), dtype=torch.bfloat16) for n in names}
    worker.register_kv_caches(kv)

    # ---- scheduler step ----
    req = SimpleNamespace(request_id="req-0", prompt_token_ids=list(tokens),
                          all_token_ids=list(tokens), num_computed_tokens=0, cache_salt=None,
                          lora_request=None, mm_features=[], block_hashes=[])
    t0 = time.perf_counter()
    ext, is_async = sched.get_num_new_matched_tokens(req, 0)
    t_lookup = time.perf_counter() - t0
    assert is_async is False
    if cfg.get("expire_then_delete"):
        time.sleep(cfg["lease_ms"] / 1000.0 + 0.3)
        n_full = (len(tokens) - 1) // bs
        seed = sched._seed(req)
        c = tqkv.Client(cfg["targets"])
        c.delete(sched._namespace(req), token_block_hashes(tokens, bs, n_full, seed))
        c.close()
    need = (len(tokens) + bs - 1) // bs
    table = np.random.default_rng(cfg["table_seed"]).permutation(NB)[:need].tolist()
    sched.update_state_after_alloc(req, Blocks(table), ext)
    new_req = SimpleNamespace(req_id="req-0", prompt_token_ids=list(tokens), block_ids=(table,),
                              num_computed_tokens=ext, mm_features=[], lora_request=None)
    out = SimpleNamespace(scheduled_new_reqs=[new_req],
                          scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                                                num_computed_tokens=[],
                                                                resumed_req_ids=set()),
                          num_scheduled_tokens={"req-0": len(tokens) - ext})
    meta = pickle.loads(pickle.dumps(sched.build_connector_meta(out)))  # to the worker

    # ---- worker: one forward pass ----
    worker.bind_connector_metadata(meta)
    t0 = time.perf_counter()
    worker.start_load_kv(SimpleNamespace(attn_metadata={}, no_compile_layers={}))
    ext_blocks = ext // bs
    for i, n in enumerate(names):
        worker.wait_for_layer_load(n)
        if cfg.get("kill_pid") and i == cfg.get("kill_at_layer", 0):
            os.kill(cfg["kill_pid"], signal.SIGKILL)
        # "compute" this layer's KV for the tokens not loaded, into their slots
        pos = list(range(ext, len(tokens)))
        if pos:
            k, v = original_kv(cfg["seed"], i, pos, H, D)
            slots = torch.as_tensor([table[p // bs] * bs + p % bs for p in pos])
            kv[n][0].view(NB * bs, H, D)[slots] = k
            kv[n][1].view(NB * bs, H, D)[slots] = v
        worker.save_kv_layer(n, kv[n], None)
    worker.wait_for_save()
    t_forward = time.perf_counter() - t0
    failed = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    # vLLM recomputes from the first failed block: the test engine does the same.
    recompute_from = min([table.index(b) for b in failed], default=ext_blocks)
    if failed:
        pos = list(range(recompute_from * bs, ext))
        for i, n in enumerate(names):
            k, v = original_kv(cfg["seed"], i, pos, H, D)
            slots = torch.as_tensor([table[p // bs] * bs + p % bs for p in pos])
            kv[n][0].view(NB * bs, H, D)[slots] = k
            kv[n][1].view(NB * bs, H, D)[slots] = v
    sched.request_finished(req, table)

    # ---- checks: every block is the codec's decode of its page, or the original ----
    res = dict(ext_tokens=ext, failed_blocks=len(failed), recompute_from=recompute_from,
               stats=worker.stats(), sched_stats=sched.stats(), t_lookup=t_lookup,
               t_forward=t_forward, table=table[:4], checked_pages=0, codec_equal=True,
               original_equal=True, loaded_rel_err=0.0)
    loaded = list(range(recompute_from))  # request block indices that came from tqkv
    n_full = (len(tokens) - 1) // bs
    hashes = token_block_hashes(tokens, bs, n_full, sched._seed(req))
    verify = cfg.get("verify", list(range(L)))
    codec = os.environ.get("TQKV_CODEC")
    errs = []
    if loaded and verify and cfg.get("verify_targets"):
        c = tqkv.Client(cfg["verify_targets"])
        for layer in verify:
            pages = c.get_pages(sched._namespace(req), [hashes[j] for j in loaded], layer,
                                layer + 1)
            if len(pages) != len(loaded):
                res["codec_equal"] = False
                errs.append("layer %d: %d of %d pages on the server" % (layer, len(pages),
                                                                        len(loaded)))
                continue
            with tempfile.TemporaryDirectory() as td:
                with open(os.path.join(td, "p.tqp"), "wb") as f:
                    for j in range(len(loaded)):
                        f.write(pages[(j, layer)])
                subprocess.run([codec, "decode-kv", os.path.join(td, "p.tqp"),
                                os.path.join(td, "k"), os.path.join(td, "v")], check=True,
                               capture_output=True)
                dk = np.fromfile(os.path.join(td, "k"), np.uint16).reshape(-1, bs, H, D)
                dv = np.fromfile(os.path.join(td, "v"), np.uint16).reshape(-1, bs, H, D)
            ids = [table[j] for j in loaded]
            mk = kv[names[layer]][0][ids].view(torch.int16).numpy().view(np.uint16)
            mv = kv[names[layer]][1][ids].view(torch.int16).numpy().view(np.uint16)
            if not (np.array_equal(mk, dk) and np.array_equal(mv, dv)):
                res["codec_equal"] = False
                errs.append("layer %d: paged blocks differ from tqkv-codec decode-kv" % layer)
            res["checked_pages"] += len(loaded)
            ok, ov = original_kv(cfg["seed"], layer, list(range(len(loaded) * bs)), H, D)
            e = float((torch.from_numpy(dk.astype(np.int16)).view(torch.bfloat16).float()
                       .reshape(ok.shape) - ok.float()).norm() / ok.float().norm())
            res["loaded_rel_err"] = max(res["loaded_rel_err"], e)
        c.close()
    # Blocks not loaded hold exactly the original (computed or recomputed).
    for layer in verify:
        pos = list(range(recompute_from * bs, len(tokens)))
        if not pos:
            continue
        k, v = original_kv(cfg["seed"], layer, pos, H, D)
        slots = torch.as_tensor([table[p // bs] * bs + p % bs for p in pos])
        if not (torch.equal(kv[names[layer]][0].view(NB * bs, H, D)[slots], k) and
                torch.equal(kv[names[layer]][1].view(NB * bs, H, D)[slots], v)):
            res["original_equal"] = False
            errs.append("layer %d: computed blocks differ from the original" % layer)
    res["errors"] = errs[:5]
    worker.shutdown()
    sched.shutdown()
    print(json.dumps(res))


if __name__ == "__main__":
    main()
