"""Per-runner capture: after each step, copy the selected rows and publish them to the ring.

It never raises into vLLM. An exception inside a wrapped ``execute_model``/``sample_tokens``
would kill the engine and every request with it, so every entry point here catches, logs once,
publishes error records for the keys of the affected step (those requests then get a clear
error from the proxy at once) and carries on.

Per flagged request (see :mod:`.selection`): with pooling ``"last"``, the rows of its last
prompt position in each wanted layer, in the step that computes that position; with ``"mean"``,
its prompt rows summed per layer in every step that computes some (:mod:`.pooling`), and the
mean in the step that completes the prompt; with ``"all_prompt"``, those rows kept, and the
matrix of them all in that step (its bytes reserved first, :mod:`.matrix_budget`). The
answer's poolings (``"last_answer"``, ``"all_answer"``) keep rows per choice and publish when it
finishes (:mod:`.answer_rows`).

**CPU** (``device_copy.SyncRowCopier``): the rows are copied and published before
``execute_model`` returns; there is no device work to overlap.

**GPU and other devices** (``device_copy.AsyncRowCopier``): after ``execute_model`` of step N the
gather and a non-blocking copy into pinned host memory are enqueued on the current stream, behind
step N's forward, and an event is recorded; nothing waits. Each key is fixed to its row when the
copy starts (``publication_queue.RecordTarget``). The vectors are published as soon as one of
these sees the copy complete:

1. the output of step N on its way out of the worker (below) -- the deadline;
2. any later ``execute_model`` on the main thread (``event.query()``, never waits);
3. more than a few unpublished steps (a safeguard; vLLM's output path drains every step).

*Why (1) is in time, and costs no overlap.* The proxy looks for the vector as soon as vLLM
answers (with streaming, at the first chunk), so it must be in the ring before vLLM can emit the
request's first token -- the token sampled in the step that computed its last prompt token.
In vLLM 0.32 that token leaves the worker only as the output of ``sample_tokens()`` of that same
step, and only after its ``get_output()``:

- V1 runner (``vllm/v1/worker/gpu_model_runner.py``), async scheduling: ``sample_tokens``
  returns an ``AsyncGPUModelRunnerOutput`` whose ``get_output()`` blocks on
  ``async_copy_ready_event``, recorded on a copy stream that first ``wait_stream``-ed the main
  stream after sampling. Without async scheduling it returns a plain ``ModelRunnerOutput``,
  built after ``_to_list`` synchronized the stream.
- V2 runner (``vllm/v1/worker/gpu/model_runner.py``): ``sample_tokens`` always returns an
  ``AsyncOutput`` (``gpu/async_utils.py``) whose ``get_output()`` waits on ``copy_event``,
  recorded the same way.
- ``get_output()`` is called by whoever forwards the output: ``WorkerProc.enqueue_output`` on the
  worker's async output thread (``vllm/v1/executor/multiproc_executor.py``; the output rank is
  TP rank 0 of the last PP stage, the rank that publishes), ``AsyncOutputFuture.result``
  (``uniproc_executor.py``), or ``execute_model_ray`` (``ray_utils.py``). The engine core turns
  it into request outputs only after that (``EngineCore.step`` / ``step_with_batch_queue`` in
  ``vllm/v1/engine/core.py``: ``future.result()``, then ``scheduler.update_from_output``).

So the wrapped ``sample_tokens`` of step N (:meth:`StepCapture.after_sample_tokens`) gives the
returned output a ``get_output`` that first waits for the copies of steps <= N and publishes
them, then runs vLLM's own. That wait adds no device time: those copies sit on the main stream
ahead of step N's sampling, which vLLM's own event already waits for; what it adds is the host
work of writing the ring records, on the thread that forwards the output. The main thread does
not wait (only safeguard 3 does), so async scheduling keeps overlapping the next step's
scheduling and launch with this step's GPU work. For a plain ``ModelRunnerOutput`` (no async
scheduling) the stream is already synchronized, and the copies are published before
``sample_tokens`` returns.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from vllm_hidden_state_proxy.protocol import (
    ANSWER_POOLINGS,
    ANSWER_WINDOW,
    MATRIX_POOLINGS,
    SPANS_POOLING,
)
from vllm_hidden_state_proxy.ring.records import PREFIX_GAP_STATUS, matrix_bytes
from vllm_hidden_state_proxy.worker_hook.answer_rows import AnswerRows, FinishedAnswer
from vllm_hidden_state_proxy.worker_hook.device_copy import RowCopier, copier_for
from vllm_hidden_state_proxy.worker_hook.engine import engine_identity, is_publishing_rank
from vllm_hidden_state_proxy.worker_hook.layers import CapturedLayers
from vllm_hidden_state_proxy.worker_hook.matrix_budget import (
    DeviceBudget,
    MatrixBudget,
    Refusal,
)
from vllm_hidden_state_proxy.worker_hook.pooling import (
    MeanPooling,
    PromptMatrix,
    SpanError,
    SpanPooling,
)
from vllm_hidden_state_proxy.worker_hook.publication_queue import PublicationQueue, RecordTarget
from vllm_hidden_state_proxy.worker_hook.ring_start import (
    create_ring,
    leave_note,
    served_name,
)
from vllm_hidden_state_proxy.worker_hook.runners import RunnerView, step_layers
from vllm_hidden_state_proxy.worker_hook.selection import (
    MeanGap,
    ScheduledRequest,
    SelectedRequests,
    Selection,
    ids_randomized,
    last_prompt_row,
)
from vllm_hidden_state_proxy.worker_hook.settings import DEVICE, HookSettings

logger = logging.getLogger("vllm.hidden_state_hook")

#: The error record of a request whose step could not be captured.
STEP_FAILED = "capturing the hidden states failed in the vLLM worker (see vLLM's log)"


class _LogOnce:
    def __init__(self) -> None:
        self._seen: set[str] = set()

    def exception(self, where: str) -> None:
        if where in self._seen:
            return
        self._seen.add(where)
        logger.exception(
            "vllm-hidden-state-proxy: error in the worker hook (%s); the affected flagged "
            "requests get an error instead of vectors, vLLM keeps serving. "
            "Further errors here are not logged.",
            where,
        )


class StepCapture:
    """Selects flagged requests and publishes their vectors, once per request key."""

    def __init__(
        self,
        view: RunnerView,
        writer: Any | None,
        model_name: str,
        *,
        captured: CapturedLayers | None = None,
        copier: RowCopier | None = None,
        device_limit: int = DEVICE.default,
    ) -> None:
        self.view = view
        self.writer = writer  # a RingWriter, or None on ranks that do not publish
        self.model_name = model_name
        self.captured = captured or CapturedLayers(1, (1,))
        self.selected = SelectedRequests(
            self.captured.layers, self.captured.num_hidden_layers, randomized_ids=ids_randomized()
        )
        self.means = MeanPooling()
        self.matrices = PromptMatrix()
        self.spans = SpanPooling()
        self.answers = AnswerRows()
        self.budget = MatrixBudget(getattr(writer, "space", None))
        self.device = DeviceBudget(device_limit)
        #: Speculative decoding computes several positions per step and accepts some: the
        #: position that chose an answer's token is not known (``"last_answer"`` refused).
        self.speculative = False
        self.copier = copier  # chosen from the hidden states' device on first use if None
        self._errors = _LogOnce()
        self.publications = (
            None if writer is None else PublicationQueue(writer, self._errors.exception)
        )

    @classmethod
    def for_runner(cls, runner: Any, view: RunnerView) -> StepCapture:
        """The capture for ``runner``; on the publishing worker, with its engine's ring.

        If the ring cannot be started there, a failure note takes its place (so proxies can
        name this engine and the cause) and the error is raised.
        """
        vllm_config = runner.vllm_config
        model_name = served_name(vllm_config.model_config)
        if not is_publishing_rank(vllm_config.parallel_config):
            return cls(view, None, model_name)
        identity = engine_identity(vllm_config)
        try:
            device_limit = HookSettings().device_bytes
            writer, captured = create_ring(runner, view, identity, model_name)
        except Exception as error:
            leave_note(identity, error, view)
            raise
        capture = cls(view, writer, model_name, captured=captured, device_limit=device_limit)
        capture.speculative = getattr(vllm_config, "speculative_config", None) is not None
        return capture

    @staticmethod
    def refuse(runner: Any, view: RunnerView, error: BaseException) -> None:
        """No capture for ``runner``: on the publishing worker, its engine's note says why.
        Never raises."""
        try:
            vllm_config = runner.vllm_config
            if is_publishing_rank(vllm_config.parallel_config):
                leave_note(engine_identity(vllm_config), error, view)
        except Exception as note_error:
            logger.warning(
                "vllm-hidden-state-proxy: could not leave a failure note for proxies: %s",
                note_error,
            )

    @property
    def publishing(self) -> bool:
        return self.writer is not None

    def after_execute_model(self, runner: Any, scheduler_output: Any) -> None:
        """Called after every ``execute_model``; cheap unless a selected request is in the step."""
        if self.publications is None:
            return
        try:
            self.publications.publish_ready()  # earlier steps' copies that have completed
        except Exception:  # the queue contains its own errors; belt and braces
            self._errors.exception("publishing earlier steps' hidden states")
        selected = self.selected
        try:
            finished = scheduler_output.finished_req_ids
            if len(self.answers):  # before observing: a finished id may be reused
                self._publish_answers(finished, scheduler_output)
            if len(self.means):
                # Before observing: a finished id may be reused by a new request in this step,
                # which must not continue the old request's sum (keep_only cannot tell them
                # apart).
                self.means.forget(finished)
            if len(self.matrices) or len(self.spans):
                self.matrices.forget(finished)
                self.spans.forget(finished)
            selected.observe(scheduler_output.scheduled_new_reqs, finished)
            if selected.pending:
                self._track_answers()
        except Exception:
            self._errors.exception("reading the scheduler output")
            return
        if len(self.answers):
            self._keep_answers(runner, scheduler_output)
        if len(self.means):
            self.means.keep_only(selected.pending)
        if len(self.matrices) or len(self.spans):
            self.matrices.keep_only(selected.pending)
            self.spans.keep_only(selected.pending)
        if len(self.budget) or len(self.device):
            live = {*selected.pending, *self.answers.ids()}
            self.budget.keep_only(live)
            self.device.keep_only(live)
        if not selected.pending:
            return
        wanted = [rid for rid in selected.pending if rid in scheduler_output.num_scheduled_tokens]
        if not wanted:
            return
        try:
            self._start_copy(runner, scheduler_output, wanted)
        except Exception:
            self._errors.exception("capturing a step's hidden states")
            self._fail(wanted, STEP_FAILED)

    def after_sample_tokens(self, output: Any) -> None:
        """Called with what ``sample_tokens`` returns: the step's copies go out before it does.

        The output is not replaced. If it is an async output, its ``get_output`` is shadowed by
        one that first publishes the copies started so far (see the module docstring); otherwise
        they are published here, before ``sample_tokens`` returns.
        """
        publications = self.publications
        if publications is None or not len(publications):
            return
        through = publications.last_number
        get_output = getattr(output, "get_output", None)
        if callable(get_output):
            try:
                output.get_output = _publishing_first(get_output, publications, through)
                return
            except Exception:
                self._errors.exception("attaching the publication to vLLM's output")
        publications.publish_through(through)

    def _track_answers(self) -> None:
        """Take the new ``"last_answer"`` requests out of ``selected``: each choice publishes
        records of its own when it finishes (:mod:`.answer_rows`)."""
        pending = self.selected.pending
        for req_id in [r for r, s in pending.items() if s.pooling in ANSWER_POOLINGS]:
            selection = pending[req_id]
            if selection.problem is not None:
                continue  # answered with an error record when the request is scheduled
            del pending[req_id]
            if self.speculative:
                self._publish_error(
                    selection.key,
                    "speculative decoding computes several positions per step, so the state "
                    "that chose an answer's token is not known: the answer's poolings are not "
                    "supported on this server",
                )
                continue
            refusal = self._reserve_answer(req_id, selection)
            if refusal is not None:
                self._publish_error(selection.key, refusal.message, refusal.status)
                continue
            problem = self.answers.track(req_id, selection)
            if problem is not None:
                self._release([req_id])
                self._publish_error(selection.key, problem)

    def _release(self, req_ids: list[str]) -> None:
        self.budget.release(req_ids)
        self.device.release(req_ids)

    def _reserve_answer(self, req_id: str, selection: Selection) -> Refusal | None:
        """A choice's kept rows (on the device) and, for ``"all_answer"``, its matrix's region
        of the arena, reserved before any row is kept."""
        hidden = int(getattr(self.writer, "hidden_size", 0))
        count = len(selection.layers)
        if selection.pooling != "all_answer":
            what = f"the last_answer rows of {ANSWER_WINDOW + 1} positions x {count} layers"
            kept = matrix_bytes(ANSWER_WINDOW + 1, count, hidden)
            return self.device.reserve(req_id, kept, what)
        rows = selection.max_tokens
        if rows is None:
            return Refusal("an 'all_answer' request needs max_tokens (vLLM did not set it)", 413)
        what = f"the all_answer matrix of up to {rows} rows x {count} layers"
        size = matrix_bytes(rows, count, hidden)
        refusal = self.budget.reserve(req_id, size, what) or self.device.reserve(req_id, size, what)
        if refusal is not None:
            self._release([req_id])
        return refusal

    def _keep_answers(self, runner: Any, scheduler_output: Any) -> None:
        scheduled = scheduler_output.num_scheduled_tokens
        wanted = [rid for rid in self.answers.ids() if rid in scheduled]
        if not wanted:
            return
        try:
            captured = self.captured
            layers = step_layers(runner, captured.num_hidden_layers, captured.aux_ids)
            for request in self.view.scheduled(runner, scheduler_output, wanted):
                self.answers.keep(request, layers)
        except Exception:
            self._errors.exception("keeping an answer's hidden states")
            for finished in self.answers.finish(wanted):
                self._publish_error(finished.key, STEP_FAILED)

    def _publish_answers(self, finished_ids: Any, scheduler_output: Any) -> None:
        """Publish the records of the answers that finished. A step with nothing scheduled
        gets no ``sample_tokens`` (nor ``get_output``) from vLLM, so there they go out now."""
        for req_id in finished_ids:
            region = self.budget.hand_over(req_id)  # an all_answer's: its copy holds it now
            self.device.release([req_id])
            for finished in self.answers.finish([req_id]):
                self._publish_answer(finished, region, scheduler_output)
                region = None
            self._give_back(region)

    def _give_back(self, region: int | None) -> None:
        """An arena region whose matrix will not be published."""
        if region is not None and self.writer is not None:
            self.writer.space.release(region)

    def _publish_answer(
        self, finished: FinishedAnswer, region: int | None, scheduler_output: Any
    ) -> None:
        """Copy a finished choice's rows and queue its records (an ``"all_answer"``'s into
        ``region``, which goes back to the arena if they will not be published)."""
        if not finished.targets:
            self._give_back(region)
            self._publish_error(
                finished.key,
                finished.problem or "the request ended before any state of its answer was computed",
            )
            return
        try:
            if self.copier is None:
                self.copier = copier_for(finished.rows[0].device)
            started = self.copier.start(finished.rows)
        except Exception:
            self._errors.exception("copying an answer's hidden states")
            self._give_back(region)
            self._publish_error(finished.key, STEP_FAILED)
            return
        targets = finished.targets
        if region is not None:
            targets = [dataclasses.replace(target, region=region) for target in targets]
        if self.publications is not None:
            number = self.publications.add(started, targets)
            if not getattr(scheduler_output, "total_num_scheduled_tokens", 0):
                self.publications.publish_through(number)

    def _publish_error(self, key: bytes, message: str, status: int = 502) -> None:
        if self.writer is None:
            return
        try:
            self.writer.publish_error(key, message, status)
        except Exception:
            self._errors.exception("publishing an error record to the ring")

    def _fail(self, req_ids: list[str], message: str, status: int = 502) -> None:
        """Error records for ``req_ids`` (still pending); they are not taken again."""
        for req_id in req_ids:
            selection = self.selected.pending.get(req_id)
            if selection is None:
                continue
            self.selected.mark_published(req_id, selection.key)
            self._forget_prompt([req_id])
            self._publish_error(selection.key, message, status)

    def _forget_prompt(self, req_ids: list[str]) -> None:
        self.means.forget(req_ids)
        self.matrices.forget(req_ids)
        self.spans.forget(req_ids)
        self._release(req_ids)

    def _start_copy(self, runner: Any, scheduler_output: Any, wanted: list[str]) -> None:
        captured = self.captured
        layers = step_layers(runner, captured.num_hidden_layers, captured.aux_ids)
        rows: list[Any] = []
        targets: list[RecordTarget] = []
        matrices: list[tuple[Any, RecordTarget]] = []
        try:
            for request in self.view.scheduled(runner, scheduler_output, wanted):
                selection = self.selected.pending.get(request.req_id)
                if selection is None:  # a sibling took the key earlier in this step
                    continue
                if selection.problem is not None:
                    self._fail([request.req_id], selection.problem)
                    continue
                vectors = self._vectors(request, selection, layers)
                if vectors is None:
                    continue
                matrix = selection.pooling in MATRIX_POOLINGS  # of the prompt: the answer's
                rows_per_layer = {  # are published when their choices finish
                    "all_prompt": request.num_prompt_tokens,
                    SPANS_POOLING: len(selection.spans),
                }.get(selection.pooling, 1)
                target = RecordTarget(
                    selection.key,
                    position=0 if matrix else request.num_prompt_tokens - 1,
                    num_prompt_tokens=request.num_prompt_tokens,
                    layers=selection.layers,
                    pooling=selection.pooling,
                    rows=rows_per_layer,
                    region=self.budget.hand_over(request.req_id) if matrix else None,
                )
                if matrix:  # its own copy: one tensor, not a view per row
                    matrices.append((vectors, target))
                else:
                    rows.extend(vectors)
                    targets.append(target)
                # The key is claimed now: whether or not the copy succeeds, it is not taken
                # again.
                self.selected.mark_published(request.req_id, selection.key)
            copies = [(rows, targets)] if rows else []
            copies.extend((matrix_rows, [target]) for matrix_rows, target in matrices)
            if not copies:
                return
            if self.copier is None:
                self.copier = copier_for(copies[0][0][0].device)
            started = [(self.copier.start(copied), to) for copied, to in copies]
        except Exception:
            # The keys claimed so far are no longer pending, so the caller's error records
            # (for the step's pending keys) would miss them: answer them here.
            if self.publications is not None:
                self.publications.publish_errors(
                    [*targets, *(target for _, target in matrices)], STEP_FAILED
                )
            raise
        if self.publications is not None:
            for pending, to in started:
                self.publications.add(pending, to)

    def _vectors(
        self, request: ScheduledRequest, selection: Selection, layers: dict[int, Any]
    ) -> list[Any] | None:
        """This step's vectors for ``request`` (one 1-D tensor per layer), or ``None`` if they
        are not complete in this step."""
        if selection.pooling == "last":
            row = last_prompt_row(request)
            return None if row is None else [layers[layer][row] for layer in selection.layers]
        try:
            if selection.pooling != "mean":
                return self._prompt_matrix(request, selection, layers)
            return self.means.add(request, selection.layers, layers)
        except SpanError as error:
            self._fail([request.req_id], str(error), 400)
            return None
        except MeanGap as gap:
            self._forget_prompt([request.req_id])
            if self.selected.has_sibling(request.req_id, selection.key):
                self.selected.drop([request.req_id])  # another child of n > 1 can still do it
            else:
                self._fail([request.req_id], str(gap), PREFIX_GAP_STATUS)
            return None

    def _prompt_matrix(
        self, request: ScheduledRequest, selection: Selection, layers: dict[int, Any]
    ) -> Any | None:
        """This step's part of an ``"all_prompt"`` or ``"spans"`` matrix; the matrix once it is
        complete. Its bytes are reserved when its request is first seen (a refusal: an error
        record)."""
        spans = selection.pooling == SPANS_POOLING
        if request.req_id not in (self.spans if spans else self.matrices):
            prompt = request.num_prompt_tokens
            rows = len(selection.spans) if spans else prompt
            count = len(selection.layers)
            hidden = int(layers[selection.layers[0]].shape[-1])
            what = f"the {selection.pooling} matrix of {rows} rows x {count} layers x {hidden}"
            size = matrix_bytes(rows, count, hidden)
            # On the device: the rows so far; a spans request's sums, and one layer's running
            # sum of a step's rows (at most the prompt's).
            kept = size + matrix_bytes(prompt + 1, 1, hidden) if spans else size
            refusal = self.budget.reserve(request.req_id, size, what) or self.device.reserve(
                request.req_id, kept, what
            )
            if refusal is not None:
                self._fail([request.req_id], refusal.message, refusal.status)
                return None
        if spans:
            matrix = self.spans.add(request, selection.layers, selection.spans, layers)
        else:
            matrix = self.matrices.add(request, selection.layers, layers)
        if matrix is not None:
            self.device.release([request.req_id])  # the copy holds it from here
        return matrix


def _publishing_first(get_output: Any, publications: PublicationQueue, through: int) -> Any:
    """vLLM's ``get_output``, preceded by publishing the copies numbered up to ``through``.

    It replaces the method on vLLM's output object, and takes itself off again when called:
    the output would otherwise hold a cycle (itself -> this -> its bound method -> itself) that
    only the cycle collector frees, with the output's tensors."""

    def get_output_after_publishing() -> Any:
        try:
            vars(get_output.__self__).pop("get_output", None)
            publications.publish_through(through)
        except Exception:  # the queue contains its own errors; never fail vLLM's output
            logger.exception("vllm-hidden-state-proxy: unexpected error publishing hidden states")
        return get_output()

    return get_output_after_publishing
