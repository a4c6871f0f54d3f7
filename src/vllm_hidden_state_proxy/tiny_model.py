"""Build a tiny random-weight chat model offline, for the demo, the tests and the benchmark.

No model hub is needed: a Qwen3-style config with random float32 weights, a byte-level BPE
tokenizer trained on an embedded corpus with the ``tokenizers`` library, and a ChatML chat
template that honours ``continue_final_message`` and ``enable_thinking``. Building takes a few
seconds and needs ``torch`` and ``transformers`` (present wherever vLLM is).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from vllm_hidden_state_proxy.protocol import TINY_MODEL_DIR_ENV

_MARKER = "hidden_state_proxy_tiny_model.json"

#: Default location of the built model (override with ``TINY_MODEL_DIR_ENV``).
DEFAULT_TINY_MODEL_DIR = Path.home() / ".cache" / "vllm-hidden-state-proxy" / "tiny-chat-model"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

HIDDEN_SIZE = 128
NUM_HIDDEN_LAYERS = 2
#: The model in a few words, for help texts.
DESCRIPTION = f"random weights, {NUM_HIDDEN_LAYERS} layers, hidden size {HIDDEN_SIZE}"

#: What ``serve --tiny-model`` gives vLLM before the user's own options (which win): the weights
#: as they are (float32: vLLM on CPU would load them as bfloat16) and no compiled graphs (eager:
#: a start of seconds, not minutes). The README's sample answer comes from these settings.
SERVE_VLLM_ARGS = ("--dtype", "float32", "--enforce-eager")
#: The environment ``serve --tiny-model`` gives vLLM where the user has not set these: a small
#: CPU KV cache (GiB; the model needs a few MiB), no model hub, no usage statistics.
SERVE_ENVIRONMENT = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}

# ChatML. `continue_final_message` leaves the last message open (no <|im_end|>);
# `enable_thinking=false` adds an empty think block after the generation prompt, as Qwen3 does.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- if not (loop.last and continue_final_message is defined and continue_final_message) -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)

_CORPUS = """\
Summarize this text in one word: A yellow bicycle beside a stone wall.
The quick brown fox jumps over the lazy dog. A stitch in time saves nine.
Researchers use hidden states for retrieval, clustering, classification and interpretability.
The model reads the prompt, computes a representation at every position, and predicts a token.
Operators want ordinary traffic to cost nothing. The proxy passes requests through untouched.
Shared memory rings hold fixed-size slots; a seqlock guards each slot against torn reads.
Once upon a time there was a small language model that lived on a server with two cores.
It answered questions about rivers, mountains, cities, numbers, colours and the weather.
Red, orange, yellow, green, blue, indigo, violet. One, two, three, four, five, six, seven.
What is the capital of France? Paris. What is two plus two? Four. Is the sky blue? Yes.
"""


def tiny_model_dir() -> Path:
    return Path(os.environ.get(TINY_MODEL_DIR_ENV) or DEFAULT_TINY_MODEL_DIR)


def source_revision(*builders: str | os.PathLike[str]) -> str:
    """The revision of a model built by the code in ``builders`` (source files): a digest of that
    code, this module's (the tokenizer and template every tiny model shares) and the versions of
    the libraries that write the files, so a cached build is rebuilt whenever any changes."""
    from importlib.metadata import PackageNotFoundError, version

    digest = hashlib.sha256()
    for source in (__file__, *builders):
        digest.update(Path(source).read_bytes())
    for library in ("transformers", "tokenizers", "torch"):
        try:
            digest.update(f"{library}=={version(library)}".encode())
        except PackageNotFoundError:
            digest.update(f"{library} absent".encode())
    return digest.hexdigest()[:16]


def is_built(path: Path, marker_name: str, revision: str) -> bool:
    """True if ``path`` holds a finished build of ``revision`` (see ``finish_model_dir``)."""
    marker = path / marker_name
    if not marker.is_file():
        return False
    try:
        return bool(json.loads(marker.read_text()).get("revision") == revision)
    except (OSError, ValueError):
        return False


def chatml_tokenizer(chat_template: str) -> Any:
    """The byte-level BPE tokenizer (ChatML special tokens) as a transformers tokenizer."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(vocab_size=1024),
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    tokenizer.chat_template = chat_template
    tokenizer.model_max_length = 4096
    return tokenizer


def finish_model_dir(target: Path, marker_name: str, revision: str, dtype: str = "float32") -> None:
    """After ``save_pretrained``: make the dtype vLLM reads ``dtype`` (transformers versions
    differ in the key), drop the generation config (no sampling defaults), mark it built."""
    config_path = target / "config.json"
    data: dict[str, Any] = json.loads(config_path.read_text())
    data["torch_dtype"] = dtype
    data["dtype"] = dtype
    config_path.write_text(json.dumps(data, indent=2))
    generation_config = target / "generation_config.json"
    if generation_config.exists():
        generation_config.unlink()
    (target / marker_name).write_text(json.dumps({"revision": revision}))


def _train_tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(  # type: ignore[no-untyped-call]  # untyped in tokenizers 0.23.2
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tokenizer


def build_tiny_model(path: str | os.PathLike[str] | None = None, *, force: bool = False) -> Path:
    """Build (or reuse) the tiny chat model at ``path`` and return its directory."""
    target = Path(path) if path is not None else tiny_model_dir()
    revision = source_revision()
    if not force and is_built(target, _MARKER, revision):
        return target

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    target.mkdir(parents=True, exist_ok=True)
    tokenizer = chatml_tokenizer(CHAT_TEMPLATE)
    tokenizer.save_pretrained(target)

    vocab_size = ((len(tokenizer) + 63) // 64) * 64
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=256,
        num_hidden_layers=NUM_HIDDEN_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        torch_dtype="float32",
    )
    torch.manual_seed(1234)
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(target, safe_serialization=True)
    finish_model_dir(target, _MARKER, revision)
    return target
