"""layers.py and ring_start.prepare_layers: which layers a server captures, and asking the model.

The models are stand-ins (vLLM's ``supports_eagle3`` is an ``isinstance`` check against the
runtime-checkable ``SupportsEagle3`` protocol, so what a model must have is exactly that
protocol's members), plus vLLM's real model classes, created without weights, where only the
check runs.
"""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import vllm
from vllm.model_executor.models.interfaces import (
    EagleModelMixin,
    SupportsEagle3,
    supports_eagle3,
)

from tests.worker_hook.conftest import HookLog
from tests.worker_hook.fakes import FINAL, HIDDEN, FakeV1Runner, fake_vllm_config
from vllm_hidden_state_proxy.protocol import LAYERS_ENV
from vllm_hidden_state_proxy.ring import RingReader
from vllm_hidden_state_proxy.ring.files import note_name
from vllm_hidden_state_proxy.ring.notes import read_live_note
from vllm_hidden_state_proxy.worker_hook import ring_start
from vllm_hidden_state_proxy.worker_hook.capture import StepCapture
from vllm_hidden_state_proxy.worker_hook.engine import instance_of
from vllm_hidden_state_proxy.worker_hook.layers import (
    ACCEPTED_OVERRIDES,
    ADD_STATE,
    CapturedLayers,
    LayerConfigError,
    accepted_override,
    aux_capture_problem,
    configured_layers,
    enable_aux_outputs,
    parse_layers,
    stack_problem,
)
from vllm_hidden_state_proxy.worker_hook.ring_start import prepare_layers
from vllm_hidden_state_proxy.worker_hook.runners import V1RunnerView

# -- parse_layers ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "layers"),
    [
        (None, (12,)),
        ("", (12,)),
        (" , ", (12,)),
        ("-1", (12,)),
        ("12", (12,)),
        ("4,8,-1", (4, 8, 12)),
        ("8, 4", (4, 8, 12)),  # sorted, the final layer always included
        ("0", (0, 12)),  # the embeddings
        ("-13", (0, 12)),  # -N-1 is the embeddings
        ("-2,11", (11, 12)),  # duplicates collapse
        ("+3,-0", (0, 3, 12)),
        (" 1 ,, 2 ", (1, 2, 12)),
    ],
)
def test_parse_layers(text: str | None, layers: tuple[int, ...]) -> None:
    captured = parse_layers(text, 12)
    assert captured == CapturedLayers(12, layers)
    assert captured.aux_ids == tuple(layer for layer in layers if layer != 12)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("13", "layer 13 is out of range for a model with 12 layers (valid: 0..12, or -13..-1)"),
        ("-14", "layer -14 is out of range"),
        ("4,100", "layer 100 is out of range"),
        ("four", "'four' is not a layer index (expected e.g. 4,8,-1)"),
        ("1.5", "'1.5' is not a layer index"),
        ("1;2", "'1;2' is not a layer index"),
        ("0x2", "'0x2' is not a layer index"),
    ],
)
def test_parse_layers_refuses_what_is_not_a_layer(text: str, message: str) -> None:
    with pytest.raises(LayerConfigError) as raised:
        parse_layers(text, 12)
    assert message in str(raised.value)
    assert str(raised.value).startswith(f"{LAYERS_ENV}={text!r}: ")


def test_a_one_layer_model_has_layers_0_and_1() -> None:
    assert parse_layers("0,-2,-1", 1) == CapturedLayers(1, (0, 1))
    with pytest.raises(LayerConfigError, match=re.escape("(valid: 0..1, or -2..-1)")):
        parse_layers("2", 1)


def test_configured_layers_read_the_env_and_the_models_layer_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = fake_vllm_config()
    monkeypatch.delenv(LAYERS_ENV, raising=False)
    assert configured_layers(config) == CapturedLayers(FINAL, (FINAL,))
    monkeypatch.setenv(LAYERS_ENV, "2,-4")
    assert configured_layers(config) == CapturedLayers(FINAL, (1, 2, FINAL))


# -- enable_aux_outputs ---------------------------------------------------------------------------


class DecoderStack(EagleModelMixin):  # type: ignore[misc]  # vLLM's types are not followed
    """A decoder stack that captures its layers as vLLM's own models do (Qwen2Model,
    LlamaModel): through the mixin's ``_maybe_add_hidden_state``."""

    def forward(self, hidden_states: Any, residual: Any) -> Any:
        aux: list[Any] = []
        for layer_idx in range(FINAL):
            aux = self._maybe_add_hidden_state(aux, layer_idx, hidden_states, residual)
        return hidden_states, aux


class Eagle3Model(SupportsEagle3):  # type: ignore[misc]  # vLLM's types are not followed
    """A model with vLLM's EAGLE-3 interface; records what it is asked for."""

    stack_class: type = DecoderStack

    def __init__(self) -> None:
        self.aux_layers: tuple[int, ...] | None = None
        self.model = self.stack_class()

    def modules(self) -> list[Any]:  # as torch.nn.Module's: itself and every submodule
        return [self, self.model]

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        self.aux_layers = layers


class ProtocolShapedModel:
    """Not a subclass, but every member of the protocol: ``isinstance`` accepts it too."""

    supports_eagle3 = True
    has_own_lm_head = False
    has_own_embed_tokens = False

    def __init__(self) -> None:
        self.aux_layers: tuple[int, ...] | None = None
        self.stack = DecoderStack()

    def modules(self) -> list[Any]:
        return [self, self.stack]

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        self.aux_layers = layers

    def get_eagle3_default_aux_hidden_state_layers(self) -> tuple[int, ...]:
        return (1,)


class OnlyTheSetterModel:
    """Has ``set_aux_hidden_state_layers`` but not the rest of ``SupportsEagle3``."""

    def __init__(self) -> None:
        self.aux_layers: tuple[int, ...] | None = None

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        self.aux_layers = layers


def runner_with(model: Any, *, pipeline: int = 1) -> FakeV1Runner:
    runner = FakeV1Runner(model=model)
    runner.vllm_config.parallel_config.pipeline_parallel_size = pipeline
    return runner


def test_what_supports_eagle3_needs() -> None:
    assert supports_eagle3(Eagle3Model())
    assert supports_eagle3(ProtocolShapedModel())
    assert not supports_eagle3(OnlyTheSetterModel())


@pytest.mark.parametrize("model_class", [Eagle3Model, ProtocolShapedModel])
def test_enable_aux_outputs_asks_the_model_and_switches_the_runner(model_class: type) -> None:
    model = model_class()
    runner = runner_with(model)
    enable_aux_outputs(runner, CapturedLayers(FINAL, (0, 2, FINAL)))
    assert model.aux_layers == (0, 2)  # the final layer is the runner's own output
    assert runner.use_aux_hidden_state_outputs is True


def test_the_model_comes_from_get_model_where_the_runner_has_it() -> None:
    loaded, wrapper = Eagle3Model(), Eagle3Model()
    runner = SimpleNamespace(
        vllm_config=fake_vllm_config(),
        use_aux_hidden_state_outputs=False,
        model=wrapper,
        get_model=lambda: loaded,
    )
    enable_aux_outputs(runner, CapturedLayers(FINAL, (1, FINAL)))
    assert (loaded.aux_layers, wrapper.aux_layers) == ((1,), None)
    # A runner without get_model: its model attribute.
    bare = SimpleNamespace(
        vllm_config=fake_vllm_config(), use_aux_hidden_state_outputs=False, model=wrapper
    )
    enable_aux_outputs(bare, CapturedLayers(FINAL, (3, FINAL)))
    assert wrapper.aux_layers == (3,)


@pytest.mark.parametrize("model", [OnlyTheSetterModel(), object()])
def test_the_final_layer_alone_asks_nothing_of_any_model(model: Any) -> None:
    runner = runner_with(model, pipeline=4)
    enable_aux_outputs(runner, CapturedLayers(FINAL, (FINAL,)))
    assert runner.use_aux_hidden_state_outputs is False
    assert getattr(model, "aux_layers", None) is None


def refusal(runner: FakeV1Runner, layers: tuple[int, ...] = (1, FINAL)) -> str:
    with pytest.raises(LayerConfigError) as raised:
        enable_aux_outputs(runner, CapturedLayers(FINAL, layers))
    return str(raised.value)


def test_a_model_without_the_interface_is_refused_by_its_class_name() -> None:
    model = OnlyTheSetterModel()
    runner = runner_with(model)
    message = refusal(runner, (0, 2, FINAL))
    assert message.startswith("OnlyTheSetterModel does not support auxiliary hidden-state outputs")
    assert "SupportsEagle3" in message
    assert "layers 0, 2 of HIDDEN_STATE_PROXY_LAYERS cannot be captured" in message
    assert "only the final layer (-1) can be" in message
    assert model.aux_layers is None  # nothing was changed
    assert runner.use_aux_hidden_state_outputs is False


@pytest.mark.parametrize(
    ("module", "name", "supported"),
    [
        ("vllm.model_executor.models.llama", "LlamaForCausalLM", True),
        ("vllm.model_executor.models.qwen2", "Qwen2ForCausalLM", True),
        ("vllm.model_executor.models.gpt2", "GPT2LMHeadModel", False),
        ("vllm.model_executor.models.opt", "OPTForCausalLM", False),
        # The e2e image fixture's class (tests/e2e/tiny_vlm.py): final layer only.
        ("vllm.model_executor.models.idefics3", "Idefics3ForConditionalGeneration", False),
    ],
)
def test_vllms_own_model_classes(module: str, name: str, supported: bool) -> None:
    import importlib

    cls = getattr(importlib.import_module(module), name)
    model = cls.__new__(cls)  # no weights, no config: only the interface check runs
    assert supports_eagle3(model) is supported
    if not supported:
        assert refusal(runner_with(model)).startswith(f"{name} does not support auxiliary")


def test_pipeline_parallelism_is_refused() -> None:
    model = Eagle3Model()
    runner = runner_with(model, pipeline=2)
    message = refusal(runner)
    assert "with pipeline parallelism (2 stages) is not supported yet" in message
    assert message.startswith(LAYERS_ENV)
    assert model.aux_layers is None
    assert runner.use_aux_hidden_state_outputs is False


def test_a_runner_whose_aux_outputs_are_taken_is_refused() -> None:
    model = Eagle3Model()
    runner = runner_with(model)
    runner.use_aux_hidden_state_outputs = True  # EAGLE-3 speculative decoding set them up
    message = refusal(runner)
    assert "speculative decoding already uses the model's auxiliary hidden-state outputs" in message
    assert f"{LAYERS_ENV} cannot be combined with it" in message
    assert model.aux_layers is None  # the drafter's layers stay as they are


@pytest.mark.parametrize("method", ["eagle", "mtp", "ngram"])
def test_speculative_decoding_is_refused(method: str) -> None:
    """EAGLE-1 and MTP leave the aux outputs off, but vLLM would feed them to the drafter."""
    model = Eagle3Model()
    runner = runner_with(model)
    runner.vllm_config.speculative_config = SimpleNamespace(method=method)
    message = refusal(runner)
    assert f"cannot be combined with speculative decoding (method {method!r})" in message
    assert model.aux_layers is None
    assert runner.use_aux_hidden_state_outputs is False


@pytest.mark.parametrize("how", ["enable_dbo", "ubatch_size"])
def test_micro_batching_is_refused(how: str) -> None:
    """vLLM merges per-micro-batch outputs with torch.cat over zip(*outputs); whether the aux
    list survives that is unverified, so layers and micro-batching are not combined."""
    from vllm.config import ParallelConfig

    parallel = ParallelConfig(**({"enable_dbo": True} if how == "enable_dbo" else {}))
    if how == "ubatch_size":
        parallel.ubatch_size = 2
    assert parallel.use_ubatching  # vLLM's own reading of both options
    model = Eagle3Model()
    runner = runner_with(model)
    runner.vllm_config.parallel_config.use_ubatching = parallel.use_ubatching
    message = refusal(runner)
    assert "cannot be combined with micro-batching (--enable-dbo or --ubatch-size > 1)" in message
    assert model.aux_layers is None
    assert runner.use_aux_hidden_state_outputs is False


class OverridingStack(DecoderStack):
    """Like attention-residual models: ``residual`` is not what the mixin adds."""

    def _maybe_add_hidden_state(
        self, aux: list[Any], layer_idx: int, hidden_states: Any, residual: Any
    ) -> list[Any]:
        added: list[Any] = super()._maybe_add_hidden_state(aux, layer_idx, hidden_states, None)
        return added


class OwnWayStack(DecoderStack):
    """Like DeepSeek V4: the aux list is built in forward without the mixin's method."""

    def forward(self, hidden_states: Any, residual: Any) -> Any:
        return hidden_states, [hidden_states.mean()]


class AttnResStack(DecoderStack):
    config = SimpleNamespace(attn_res_block_size=4)


class HandingOn(OwnWayStack):
    """Like Plamo3's model: it keeps no layers itself, its decoder (a stack) captures them."""

    def __init__(self) -> None:
        self.decoder = DecoderStack()

    def _set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        self.decoder._set_aux_hidden_state_layers(layers)


def test_a_stack_that_hands_its_layers_on_is_judged_by_the_one_that_captures() -> None:
    class Model(Eagle3Model):
        stack_class = HandingOn

        def modules(self) -> list[Any]:
            return [self, self.model, self.model.decoder]

    assert aux_capture_problem(Model()) is None

    class Broken(Model):
        def modules(self) -> list[Any]:
            return [self, self.model, OwnWayStack()]

    assert aux_capture_problem(Broken()) == (
        "OwnWayStack.forward builds its auxiliary outputs without vLLM's mixin"
    )


@pytest.mark.parametrize(
    ("stack", "problem"),
    [
        (OverridingStack, "OverridingStack overrides vLLM's _maybe_add_hidden_state"),
        (OwnWayStack, "OwnWayStack.forward builds its auxiliary outputs without vLLM's mixin"),
        (AttnResStack, "AttnResStack uses attention residuals (attn_res_block_size)"),
    ],
)
def test_models_whose_aux_outputs_are_not_transformers_hidden_states_are_refused(
    stack: type, problem: str
) -> None:
    model = type("Model", (Eagle3Model,), {"stack_class": stack})()
    runner = runner_with(model)
    message = refusal(runner)
    assert message.startswith(problem), message
    assert "are not Transformers' hidden_states[k]" in message
    assert model.aux_layers is None
    assert runner.use_aux_hidden_state_outputs is False


@pytest.mark.parametrize(
    ("module", "name", "problem"),
    [
        ("vllm.model_executor.models.qwen2", "Qwen2Model", None),
        ("vllm.model_executor.models.qwen3", "Qwen3Model", None),
        ("vllm.model_executor.models.llama", "LlamaModel", None),
        # Its forward is LlamaModel's, through super().forward.
        ("vllm.model_executor.models.mistral", "MistralModel", None),
        # Its own forward returns no auxiliary outputs at all.
        (
            "vllm.model_executor.models.mimo",
            "MiMoModel",
            "MiMoModel.forward builds its auxiliary outputs without vLLM's mixin",
        ),
        (
            "vllm.models.kimi_k3.amd.linear",
            "KimiLinearModel",
            "KimiLinearModel overrides vLLM's _maybe_add_hidden_state",
        ),
        (
            "vllm.models.deepseek_v4.xpu.model",
            "DeepseekV4Model",
            "DeepseekV4Model.forward builds its auxiliary outputs without vLLM's mixin",
        ),
        # vLLM 0.34's CUDA Qwen3.5: its override is an accepted one (ACCEPTED_OVERRIDES).
        ("vllm.models.qwen3_5.nvidia.model", "Qwen3_5Model", None),
    ],
)
def test_vllms_own_decoder_stacks(module: str, name: str, problem: str | None) -> None:
    try:
        cls = getattr(import_vllm_module(module), name)
    except (ImportError, AttributeError) as error:  # a vLLM release without that model
        pytest.skip(f"{module}.{name} is not in this vLLM: {error}")
    assert stack_problem(cls) == problem


def import_vllm_module(module: str) -> Any:
    """``module``, imported without turning its libraries' deprecation warnings into errors
    (vLLM 0.34's CUDA Qwen3.5 imports CUTLASS's DSL, which warns of its own renamed names)."""
    import importlib

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return importlib.import_module(module)


def tensor_model_parallel_all_reduce(tensor: Any) -> Any:
    """Stands for vLLM's (one rank: the identity); only its name matters to the check."""
    return tensor


QWEN3_5 = ("vllm.models.qwen3_5.nvidia.model", "Qwen3_5Model._maybe_add_hidden_state")


def _as_qwen3_5s(function: Any) -> Any:
    function.__module__, function.__qualname__ = QWEN3_5
    return function


class AsQwen3_5(DecoderStack):
    """An override named as vLLM 0.34's CUDA Qwen3.5 one, using the same names."""

    aux_hidden_state_layers: tuple[int, ...] = ()
    mlp_output_is_partial = False

    @_as_qwen3_5s
    def _maybe_add_hidden_state(
        self, aux: list[Any], layer_idx: int, hidden_states: Any, residual: Any
    ) -> list[Any]:
        if residual is None and layer_idx in self.aux_hidden_state_layers:
            hidden_states = hidden_states.clone()
        if residual is not None and self.mlp_output_is_partial:
            hidden_states = tensor_model_parallel_all_reduce(hidden_states)
        added: list[Any] = super()._maybe_add_hidden_state(aux, layer_idx, hidden_states, residual)
        return added


class ChangedQwen3_5(DecoderStack):
    """The same name, but the override now does something more (here: scales the state)."""

    @_as_qwen3_5s
    def _maybe_add_hidden_state(
        self, aux: list[Any], layer_idx: int, hidden_states: Any, residual: Any
    ) -> list[Any]:
        added: list[Any] = super()._maybe_add_hidden_state(
            aux, layer_idx, hidden_states.mul(2), residual
        )
        return added


def test_an_accepted_override_passes_only_while_unchanged() -> None:
    assert ACCEPTED_OVERRIDES.keys() == {QWEN3_5}
    assert stack_problem(AsQwen3_5) is None
    assert stack_problem(ChangedQwen3_5) == (
        "ChangedQwen3_5 overrides vLLM's _maybe_add_hidden_state"
    )

    class OverridesTheAccepted(AsQwen3_5):  # an unread override on top of the accepted one
        def _maybe_add_hidden_state(
            self, aux: list[Any], layer_idx: int, hidden_states: Any, residual: Any
        ) -> list[Any]:
            return aux

    assert stack_problem(OverridesTheAccepted) == (
        "OverridesTheAccepted overrides vLLM's _maybe_add_hidden_state"
    )


def test_an_inherited_override_is_refused_as_the_one_it_inherits() -> None:
    """A stack that only inherits an unread override (a model class deriving another one,
    as vLLM's families do) captures what its base captures, so it is refused the same; one
    deriving the accepted override passes as that one does."""

    class InheritsTheOverride(OverridingStack):
        pass

    class InheritsItTwice(InheritsTheOverride):
        pass

    class InheritsTheAccepted(AsQwen3_5):
        pass

    for stack in (InheritsTheOverride, InheritsItTwice):
        assert stack_problem(stack) == (
            f"{stack.__name__} overrides vLLM's _maybe_add_hidden_state"
        )
    assert stack_problem(InheritsTheAccepted) is None


def test_vllms_cuda_qwen3_5_override_still_captures_hidden_states_k() -> None:
    """vLLM 0.34's ``Qwen3_5Model._maybe_add_hidden_state`` itself (one rank): layer 0 is
    the embeddings, by value (the next layer's fused norm mutates them in place), layer k is
    ``hidden_states + residual``, and layers not asked for are left out."""
    try:
        Qwen3_5Model = import_vllm_module(QWEN3_5[0]).Qwen3_5Model
    except ImportError as error:
        pytest.skip(f"vLLM {vllm.__version__} has no CUDA Qwen3.5 module: {error}")
    own = Qwen3_5Model.__dict__[ADD_STATE]
    assert accepted_override(own)
    stack = object.__new__(Qwen3_5Model)  # no nn.Module init: only the two fields it reads
    stack.__dict__.update(aux_hidden_state_layers=(0, 2), mlp_output_is_partial=False)
    embeddings = torch.arange(6.0).reshape(2, 3)
    aux = stack._maybe_add_hidden_state([], 0, embeddings, None)
    mlp_out, residual = torch.full((2, 3), 0.5), torch.full((2, 3), 10.0)
    stack._maybe_add_hidden_state(aux, 1, mlp_out, residual)
    stack._maybe_add_hidden_state(aux, 2, mlp_out, residual)
    embeddings.add_(100.0)  # as the first layer's fused add-norm does
    assert len(aux) == 2
    assert torch.equal(aux[0], torch.arange(6.0).reshape(2, 3))
    assert torch.equal(aux[1], mlp_out + residual)


# -- prepare_layers (run by the load_model wrapper) ----------------------------------------------


LAYERS_ATTR = ring_start.LAYERS_ATTR


def test_prepare_layers_asks_the_model_and_leaves_the_layers_on_the_runner(
    monkeypatch: pytest.MonkeyPatch, hook_log: HookLog
) -> None:
    monkeypatch.setenv(LAYERS_ENV, "0,2")
    model = Eagle3Model()
    runner = runner_with(model)
    prepare_layers(runner)
    assert runner.__dict__[LAYERS_ATTR] == CapturedLayers(FINAL, (0, 2, FINAL))
    assert model.aux_layers == (0, 2)
    assert runner.use_aux_hidden_state_outputs is True
    [logged] = hook_log.records
    assert logged.levelno == logging.INFO
    assert "layers 0,2 as auxiliary outputs" in logged.getMessage()
    # Once per runner: a second call changes nothing.
    model.aux_layers = None
    prepare_layers(runner)
    assert model.aux_layers is None


def test_prepare_layers_without_the_setting_touches_nothing(
    monkeypatch: pytest.MonkeyPatch, hook_log: HookLog
) -> None:
    monkeypatch.delenv(LAYERS_ENV, raising=False)
    runner = runner_with(OnlyTheSetterModel())
    prepare_layers(runner)
    assert runner.__dict__[LAYERS_ATTR] == CapturedLayers(FINAL, (FINAL,))
    assert runner.use_aux_hidden_state_outputs is False
    assert hook_log.records == []


@pytest.mark.parametrize(
    ("setting", "model", "expected"),
    [
        ("1", OnlyTheSetterModel(), "OnlyTheSetterModel does not support"),
        ("99", Eagle3Model(), "layer 99 is out of range"),
        ("x", Eagle3Model(), "'x' is not a layer index"),
    ],
)
def test_prepare_layers_never_raises_and_leaves_the_error_on_the_runner(
    monkeypatch: pytest.MonkeyPatch,
    hook_log: HookLog,
    setting: str,
    model: Any,
    expected: str,
) -> None:
    monkeypatch.setenv(LAYERS_ENV, setting)
    runner = runner_with(model)
    prepare_layers(runner)
    outcome = runner.__dict__[LAYERS_ATTR]
    assert isinstance(outcome, LayerConfigError)
    assert expected in str(outcome)
    assert runner.use_aux_hidden_state_outputs is False
    [logged] = hook_log.records
    assert logged.levelno == logging.ERROR
    assert expected in logged.getMessage()


def test_prepare_layers_survives_a_runner_it_cannot_read(hook_log: HookLog) -> None:
    class Odd:
        @property
        def vllm_config(self) -> Any:
            raise AttributeError("no config here")

    runner = Odd()
    prepare_layers(runner)
    assert isinstance(runner.__dict__[LAYERS_ATTR], AttributeError)
    assert [r.levelno for r in hook_log.records] == [logging.ERROR]


def test_a_model_that_rejects_the_layers_is_contained(monkeypatch: pytest.MonkeyPatch) -> None:
    class Rejecting(Eagle3Model):
        def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
            raise AssertionError("Model instance must inherit from EagleModelMixin")

    monkeypatch.setenv(LAYERS_ENV, "1")
    runner = runner_with(Rejecting())
    prepare_layers(runner)
    assert isinstance(runner.__dict__[LAYERS_ATTR], AssertionError)
    assert runner.use_aux_hidden_state_outputs is False


# -- what the capture makes of it ----------------------------------------------------------------


@pytest.fixture
def closing() -> Any:
    made: list[StepCapture] = []
    yield made
    for capture in made:
        if capture.writer is not None:
            capture.writer.close()


def test_the_ring_holds_the_prepared_layers(
    monkeypatch: pytest.MonkeyPatch, ring_env: Path, closing: list[StepCapture]
) -> None:
    monkeypatch.setenv(LAYERS_ENV, "2,0")
    runner = runner_with(Eagle3Model())
    prepare_layers(runner)
    capture = StepCapture.for_runner(runner, V1RunnerView())
    closing.append(capture)
    assert capture.writer is not None
    assert capture.captured == CapturedLayers(FINAL, (0, 2, FINAL))
    assert capture.selected.captured == (0, 2, FINAL)
    with RingReader.open(capture.writer.path) as ring:
        assert ring.layers == (0, 2, FINAL)
        assert ring.shape.num_hidden_layers == FINAL
        assert ring.hidden_size == HIDDEN


@pytest.mark.parametrize(
    ("prepare", "cause"),
    [
        (True, "LayerConfigError: OnlyTheSetterModel does not support auxiliary"),
        (False, "LayerConfigError: the model was loaded before the worker hook could ask it"),
    ],
)
def test_layers_that_cannot_be_captured_leave_a_failure_note(
    monkeypatch: pytest.MonkeyPatch, ring_env: Path, prepare: bool, cause: str
) -> None:
    monkeypatch.setenv(LAYERS_ENV, "1")
    runner = runner_with(OnlyTheSetterModel())
    if prepare:
        prepare_layers(runner)
    with pytest.raises(LayerConfigError):
        StepCapture.for_runner(runner, V1RunnerView())
    assert not list(ring_env.glob("*.bin"))
    config = runner.vllm_config
    note = read_live_note(ring_env / note_name(instance_of(config), 0), None)
    assert note is not None
    assert note.message.startswith(cause)


def test_a_non_publishing_rank_ignores_the_layer_outcome(
    monkeypatch: pytest.MonkeyPatch, ring_env: Path
) -> None:
    monkeypatch.setenv(LAYERS_ENV, "1")
    runner = runner_with(OnlyTheSetterModel())
    runner.vllm_config.parallel_config.tensor_parallel_size = 2
    runner.vllm_config.parallel_config.rank = 1
    prepare_layers(runner)
    capture = StepCapture.for_runner(runner, V1RunnerView())
    assert not capture.publishing
    assert not ring_env.exists()
