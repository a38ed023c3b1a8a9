#!/usr/bin/env python3
"""One real vLLM engine process for test_vllm_engine.py: vLLM's LLM (the installed vLLM,
CPU build) on a tiny Llama-architecture model whose config.json the test wrote, dummy
weights (load_format="dummy", no download), token-id prompts (skip_tokenizer_init),
greedy decoding; with "targets" set, kv_transfer_config loads tqkv.vllm_connector's
TqkvConnector against those tqkv-servers. Config: JSON on stdin. Prints a JSON result on
its last line: the generated token ids per prompt and the connector's counters
(scheduler and worker side, from tqkv_stats_path).

kill_pid: SIGKILL that process (a tqkv-server) when the worker's first load starts
(the engine runs in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0).
"""
import json
import os
import signal
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
BS = 32  # vLLM's CPU attention takes blocks of a multiple of 32 tokens


def wait_dead(pid, timeout=10.0):
    """Until pid (the test's child: a zombie once dead) has stopped running."""
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        try:
            with open("/proc/%d/stat" % pid) as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except OSError:
            return
        time.sleep(0.001)
    raise RuntimeError("pid %d still running %.0f s after SIGKILL" % (pid, timeout))


def main():
    cfg = json.loads(sys.stdin.read())
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    stats_path = None
    kw = {}
    if cfg.get("targets"):
        stats_path = tempfile.mktemp(prefix="tqkv-stats-")
        extra = {"tqkv_targets": cfg["targets"], "tqkv_namespace": cfg.get("namespace", "tiny"),
                 "tqkv_deadline_ms": cfg.get("deadline_ms", 5000),
                 "tqkv_stats_path": stats_path, "tqkv_layers_per_get": 1}
        # kv_load_failure_policy: vLLM 0.32 fails a request whose KV did not load by
        # default; "recompute" is what a best-effort cache needs (docs/integration.md)
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="TqkvConnector", kv_connector_module_path="tqkv.vllm_connector",
            kv_role="kv_both", kv_connector_extra_config=extra,
            kv_load_failure_policy="recompute")
    state = {"done": False}
    if cfg.get("kill_pid"):
        from tqkv import vllm_connector as vc
        orig = vc.TqkvConnector._load_layers

        def load_then_kill(self, ld, l0, l1):
            if not state["done"]:
                state["done"] = True
                os.kill(cfg["kill_pid"], signal.SIGKILL)
                wait_dead(cfg["kill_pid"])
            return orig(self, ld, l0, l1)
        vc.TqkvConnector._load_layers = load_then_kill
    if cfg.get("num_blocks"):
        kw["num_gpu_blocks_override"] = cfg["num_blocks"]
    llm = LLM(model=cfg["model"], load_format="dummy", skip_tokenizer_init=True,
              dtype="bfloat16", max_model_len=cfg.get("max_model_len", 1024), block_size=BS,
              enforce_eager=True, seed=0, max_num_seqs=cfg.get("max_num_seqs", 8),
              max_num_batched_tokens=cfg.get("max_num_batched_tokens", 2048),
              kv_cache_memory_bytes=cfg.get("kv_cache_bytes", 64 << 20),
              enable_prefix_caching=False, **kw)
    sp = SamplingParams(max_tokens=cfg.get("max_tokens", 8), temperature=0.0,
                        detokenize=False, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in cfg["prompts"]], sp,
                        use_tqdm=False)
    res = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
           "killed": int(state["done"]),
           "finish": [o.outputs[0].finish_reason for o in outs]}
    try:
        import vllm
        res["vllm"] = vllm.__version__
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        res["preemptions"] = int(getattr(sched, "num_preemptions", 0) or 0)
    except Exception:  # noqa: BLE001
        pass
    del llm
    if stats_path:
        for role in ("scheduler", "worker"):
            try:
                with open("%s.%s.json" % (stats_path, role)) as f:
                    res[role] = json.load(f)
                os.unlink("%s.%s.json" % (stats_path, role))
            except OSError:
                res[role] = None
    print(json.dumps(res))


if __name__ == "__main__":
    main()
