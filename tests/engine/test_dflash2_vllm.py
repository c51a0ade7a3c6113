"""Our DFlash2 convolution and selector against vLLM 0.33's own modules, on the same weights.

vLLM's DFlash2 pieces run on a CPU in the contract environment (.venv-vllm, `make vllm-env`):
`DFlashGroupedConv` (prepare/finish take its torch path, `_grouped_conv`, off CUDA),
`CandidateSelector` (compilation off: vLLM's compiled graph needs its `_C` ops, absent from
the CPU-less build) and the candidate head, `LogitsProcessor.get_top_k_tokens`, over a
`ParallelLMHead` (a one-process gloo group on a file store; no network).

What does NOT run there: vLLM's walk over the scores, `_selector_walk_kernel` (Triton, a GPU
kernel). At temperature 0 it is `gumbel_noised_argmax` without noise, starting at candidate
0 and following the chosen index; the test walks vLLM's scores that way and compares the
path with our drafter's proposals. Nor does the whole decoder layer (its attention needs
vLLM's attention backends and KV cache): the layer order is checked against the formulas in
test_dflash2.py.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.dflash2 import DFlash2Config
from tests.fixtures.tiny_dflash2 import random_dflash2_drafter
from tests.fixtures.tiny_models import random_target, tiny_target_config

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

PROBE = r"""
import json, sys, tempfile
import torch
torch.set_num_threads(1)
from safetensors.torch import load_file, save_file
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
import vllm.model_executor.models.qwen3_dflash2 as m



def after_loading(module):
    # what vLLM's loader does once weights are in (a CPU build prepares its linear here)
    for sub in module.modules():
        method = getattr(sub, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(sub)


p = json.loads(sys.argv[3])
t = load_file(sys.argv[1])
H, V, T, C, R, K = p["hidden"], p["vocab"], p["taps"], p["group"], p["rank"], p["top_k"]
cfg = VllmConfig(device_config=DeviceConfig(device="cpu"), compilation_config={"mode": 0})
out = {}
with set_current_vllm_config(cfg), torch.no_grad():
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method="file://" + tempfile.mktemp())
    initialize_model_parallel(1)
    conv = m.DFlashGroupedConv(hidden_size=H, taps=T, group_size=C, block_size=p["block"],
                               params_dtype=torch.float32, prefix="conv")
    conv.base_kernel.copy_(t["base_kernel"])
    conv.kernel_projection.weight.copy_(t["kernel_projection"])
    after_loading(conv)
    prepared, delta = conv.prepare(t["conv_x"])
    out["prepared"] = prepared
    out["finished"] = conv.finish(t["conv_y"], delta)
    selector = m.CandidateSelector(hidden_size=H, vocab_size=V, rank=R, top_k=K,
                                   params_dtype=torch.float32, prefix="sel", vllm_config=cfg)
    selector.predecessor_codebook.copy_(t["predecessor_codebook"])
    selector.successor_codebook.copy_(t["successor_codebook"])
    selector.hidden_projection.weight.copy_(t["hidden_projection"])
    after_loading(selector)
    head = ParallelLMHead(V, H, params_dtype=torch.float32)
    head.weight_loader(head.weight, t["lm_head"])  # pads the vocabulary as vLLM does
    cap = p["softcap"]
    logits = LogitsProcessor(V, scale=p["multiplier"], soft_cap=cap if cap > 0 else None)
    rows = t["rows"]  # [b, L, H]
    ids, unary = logits.get_top_k_tokens(head, rows.flatten(0, 1), K)
    ids, unary = ids.view(*rows.shape[:2], K), unary.view(*rows.shape[:2], K)
    out["ids"], out["unary"] = ids, unary
    out["scores"] = selector(ids, unary, rows, t["anchors"])
save_file({k: v.contiguous() for k, v in out.items()}, sys.argv[2])
print("PROBE OK")
"""


def _vllm_env_or_skip() -> None:
    if VLLM_PYTHON.exists():
        return
    message = ".venv-vllm is missing: run `make vllm-env` to build vLLM's contract environment"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def _walk(scores: torch.Tensor, ids: torch.Tensor) -> list[list[int]]:
    """vLLM's `_selector_walk_kernel` at temperature 0, on the host: from candidate 0, the
    argmax of the current candidate's row of scores at each step."""
    paths = []
    for b in range(ids.shape[0]):
        previous, path = 0, []
        for step in range(ids.shape[1]):
            previous = int(scores[b, step, previous].argmax())
            path.append(int(ids[b, step, previous]))
        paths.append(path)
    return paths


def test_conv_and_selector_match_vllms_modules(tmp_path: Path) -> None:
    _vllm_env_or_skip()
    extra = DFlash2Config(3, 4, 4, 6, output_multiplier=0.8, final_logit_softcapping=2.5)
    block, rows_b = 8, 6
    target = random_target(tiny_target_config(48, 4), seed=11)
    drafter = random_dflash2_drafter(target, block_size=block, extra=extra, seed=12)
    selector = drafter.candidate_selector
    with torch.no_grad():  # pairwise terms that overturn the argmax at times
        selector.predecessor_codebook.mul_(3.0)
        selector.successor_codebook.mul_(3.0)
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(rows_b, block, 32, generator=gen)
    y = torch.randn(rows_b, block, 32, generator=gen)
    hidden = torch.randn(rows_b, block, 32, generator=gen)
    anchors = torch.randint(0, 48, (rows_b,), generator=gen)
    conv = drafter.dflash2_layers()[0].attention_conv
    with torch.no_grad():
        prepared, delta = conv.prepare(x)
        finished = conv.finish(y, delta)
        ids, scores = drafter.candidate_scores(anchors, hidden)
        proposals = drafter.propose(anchors, hidden).tolist()
        argmax = drafter.logits(hidden[:, 1:]).argmax(-1).tolist()
    inputs = {
        "base_kernel": conv.base_kernel,
        "kernel_projection": conv.kernel_projection.weight,
        "conv_x": x.flatten(0, 1),  # vLLM's rows: every request's block, one after another
        "conv_y": y.flatten(0, 1),
        "predecessor_codebook": selector.predecessor_codebook,
        "successor_codebook": selector.successor_codebook,
        "hidden_projection": selector.hidden_projection.weight,
        "lm_head": target.lm_head.weight,
        "rows": hidden[:, 1:],
        "anchors": anchors,
    }
    save_file({k: v.detach().contiguous() for k, v in inputs.items()}, str(tmp_path / "in"))
    params = {
        "hidden": 32,
        "vocab": 48,
        "taps": extra.conv_kernel_size,
        "group": extra.conv_group_size,
        "rank": extra.selector_rank,
        "top_k": extra.selector_top_k,
        "block": block,
        "multiplier": extra.output_multiplier,
        "softcap": extra.final_logit_softcapping,
    }
    (tmp_path / "probe.py").write_text(PROBE)
    proc = subprocess.run(
        [str(VLLM_PYTHON), "probe.py", "in", "out", json.dumps(params)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert "PROBE OK" in proc.stdout, proc.stderr[-3000:]
    theirs = load_file(str(tmp_path / "out"))
    gaps = {
        "prepare": (theirs["prepared"] - prepared.flatten(0, 1)).abs().max(),
        "finish": (theirs["finished"] - finished.flatten(0, 1)).abs().max(),
        "scores": (theirs["scores"] - scores).abs().max(),
    }
    print("max |ours - vLLM|", {k: float(v) for k, v in gaps.items()})
    assert torch.allclose(theirs["prepared"], prepared.flatten(0, 1), atol=1e-5)
    assert torch.allclose(theirs["finished"], finished.flatten(0, 1), atol=1e-5)
    assert torch.equal(theirs["ids"], ids)
    assert torch.allclose(theirs["scores"], scores, atol=1e-5)
    assert _walk(theirs["scores"], theirs["ids"]) == proposals
    assert proposals != argmax  # the selector decided some drafts
