"""kvhub.serving.forced in a real vLLM engine (scripts/test-vllm.sh runs these; the default suite leaves
`vllm`-marked tests out): a request naming ``vllm_xargs.kvhub_force`` generates exactly those ids, and the
logprobs vLLM returns are the model's own log-probabilities of them (taken before the processor), equal to a
teacher-forced transformers pass.  Without that second fact the served gist would score a masked
distribution (every forced token at log-probability 0) and report any cache as good as the own one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [(7 * i + 3) % 120 + 1 for i in range(40)]
FORCED = [5, 17, 99, 3, 64, 64, 8]


def _engine_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: no usable vLLM here
        return False
    return True


needs_vllm = pytest.mark.skipif(not _engine_available(), reason="vLLM is not installed (scripts/setup-vllm.sh)")


def run_engine(model_dir: str) -> dict:
    """A greedy request and a forced one, each with logprobs=1, on an engine with kvhub's processor."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvhub.serving.forced import ForcedTokens
    from kvhub.serving.launch import FORCE_KEY, FORCED_PROCESSOR

    assert FORCED_PROCESSOR == f"{ForcedTokens.__module__}:{ForcedTokens.__name__}"  # what kvhub serve passes
    llm = LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=2,
        enforce_eager=True,
        logits_processors=[FORCED_PROCESSOR],
    )
    out = {}
    for name, extra in (("greedy", None), ("forced", {FORCE_KEY: FORCED})):
        params = SamplingParams(
            temperature=0.0, max_tokens=len(FORCED), ignore_eos=True, detokenize=False, logprobs=1, extra_args=extra
        )
        result = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)[0].outputs[0]
        ids = list(result.token_ids)
        out[name] = {"ids": ids, "logprobs": [step[token].logprob for step, token in zip(result.logprobs, ids)]}
    return out


@pytest.mark.vllm
@needs_vllm
def test_forced_ids_are_generated_with_the_models_own_logprobs(tmp_path):
    import torch

    from tests.tinymodels import make_model

    model = make_model("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    model.config.eos_token_id = None
    model.save_pretrained(tmp_path / "model")
    out = tmp_path / "out.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, __file__, str(tmp_path / "model"), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    result = json.loads(out.read_text())
    with torch.no_grad():
        ids = torch.tensor([PROMPT + FORCED])
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    expected = [float(logp[len(PROMPT) - 1 + i, token]) for i, token in enumerate(FORCED)]
    assert result["forced"]["ids"] == FORCED and result["greedy"]["ids"] != FORCED
    assert result["forced"]["logprobs"] == pytest.approx(expected, abs=2e-3)
    assert all(value < -0.01 for value in result["forced"]["logprobs"])  # not the masked 0.0


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("bad", [[], ["7"], [-1], [True], "5,17", {"a": 1}])
def test_a_malformed_force_list_from_a_request_is_refused(bad):
    """vllm_xargs comes from any HTTP client: anything but a non-empty list of token ids is a ValueError,
    which vLLM answers with HTTP 400 (not a crash of the engine); a request without the key is untouched."""
    from vllm import SamplingParams

    from kvhub.serving.forced import ForcedTokens

    with pytest.raises(ValueError, match="kvhub_force must be a non-empty list of token ids"):
        ForcedTokens.validate_params(SamplingParams(max_tokens=1, extra_args={"kvhub_force": bad}))
    ForcedTokens.validate_params(SamplingParams(max_tokens=1))


if __name__ == "__main__":
    Path(sys.argv[2]).write_text(json.dumps(run_engine(sys.argv[1])))
