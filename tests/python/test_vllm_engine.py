#!/usr/bin/env python3
"""TqkvConnector inside real vLLM engines (the installed vLLM's CPU build; run under the
venv of deploy/python-env.sh vllm): a tiny Llama-architecture model whose config.json
this test writes (4 layers, 2 KV heads of 64, BF16), dummy weights, token-id prompts,
greedy decoding, each engine a fresh process (vllm_real_engine.py):

  baseline   no tqkv: the reference tokens (run twice: dummy weights are the same in
             every process, so the comparison below means something)
  save       engine 1 prefills N prompts sharing a long prefix, saving through tqkv
  load       engine 2 (fresh) gets external hits for exactly the stored prefix blocks,
             loads them and generates; its tokens vs the baseline: equal for every
             prompt with lossless pages (TQKV_ENGINE_LOSSLESS=1), counted with the default
             lossy policy
  preempt    a KV cache of a few blocks forcing preemption and resume: every full prompt
             block saved once, tokens as the baseline's
  killed     the server SIGKILLed when engine 2's first load starts: every loaded block
             recomputed (load_failed_blocks), tokens equal to the baseline

Exit 77 (SKIP) naming what failed when vLLM cannot be imported or its engine cannot
start on this machine.
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
BS = 32  # vLLM's CPU attention (CPU_ATTN) takes blocks of a multiple of 32 tokens
LOSSLESS = os.environ.get("TQKV_ENGINE_LOSSLESS") == "1"
TIMEOUT = int(os.environ.get("TQKV_ENGINE_TIMEOUT", "1200"))

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
          "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 64, "num_hidden_layers": 4, "vocab_size": 1024,
          "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
          "tie_word_embeddings": False, "hidden_act": "silu"}

try:
    import vllm  # noqa: F401
except Exception as e:  # noqa: BLE001
    print("SKIPPED: vLLM is not importable with %s (%s: %s); run under the venv of "
          "deploy/python-env.sh vllm" % (sys.executable, type(e).__name__, e))
    sys.exit(77)

from tqkv_testutil import Server, rng  # noqa: E402

R = rng(31)
MODEL_DIR = tempfile.mkdtemp(prefix="tqkv-tiny-llama-")
with open(os.path.join(MODEL_DIR, "config.json"), "w") as f:
    json.dump(CONFIG, f)


def engine(**cfg):
    cfg.setdefault("model", MODEL_DIR)
    p = subprocess.run([sys.executable, os.path.join(HERE, "vllm_real_engine.py")],
                       input=json.dumps(cfg), capture_output=True, text=True, timeout=TIMEOUT)
    if p.returncode != 0:
        raise AssertionError("engine failed (rc %d):\n%s" % (p.returncode, p.stderr[-4000:]))
    return json.loads(p.stdout.strip().splitlines()[-1])


def server_args(ns):
    return ("--namespace-policy", "%s:lossless=1" % ns) if LOSSLESS else ()


class Engine(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        prefix = R.integers(3, 1000, 200).tolist()  # 12.5 blocks shared
        cls.prompts = [prefix + R.integers(3, 1000, n).tolist() for n in (60, 75, 90)]
        try:
            cls.base = engine(prompts=cls.prompts)
        except AssertionError as e:
            print("SKIPPED: vLLM's engine does not start on this machine: %s" % e)
            sys.exit(77)
        cls.base2 = engine(prompts=cls.prompts)

    def expected_hit_blocks(self, p):
        return (len(p) - 1) // BS

    def compare(self, got, what):
        same = sum(a == b for ta, tb in zip(got, self.base["tokens"]) for a, b in zip(ta, tb))
        total = sum(len(t) for t in self.base["tokens"])
        print("  %s: %d of %d greedy tokens equal to the run without tqkv (%s pages)" %
              (what, same, total, "lossless" if LOSSLESS else "lossy"), file=sys.stderr)
        if LOSSLESS:
            self.assertEqual(got, self.base["tokens"])
        return same, total

    def test_0_deterministic_baseline(self):
        self.assertEqual(self.base["tokens"], self.base2["tokens"])

    def test_1_save_then_load(self):
        srv = Server(*server_args("tiny"), capacity="1G")
        try:
            a = engine(prompts=self.prompts, targets=[srv.addr], max_tokens=1)
            full = sum(len(p) // BS for p in self.prompts)
            self.assertEqual(a["worker"]["save_failed_blocks"], 0)
            # the shared prefix's blocks are stored once per request: duplicates are fine
            self.assertEqual(a["worker"]["save_blocks"], full * CONFIG["num_hidden_layers"])
            b = engine(prompts=self.prompts, targets=[srv.addr])
            want = sum(self.expected_hit_blocks(p) for p in self.prompts)
            self.assertEqual(b["scheduler"]["lookup_hit_tokens"], want * BS)
            self.assertEqual(b["worker"]["load_blocks"], want)
            self.assertEqual(b["worker"]["load_failed_blocks"], 0)
            self.compare(b["tokens"], "load")
        finally:
            srv.stop()

    def test_2_preempt_resume(self):
        srv = Server(*server_args("tiny"), capacity="1G")
        try:
            longp = [self.prompts[i] + R.integers(3, 1000, 120).tolist() for i in range(3)]
            ref = engine(prompts=longp, max_tokens=24)
            a = engine(prompts=longp, targets=[srv.addr], max_tokens=24, num_blocks=40,
                       max_num_batched_tokens=128)
            self.assertGreater(a["scheduler"]["resumed"], 0, "no preemption happened")
            full = sum(len(p) // BS for p in longp)
            self.assertEqual(a["scheduler"]["saves_emitted"], full)
            self.assertEqual(a["worker"]["save_failed_blocks"], 0)
            self.assertEqual(a["tokens"], ref["tokens"])  # its own KV or tqkv's
        finally:
            srv.stop()

    def test_3_server_killed_mid_load(self):
        srv = Server(*server_args("tiny"), capacity="1G")
        try:
            engine(prompts=self.prompts, targets=[srv.addr], max_tokens=1)
            b = engine(prompts=self.prompts, targets=[srv.addr], kill_pid=srv.proc.pid,
                       deadline_ms=2000)
            want = sum(self.expected_hit_blocks(p) for p in self.prompts)
            self.assertEqual(b["scheduler"]["lookup_hit_tokens"], want * BS)
            self.assertGreater(b["worker"]["load_failed_blocks"], 0)
            self.assertEqual(b["worker"]["load_blocks"] + b["worker"]["load_failed_blocks"],
                             want)
            # recomputed, never wrong KV: the blocks that did not load are the engine's own
            if b["worker"]["load_blocks"] == 0:
                self.assertEqual(b["tokens"], self.base["tokens"])
            else:
                self.compare(b["tokens"], "killed")
        finally:
            srv.stop()


if __name__ == "__main__":
    unittest.main(verbosity=2)
