"""Arguments that several commands share, defined once so their help and defaults agree."""
from __future__ import annotations

GIB = 2**30


def add_job_arguments(parser) -> None:
    """--model --cluster --gpus --gbs --seq: what is trained, where, and on how much data per step."""
    parser.add_argument("--model", required=True,
                        help="model SPEC (built-in name, gpt:/llama: spec, file.py:fn, hf:config.json)")
    parser.add_argument("--cluster", required=True, help="cluster profile name (a100-80g, h100-sxm, ...) or .toml path")
    parser.add_argument("--gpus", type=int, required=True, help="number of GPUs (cpu profile: local processes)")
    parser.add_argument("--gbs", type=int, required=True, help="global batch size in samples per optimizer step")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 2048, GPT-2 presets 1024)")
