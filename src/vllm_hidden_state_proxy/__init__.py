"""vllm-hidden-state-proxy: a chat model's last hidden state from the vLLM server you run."""

__version__ = "0.1.0"
