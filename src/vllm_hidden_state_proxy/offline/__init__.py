"""Hidden states from vLLM's offline ``LLM``, without a server: functions over an ``LLM``.

.. code-block:: python

    from vllm import LLM, SamplingParams
    from vllm_hidden_state_proxy import offline

    llm = LLM("Qwen/Qwen3-0.6B")        # HIDDEN_STATE_PROXY_LAYERS=8,-1 in the environment
    for output, states in offline.generate(
        llm, ["A yellow bicycle."], SamplingParams(max_tokens=8), layers=[8, -1]
    ):
        output.outputs[0].text, states.by_layer[8]            # numpy float32, (hidden_size,)
    vectors = offline.embed(llm, texts, pooling="mean")     # (len(texts), hidden_size)

The worker hook runs in the ``LLM``'s engine as in a server, and publishes into the engine's
ring; this module plays the proxy's part in the caller's process: it gives each request a
fresh request key in ``SamplingParams.extra_args`` (the proxy's ``vllm_xargs`` entries,
:func:`~vllm_hidden_state_proxy.wanted_vectors.xargs_entries`), drives vLLM's engine itself
(``LLMEngine.add_request`` and ``step``, as ``LLM.generate`` does) and reads each request's
record from the ring once vLLM's output for it is final. Results come in input order, each
``(RequestOutput, HiddenStateAnswer)``: one entry, or one per choice for ``"last_answer"`` and
``"all_answer"``.

**Any number of prompts.** A ring keeps its latest ``HIDDEN_STATE_PROXY_RING_SLOTS`` records
and writes matrices round and round its arena; an early record read after the ring moved on
would be gone. So requests are added as earlier ones are read, never more at once than their
records fit: the requests from the oldest not yet returned to the newest added publish at most
the ring's slot count of records, and their matrices take at most half of the arena (or of
``HIDDEN_STATE_PROXY_DEVICE_MIB``), so the arena's write head does not come round to a block
before it is read (docs/design.md says why half). Prompts are rendered (tokenized, templated)
one at a time as they are added; an iterator of prompts is read lazily, and the ``iter_*``
functions hold only the results not yet returned: memory is what the caller keeps.

**The same guarantees as the server.** Each record is the one published under the request's
own key (the ring reader checks key, seqlock and CRC), of the layers and pooling asked for, of
a prompt of the length vLLM's output reports, at the position that length (and each choice's
token count) names. Anything else, a record missing or written over, or the hook's own error
record, raises :class:`OfflineHiddenStateError` naming the prompt (its index in the call, and
its start), with the status the server would answer; never another prompt's vector. An engine
whose hook is off or could not start (its failure note) is the server's 503, in its words.

The modules, along a call's path (docs/offline.md is the user's page):

- ``calls.py``: ``generate``, ``chat``, their ``iter_`` forms and ``embed``, shaped as ``LLM``'s
  own, the vector options checked by the server's rules;
- ``engine_ring.py``: the ``LLM``'s engine's ring, or the server's 503 saying why there is none;
  what this vLLM must have;
- ``engine_loop.py``: requests keyed and added while their records fit, the engine stepped,
  results in input order;
- ``records.py``: each request's records read, checked, given as ``HiddenStates``;
- ``types.py``: what a call returns and raises.
"""

from vllm_hidden_state_proxy.offline.calls import chat, embed, generate, iter_chat, iter_generate
from vllm_hidden_state_proxy.offline.types import HiddenStateOutput, OfflineHiddenStateError

__all__ = [
    "HiddenStateOutput",
    "OfflineHiddenStateError",
    "chat",
    "embed",
    "generate",
    "iter_chat",
    "iter_generate",
]
