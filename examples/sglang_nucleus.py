"""nucleus as SGLang's sampler (nucleus.sglang): every row drawn by nucleus, per-request
seeds honoured (SGLang's FlashInfer backend refuses them), batch-invariant.

NOT RUN BY CI: it needs SGLang 0.5.23 (`pip install sglang==0.5.23 ./bindings/python`), a GPU
and a model. README.md, "Using nucleus from vLLM and SGLang", has the semantics.

The backend must be registered in the processes that build SGLang's model runner, before they
do. This launcher registers it, then starts the server in the same process tree:

    python examples/sglang_nucleus.py --model-path Qwen/Qwen3-0.6B --sampling-backend nucleus \
        --port 30000

(Each request's `sampling_seed` reaches the sampler as `sampling_info.sampling_seed`; if your
SGLang leaves it `None`, for instance unless it runs with `--enable-deterministic-inference`,
every row takes a fresh seed. This was not checked against a running SGLang.) Then:

    curl localhost:30000/generate -H 'Content-Type: application/json' -d '{
      "text": "Once upon a time",
      "sampling_params": {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 64,
                          "sampling_seed": 42}}'

Offline, with sglang.Engine in the same script: call nucleus.sglang.register() first, then
sglang.Engine(model_path=..., sampling_backend="nucleus").
"""

import sys

import nucleus.sglang

nucleus.sglang.register("nucleus")  # adds "nucleus" to --sampling-backend's choices


def main() -> None:
    from sglang.launch_server import prepare_server_args
    from sglang.srt.entrypoints.http_server import launch_server

    launch_server(prepare_server_args(sys.argv[1:]))


if __name__ == "__main__":
    main()
