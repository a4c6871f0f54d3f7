"""The vLLM worker hook: a ``vllm.general_plugins`` plugin that captures last prompt hidden states.

See :mod:`.plugin` for how it attaches to vLLM, :mod:`.selection` for which row of a step's
hidden states is taken, and :mod:`.capture` for the per-step work.
"""
