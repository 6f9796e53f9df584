"""nucleus's sampling inside vLLM (nucleus.vllm): DRY, XTC, mirostat and nucleus's seeded,
batch-invariant draw per request, through SamplingParams.extra_args.

NOT RUN BY CI: it needs vLLM 0.33.0 (`pip install vllm==0.33.0 ./bindings/python`), a GPU and
a model. README.md, "Using nucleus from vLLM and SGLang", has the semantics.

Offline:
    python examples/vllm_nucleus.py --model Qwen/Qwen3-0.6B

Server (the processor is also loaded from nucleus's `vllm.logits_processors` entry point
when nucleus is installed; --logits-processors names it explicitly):
    vllm serve Qwen/Qwen3-0.6B --logits-processors nucleus.vllm:NucleusLogitsProcessor

    curl localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{
      "model": "Qwen/Qwen3-0.6B", "prompt": "Once upon a time", "max_tokens": 64,
      "vllm_xargs": {
        "nucleus": "[{\"dry\": {\"multiplier\": 0.8}}, {\"xtc\": {\"probability\": 0.5, \"threshold\": 0.1}}, {\"temperature\": {\"t\": 0.9}}, {\"sample\": {\"seed\": 42}}]"
      }}'
  (vllm_xargs values are strings, numbers or lists of them: the chain goes as JSON text.)
"""

import argparse

from vllm import LLM, SamplingParams

from nucleus.vllm import NucleusLogitsProcessor

CHAIN = [
    {"dry": {"multiplier": 0.8, "base": 1.75, "allowed_length": 2}},
    {"xtc": {"probability": 0.5, "threshold": 0.1}},
    {"temperature": {"t": 0.9}},
    {"min_p": {"p": 0.05}},
    {"sample": {"seed": 42}},
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen3-0.6B")
    args = ap.parse_args()
    llm = LLM(model=args.model, logits_processors=[NucleusLogitsProcessor])
    prompts = ["Once upon a time", "The three laws of thermodynamics are"]
    params = [
        # a nucleus chain, "sample" mode: the row becomes one-hot on nucleus's token, so
        # vLLM's own temperature / top-k / top-p / RNG cannot change it
        SamplingParams(max_tokens=64, extra_args={"nucleus": CHAIN}),
        # nucleus.SamplingParams fields, and vLLM draws from nucleus's exact distribution
        # (leave vLLM's temperature at 1 and its filters off in this mode)
        SamplingParams(max_tokens=64, seed=7, extra_args={
            "nucleus": {"temperature": 0.8, "mirostat": 2, "mirostat_tau": 4.0},
            "nucleus_mode": "distribution"}),
    ]
    for out in llm.generate(prompts, params):
        print(repr(out.outputs[0].text))


if __name__ == "__main__":
    main()
