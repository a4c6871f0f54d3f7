"""Build a tiny random-weight vision-language model offline, for the image tests.

An Idefics3-style model (``Idefics3ForConditionalGeneration``: a 2-layer SigLIP-style vision
tower, a pixel-shuffle connector, a 2-layer Llama decoder), random float32 weights, saved with
its processor:

- the tokenizer of :mod:`vllm_hidden_state_proxy.tiny_model` (the same trained BPE) plus the
  Idefics3 image tokens (``<image>``, ``<fake_token_around_image>``, ``<global-img>``,
  ``<row_i_col_j>``, ``<end_of_utterance>``);
- a ChatML chat template that renders each ``image`` / ``image_url`` content item as ``<image>``
  in place; the processor (and vLLM, the same way) expands it to the image's tiles;
- the PIL image processor (``Idefics3ImageProcessorPil``), so neither building nor serving
  needs torchvision.

Why Idefics3 and not Qwen2-VL: with transformers 5.19 and no torchvision, vLLM cannot import
its Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA(-Next/-OneVision), Pixtral/Mistral3, Gemma3 or
LFM2-VL model modules (each imports a torchvision-backed image processor at module level), and
transformers cannot even build a ``Qwen2VLProcessor`` (its video processor needs torchvision).
vLLM's Idefics3 module and processor load with the PIL backend. Idefics3 has plain 1-D rotary
positions, so multimodal rotary embeddings (M-RoPE) are not exercised end to end here.

An image of any size is resized so its longest edge is :data:`IMAGE_LONGEST_EDGE` pixels and cut
into tiles of :data:`TILE_SIZE` pixels (at most 2 x 2; a 64 x 64 image gives 2 x 2), plus one
downscaled global tile; each tile costs :data:`TOKENS_PER_TILE` ``<image>`` tokens, and the
tile markers (``<fake_token_around_image>``, ``<row_r_col_c>``, ``<global-img>``, newlines)
are prompt tokens too: a 64 x 64 image is 34 prompt tokens. No model hub is needed; building takes a
few seconds and needs ``torch``, ``transformers`` and ``Pillow`` (present wherever vLLM is).
"""

from __future__ import annotations

import os
from pathlib import Path

from vllm_hidden_state_proxy.tiny_model import (
    SPECIAL_TOKENS,
    chatml_tokenizer,
    finish_model_dir,
    is_built,
    source_revision,
)

_MARKER = "hidden_state_proxy_tiny_vlm.json"

#: Default location of the built model (override with HIDDEN_STATE_PROXY_TINY_VLM_DIR).
DEFAULT_TINY_VLM_DIR = Path.home() / ".cache" / "vllm-hidden-state-proxy" / "tiny-vlm"

HIDDEN_SIZE = 128
IMAGE_TOKEN = "<image>"
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
END_OF_UTTERANCE = "<end_of_utterance>"
MAX_TILE_GRID = 6  # the processor knows <row_1_col_1> .. <row_6_col_6>
IMAGE_TOKENS = [
    FAKE_IMAGE_TOKEN,
    IMAGE_TOKEN,
    END_OF_UTTERANCE,
    GLOBAL_IMAGE_TOKEN,
    *(
        f"<row_{r}_col_{c}>"
        for r in range(1, MAX_TILE_GRID + 1)
        for c in range(1, MAX_TILE_GRID + 1)
    ),
]

PATCH_SIZE = 14
SCALE_FACTOR = 2  # pixel shuffle: 2 x 2 patches -> one token
TILE_SIZE = 56  # the vision tower's image size: 4 x 4 patches
TOKENS_PER_TILE = (TILE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2  # 4
IMAGE_LONGEST_EDGE = 2 * TILE_SIZE  # so an image is at most 2 x 2 tiles (+ 1 global)

# ChatML, as tiny_model.CHAT_TEMPLATE, with image items rendered in place. Iterating over
# message['content'] makes vLLM pass the content items through in order ("openai" format).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] in ['image', 'image_url'] -%}{{- '" + IMAGE_TOKEN + "' -}}"
    "{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- if not (loop.last and continue_final_message is defined and continue_final_message) -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)


def tiny_vlm_dir() -> Path:
    return Path(os.environ.get("HIDDEN_STATE_PROXY_TINY_VLM_DIR") or DEFAULT_TINY_VLM_DIR)


def build_tiny_vlm(path: str | os.PathLike[str] | None = None, *, force: bool = False) -> Path:
    """Build (or reuse) the tiny vision-language model at ``path`` and return its directory."""
    target = Path(path) if path is not None else tiny_vlm_dir()
    revision = source_revision(__file__)
    if not force and is_built(target, _MARKER, revision):
        return target

    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    target.mkdir(parents=True, exist_ok=True)
    tokenizer = chatml_tokenizer(CHAT_TEMPLATE)
    tokenizer.add_special_tokens({"additional_special_tokens": [*SPECIAL_TOKENS, *IMAGE_TOKENS]})
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": IMAGE_LONGEST_EDGE},
        max_image_size={"longest_edge": TILE_SIZE},
        do_image_splitting=True,
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=TOKENS_PER_TILE,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(target)

    def token_id(token: str) -> int:
        return int(tokenizer.convert_tokens_to_ids(token))

    config = Idefics3Config(
        text_config={
            "model_type": "llama",
            "vocab_size": ((len(tokenizer) + 63) // 64) * 64,
            "hidden_size": HIDDEN_SIZE,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "bos_token_id": None,
            "eos_token_id": token_id("<|im_end|>"),
            "pad_token_id": token_id("<|endoftext|>"),
            "tie_word_embeddings": False,
            "initializer_range": 0.2,
        },
        vision_config={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "image_size": TILE_SIZE,
            "patch_size": PATCH_SIZE,
            "initializer_range": 0.2,
        },
        scale_factor=SCALE_FACTOR,
        image_token_id=token_id(IMAGE_TOKEN),
        pad_token_id=token_id("<|endoftext|>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(1234)
    model = Idefics3ForConditionalGeneration(config).to(torch.float32).eval()
    model.save_pretrained(target, safe_serialization=True)
    finish_model_dir(target, _MARKER, revision)
    return target
