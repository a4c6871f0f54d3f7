"""The HTTP proxy in front of vLLM's OpenAI server (see ``app.create_app``)."""

from vllm_hidden_state_proxy.proxy.app import create_app
from vllm_hidden_state_proxy.proxy.server import serve_proxy
from vllm_hidden_state_proxy.proxy.settings import ProxySettings

__all__ = ["ProxySettings", "create_app", "serve_proxy"]
