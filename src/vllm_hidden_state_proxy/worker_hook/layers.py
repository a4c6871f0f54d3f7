"""Which layers the hook captures, and how vLLM is asked to hand them over.

The server chooses its layers once, at startup (``HIDDEN_STATE_PROXY_LAYERS``, e.g. ``4,8,-1``;
``serve --hidden-state-layers``), as Transformers' ``output_hidden_states`` indices: ``0`` the
embeddings, ``k`` the residual stream after ``k`` decoder layers, ``N`` (= ``num_hidden_layers``)
and ``-1`` the final layer after the final norm. The final layer is always captured: it is the
runner's own output, and the default of every request.

**How, without hooks.** Forward hooks and patched forwards do not run under CUDA-graph replay and
are bypassed by torch.compile's cached callable. vLLM's own mechanism is the auxiliary
hidden-state outputs of EAGLE-3 (``SupportsEagle3.set_aux_hidden_state_layers``,
``EagleModelMixin._maybe_add_hidden_state``): the model returns the chosen layers as real
outputs of its compiled forward, and both model runners keep them in
``execute_model_state.aux_hidden_states``. vLLM's aux id ``k`` is ``hidden_states + residual``
after ``k`` layers, which is Transformers' ``hidden_states[k]`` for ``k < N``; id ``N`` would be
*before* the final norm, so layer ``N`` is read from the runner's final hidden states instead.
The aux layers are set right after ``load_model`` (before warm-up, compilation and graph
capture), and the runner's ``use_aux_hidden_state_outputs`` is switched on so that it unpacks
the model's ``(hidden_states, aux_hidden_states)`` output. Without intermediate layers nothing of
this happens and nothing is paid.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from vllm_hidden_state_proxy.protocol import LAYERS_ENV, absolute_layer, layer_indices
from vllm_hidden_state_proxy.worker_hook.settings import HookSettings

#: The mixin method through which a model's decoder stack receives the aux layer ids.
SET_LAYERS = "_set_aux_hidden_state_layers"
#: The mixin method that appends one layer's ``hidden_states + residual`` to the aux outputs.
ADD_STATE = "_maybe_add_hidden_state"

#: Overrides of ``_maybe_add_hidden_state`` that were read and still capture Transformers'
#: ``hidden_states[k]`` (docs/design.md, "Overrides of the capture"): (module, qualified name)
#: -> every name its byte code uses. An override whose names differ (it calls something new) is
#: refused again, as every other override is, until someone reads it.
#:
#: - vLLM 0.34's CUDA Qwen3.5 (``vllm/models/qwen3_5/nvidia/model.py``, ``Qwen3_5Model``):
#:   clones the layer-0 capture (the embeddings, which the next layer's fused add-norm mutates
#:   in place: the same values, kept by value) and, under tensor parallelism with the fused
#:   all-reduce norm, all-reduces the layer's partial MLP output before the mixin adds the
#:   (complete) residual; then calls the mixin's method.
ACCEPTED_OVERRIDES: dict[tuple[str, str], frozenset[str]] = {
    ("vllm.models.qwen3_5.nvidia.model", "Qwen3_5Model._maybe_add_hidden_state"): frozenset(
        {
            "_maybe_add_hidden_state",
            "aux_hidden_state_layers",
            "clone",
            "mlp_output_is_partial",
            "super",
            "tensor_model_parallel_all_reduce",
        }
    ),
}


class LayerConfigError(Exception):
    """The configured layers cannot be captured (the message says why and what to change)."""


@dataclass(frozen=True, slots=True)
class CapturedLayers:
    """The layers one server captures, as absolute indices."""

    #: The model's decoder layer count N (layer N is the final layer after the final norm).
    num_hidden_layers: int
    #: Every captured layer, ascending; always includes N.
    layers: tuple[int, ...]

    @property
    def aux_ids(self) -> tuple[int, ...]:
        """The layers vLLM must return as auxiliary outputs (all but the final one)."""
        return tuple(layer for layer in self.layers if layer != self.num_hidden_layers)


def parse_layers(text: str | None, num_hidden_layers: int) -> CapturedLayers:
    """``HIDDEN_STATE_PROXY_LAYERS`` (``None`` or empty: the final layer only), normalised."""
    final = num_hidden_layers
    try:
        asked = layer_indices(text or "")
    except ValueError as problem:
        raise LayerConfigError(f"{LAYERS_ENV}={text!r}: {problem}") from None
    chosen = {final}
    for layer in asked:
        absolute = absolute_layer(layer, final)
        if absolute is None:
            raise LayerConfigError(
                f"{LAYERS_ENV}={text!r}: layer {layer} is out of range for a model with "
                f"{final} layers (valid: 0..{final}, or -{final + 1}..-1)"
            )
        chosen.add(absolute)
    return CapturedLayers(final, tuple(sorted(chosen)))


def configured_layers(vllm_config: Any) -> CapturedLayers:
    """The layers the hook's settings ask of this model."""
    num_hidden_layers = int(vllm_config.model_config.get_total_num_hidden_layers())
    return parse_layers(HookSettings().layers, num_hidden_layers)


def enable_aux_outputs(runner: Any, captured: CapturedLayers) -> None:
    """Make ``runner``'s freshly loaded model return the intermediate layers as outputs.

    Raises :class:`LayerConfigError` naming the model class when it cannot.
    """
    aux_ids = captured.aux_ids
    if not aux_ids:
        return
    vllm_config = runner.vllm_config
    if getattr(runner, "use_aux_hidden_state_outputs", False):
        raise LayerConfigError(
            "speculative decoding already uses the model's auxiliary hidden-state outputs "
            f"(EAGLE-3 or similar); {LAYERS_ENV} cannot be combined with it yet"
        )
    speculative = getattr(vllm_config, "speculative_config", None)
    if speculative is not None:
        # EAGLE, MTP and their kin feed the drafter the target's hidden states, and both of
        # vLLM's runners take the auxiliary outputs for those when they are switched on: a
        # drafter fed k intermediate layers crashes the engine (or, with one, drafts from it).
        raise LayerConfigError(
            f"{LAYERS_ENV} cannot be combined with speculative decoding (method "
            f"{getattr(speculative, 'method', None)!r}) yet: the drafter would be fed the "
            "captured layers instead of the final hidden states"
        )
    parallel_config = vllm_config.parallel_config
    pipeline = int(getattr(parallel_config, "pipeline_parallel_size", 1) or 1)
    if pipeline > 1:
        raise LayerConfigError(
            f"{LAYERS_ENV} with pipeline parallelism ({pipeline} stages) is not supported yet"
        )
    if getattr(parallel_config, "use_ubatching", False):
        # Micro-batching runs the forward per micro-batch and merges the outputs with
        # torch.cat over zip(*outputs); whether the auxiliary list survives that merge (in
        # both runners, with CUDA graphs) is unverified, so it is refused, not guessed at.
        raise LayerConfigError(
            f"{LAYERS_ENV} cannot be combined with micro-batching (--enable-dbo or "
            "--ubatch-size > 1) yet: the per-micro-batch auxiliary outputs are not known to be "
            "merged correctly; drop one of the two"
        )
    from vllm.model_executor.models.interfaces import supports_eagle3

    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    if not supports_eagle3(model):
        raise LayerConfigError(
            f"{type(model).__name__} does not support auxiliary hidden-state outputs (vLLM's "
            f"SupportsEagle3 interface), so layers {', '.join(map(str, aux_ids))} of "
            f"{LAYERS_ENV} cannot be captured; only the final layer (-1) can be"
        )
    problem = aux_capture_problem(model)
    if problem is not None:
        raise LayerConfigError(
            f"{problem}, so its auxiliary outputs are not Transformers' hidden_states[k] and "
            f"layers {', '.join(map(str, aux_ids))} of {LAYERS_ENV} cannot be captured; only the "
            "final layer (-1) can be"
        )
    model.set_aux_hidden_state_layers(aux_ids)
    runner.use_aux_hidden_state_outputs = True


def aux_capture_problem(model: Any) -> str | None:
    """Why ``model``'s auxiliary outputs may not be ``hidden_states + residual`` after ``k``
    layers (``None`` if they are, as far as its structure shows).

    vLLM's ``EagleModelMixin._maybe_add_hidden_state`` takes that sum; models that override it
    (attention-residual models, whose ``residual`` is a bank of block states; the overrides of
    :data:`ACCEPTED_OVERRIDES` excepted), build their aux
    list another way in ``forward`` (DeepSeek V4 takes a mean of reconstructed streams), or set
    ``attn_res_block_size`` capture something else, which the hook cannot check row by row.
    So it requires, for every decoder stack in the model: the mixin, its method unchanged (or
    overridden by an accepted override that calls it), and a ``forward`` that calls it.
    """
    from vllm.model_executor.models.interfaces import EagleModelMixin

    modules = model.modules() if hasattr(model, "modules") else [model]
    stacks = [module for module in modules if isinstance(module, EagleModelMixin)]
    if not stacks:
        return (
            f"{type(model).__name__} keeps its decoder layers in no EagleModelMixin module "
            "(vLLM's shared capture of auxiliary outputs)"
        )
    for stack in stacks:
        if _hands_layers_on(type(stack)):
            continue  # another module (itself in ``stacks``) captures them
        problem = stack_problem(type(stack), getattr(stack, "config", None))
        if problem is not None:
            return problem
    return None


def _hands_layers_on(cls: type) -> bool:
    """Whether ``cls`` passes its aux layers to a submodule instead of keeping them (Plamo3's
    model gives them to its decoder): its ``_set_aux_hidden_state_layers`` is its own and
    does not call the mixin's."""
    own = next((c.__dict__[SET_LAYERS] for c in cls.__mro__ if SET_LAYERS in c.__dict__), None)
    from vllm.model_executor.models.interfaces import EagleModelMixin

    if own is None or own is EagleModelMixin.__dict__.get(SET_LAYERS):
        return False
    code = getattr(inspect.unwrap(own), "__code__", None)
    return code is not None and "super" not in code.co_names


def stack_problem(cls: type, config: Any = None) -> str | None:
    """Why the decoder stack class ``cls`` (an ``EagleModelMixin``) may capture something else
    than ``hidden_states + residual`` (``None``: it does not, as far as its structure shows)."""
    from vllm.model_executor.models.interfaces import EagleModelMixin

    mixins = EagleModelMixin.__dict__[ADD_STATE]
    # Every class up to the mixin's own method: an override is refused wherever it sits, in
    # ``cls`` or in a base ``cls`` merely inherits it from.
    for owner in cls.__mro__:
        method = owner.__dict__.get(ADD_STATE)
        if method is mixins:
            break
        if method is not None and not accepted_override(method):
            return f"{cls.__name__} overrides vLLM's {ADD_STATE}"
    if getattr(config, "attn_res_block_size", None) is not None:
        return f"{cls.__name__} uses attention residuals (attn_res_block_size)"
    if not _forward_uses_the_mixin(cls):
        return f"{cls.__name__}.forward builds its auxiliary outputs without vLLM's mixin"
    return None


def accepted_override(method: Any) -> bool:
    """Whether ``method`` (an override of ``_maybe_add_hidden_state``) is one of
    :data:`ACCEPTED_OVERRIDES`, unchanged as far as its byte code's names show."""
    function = inspect.unwrap(method)
    code = getattr(function, "__code__", None)
    names = ACCEPTED_OVERRIDES.get(
        (getattr(function, "__module__", ""), getattr(function, "__qualname__", ""))
    )
    return code is not None and names is not None and frozenset(code.co_names) == names


def _forward_uses_the_mixin(cls: type) -> bool:
    """Whether ``cls.forward`` calls ``_maybe_add_hidden_state``, itself or through the
    ``super().forward`` it delegates to (MistralModel's, say): read from the byte code's
    names, so no source file is needed."""
    for owner in cls.__mro__:
        forward = owner.__dict__.get("forward")
        if forward is None:
            continue
        code = getattr(inspect.unwrap(forward), "__code__", None)
        if code is None:
            return False
        if "_maybe_add_hidden_state" in code.co_names:
            return True
        if not ("super" in code.co_names and "forward" in code.co_names):
            return False
    return False
