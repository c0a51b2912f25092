import statistics, time, json, sys
from verispec import LLM, SamplingParams
prompt = "Write a Python function that checks whether a number is prime."
res = {}
for name in ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"]:
    for dt in ["float32", "bfloat16", "int8"]:
        t = time.perf_counter()
        llm = LLM(name, proposer="none", dtype=dt)
        load = time.perf_counter() - t
        p = llm.chat_prompt([{"role": "user", "content": prompt}])
        llm.generate([p], SamplingParams(temperature=0, max_tokens=8))
        rates = [llm.generate([p], SamplingParams(temperature=0, max_tokens=64))[0].tokens_per_s for _ in range(3)]
        res[f"{name} {dt}"] = {"load_s": round(load, 1), "tok_s_runs": [round(r, 2) for r in rates], "median": round(statistics.median(rates), 2)}
        print(name, dt, res[f"{name} {dt}"], flush=True)
json.dump(res, open("/tmp/decode_speed.json", "w"), indent=1)
