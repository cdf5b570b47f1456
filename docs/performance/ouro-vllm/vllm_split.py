"""vLLM's time split into prefill and decode (a record of 2026-12-04; run under vLLM's venv, never dasspec's):
the benchmark's worker set-up (benchmarks/ouro_batch.py), then 4 rounds of the 8 prompts with 1, 2 and 32 new tokens.
    /tmp/vllm-venv/bin/python docs/performance/ouro-vllm/vllm_split.py     # reads /tmp/vs/prompts.json: the 8
    token lists (dasspec.load_tokenizer("/tmp/ouro-mid").encode of the first 8 GSM8K test questions)
Output: vllm_split.log (lines "@@ round new_tokens seconds")."""
import json, os, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
import importlib.util, torch
torch.set_num_threads(2)
from transformers import AutoConfig, Qwen2Config
from vllm import LLM, ModelRegistry, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.model_executor.models.utils import AutoWeightsLoader
class OuroConfig(Qwen2Config):
    model_type = "ouro"
AutoConfig.register("ouro", OuroConfig)
name = "vllm.model_executor.models.ouro"
spec = importlib.util.spec_from_file_location(name, "/tmp/vllm026/x/vllm/model_executor/models/ouro.py")
mod = importlib.util.module_from_spec(spec); sys.modules[name] = mod; spec.loader.exec_module(mod)
class OuroForCausalLM(mod.OuroForCausalLM):
    def load_weights(self, weights):
        return AutoWeightsLoader(self).load_weights(weights, mapper=self.hf_to_vllm_mapper)
ModelRegistry.register_model("OuroForCausalLM", OuroForCausalLM)
prompts = json.load(open("/tmp/vs/prompts.json"))
llm = LLM(model="/tmp/ouro-mid", dtype="float32", max_model_len=1024, max_num_seqs=8, seed=0, skip_tokenizer_init=True)
P = [TokensPrompt(prompt_token_ids=p) for p in prompts]
def sp(n): return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
llm.generate(P[:2], sp(4), use_tqdm=False)
for r in range(4):
    for n in (1, 2, 32):
        t = time.perf_counter(); llm.generate(P, sp(n), use_tqdm=False); dt = time.perf_counter() - t
        print("@@", r, n, f"{dt:.3f}", flush=True)
