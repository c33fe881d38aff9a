"""Plain greedy vLLM (no speculation, stock scheduler): the reference outputs of the vLLM tests.

Run as ``python _plain_greedy.py '<json args>'`` (model, max_model_len, prompts, max_tokens, out);
writes ``{prompt: {"token_ids": [...], "text": "..."}}`` to ``out``.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    args = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args["model"],
        tokenizer=args["model"],
        dtype="float32",
        enforce_eager=True,
        max_model_len=args["max_model_len"],
        seed=0,
        max_num_seqs=4,
    )
    sp = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"], ignore_eos=True)
    outs = llm.generate(args["prompts"], sp, use_tqdm=False)
    ref = {o.prompt: {"token_ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text} for o in outs}
    tmp = args["out"] + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(ref, fh)
    os.replace(tmp, args["out"])


if __name__ == "__main__":
    main()
