"""vLLM's reply as it streams back: relayed byte for byte (:mod:`.relay`), or, for a flagged
request, rewritten so that the vectors ride on it, in one of three ways:

- :mod:`.prompt_vectors`: the prompt's vectors on the first chunk that carries a choice (chat
  and completions);
- :mod:`.answer_vectors`: each choice's answer vectors on its last chunk;
- :mod:`.responses`: the Responses API's ``response.completed`` event.

What the three share (holding the stream until the vectors can join, the rewritten head) is
:mod:`.rewriting`'s; the server-sent events' framing, the only place that writes it, is
:mod:`.events`'.
"""
