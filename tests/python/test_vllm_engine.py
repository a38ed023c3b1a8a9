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
import time
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
    """One engine process (vllm_real_engine.py); its JSON result."""
    cfg.setdefault("model", MODEL_DIR)
    p = subprocess.run([sys.executable, os.path.join(HERE, "vllm_real_engine.py")],
                       input=json.dumps(cfg), capture_output=True, text=True, timeout=TIMEOUT)
    if p.returncode != 0:
        err = "\n".join(ln for ln in p.stderr.splitlines()
                        if "Warning" not in ln and not ln.startswith("  "))
        raise AssertionError("engine failed (rc %d):\n%s" % (p.returncode, err[-4000:]))
    res = json.loads(p.stdout.strip().splitlines()[-1])
    print("  engine %s: scheduler %s worker %s" % (
        "with tqkv" if cfg.get("targets") else "without tqkv", res.get("scheduler"),
        res.get("worker")), file=sys.stderr)
    return res


def server_args(ns):
    return ("--namespace-policy", "%s:lossless=1" % ns) if LOSSLESS else ()


def full_blocks(prompts):
    return sum(len(p) // BS for p in prompts)


def hit_blocks(prompts):
    # the connector never offers a prompt's last token: its block is computed
    return sum((len(p) - 1) // BS for p in prompts)


class Engine(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        prefix = R.integers(3, 1000, 200).tolist()  # 6 full blocks shared
        cls.prompts = [prefix + R.integers(3, 1000, n).tolist() for n in (60, 75, 90)]
        t0 = time.monotonic()
        try:
            cls.base = engine(prompts=cls.prompts)
        except AssertionError as e:
            print("SKIPPED: vLLM's engine does not start on this machine: %s" % e)
            sys.exit(77)
        print("  baseline engine: %.0f s (vLLM %s)" % (time.monotonic() - t0,
                                                    cls.base.get("vllm")), file=sys.stderr)
        cls.base2 = engine(prompts=cls.prompts)
        # engine 1 saves the prompts' full blocks into cls.srv (test_1 loads them in a
        # fresh engine; test_3 loads them again and kills the server meanwhile)
        cls.srv = Server(*server_args("tiny"), capacity="1G")
        try:
            cls.saved = engine(prompts=cls.prompts, targets=[cls.srv.addr], max_tokens=1)
        except BaseException:
            cls.srv.stop()
            raise

    @classmethod
    def tearDownClass(cls):
        cls.srv.stop()

    def compare(self, got, ref, what):
        same = sum(a == b for ta, tb in zip(got, ref) for a, b in zip(ta, tb))
        total = sum(len(t) for t in ref)
        print("  %s: %d of %d greedy tokens (%.1f%%) equal to the run without tqkv (%s "
              "pages)" % (what, same, total, 100.0 * same / total,
                          "lossless" if LOSSLESS else "lossy"), file=sys.stderr)
        self.assertEqual(len(got), len(ref))
        if LOSSLESS:
            self.assertEqual(got, ref)
        return same, total

    def test_0_deterministic_baseline(self):
        self.assertEqual(self.base["tokens"], self.base2["tokens"])

    def test_1_save_then_load(self):
        a = self.saved
        L = CONFIG["num_hidden_layers"]
        self.assertEqual(a["worker"]["save_failed_blocks"], 0)
        # the three requests are looked up in the same first step, before any save:
        # each saves its own full prompt blocks (the shared prefix three times)
        self.assertEqual(a["scheduler"]["saves_emitted"], full_blocks(self.prompts))
        self.assertEqual(a["worker"]["save_blocks"], full_blocks(self.prompts) * L)
        b = engine(prompts=self.prompts, targets=[self.srv.addr])
        want = hit_blocks(self.prompts)
        self.assertEqual(b["scheduler"]["lookup_hit_tokens"], want * BS)
        self.assertEqual(b["worker"]["load_blocks"], want)
        self.assertEqual(b["worker"]["load_failed_blocks"], 0)
        self.compare(b["tokens"], self.base["tokens"], "load")

    def test_2_preempt_resume(self):
        srv = Server(*server_args("tiny"), capacity="1G")
        try:
            # distinct prompts (no prefix one request could load from another's saves)
            # of 3 full blocks, decoding 120 tokens each in a KV cache of 16 blocks: the
            # three are admitted (4 blocks each), outgrow the cache as they decode and
            # one is preempted; on resume the scheduler asks the connector again, which
            # offers the prompt blocks that request saved before
            longp = [R.integers(3, 1000, n).tolist() for n in (96, 110, 120)]
            ref = engine(prompts=longp, max_tokens=120)
            a = engine(prompts=longp, targets=[srv.addr], max_tokens=120, num_blocks=16,
                       max_num_batched_tokens=64, max_model_len=448)
            self.assertGreater(a["scheduler"]["resumed"], 0, "no preemption happened")
            self.assertEqual(a["scheduler"]["saves_emitted"], full_blocks(longp))
            self.assertEqual(a["worker"]["save_failed_blocks"], 0)
            self.assertEqual(a["worker"]["load_failed_blocks"], 0)
            self.assertGreater(a["worker"]["load_blocks"], 0)
            self.compare(a["tokens"], ref["tokens"], "preempt-resume")
        finally:
            srv.stop()

    def test_3_server_killed_mid_load(self):
        b = engine(prompts=self.prompts, targets=[self.srv.addr], kill_pid=self.srv.proc.pid,
                   deadline_ms=2000)
        want = hit_blocks(self.prompts)
        self.assertEqual(b["scheduler"]["lookup_hit_tokens"], want * BS)
        self.assertEqual(b["killed"], 1)
        self.assertGreater(b["worker"]["load_failed_blocks"], 0)
        self.assertEqual(b["worker"]["load_blocks"] + b["worker"]["load_failed_blocks"], want)
        # recomputed, never wrong KV: the blocks that did not load are the engine's own
        if b["worker"]["load_blocks"] == 0:
            self.assertEqual(b["tokens"], self.base["tokens"])
        else:
            self.compare(b["tokens"], self.base["tokens"], "killed")


if __name__ == "__main__":
    unittest.main(verbosity=2)
