"""Run one vLLM engine in its own process: greedy-generate and teacher-force score token ids.

Each engine gets a fresh process so that two models never share memory or vLLM's global state.
Usage: python vllm_probe.py MODEL_DIR REQUEST.json RESULT.json
REQUEST: {"messages": [str], "max_tokens": int, "score": [[token ids]] | null}
RESULT:  {"prompt_ids": [[int]], "greedy": [{"token_ids", "logprobs", "text", "top"}], "scored": [[float]]}
("top": per position, the log-probabilities of the 5 most likely tokens, by token id)
Prefix caching is off: a cached prefix takes another kernel path and flips near-tied tokens.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

model, req_path, out_path = sys.argv[1:4]
req = json.loads(open(req_path).read())
llm = LLM(model=model, dtype=req.get("dtype", "bfloat16"), max_model_len=512, enforce_eager=True,
          enable_prefix_caching=False, gpu_memory_utilization=0.3, seed=0)
tok = llm.get_tokenizer()
prompt_ids = [tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False) for m in req["messages"]]
TOP = 5
greedy = []
params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], logprobs=TOP, ignore_eos=True)
for out in llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params):
    c = out.outputs[0]
    lps = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]
    top = [{t: v.logprob for t, v in lp.items()} for lp in c.logprobs]  # each position's TOP most likely tokens
    greedy.append({"token_ids": list(c.token_ids), "logprobs": lps, "text": c.text, "top": top})
scored = None
if req.get("score"):
    scored = []
    seqs = [TokensPrompt(prompt_token_ids=p + list(s)) for p, s in zip(prompt_ids, req["score"])]
    for out, cont in zip(llm.generate(seqs, SamplingParams(max_tokens=1, prompt_logprobs=0)),
                         req["score"]):
        tail = out.prompt_logprobs[-len(cont):]
        scored.append([lp[t].logprob for t, lp in zip(cont, tail)])
with open(out_path, "w") as f:
    json.dump({"prompt_ids": prompt_ids, "greedy": greedy, "scored": scored}, f)

from flashrl_tools.verify.engine_job import exit_engine_process  # noqa: E402

exit_engine_process()
